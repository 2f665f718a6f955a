"""The runtime's float64 views of each activation (printed by codegen into invact/_generated/) against
fitting's (built from the same spec entry): f, f', T, y_min and the exact derivative at f^-1(y) per
branch. Both come from one spec entry by different printers (torch code vs numpy lambdify), so they
must agree to float64 rounding; a disagreement means the runtime inverts or differentiates another
function than the one the fits were made for."""

import numpy as np
import pytest
import torch

from fitting.activations import ACTIVATIONS as FITTING
from fitting.evaluate import branch_y_range
from fitting.targets import target
from invact.activation._float64 import derivative_from_output
from invact.activation.activations import ACTIVATIONS as RUNTIME

NAMES = sorted(FITTING)
X = np.concatenate([np.linspace(-30.0, 30.0, 6001), [-0.75, -1.28, 1e-3, -1e-3, 100.0, 1e4]])
# Both evaluate the same formula with different libraries and operation orders: ulps of terms of size
# ~max(1, |f|) (measured on an AMD EPYC: 1.02 ulp at most for f and f' on this grid; 4x that).
F_ULPS = 4
# The runtime inverts y by Newton to a 4e-16 relative step, fitting by its own safeguarded Newton; at
# the cusp both lose accuracy as sqrt(eps) (q ~ sqrt(y - y_min)), so compare away from it:
# measured 2.0e-15 absolute at most over these points (gelu, left branch); 5x that.
TARGET_AGREEMENT = 1e-14
CUSP_MARGIN = 1e-6  # y within this of y_min is left out (see TARGET_AGREEMENT)


def test_the_runtime_has_every_activation_of_the_spec():
    assert sorted(RUNTIME) == NAMES


@pytest.mark.parametrize("name", NAMES)
def test_f_and_derivative_agree(name):
    x = torch.from_numpy(X)
    for runtime, fitting in ((RUNTIME[name].f, FITTING[name].f), (RUNTIME[name].df, FITTING[name].df)):
        got, want = runtime(x).numpy(), fitting(X)
        scale = np.maximum(np.abs(want), 1.0)
        assert np.all(np.abs(got - want) <= F_ULPS * np.finfo(np.float64).eps * scale)


@pytest.mark.parametrize("name", NAMES)
def test_threshold_and_minimum_agree(name):
    runtime, fitting = RUNTIME[name], FITTING[name]
    if fitting.monotone:
        assert runtime.threshold is None and runtime.monotone
    else:
        assert runtime.threshold == fitting.threshold
    assert runtime.y_min == fitting.y_min


@pytest.mark.parametrize("name", NAMES)
def test_exact_derivative_at_the_inverse_agrees_with_the_fitting_target(name):
    fitting = FITTING[name]
    for branch in fitting.branches:
        lo, hi = branch_y_range(fitting, branch)
        y = np.linspace(lo, min(hi, 50.0), 2001)
        y = y[np.abs(y - fitting.y_min) > CUSP_MARGIN]
        left = None if fitting.monotone else torch.full((len(y),), branch == "left")
        got = derivative_from_output(RUNTIME[name], torch.from_numpy(y), left).numpy()
        want = target(fitting, y, branch)
        assert np.abs(got - want).max() <= TARGET_AGREEMENT, branch
