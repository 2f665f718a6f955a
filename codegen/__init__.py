"""Code generation from coefficient files (coeffs/<activation>/<family>.json).

This package reads the JSON contract (`codegen.coeffs_json`) and never imports `fitting`. Nor does it
import NumPy: every number it prints is computed by sympy/mpmath, exact rationals or single IEEE float
operations, never by BLAS or a SIMD-dispatched loop, so `python -m codegen` prints the same bytes on
every CPU (tests/codegen/test_cpu_independence.py).
"""
