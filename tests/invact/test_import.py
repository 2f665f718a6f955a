"""The runtime imports with torch alone: no fitting toolkit, no scipy or sympy."""

import subprocess
import sys

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
