"""`python -m invact plan CONFIG.json --batch B --seq S`: the invact command (invact/cli.py)."""

import sys

from invact.cli import main

sys.exit(main())
