"""Code generation prints the same bytes on every CPU.

The committed invact/_generated/ is checked byte for byte (test_codegen.py), on whatever machine runs
the tests, so every number codegen prints must be a function of the committed inputs alone: no
BLAS/LAPACK call and no SIMD-dispatched NumPy loop may reach a printed digit (OpenBLAS picks its
kernels per CPU; NumPy's AVX2 and AVX-512 loops for cos and friends round differently). A machine of
another kind is not at hand in a test, so each case below takes the CPU-dependent routines away, or
moves them to other code paths, in a fresh interpreter and asks `python -m codegen --check` whether a
single byte moved.
"""

import os
import subprocess
import sys

import numpy as np
import pytest

from codegen.render import ROOT

# Run in the child before codegen is imported: argv[1] names the case.
_CHILD = """
import sys

if sys.argv[1] == "numpy unimportable":
    sys.modules["numpy"] = None  # `import numpy` raises ImportError from here on
else:
    import numpy
    from numpy.lib.introspect import opt_func_info

    current = opt_func_info(func_name="cos", signature="float64")["cos"]["dd"]["current"]
    assert current.startswith("baseline"), f"NPY_DISABLE_CPU_FEATURES left cos on {current}"

    def refuse(*args, **kwargs):
        raise RuntimeError("codegen called a BLAS/LAPACK routine, whose rounding depends on the CPU")

    for name in ("lstsq", "solve", "inv", "pinv", "svd", "qr", "eig", "eigh", "eigvals", "eigvalsh",
                 "cholesky", "det", "matrix_power", "multi_dot"):
        setattr(numpy.linalg, name, refuse)
    for name in ("matmul", "dot", "vdot", "inner", "tensordot", "einsum"):
        setattr(numpy, name, refuse)

import codegen.__main__

sys.exit(codegen.__main__.main(["--check"]))
"""


def _dispatched_features() -> list[str]:
    """The CPU features NumPy dispatches loops to beyond its baseline, among those this CPU has (X86_V3
    and X86_V4 on an AVX-512 x86 machine): disabling all of them runs every loop on the baseline."""
    from numpy._core._multiarray_umath import __cpu_dispatch__, __cpu_features__

    return [f for f in __cpu_dispatch__ if __cpu_features__.get(f)]


CASES = ["numpy unimportable", "numpy on its baseline loops, BLAS and LAPACK refusing"]


@pytest.mark.parametrize("case", CASES)
def test_generated_bytes_do_not_depend_on_cpu_routines(case):
    env = dict(os.environ)
    if case != "numpy unimportable":
        features = _dispatched_features()
        if not features:
            pytest.skip(f"NumPy {np.__version__} dispatches no loop beyond its baseline on this CPU")
        env["NPY_DISABLE_CPU_FEATURES"] = " ".join(features)
    run = subprocess.run(
        [sys.executable, "-c", _CHILD, case], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, f"codegen --check failed ({case}):\n{run.stdout}{run.stderr[-2000:]}"
