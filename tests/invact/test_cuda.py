"""The whole op on a CUDA device: compiled Triton kernels through autograd, torch.compile with inductor,
and the memory contract. Skipped without CUDA (conftest.py); `make gpu` runs them. The CPU versions of
these checks are in test_functional.py and test_memory_and_compile.py, whose bounds they reuse."""

import pytest
import torch

import invact
from invact._float64 import derivative_from_output
from invact.activations import ACTIVATIONS
from invact.ops import invact as invact_op
from tests.invact.test_functional import _all_finite, _branch_masks, _exact_derivative
from tests.invact.test_memory_and_compile import MLP, ActThenLinear, _grads, saved_storages

pytestmark = pytest.mark.gpu

NAMES = sorted(ACTIVATIONS)
# q evaluated in fp32 against q in float64: under 1e-6 (measured 7.4e-7 on CPU libm,
# tests/codegen/test_generated_precision.py). The GPU's exp/log/sqrt are the same IEEE fp32 functions
# to within 2 ulp (CUDA C Programming Guide, "Mathematical Functions": expf 2 ulp, logf 1 ulp), so the
# same margin holds there.
FP32_EVALUATION = 1e-6
# Every finite 16-bit input: the CPU test's limits (bf16 0.06, fp16 0.03: the storage floor at the cusp,
# ~0.015 / ~0.007, plus the family's error and dx's rounding to the dtype; test_functional.py).
HALF_LIMITS = [(torch.bfloat16, 0.06), (torch.float16, 0.03)]


def _run(name, x, mode="bits", dy=None):
    x = x.detach().requires_grad_()
    y = invact_op(x, name, mode)
    y.backward(torch.ones_like(y) if dy is None else dy)
    return y.detach(), x.grad


def test_cuda_tensors_take_the_triton_backend():
    assert invact.backend_for(torch.zeros(1, device="cuda")) == "triton"


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("mode", ["bits", "precision_bit"])
def test_fp32_gradient_is_the_familys_at_the_stored_output(name, mode):
    torch.manual_seed(0)
    x = torch.randn(2**20, device="cuda") * 3
    dy = torch.randn(2**20, device="cuda")
    y, dx = _run(name, x, mode, dy)
    act = ACTIVATIONS[name]
    q = (dx.double() / dy.double()).cpu()
    masks = _branch_masks(name, x.cpu())
    # The bit is x < T: the branch masks come from x, and the exact derivative is taken at the y the
    # kernel stored (in precision-bit mode, the y with the bit in its last place, which q also reads).
    at_y = derivative_from_output(act, y.cpu(), None if act.monotone else masks[0][1])
    for branch, mask in masks:
        err = (q[mask] - at_y[mask]).abs().max().item()
        assert err <= act.generated.ERRORS[branch]["linf_fp32"] + FP32_EVALUATION, (branch, err)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(("dtype", "limit"), HALF_LIMITS)
def test_every_finite_16bit_input(name, dtype, limit):
    x = _all_finite(dtype).cuda()
    y_torch = ACTIVATIONS[name].torch_forward(x)
    ok = torch.isfinite(y_torch)  # torch's own y overflows for |x| near the dtype's max (CPU test)
    y, dx = _run(name, x)
    assert torch.isfinite(dx[ok]).all()
    err = (dx[ok].double() - _exact_derivative(name, x[ok])).abs().max().item()
    assert err <= limit, err


@pytest.mark.parametrize("name", NAMES)
def test_layouts_match_contiguous(name):
    """channels_last and permuted inputs flatten in storage order; a mix-up would be off by O(1)."""
    base = torch.randn(2, 3, 5, 7, device="cuda")
    for x in (base.to(memory_format=torch.channels_last), base.transpose(1, 3), base[:, :, ::2]):
        dy = torch.randn_like(x)
        y, dx = _run(name, x, dy=dy)
        y_ref, dx_ref = _run(name, x.contiguous(), dy=dy.contiguous())
        assert torch.equal(y, y_ref) and torch.equal(dx, dx_ref)


@pytest.mark.parametrize(
    "act", [invact.InvActGELU(), invact.InvActSiLU(), invact.InvActQuickGELU(), invact.InvActMish()]
)
def test_only_the_output_and_the_bits_are_held(act):
    h = torch.randn(33, 96, device="cuda", requires_grad=True)
    n = h.numel()
    model = ActThenLinear(act).cuda()
    saved = saved_storages(model, h)
    assert h.untyped_storage().data_ptr() not in saved
    assert saved.pop(model.y.untyped_storage().data_ptr()) == 4 * n
    assert list(saved.values()) == [(n + 7) // 8]


@pytest.mark.parametrize("mode", ["bits", "precision_bit"])
@pytest.mark.parametrize("act", [invact.InvActGELU, invact.InvActSoftplus])
def test_inductor_matches_eager(mode, act):
    torch.manual_seed(0)
    eager = MLP(act(mode=mode)).cuda()
    compiled_model = MLP(act(mode=mode)).cuda()
    compiled_model.load_state_dict(eager.state_dict())
    compiled = torch.compile(compiled_model, fullgraph=True)
    x = torch.randn(16, 64, device="cuda")
    torch._dynamo.reset()
    want, got = _grads(eager, x), _grads(compiled, x)
    # The same Triton kernels in both; inductor may fuse the Linear epilogues (fp32 rounding): the CPU
    # test's 1e-5.
    for a, b in zip([want[0], want[1], *want[2]], [got[0], got[1], *got[2]], strict=True):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)
