"""The runtime imports with torch alone: no fitting toolkit, no scipy or sympy."""

import subprocess
import sys
from pathlib import Path

import pytest

from invact.activations import ACTIVATIONS

ROOT = Path(__file__).resolve().parents[2]

FORBIDDEN = ("fitting", "codegen", "scipy", "sympy", "matplotlib", "rich")


def test_runtime_import_pulls_in_no_fitting_dependency():
    code = (
        "import sys, invact\n"
        f"bad = [m for m in {FORBIDDEN!r} if m in sys.modules]\n"
        "assert not bad, bad\n"
        "print(invact.__version__)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_the_hand_written_runtime_names_no_activation(name):
    # Every per-activation view is printed from the spec into invact/_generated/; the runtime's own
    # modules take an activation by name and so work unchanged for a new one.
    hand_written = sorted((ROOT / "invact").glob("*.py"))
    assert hand_written and not [p.name for p in hand_written if name in p.read_text().lower()]
