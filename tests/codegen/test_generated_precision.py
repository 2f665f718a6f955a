"""The generated torch q evaluated in fp32, as the kernels compute it, keeps the family's error.

The coefficient files' errors are measured in float64. In fp32, rounding in the pieces' variables and
Horner sums adds to that; the 'floor' family is built so this stays below 1e-6 (its module docstring).
"""

import importlib

import numpy as np
import pytest
import torch

from codegen import near_tables
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


# The numba kernel's near pieces (codegen prints q_near_scalar where both branches' near pieces are
# polynomials in one variable): evaluated as the kernel does, compiled with its fast-math flags.
SHARED_NEAR = [
    (name, branch)
    for name, branch in PAIRS
    if hasattr(importlib.import_module(f"invact._generated.{name}_cpu"), "q_near_scalar")
]


@pytest.mark.parametrize(("name", "branch"), SHARED_NEAR)
def test_kernel_near_piece_stays_within_the_recorded_error(name, branch):
    numba = pytest.importorskip("numba")
    cpu = importlib.import_module(f"invact._generated.{name}_cpu")
    generated = importlib.import_module(f"invact._generated.{name}")
    q_near = cpu._q_near

    @numba.njit(fastmath=cpu._FASTMATH)
    def evaluate(y, left):
        out = np.empty_like(y)
        for i in range(y.size):
            out[i] = q_near(y[i], left)
        return out

    act = get_activation(name)
    y = dtype_eval_points(act, branch, FORMATS["fp32"])
    y = y[y < getattr(cpu, f"{branch.upper()}_SPLIT")]
    q32 = evaluate(y.astype(np.float32), branch == "left").astype(np.float64)
    exact = target(act, y, branch)
    err = (np.abs(q32 - exact) - FP32_EVALUATION * np.maximum(np.abs(exact), 1)).max()
    assert err <= generated.ERRORS[branch]["linf_fp32"], err


# The near tables (codegen prints NEAR_TABLE_<ISA> beside q_near_scalar where its degree meets the
# bound): the table as the kernel reads it, in float64, against the near piece it stands for.
TABLED = [(name, branch, isa) for name, branch in SHARED_NEAR for isa in near_tables.NEAR_TABLE_LOOKUPS
          if hasattr(importlib.import_module(f"invact._generated.{name}_cpu"),
                     f"NEAR_TABLE_{isa.upper()}")]  # fmt: skip
# float64 rounding of both sides (Horner sums of degree <= 14 with terms below 2): 1e-15 each, with room.
FLOAT64_ROUNDING = 1e-13


def _table_in_float64(cpu, isa: str, y: np.ndarray, left: bool) -> np.ndarray:
    """NEAR_TABLE_<ISA> evaluated as invact.activation._lookup.near_table does, in float64: entry j = k g
    rounded, u = k g - j."""
    e1, a, e2 = cpu.NEAR_TABLE_G
    g = np.sqrt(np.maximum(y + a, e1) + e2)
    k = getattr(cpu, f"NEAR_TABLE_{isa.upper()}_SCALE")[0 if left else 1]
    n_left, n_right = getattr(cpu, f"NEAR_TABLE_{isa.upper()}_ENTRIES")
    j = np.rint(k * g).astype(np.int64)
    assert j.max() < (n_left if left else n_right)  # up to the split, no entry past the branch's last
    u = k * g - j
    table = np.array(getattr(cpu, f"NEAR_TABLE_{isa.upper()}"))[:, j + (n_right if left else 0)]
    return np.polynomial.polynomial.polyval(u, table, tensor=False)


@pytest.mark.parametrize(("name", "branch", "isa"), TABLED)
def test_near_table_is_within_its_bound_of_the_near_piece(name, branch, isa):
    cpu = importlib.import_module(f"invact._generated.{name}_cpu")
    generated = importlib.import_module(f"invact._generated.{name}")
    act = get_activation(name)
    y = dtype_eval_points(act, branch, FORMATS["fp32"])
    y = y[y < getattr(cpu, f"{branch.upper()}_SPLIT")]
    table = _table_in_float64(cpu, isa, y, branch == "left")
    near = getattr(generated, f"q_{branch}")(torch.tensor(y, dtype=torch.float64)).numpy()
    assert np.abs(table - near).max() <= getattr(cpu, f"NEAR_TABLE_{isa.upper()}_BOUND") + FLOAT64_ROUNDING


@pytest.mark.parametrize(("name", "branch", "isa"), TABLED)
def test_kernel_near_table_stays_within_the_recorded_error(name, branch, isa):
    """The table kernel itself (where the CPU runs it) with dy = 1 on the near pieces' points: the fp32
    bound of the polynomial it stands for holds."""
    pytest.importorskip("numba")
    from invact.activation import _lookup

    if not _lookup.runs(isa):
        pytest.skip(f"numba does not compile for {isa} here")
    cpu = importlib.import_module(f"invact._generated.{name}_cpu")
    generated = importlib.import_module(f"invact._generated.{name}")
    act = get_activation(name)
    y = dtype_eval_points(act, branch, FORMATS["fp32"])
    y = y[y < getattr(cpu, f"{branch.upper()}_SPLIT")].astype(np.float32)
    flags = np.full(y.size, branch == "left", dtype=np.uint8)
    q32 = np.empty_like(y)
    cpu.TABLE_KERNELS[isa][0](y, flags, np.ones_like(y), q32)
    exact = target(act, y.astype(np.float64), branch)
    err = (np.abs(q32.astype(np.float64) - exact) - FP32_EVALUATION * np.maximum(np.abs(exact), 1)).max()
    assert err <= generated.ERRORS[branch]["linf_fp32"], err
