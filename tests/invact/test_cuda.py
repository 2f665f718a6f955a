"""The whole op on a CUDA device: compiled Triton kernels through autograd, torch.compile with inductor,
and the memory contract. Skipped without CUDA (conftest.py); `make gpu` runs them. The CPU versions of
these checks are in test_functional.py and test_memory_and_compile.py, whose bounds they reuse."""

import pytest
import torch

import invact
from invact.activation.activations import ACTIVATIONS
from invact.activation.ops import invact as invact_op
from tests.invact.test_functional import (
    HALF_LIMITS,
    _branch_masks,
    check_every_finite_16bit,
    check_q_at_stored_y,
)
from tests.invact.test_memory_and_compile import (
    INDUCTOR_GRAD_RTOL,
    MLP,
    ActThenLinear,
    _grads,
    saved_storages,
)

pytestmark = pytest.mark.gpu

NAMES = sorted(ACTIVATIONS)
# The CPU tests' checks and bounds (test_functional.py). Its margin for evaluating q in fp32, measured on
# CPU libm, holds on the GPU too: exp/log/sqrt there are the same IEEE fp32 functions to within 2 ulp
# (CUDA C Programming Guide, "Mathematical Functions": expf 2 ulp, logf 1 ulp; sqrt printed as sqrt_rn).


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
    q = (dx.double() / dy.double()).cpu()
    check_q_at_stored_y(ACTIVATIONS[name], y.cpu(), q, _branch_masks(name, x.cpu()))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(("dtype", "limit"), HALF_LIMITS)
def test_every_finite_16bit_input(name, dtype, limit):
    check_every_finite_16bit(name, dtype, limit, "cuda")


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
    # Compiled, y and q are inductor's code (the op's body, invact._traced), eager's the Triton kernels:
    # the CPU test's bounds (test_compiled_mlp_matches_eager)
    assert torch.allclose(want[0], got[0], atol=1e-5, rtol=1e-5)
    for a, b in zip([want[1], *want[2]], [got[1], *got[2]], strict=True):
        assert (a - b).norm() <= INDUCTOR_GRAD_RTOL * a.norm()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 17, 4096, 4104, 4099])  # full blocks, rows of 8, split in two
@pytest.mark.parametrize("offset", [0, 1])  # 1: pointers off 16-byte alignment
@pytest.mark.parametrize("precision_bit", [False, True])
def test_direct_launch_runs_the_kernel_tritons_launcher_picks(dtype, n, offset, precision_bit):
    """_triton._launch keys compiled kernels by its own reading of Triton's specialization rules; a
    Triton that specializes on more would have it run a kernel compiled for other arguments."""
    import triton

    from invact.activation import _triton

    act = ACTIVATIONS["gelu"]
    x = torch.randn(n + offset, device="cuda", dtype=dtype)[offset:]
    dy = torch.randn(n + offset, device="cuda", dtype=dtype)[offset:]
    y, bits = _triton.forward(act, x, precision_bit)
    y_view = torch.empty(n + offset, device="cuda", dtype=dtype)[offset:].copy_(y)
    dx = _triton.backward(act, y_view, bits, dy, precision_bit)
    for _ in range(2):  # the second call takes the direct path
        y2, bits2 = _triton.forward(act, x, precision_bit)
        assert torch.equal(y2, y) and torch.equal(bits2, bits)
        assert torch.equal(_triton.backward(act, y_view, bits, dy, precision_bit), dx)
    config = _triton.CONFIGS["forward"]
    # past one block, n not a multiple of 8 is two launches: the first over n - n % 8 elements
    n = n - n % 8 if n % 8 and n > config.block else n
    masks = {"EVEN": n % config.block == 0, "ROWS": n % 8 == 0}
    constexprs = _triton.forward_constexprs(act, precision_bit) | masks
    tensors = (x, torch.empty_like(x), torch.empty_like(bits))
    key = _triton._specialization(_triton._forward_kernel, config, n, tensors, constexprs)
    grid = (triton.cdiv(n, config.block), 1, 1)
    launch = _triton._forward_kernel[grid]
    tritons = launch(*tensors, n, **constexprs, BLOCK=config.block, num_warps=config.num_warps)
    assert _triton._COMPILED[key][0] is tritons


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("mode", ["bits", "precision_bit"])
def test_tensors_on_a_device_that_is_not_the_current_one(mode):
    torch.manual_seed(0)
    x, dy = torch.randn(4099, device="cuda:1"), torch.randn(4099, device="cuda:1")
    with torch.cuda.device(1):
        want = _run("gelu", x, mode, dy)
    with torch.cuda.device(0):
        got = _run("gelu", x, mode, dy)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_reduce_overhead_runs_a_patched_model_in_cuda_graphs():
    """torch.compile(mode="reduce-overhead") on a patched Llama (activations, gated MLP, norms, loss):
    every graph is captured (inductor skips none for a custom op or a sync: the compiled graphs hold
    invact's bodies, not its ops), and replaying the captured graphs gives the loss and gradients of
    the same model compiled without CUDA graphs, bit for bit (the same kernels)."""
    import copy

    import transformers
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=512,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).cuda().train()
    invact.patch(model)
    plain = copy.deepcopy(model)
    ids = torch.randint(0, 512, (2, 16), device="cuda")

    def steps(m, mode):
        torch._dynamo.reset()
        compiled = torch.compile(m, mode=mode, fullgraph=True)
        for _ in range(3):  # capture, then replays
            m.zero_grad(set_to_none=True)
            loss = compiled(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
        return loss.detach().clone(), [p.grad.clone() for p in m.parameters()]

    counters.clear()
    got_loss, got = steps(model, "reduce-overhead")
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
    want_loss, want = steps(plain, None)
    assert torch.equal(got_loss, want_loss)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("chunks", ["one chunk", "many chunks"])
@pytest.mark.parametrize("transform", ["none", "scale", "softcap"])
def test_loss_kernels_in_bf16_no_farther_from_float64_than_eager(monkeypatch, transform, chunks):
    """invact.loss._triton's kernel on CUDA, bf16: the loss and gradients no farther from float64 than
    eager's (bf16 logits upcast, F.cross_entropy), within test_loss.py's fp32 slack (on CUDA the weight's
    gradient is summed across chunks in fp32 and rounded once, as eager's)."""
    if chunks == "many chunks":  # 14 rows of bf16 logits a chunk: 7 chunks of the 96 rows
        from tests.invact.test_loss import _many_chunks

        _many_chunks(monkeypatch)
    import invact.loss as L
    from invact.loss import op as loss_op
    from tests.invact.test_loss import (
        HIDDEN,
        ROWS,
        TRANSFORMS,
        VOCAB,
        _case,
        _eager,
        _errors,
        _fp32_bound,
        _run,
    )

    h, w, _, t = (x.cuda() if x is not None else None for x in _case(0))
    ops = TRANSFORMS[transform]
    assert loss_op._kernels(h, ops)
    want = _run(lambda h, w: _eager(h, w, None, t, ops, 0.0, "mean"), (h, w), torch.float64)
    eager = _errors(_run(lambda h, w: _eager(h, w, None, t, ops, 0.0, "mean"), (h, w), torch.bfloat16), want)
    ours = _errors(_run(lambda h, w: L.linear_cross_entropy(h, w, t, ops=ops), (h, w), torch.bfloat16), want)
    slack = _fp32_bound(ROWS, HIDDEN, VOCAB)
    assert all(o <= e + slack for o, e in zip(ours, eager, strict=True)), (ours, eager)
