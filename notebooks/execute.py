"""Re-execute the committed notebooks in place, with full settings (unless --small), so they carry
fresh outputs:

    python notebooks/execute.py            # both notebooks, full settings
    python notebooks/execute.py --small    # INVACT_NOTEBOOK_SMALL=1 settings (what CI runs)
    python notebooks/execute.py notebooks/01_approximation_error.ipynb

The kernel is this interpreter's ipykernel, whatever other Jupyter kernels are installed.
"""

import argparse
import sys
import time
from pathlib import Path

from fitting.notebook_support import NOTEBOOKS, execute_notebook


def main(argv: list[str] | None = None) -> int:
    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=fmt)
    parser.add_argument("paths", nargs="*", type=Path, help="notebooks (default: all in notebooks/)")
    parser.add_argument("--small", action="store_true", help="execute with INVACT_NOTEBOOK_SMALL=1")
    args = parser.parse_args(argv)
    for path in args.paths or sorted(NOTEBOOKS.glob("*.ipynb")):
        start = time.perf_counter()
        execute_notebook(path, path, small=args.small)
        print(f"{path}: executed in {time.perf_counter() - start:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
