"""The generated torch q evaluated in fp32, as the kernels compute it, keeps the family's error.

The coefficient files' errors are measured in float64. In fp32, rounding in the pieces' variables and
Horner sums adds to that; the 'floor' family is built so this stays below 1e-6 (its module docstring).
"""

import importlib

import numpy as np
import pytest
import torch

from fitting.activations import ACTIVATIONS, get_activation
from fitting.evaluate import FORMATS, dtype_eval_points
from fitting.targets import target

# Measured worst excess over the float64 error: 4.9e-7 of max(|q|, 1) (laplace, y = 0.49, |q| = 1.41); of
# the two-branch activations 1.7e-7 (gelu right, y = 2.92, in its degree-14 near piece). Rounding
# is relative, so where q grows past 1 (relu2's 2 sqrt(y) reaches 40) the bound is this times |q|.
FP32_EVALUATION = 1e-6
PAIRS = [(name, branch) for name in sorted(ACTIVATIONS) for branch in ACTIVATIONS[name].branches]


@pytest.mark.parametrize(("name", "branch"), PAIRS)
def test_fp32_evaluation_stays_within_the_recorded_error(name, branch):
    act = get_activation(name)
    generated = importlib.import_module(f"invact._generated.{name}")
    y = dtype_eval_points(act, branch, FORMATS["fp32"])  # fp32 values: the lattice at the cusp and more
    q32 = getattr(generated, f"q_{branch}")(torch.tensor(y, dtype=torch.float32)).double().numpy()
    exact = target(act, y, branch)
    err = (np.abs(q32 - exact) - FP32_EVALUATION * np.maximum(np.abs(exact), 1)).max()
    assert err <= generated.ERRORS[branch]["linf_fp32"], err
