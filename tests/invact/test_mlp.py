"""invact.mlp: a recognised MLP runs as one Function with the unfused patched module's output and
gradients, bitwise, saves no gated product, and hands every call it does not take to the module's
own forward."""

import copy
import pickle

import pytest
import torch
from torch import nn

import invact
from invact.activation.activations import ACTIVATIONS
from invact.activation.modules import InvAct
from invact.memory import inductor_partition
from invact.mlp import Forward, Pattern, match
from invact.mlp.op import _MLP

HIDDEN, INTERMEDIATE = 12, 24
SHAPES = {"rows": (5, HIDDEN), "batch x seq": (2, 3, HIDDEN)}


class Gated(nn.Module):
    """Llama's MLP: down(act(gate(x)) * up(x))."""

    def __init__(self, activation: str, bias: bool, up_first: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(HIDDEN, INTERMEDIATE, bias=bias)
        self.up_proj = nn.Linear(HIDDEN, INTERMEDIATE, bias=bias)
        self.down_proj = nn.Linear(INTERMEDIATE, HIDDEN, bias=bias)
        self.act_fn = InvAct(activation)
        self.up_first = up_first

    def forward(self, x):
        if self.up_first:
            return self.down_proj(self.up_proj(x) * self.act_fn(self.gate_proj(x)))
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def _plain(activation: str, bias: bool) -> nn.Module:
    return nn.Sequential(nn.Linear(HIDDEN, INTERMEDIATE, bias=bias), InvAct(activation),
                         nn.Linear(INTERMEDIATE, HIDDEN, bias=bias))  # fmt: skip


def _pair(form: str, activation: str, dtype: torch.dtype, bias: bool = True):
    """(unfused, fused): the same weights; the unfused one runs its class's forward, with InvAct and,
    for the gated form, the product saved (patch(gated=False)'s behaviour)."""
    torch.manual_seed(0)
    if form == "plain":
        model = _plain(activation, bias)
    else:
        model = Gated(activation, bias, up_first=form == "gated, up first")
    model = model.to(dtype)
    unfused, fused = copy.deepcopy(model), model
    invact.patch(fused)
    assert isinstance(fused.__dict__.get("forward"), Forward)
    return unfused, fused


def _grads(model: nn.Module, x: torch.Tensor, x_grad: bool = True):
    torch.manual_seed(1)
    x = x.clone().requires_grad_(x_grad)
    out = model(x)
    out.backward(torch.randn_like(out))
    return out, [x.grad, *(p.grad for p in model.parameters())]


FORMS = ["plain", "gated", "gated, up first"]


@pytest.mark.parametrize("x_grad", [True, False], ids=["x needs grad", "weights alone"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no bias"])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("form", FORMS)
def test_output_and_gradients_are_the_unfused_modules_bitwise(form, dtype, shape, bias, x_grad):
    unfused, fused = _pair(form, "silu" if form != "plain" else "gelu", dtype, bias)
    x = torch.randn(SHAPES[shape], dtype=dtype)
    want_out, want = _grads(unfused, x, x_grad)
    got_out, got = _grads(fused, x, x_grad)
    assert type(got_out.grad_fn) is _MLP._backward_cls  # the Function ran
    assert torch.equal(got_out, want_out)
    for a, b in zip(got, want, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
@pytest.mark.parametrize("form", ["plain", "gated"])
def test_every_activation_fuses_bitwise(form, activation):
    unfused, fused = _pair(form, activation, torch.float32)
    x = torch.randn(SHAPES["batch x seq"])
    (want_out, want), (got_out, got) = _grads(unfused, x), _grads(fused, x)
    assert type(got_out.grad_fn) is _MLP._backward_cls
    assert torch.equal(got_out, want_out)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def _saved_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd saves in one forward (parameters left out)."""
    return sum(_saved_sizes(model, x))


def _saved_sizes(model: nn.Module, x: torch.Tensor) -> list[int]:
    """Bytes of each distinct storage autograd saves in one forward (parameters left out)."""
    storages = {}
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    return list(storages.values())


@pytest.mark.parametrize("form", ["plain", "gated"])
def test_it_saves_the_unfused_modules_tensors_less_the_product(form):
    unfused, fused = _pair(form, "silu", torch.float32, bias=False)
    x = torch.randn(SHAPES["batch x seq"], requires_grad=True)
    product = x.numel() // HIDDEN * INTERMEDIATE * 4 if form == "gated" else 0  # h = y * u, fp32
    assert _saved_bytes(fused, x) == _saved_bytes(unfused, x) - product


def _hook_down(m):
    m.down_proj.register_forward_hook(lambda *args: None)


def _wrap_down(m):
    class Wrapped(nn.Linear):  # a subclass with a forward of its own (as quantized layers have): not fused
        def forward(self, x):
            return super().forward(x)

    wrapped = Wrapped(INTERMEDIATE, HIDDEN)
    wrapped.load_state_dict(m.down_proj.state_dict())
    m.down_proj = wrapped


def _parametrize_down(m):
    torch.nn.utils.parametrize.register_parametrization(m.down_proj, "weight", _Doubled())


class _Doubled(nn.Module):
    def forward(self, w):
        return 2 * w


# Calls the Function does not take: (how the model is changed after patch(), how it is called)
FALLBACKS = {
    "autocast of float64 (not cast)": (lambda m: m.double(), lambda m, x: _autocast(m, x.double())),
    "keyword argument": (None, lambda m, x: m(x=x)),
    "hook on down": (_hook_down, lambda m, x: m(x)),
    "down wrapped": (_wrap_down, lambda m, x: m(x)),
    "down parametrized": (_parametrize_down, lambda m, x: m(x)),
    "4-D input": (None, lambda m, x: m(x.unsqueeze(0))),
    "strided input": (None, lambda m, x: m(x.transpose(0, 1).contiguous().transpose(0, 1))),
    "no grad": (None, lambda m, x: _no_grad(m, x)),
}


def _autocast(m, x):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return m(x)


def _no_grad(m, x):
    with torch.no_grad():
        return m(x)


@pytest.mark.parametrize("case", list(FALLBACKS))
def test_calls_it_does_not_take_run_the_modules_forward(case):
    change, call = FALLBACKS[case]
    unfused, fused = _pair("gated", "silu", torch.float32)
    if change is not None:
        change(unfused)
        change(fused)
    torch.manual_seed(2)
    x = torch.randn(SHAPES["batch x seq"], requires_grad=True)
    want, got = call(unfused, x), call(fused, x)
    assert type(got.grad_fn) is not _MLP._backward_cls
    assert torch.equal(got, want)


class _Configurable(nn.Linear):
    """torchtitan's Linear: a subclass that keeps nn.Linear's forward, weight and bias."""


def test_a_linear_subclass_keeping_its_forward_is_a_projection():
    unfused, fused = _pair("gated", "silu", torch.float32)
    for model in (unfused, fused):
        for name in ("gate_proj", "up_proj", "down_proj"):
            old = getattr(model, name)
            new = _Configurable(old.in_features, old.out_features)
            new.load_state_dict(old.state_dict())
            setattr(model, name, new)
    x = torch.randn(SHAPES["batch x seq"], requires_grad=True)
    want, got = unfused(x), fused(x)
    assert type(got.grad_fn) is _MLP._backward_cls and torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_under_autocast_to_the_models_own_dtype_it_runs(dtype):
    # every cast autocast would make is a no-op: the Function serves, bitwise the modules' result
    unfused, fused = _pair("gated", "silu", dtype)
    x = torch.randn(SHAPES["batch x seq"], dtype=dtype)
    with torch.autocast("cpu", dtype=dtype):
        (want_out, want), (got_out, got) = _grads(unfused, x), _grads(fused, x)
    assert type(got_out.grad_fn) is _MLP._backward_cls
    assert torch.equal(got_out, want_out)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


class _Computed(nn.Module):
    """model(x * 1): its input is computed, not a leaf (autocast caches the cast of a leaf needing grad,
    and casts any other input once per use)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x * 1)


@pytest.mark.parametrize("x_is", ["leaf", "computed"])
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no bias"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_under_autocast_of_a_float32_model_it_runs_with_the_casts_gradients(dtype, bias, form, x_is):
    # x and the weights are cast for the projections, as autocast casts them for nn.Linear, and each
    # gradient is cast back: bitwise the modules' under the same autocast
    unfused, fused = _pair(form, "silu" if form != "plain" else "gelu", torch.float32, bias)
    if x_is == "computed":
        unfused, fused = _Computed(unfused), _Computed(fused)
    x = torch.randn(SHAPES["batch x seq"])
    with torch.autocast("cpu", dtype=dtype):
        (want_out, want), (got_out, got) = _grads(unfused, x), _grads(fused, x)
    assert type(got_out.grad_fn) is _MLP._backward_cls and got_out.dtype == dtype
    assert torch.equal(got_out, want_out)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == torch.float32 and torch.equal(a, b)


@pytest.mark.parametrize("x_is", ["leaf", "computed"])
@pytest.mark.parametrize("form", ["plain", "gated"])
def test_under_autocast_it_saves_no_more_than_the_modules(form, x_is):
    # the modules save a cast copy of x per projection (one if x is a leaf: autocast's cache) and cast
    # copies of the weights; the Function one cast copy of x, the weights cast again in backward.
    unfused, fused = _pair(form, "silu", torch.float32, bias=False)
    if x_is == "computed":
        unfused, fused = _Computed(unfused), _Computed(fused)
    x = torch.randn(SHAPES["batch x seq"], requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        saved, saved_unfused = _saved_sizes(fused, x), _saved_sizes(unfused, x)
    product = x.numel() // HIDDEN * INTERMEDIATE * 2 if form == "gated" else 0  # h = y * u in bf16
    weights = sum(2 * p.numel() for p in fused.parameters())  # the modules' bf16 copies of them
    assert sum(saved) <= sum(saved_unfused) - product - weights


def test_global_module_hooks_are_run():
    _, fused = _pair("gated", "silu", torch.float32)
    seen = []
    handle = nn.modules.module.register_module_forward_hook(lambda m, args, out: seen.append(m))
    try:
        out = fused(torch.randn(SHAPES["rows"], requires_grad=True))
    finally:
        handle.remove()
    assert type(out.grad_fn) is not _MLP._backward_cls
    assert any(type(m) is nn.Linear for m in seen) and any(m is fused for m in seen)


def test_functional_call_differentiates_the_given_parameters():
    unfused, fused = _pair("gated", "silu", torch.float32)
    params = {k: v.detach().clone().requires_grad_() for k, v in fused.named_parameters()}
    x = torch.randn(SHAPES["batch x seq"])
    grads = []
    for m in (unfused, fused):
        out = torch.func.functional_call(m, params, (x,))
        grads.append(torch.autograd.grad(out.square().sum(), list(params.values())))
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


def test_a_copy_runs_its_own_weights():
    _, fused = _pair("gated", "silu", torch.float32)
    x = torch.randn(SHAPES["rows"])
    for copied in (copy.deepcopy(fused), pickle.loads(pickle.dumps(fused))):
        assert copied.forward.module is copied
        with torch.no_grad():
            copied.down_proj.weight.zero_()
            copied.down_proj.bias.zero_()
        assert not copied(x.requires_grad_()).any() and fused(x).any()


class _Dropout(Gated):
    def __init__(self):
        super().__init__("silu", True)
        self.dropout = nn.Dropout(0.1)

    def forward(self, x):
        return self.down_proj(self.dropout(self.act_fn(self.gate_proj(x)) * self.up_proj(x)))


class _Scaled(Gated):
    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x) * 2)


class _Caching(Gated):
    def forward(self, x):
        self.last = x  # a forward that stores an attribute is not traced
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class _Torchs(Gated):  # act is torch's: nothing of InvAct's to fuse
    def __init__(self):
        super().__init__("silu", True)
        self.act_fn = nn.SiLU()


@pytest.mark.parametrize("cls", [_Dropout, _Scaled, _Caching, _Torchs])
def test_other_forwards_are_not_recognised(cls):
    m = cls() if cls in (_Dropout, _Torchs) else cls("silu", True)
    assert match(m) is None
    assert "last" not in m.__dict__


@pytest.mark.parametrize("form", FORMS)
def test_the_recognised_children(form):
    up_first = form == "gated, up first"
    model = _plain("gelu", True) if form == "plain" else Gated("gelu", True, up_first=up_first)
    want = {
        "plain": Pattern("0", None, "1", "2"),
        "gated": Pattern("up_proj", "gate_proj", "act_fn", "down_proj", False),
        "gated, up first": Pattern("up_proj", "gate_proj", "act_fn", "down_proj", True),
    }[form]
    assert match(model) == want


def test_patch_without_the_gated_path_fuses_the_plain_form_only():
    plain, gated = _plain("gelu", True), Gated("silu", True)
    invact.patch(plain, gated=False)
    invact.patch(gated, gated=False)
    assert isinstance(plain.__dict__.get("forward"), Forward)
    assert "forward" not in gated.__dict__  # the product stays saved, as gated=False asks


# Under torch.compile: the gated form's down(y * u) is the custom op invact::gated_linear.


def _compiled(model: nn.Module, backend="aot_eager", **patches):
    import torch._functorch.config as functorch_config

    torch._dynamo.reset()
    with functorch_config.patch(**patches):
        return torch.compile(model, backend=backend, fullgraph=True)


@pytest.mark.parametrize("form", ["gated", "gated, up first"])
def test_compiled_it_runs_the_op_with_the_unfused_modules_results(form, portable):
    """aot_eager runs the traced ops as eager does: the output is the unfused module's bitwise (the
    op's forward is F.linear(y * u)), and so are the weights' gradients (the op's backward forms them
    by the same products); x's gradient sums its two projections' parts in the order the traced graph
    adds them, which may differ from eager's: within fp32 rounding of that one sum (one ulp of the
    larger part's magnitude, measured against eager's order)."""
    unfused, fused = _pair(form, "silu", torch.float32)
    x = torch.randn(SHAPES["batch x seq"])
    compiled = _compiled(fused)
    (want_out, want), (got_out, got) = _grads(unfused, x), _grads(compiled, x)
    assert torch.equal(got_out, want_out)
    for a, b in zip(got[1:], want[1:], strict=True):
        assert torch.equal(a, b)
    spacing = torch.finfo(torch.float32).eps * want[0].abs()  # one sum's rounding: <= 1/2 ulp of it
    assert ((got[0] - want[0]).abs() <= spacing).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_it_saves_no_more_than_eager(dtype):
    """With the min-cut partitioner inductor uses, the compiled patched MLP saves no more than the eager
    patched MLP: no product h (the op's backward recomputes it in a form the joint graph's CSE does not
    merge with the forward's: merged, the partitioner kept it for the down projection). It may save
    less: where the activation's output feeds only elementwise backward ops, the partitioner keeps its
    input g instead of y and the bits (recomputing both), one byte-eighth per element fewer."""
    _, fused = _pair("gated", "silu", dtype, bias=False)
    x = torch.randn(SHAPES["batch x seq"], dtype=dtype, requires_grad=True)
    compiled = _compiled(fused, inductor_partition)
    _saved_bytes(compiled, x)  # compile outside the measurement
    eager = _saved_bytes(fused, x)
    product = x[..., :1].numel() * INTERMEDIATE * x.element_size()  # one h
    assert eager - product < _saved_bytes(compiled, x) <= eager


def test_compiled_under_a_memory_budget_it_saves_no_more_than_compiled_alone():
    unfused, fused = _pair("gated", "silu", torch.float32, bias=False)
    alone = Gated("silu", False)
    alone.act_fn = nn.SiLU()
    alone.load_state_dict(unfused.state_dict())
    x = torch.randn(SHAPES["batch x seq"], requires_grad=True)
    figures = {}
    for name, model in (("alone", alone), ("patched", fused)):
        compiled = _compiled(model, inductor_partition, activation_memory_budget=0.5)
        _saved_bytes(compiled, x)
        figures[name] = _saved_bytes(compiled, x)
    assert figures["patched"] <= figures["alone"], figures


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_compiled_under_autocast_of_a_float32_model(dtype):
    """The op has no autocast kernel: the traced path casts the down projection's weight and bias as
    F.linear's autocast does, and their gradients come back in float32; the result is the unfused
    modules' under the same autocast within one rounding of dtype (the graph may order the casts and
    sums differently: bounded by eps(dtype) times the magnitude)."""
    unfused, fused = _pair("gated", "silu", torch.float32)
    x = torch.randn(SHAPES["batch x seq"])
    compiled = _compiled(fused)
    with torch.autocast("cpu", dtype=dtype):
        (want_out, want), (got_out, got) = _grads(unfused, x), _grads(compiled, x)
    assert got_out.dtype == dtype
    eps = torch.finfo(dtype).eps
    assert ((got_out.float() - want_out.float()).abs() <= eps * want_out.float().abs()).all()
    for a, b in zip(got, want, strict=True):
        assert a.dtype == torch.float32
        assert ((a - b).abs() <= eps * b.abs().max()).all()


class GateUp(nn.Module):
    """Phi-3's MLP: down(up * act(gate)) with gate, up = gate_up(x).chunk(2, dim=-1)."""

    def __init__(self, activation: str, bias: bool = False):
        super().__init__()
        self.gate_up_proj = nn.Linear(HIDDEN, 2 * INTERMEDIATE, bias=bias)
        self.down_proj = nn.Linear(INTERMEDIATE, HIDDEN, bias=bias)
        self.activation_fn = InvAct(activation)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(up * self.activation_fn(gate))


def test_a_fused_gate_up_is_recognised():
    assert match(GateUp("silu")) == Pattern("gate_up_proj", "gate_up_proj", "activation_fn", "down_proj",
                                            chunked=True)  # fmt: skip


class _Function(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def _torch_twin(model: GateUp, dtype: torch.dtype) -> nn.Module:
    """The same module with torch's activation, in `dtype`."""
    twin = GateUp(model.activation_fn.activation, model.down_proj.bias is not None)
    twin.load_state_dict(model.state_dict())
    twin.activation_fn = _Function(ACTIVATIONS[model.activation_fn.activation].torch_forward)
    return twin.to(dtype)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no bias"])
def test_compiled_a_fused_gate_up_runs_as_one_op(bias):
    """Under compile the fused form is invact::gate_up_linear: the output is the module's bitwise (the
    same torch ops); its gradients, which take f' in float64 rounded once where torch's activation
    rounds its own fp32 formula, are no farther from a float64 run than the unpatched module's fp32
    gradients, within twice their distance plus one fp32 rounding of the largest."""
    torch.manual_seed(0)
    model = GateUp("silu", bias)
    invact.patch(model)
    assert model.__dict__["forward"].pattern.chunked
    x = torch.randn(SHAPES["batch x seq"])
    compiled = _compiled(model)
    got_out, got = _grads(compiled, x)
    want_out, want = _grads(_torch_twin(model, torch.float32), x)
    _, exact = _grads(_torch_twin(model, torch.float64), x.double())
    assert torch.equal(got_out, want_out)
    for a, b, ref in zip(got, want, exact, strict=True):
        slack = torch.finfo(torch.float32).eps * ref.abs().max()
        assert (a.double() - ref).abs().max() <= 2 * (b.double() - ref).abs().max() + slack


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_a_fused_gate_up_saves_no_more_than_eager(dtype):
    """Eager's gated path keeps y and u moved into gate_up's output, and the bits; the op keeps that
    output (g and u) and recomputes y: no more bytes (the bits fewer)."""
    torch.manual_seed(0)
    model = GateUp("silu").to(dtype)
    invact.patch(model)
    x = torch.randn(SHAPES["batch x seq"], dtype=dtype, requires_grad=True)
    from invact.memory import count_saved  # an observer: the gated hooks act under it

    compiled = _compiled(model, inductor_partition)
    _saved_bytes(compiled, x)
    with count_saved(model) as eager:
        model(x)
    bits = x.numel() // HIDDEN * INTERMEDIATE // 8
    assert _saved_bytes(compiled, x) == eager.report.saved_bytes - bits


def _t5_mlp(dropout: float, dtype=torch.float32, patch: bool = True):
    """T5's gated MLP (transformers' T5DenseGatedActDense: wo(dropout(act(wi_0 x) * wi_1 x)) behind a
    dtype check), patched unless `patch` is False."""
    t5 = pytest.importorskip("transformers.models.t5.modeling_t5")
    config = t5.T5Config(d_model=HIDDEN, d_ff=INTERMEDIATE, feed_forward_proj="gated-gelu",
                         dropout_rate=dropout)  # fmt: skip
    torch.manual_seed(0)
    model = t5.T5DenseGatedActDense(config).to(dtype).train()
    if patch:
        invact.patch(model)
    return model


def test_t5s_gated_mlp_is_recomputed_not_fused():
    from invact.mlp import Recomputed

    model = _t5_mlp(0.0)
    assert match(model) is None and isinstance(model.__dict__["forward"], Recomputed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_t5s_gated_mlp_saves_what_eager_saves(dtype, portable):
    """Compiled, the selective checkpoint recomputes the product y * u that the partitioner would save
    for wo (one product more than eager patch() without it); gradients bitwise eager's (aot_eager: the
    same kernels, the product recomputed by the same multiply on the same operands)."""
    model = _t5_mlp(0.0, dtype)
    x = torch.randn(SHAPES["batch x seq"], dtype=dtype, requires_grad=True)
    from invact.memory import count_saved

    with count_saved(model) as eager:
        model(x)
    compiled = _compiled(model, inductor_partition)
    _saved_bytes(compiled, x)
    assert _saved_bytes(compiled, x) == eager.report.saved_bytes
    model.zero_grad()
    want_out, want = _grads(model, x.detach())
    model.zero_grad()
    got_out, got = _grads(_compiled(model), x.detach())
    assert torch.equal(got_out, want_out) and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_compiled_t5s_gated_mlp_with_dropout_saves_no_more_than_compile_alone_and_the_bits():
    """With dropout in training the dropped-out product is what wo saves, and the mask is saved, not
    drawn again (random ops are saved): torch's module compiled keeps g (and recomputes act(g)) where
    the activation's op keeps y and its bits, one bit per element more."""
    x = torch.randn(SHAPES["batch x seq"], requires_grad=True)
    figures = {}
    for name, m in (("patch", _t5_mlp(0.1)), ("torch", _t5_mlp(0.1, patch=False))):
        compiled = _compiled(m, inductor_partition)
        _saved_bytes(compiled, x)
        figures[name] = _saved_bytes(compiled, x)
    bits = x.numel() // HIDDEN * INTERMEDIATE // 8
    assert figures["patch"] <= figures["torch"] + bits, figures
