"""Gated MLPs (down(act(g) * u)) under patch(): the down projection keeps no copy of the product,
measured without saved-tensor hooks (net memory held after the forward, from the profiler), with
gradients bitwise those of the activation-only patch (the product is recomputed exactly)."""

import gc

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

import invact
from invact.mlp import Forward, recompute_products
from invact.mlp.gated import _product_node

transformers = pytest.importorskip("transformers")

BATCH, SEQ, HIDDEN, INTERMEDIATE, LAYERS, TOP_K = 2, 16, 64, 160, 2, 2
EXPERTS, MOE_INTERMEDIATE, SHARED_INTERMEDIATE = 4, 96, 128


def _held_bytes(model: nn.Module, inputs: dict, autocast: bool = False) -> int:
    """Bytes allocated and not freed during one training forward (what autograd keeps, plus the
    output): the sum of the profiler's self_cpu_memory_usage over its events. No saved-tensor hooks.
    Earlier tests' garbage is collected first: freed inside the profile, it would count as negative."""
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(**inputs)
    held = sum(e.self_cpu_memory_usage for e in prof.events())
    del out
    return held


def _decoders():
    """label -> (a builder, the elements of gated products act(g) * u per token and layer (each
    MLP's intermediate size, summed over the experts a token goes to), and of those the elements of
    g in a fused gate_up output, whose storage u alone would keep)."""
    from transformers import (
        Gemma2Config,
        Gemma2Model,
        GemmaConfig,
        GemmaModel,
        LlamaConfig,
        LlamaModel,
        MistralConfig,
        MistralModel,
        MixtralConfig,
        MixtralModel,
        Phi3Config,
        Phi3Model,
        Qwen2Config,
        Qwen2Model,
        Qwen2MoeConfig,
        Qwen2MoeModel,
        Qwen3Config,
        Qwen3Model,
        Qwen3MoeConfig,
        Qwen3MoeModel,
    )  # fmt: skip

    common = dict(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_attention_heads=4,
                  num_hidden_layers=LAYERS, num_key_value_heads=2, vocab_size=128)  # fmt: skip
    moe = dict(num_experts=EXPERTS, num_experts_per_tok=TOP_K, moe_intermediate_size=MOE_INTERMEDIATE)
    shared = dict(shared_expert_intermediate_size=SHARED_INTERMEDIATE)
    mixtral = dict(num_local_experts=EXPERTS, num_experts_per_tok=TOP_K)
    return {
        "llama (SwiGLU)": (lambda: LlamaModel(LlamaConfig(**common)), INTERMEDIATE, 0),
        "mistral (SwiGLU)": (lambda: MistralModel(MistralConfig(**common)), INTERMEDIATE, 0),
        "qwen2 (SwiGLU)": (lambda: Qwen2Model(Qwen2Config(**common)), INTERMEDIATE, 0),
        "qwen3 (SwiGLU)": (lambda: Qwen3Model(Qwen3Config(**common, head_dim=16)), INTERMEDIATE, 0),
        "gemma (tanh-GELU GeGLU)": (lambda: GemmaModel(GemmaConfig(**common, head_dim=16)), INTERMEDIATE, 0),
        "gemma2 (tanh-GELU GeGLU)": (
            lambda: Gemma2Model(Gemma2Config(**common, head_dim=16)),
            INTERMEDIATE,
            0,
        ),
        "phi3 (fused gate_up_proj)": (
            lambda: Phi3Model(Phi3Config(**common, pad_token_id=0)),
            INTERMEDIATE,
            INTERMEDIATE,
        ),
        # MoE experts: the down projection is a functional call inside the experts module; every
        # token goes to TOP_K experts, each saving its rows of the product. The third figure is g's
        # half of the experts' fused gate_up output, in the layout transformers 5.x builds: see _ideal
        # for 4.x's per-expert MLPs.
        "mixtral (MoE experts)": (
            lambda: MixtralModel(MixtralConfig(**common, **mixtral)),
            TOP_K * INTERMEDIATE,
            TOP_K * INTERMEDIATE,
        ),
        "qwen2-moe (experts + shared expert)": (
            lambda: Qwen2MoeModel(Qwen2MoeConfig(**common, **moe, **shared)),
            TOP_K * MOE_INTERMEDIATE + SHARED_INTERMEDIATE,
            TOP_K * MOE_INTERMEDIATE,  # the shared expert has gate and up projections of its own
        ),
        "qwen3-moe (experts)": (
            lambda: Qwen3MoeModel(Qwen3MoeConfig(**common, **moe, head_dim=16)),
            TOP_K * MOE_INTERMEDIATE,
            TOP_K * MOE_INTERMEDIATE,
        ),
    }


def _experts_layout(model: nn.Module) -> str | None:
    """How the installed transformers built a MoE decoder's experts (as tests/invact/test_experts.py's
    _layout tells them apart): "fused", one module of 3-D weights whose gate_up_proj output holds g and u
    (transformers 5.x), or "per-expert", an nn.ModuleList of gated MLPs, each with a gate and an up
    projection of its own (4.x); None for a dense decoder."""
    found = [m for name, m in model.named_modules() if name.rpartition(".")[2] == "experts"]
    if not found:
        return None
    return "per-expert" if all(isinstance(m, nn.ModuleList) for m in found) else "fused"


def _ideal(label: str, model: nn.Module | None = None) -> int:
    """Bytes the gated path saves beyond the activation-only patch in one fp32 forward of BATCH x SEQ
    tokens of `model` (one the label's builder made; built here if not given): every product, and g's
    half of each fused gate_up output (y moves into it, or u out). Where the experts are per-expert
    MLPs (transformers 4.x), g and u are the outputs of two nn.Linear (each expert an ordinary gated
    MLP, which invact.mlp's fuse runs as one Function saving no product): no half of anything to free,
    only the products, the same TOP_K rows per token. The MoE labels' fused figure is the experts'
    alone (the shared expert has its own gate and up projections in both layouts)."""
    make, products, fused = _decoders()[label]
    if _experts_layout(make() if model is None else model) == "per-expert":
        fused = 0
    return LAYERS * BATCH * SEQ * (products + fused) * 4


def _pair(label, dtype=torch.float32):
    """The same decoder patched twice: activation-only and gated."""
    make = _decoders()[label][0]
    torch.manual_seed(0)
    plain = make().to(dtype).train()
    gated = make().to(dtype).train()
    gated.load_state_dict(plain.state_dict())
    assert invact.patch(plain, gated=False) and invact.patch(gated)
    return plain, gated


@pytest.mark.parametrize("label", list(_decoders()))
def test_the_down_projection_keeps_no_copy_of_the_product(label):
    plain, gated = _pair(label)
    inputs = {"input_ids": torch.randint(0, 128, (BATCH, SEQ))}
    saving = _held_bytes(plain, inputs) - _held_bytes(gated, inputs)
    ideal = _ideal(label, gated)
    assert abs(saving - ideal) <= 0.01 * ideal, (saving, ideal)


@pytest.mark.parametrize("label", list(_decoders()))
def test_plan_reports_the_hooked_modules_and_the_measured_products(label):
    torch.manual_seed(0)
    model = _decoders()[label][0]().train()
    inputs = {"input_ids": torch.randint(0, 128, (BATCH, SEQ))}
    static = [d for d in invact.plan(model, norms=False) if d.replace]
    assert static and all(d.gated == d.name.rpartition(".")[0] and d.gated_bytes is None for d in static)
    measured = [d for d in invact.plan(model, example_inputs=inputs, norms=False) if d.replace]
    assert [d.name for d in measured] == [d.name for d in static]
    assert sum(d.gated_bytes for d in measured) == _ideal(label, model)
    assert all(d.gated == d.name.rpartition(".")[0] and "by the gated path" in d.reason for d in measured)
    invact.patch(model, example_inputs=inputs)
    hooked = [n for n, m in model.named_modules() if getattr(m, "_invact_recompute_products", False)]
    assert hooked == [d.gated for d in measured]


@pytest.mark.parametrize("label", list(_decoders()))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_are_the_activation_only_patchs_bitwise(label, dtype):
    plain, gated = _pair(label, dtype)
    ids = torch.randint(0, 128, (BATCH, SEQ))
    for m in (plain, gated):
        m(input_ids=ids).last_hidden_state.float().square().mean().backward()
    for (name, a), b in zip(plain.named_parameters(), gated.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad), name


# fp32: a patched model's gradient differs from torch's by dy times q's error against f'(x) at each
# activation: each family's linf_fp32 + 1e-6 (<= 3.2e-6) away from the cusp, up to 3.3e-4 at it, where the
# fp32 storage of y moves q (the README derives that bound from torch's forward ulps). Through these
# two-layer decoders it is not amplified: measured 1.4e-7 at most (Phi-3), relative to the whole
# gradient vector.
FP32_GRADIENT_REL = 3.3e-4
# bf16: q's error is ~1000x below bf16's rounding (2^-9 relative), so InvAct moves a bf16 gradient
# only where that error crosses a rounding boundary: its distance from the fp32 gradient is torch's
# own bf16 distance, measured 0.997x to 1.0034x (Phi-3) over these families and seeds 0-2 on
# transformers 5.24 (torch 2.13), to 1.0074x (Mixtral's per-expert MLPs, seed 1) on 4.57 (torch 2.11);
# the three MoE families over seeds 0-9, 0.997x to 1.005x on 5.24 and to 1.0074x on 4.57.
# Both bounds are the activation's and the gated path's: the test patches with norms=False. The
# inverted norms (patch()'s default since this test was written) have bounds of their own
# (tests/invact/test_norm.py, test_norm_patch.py): the final norm's bf16 dx is rounded once from fp32
# (0.39x to 0.72x torch's distance from the fp32 dx, Qwen3-MoE on 4.57, seeds 0-5), in another place
# than torch's in nearly every element, so every gradient below it carries another draw of bf16's
# error: with the norms patched these ratios spread from 0.35x to 1.17x over seeds 0-9 (Qwen3-MoE:
# 1.07x at seed 0 and 1.17x at seed 5 on 4.57, 1.08x at seed 9 on 5.24; the final norm alone gives
# the same), a bound on the norms' rounding, not on q.
BF16_DISTANCE_RATIO = 1.05


@pytest.mark.parametrize("label", list(_decoders()))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_against_torchs_within_the_familys_bound(label, dtype):
    torch.manual_seed(0)
    make = _decoders()[label][0]
    reference = make().train()
    ids = torch.randint(0, 128, (BATCH, SEQ))

    def gradient(m):
        m(input_ids=ids).last_hidden_state.float().square().mean().backward()
        return torch.cat([p.grad.float().flatten() for p in m.parameters()])

    def copy(patched: bool):
        m = make().train()
        m.load_state_dict(reference.state_dict())
        if patched:
            invact.patch(m, norms=False)  # the bounds above are q's: see there
        return m.to(dtype)

    want = gradient(reference)
    got = gradient(copy(patched=True))
    if dtype == torch.float32:
        assert (got - want).norm() <= FP32_GRADIENT_REL * want.norm()
    else:
        torch_bf16 = gradient(copy(patched=False))
        assert (got - want).norm() <= BF16_DISTANCE_RATIO * (torch_bf16 - want).norm()


def _mlp(hooked: bool = False):
    """A gated MLP. patch() runs it as invact.mlp's Function; `hooked`: its forward takes a second
    (unused) argument, which invact.mlp does not recognise, so that invact.mlp.gated's hooks serve it."""

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate, self.up = nn.Linear(HIDDEN, INTERMEDIATE), nn.Linear(HIDDEN, INTERMEDIATE)
            self.down, self.act = nn.Linear(INTERMEDIATE, HIDDEN), nn.SiLU()

        def forward(self, x):
            return self.down(self.act(self.gate(x)) * self.up(x))

    class HookedMLP(MLP):
        def forward(self, x, scale=None):
            return self.down(self.act(self.gate(x)) * self.up(x))

    torch.manual_seed(0)
    return HookedMLP() if hooked else MLP()


def _fused(m: nn.Module) -> bool:
    return isinstance(m.__dict__.get("forward"), Forward)


@pytest.mark.parametrize("hooked", [False, True], ids=["fused", "hooked"])
def test_under_checkpointing_and_compile_nothing_changes_but_the_memory(hooked, portable):
    torch.manual_seed(1)
    x = torch.randn(BATCH, SEQ, HIDDEN)
    grads = []
    for variant in ("plain", "checkpointed", "compiled"):
        m = _mlp(hooked)
        invact.patch(m)
        xi = x.clone().requires_grad_()
        if variant == "checkpointed":  # outer saved-tensor hooks: the gated path stands aside
            out = torch.utils.checkpoint.checkpoint(m, xi, use_reentrant=False)
        elif variant == "compiled":
            out = torch.compile(m, fullgraph=True, backend="aot_eager")(xi)
        else:
            out = m(xi)
        out.square().sum().backward()
        grads.append((xi.grad, [p.grad for p in m.parameters()]))
    for gx, gp in grads[1:]:
        assert torch.allclose(gx, grads[0][0], rtol=1e-6, atol=1e-7)  # compile may fuse: rounding only
        assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-7) for a, b in zip(gp, grads[0][1], strict=True))


def test_dropout_between_product_and_down_projection_is_left_alone():
    m = _mlp()
    invact.patch(m)
    x = torch.randn(BATCH, HIDDEN, requires_grad=True)
    h = m.act(m.gate(x)) * m.up(x)
    assert _product_node(h) is not None
    assert _product_node(nn.functional.dropout(h, 0.1)) is None  # the dropped-out tensor is saved
    assert _product_node(m.gate(x) * m.up(x)) is None  # no InvAct operand: nothing to recompute from


@pytest.mark.parametrize("hooked", [False, True], ids=["fused", "hooked"])
def test_hooking_is_idempotent(hooked):
    m = _mlp(hooked)
    invact.patch(m)
    forward = m.__dict__.get("forward")
    assert _fused(m) != hooked
    assert not recompute_products(m)  # patch() hooked the module holding the activation already
    invact.patch(m)
    assert len(m._forward_pre_hooks) == int(hooked)
    assert m.__dict__.get("forward") is forward  # not fused twice


def _plain_mlp(hooked: bool = False):
    """A plain MLP (act's output goes to a Linear: no product to recompute); `hooked` as for _mlp."""

    class PlainMLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down, self.act = (
                nn.Linear(HIDDEN, INTERMEDIATE),
                nn.Linear(INTERMEDIATE, HIDDEN),
                nn.GELU(),
            )

        def forward(self, x):
            return self.down(self.act(self.up(x)))

    class HookedPlainMLP(PlainMLP):
        def forward(self, x, scale=None):
            return self.down(self.act(self.up(x)))

    torch.manual_seed(0)
    return HookedPlainMLP() if hooked else PlainMLP()


def _step(m, x):
    xi = x.clone().requires_grad_()
    m(xi).square().sum().backward()
    grads = [xi.grad, *[p.grad.clone() for p in m.parameters()]]
    m.zero_grad()
    return grads


def test_hooks_remove_themselves_after_a_call_with_no_product():
    """Patched without example inputs, a plain MLP is hooked; its first call with grad shows no
    product (an InvAct ran, tensors were saved, none a product), and the hooks go: later calls pay no
    Python hook. Calls without grad or without an InvAct inside prove nothing and leave them."""
    torch.manual_seed(2)
    x = torch.randn(BATCH, SEQ, HIDDEN)
    eager = _plain_mlp(hooked=True)
    invact.patch(eager, gated=False)
    want = _step(eager, x)
    m = _plain_mlp(hooked=True)
    invact.patch(m)
    assert len(m._forward_pre_hooks) == len(m._forward_hooks) == 1
    with torch.no_grad():
        m(x)
    assert len(m._forward_pre_hooks) == len(m._forward_hooks) == 1
    for _ in range(2):  # the call that removes them, and one without them
        got = _step(m, x)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        assert not m._forward_pre_hooks and not m._forward_hooks
    assert not recompute_products(m)  # idempotent still: patch() does not hook it again
    invact.patch(m)
    assert not m._forward_pre_hooks


def test_hooks_stay_where_a_product_was_recomputed():
    m = _mlp(hooked=True)
    invact.patch(m)
    x = torch.randn(BATCH, SEQ, HIDDEN)
    for _ in range(2):
        _step(m, x)
        assert len(m._forward_pre_hooks) == len(m._forward_hooks) == 1


def test_lora_wrapped_down_projection_saves_the_product_and_trains():
    peft = pytest.importorskip("peft")
    from transformers import LlamaConfig, LlamaModel

    def make():
        torch.manual_seed(0)
        config = LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_attention_heads=4,
                             num_hidden_layers=1, num_key_value_heads=2, vocab_size=128)  # fmt: skip
        # LoRA on all three projections: with the base weights frozen, g and u need grad only through
        # gate's and up's adapters (with LoRA on down_proj alone, nothing before it needs grad, y and u
        # are not saved and the product is the only copy: nothing to recompute from).
        lora = peft.LoraConfig(r=4, target_modules=["gate_proj", "up_proj", "down_proj"])
        return peft.get_peft_model(LlamaModel(config), lora)

    plain, model = make(), make()
    invact.patch(plain, gated=False)
    invact.patch(model)
    ids = {"input_ids": torch.randint(0, 128, (BATCH, SEQ))}
    # The LoRA layer's base Linear and its lora_A (dropout 0: the identity) both save the product.
    saving = _held_bytes(plain, ids) - _held_bytes(model, ids)
    ideal = BATCH * SEQ * INTERMEDIATE * 4
    assert abs(saving - ideal) <= 0.01 * ideal, (saving, ideal)
    lora = [p for n, p in model.named_parameters() if "lora_" in n]
    before = [p.detach().clone() for p in lora]
    opt = torch.optim.SGD(lora, lr=1.0)
    for _ in range(2):
        model(**ids).last_hidden_state.square().mean().backward()
        opt.step()
        opt.zero_grad()
    assert all(not torch.equal(a, b) for a, b in zip(before, lora, strict=True))


def test_invact_memory_counts_the_recomputed_product_as_not_saved():
    from invact.memory import saved_tensors

    plain, gated = _pair("llama (SwiGLU)")
    ids = torch.randint(0, 128, (BATCH, SEQ))
    counted = [saved_tensors(m, input_ids=ids).saved_bytes for m in (plain, gated)]
    by_hooks = counted[0] - counted[1]
    by_profiler = _held_bytes(plain, {"input_ids": ids}) - _held_bytes(gated, {"input_ids": ids})
    assert by_hooks == by_profiler == LAYERS * BATCH * SEQ * INTERMEDIATE * 4


@pytest.mark.parametrize(("dropout", "products_saved"), [(0.0, 1), (0.1, 0)])
def test_t5_gated_gelu_with_and_without_dropout(dropout, products_saved):
    # T5's gated MLP applies dropout to the product before wo: with p = 0 dropout returns the product
    # itself, which is recomputed; with p > 0 wo saves the dropped-out tensor, and nothing changes.
    from transformers import T5Config, T5EncoderModel

    def make():
        torch.manual_seed(0)
        config = T5Config(d_model=HIDDEN, d_ff=INTERMEDIATE, num_layers=LAYERS, num_heads=4, d_kv=16,
                          vocab_size=128, feed_forward_proj="gated-gelu", dropout_rate=dropout)  # fmt: skip
        return T5EncoderModel(config).train()

    plain, gated = make(), make()
    invact.patch(plain, gated=False)
    invact.patch(gated)
    ids = {"input_ids": torch.randint(0, 128, (BATCH, SEQ))}
    held = []
    for m in (plain, gated):
        torch.manual_seed(1)  # the same dropout masks
        held.append(_held_bytes(m, ids))
    ideal = products_saved * LAYERS * BATCH * SEQ * INTERMEDIATE * 4
    assert abs(held[0] - held[1] - ideal) <= 0.01 * max(ideal, BATCH * SEQ * INTERMEDIATE * 4)


def test_compile_fullgraph_of_a_patched_decoder_matches_eager(portable):
    from transformers import LlamaConfig, LlamaModel

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_attention_heads=4,
                         num_hidden_layers=LAYERS, num_key_value_heads=2, vocab_size=128,
                         use_cache=False)  # fmt: skip
    model = LlamaModel(config).train()
    invact.patch(model)
    ids = torch.randint(0, 128, (BATCH, SEQ))
    results = []
    for run in (model, torch.compile(model, fullgraph=True, backend="aot_eager")):
        model.zero_grad()
        out = run(input_ids=ids).last_hidden_state
        out.square().mean().backward()
        results.append((out.detach(), [p.grad.clone() for p in model.parameters()]))
    # aot_eager runs the same eager kernels (under compile the gated hooks stand aside and autograd's
    # own partition saves the product): equal to the last bit
    assert torch.equal(results[0][0], results[1][0])
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1], strict=True))


@pytest.mark.parametrize("case", ["retain_graph", "autocast_bf16"])
def test_backward_twice_and_autocast_match_the_activation_only_patch(case):
    plain, gated = _mlp(), _mlp()  # the same seed: the same weights
    invact.patch(plain, gated=False)
    invact.patch(gated)
    x = torch.randn(BATCH, SEQ, HIDDEN)
    for m in (plain, gated):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case == "autocast_bf16"):
            loss = m(x.clone().requires_grad_()).float().square().sum()
        loss.backward(retain_graph=case == "retain_graph")
        if case == "retain_graph":  # the handle recomputes the product again
            loss.backward()
    pairs = zip(plain.parameters(), gated.parameters(), strict=True)
    assert all(torch.equal(a.grad, b.grad) for a, b in pairs)


def test_under_autocast_the_bf16_product_is_recomputed():
    # autocast runs gate and up in bf16, so the product is bf16 and the down projection saves it as is
    plain, gated = _mlp(), _mlp()
    invact.patch(plain, gated=False)
    invact.patch(gated)
    inputs = {"x": torch.randn(BATCH, SEQ, HIDDEN, requires_grad=True)}
    saving = _held_bytes(plain, inputs, autocast=True) - _held_bytes(gated, inputs, autocast=True)
    assert saving == BATCH * SEQ * INTERMEDIATE * 2


def test_where_no_product_is_measured_nothing_is_hooked():
    from transformers import BertConfig, BertModel

    config = BertConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
                        num_attention_heads=4, vocab_size=128)  # fmt: skip
    model = BertModel(config).train()
    inputs = {"input_ids": torch.randint(0, 128, (BATCH, SEQ))}
    replaced = [d for d in invact.plan(model, example_inputs=inputs, norms=False) if d.replace]
    assert len(replaced) == LAYERS and all(d.gated is None and d.gated_bytes == 0 for d in replaced)
    assert all(
        d.gated_bytes is None for d in invact.plan(model, example_inputs=inputs, gated=False, norms=False)
    )
    invact.patch(model, example_inputs=inputs)
    assert not any(getattr(m, "_invact_recompute_products", False) for m in model.modules())


@pytest.mark.parametrize("label", ["phi3 (fused gate_up_proj)", "mixtral (MoE experts)"])
def test_a_fused_gate_up_gains_only_with_the_gated_path(label):
    # g and u are two halves of one storage, which u keeps saved: the activation alone frees nothing
    # and adds its bits; the gated path's product pays for them
    torch.manual_seed(0)
    model = _decoders()[label][0]().train()
    if _experts_layout(model) == "per-expert":
        pytest.skip(f"transformers {transformers.__version__} builds {label}'s experts as an nn.ModuleList "
                    "of per-expert MLPs, each with gate and up projections of its own: no fused gate_up "
                    "(tests/invact/test_experts.py checks that layout)")  # fmt: skip
    inputs = {"input_ids": torch.randint(0, 128, (BATCH, SEQ))}
    alone = invact.plan(model, example_inputs=inputs, gated=False, norms=False)  # one SiLU per layer
    assert len(alone) == LAYERS and not any(d.replace for d in alone)
    assert sum(d.spared_bytes for d in alone) == -LAYERS * BATCH * SEQ * _decoders()[label][1] // 8
    assert invact.patch(model, example_inputs=inputs, gated=False, norms=False) == []
    assert len(invact.patch(model, example_inputs=inputs, norms=False)) == LAYERS


class _Fused(nn.Module):
    """down(act(g) * u) with g and u the two halves of one gate_up output (u first where `u_first`);
    where `whole_saved`, an op also saves that output whole. Without `bias` (Phi-3's gate_up_proj),
    the projection of a 3-d input is mm then _unsafe_view: its output is no view, and it is g's and
    u's `_base`; with a bias it is addmm then view, a view of the 2-d product."""

    def __init__(self, u_first: bool = False, whole_saved: bool = False, bias: bool = True):
        super().__init__()
        self.gate_up = nn.Linear(HIDDEN, 2 * INTERMEDIATE, bias=bias)
        self.down = nn.Linear(INTERMEDIATE, HIDDEN)
        self.act, self.u_first, self.whole_saved = nn.SiLU(), u_first, whole_saved

    def forward(self, x):
        gate_up = self.gate_up(x)
        g, u = gate_up.chunk(2, dim=-1)[:: -1 if self.u_first else 1]
        out = self.down(self.act(g) * u)
        return out + gate_up.square().mean() if self.whole_saved else out


def _fused_pair(dtype=torch.float32, **kwargs):
    """_Fused patched twice, the same weights: activation-only and gated."""
    torch.manual_seed(0)
    plain, gated = _Fused(**kwargs).to(dtype), _Fused(**kwargs).to(dtype)
    gated.load_state_dict(plain.state_dict())
    invact.patch(plain, gated=False)
    invact.patch(gated)
    return plain, gated


@pytest.mark.parametrize(("whole_saved", "extra_saving"), [(False, "g"), (True, "none")])
def test_g_is_freed_from_a_fused_gate_up_only_where_that_frees_it(whole_saved, extra_saving):
    # Where another op in the module saves the gate_up output whole, freeing g's half is impossible
    # and moving or copying u would add bytes: there only the product is saved less; elsewhere g's
    # half goes too.
    plain, gated = _fused_pair(whole_saved=whole_saved)
    inputs = {"x": torch.randn(BATCH, SEQ, HIDDEN, requires_grad=True)}
    saving = _held_bytes(plain, inputs) - _held_bytes(gated, inputs)
    product = BATCH * SEQ * INTERMEDIATE * 4
    assert saving == product + (product if extra_saving == "g" else 0)
    measured = invact.plan(_Fused(whole_saved=whole_saved), example_inputs=inputs, norms=False)
    assert [d.gated_bytes for d in measured] == [saving]
    for m in (plain, gated):
        m(**inputs).square().sum().backward()
    pairs = zip(plain.parameters(), gated.parameters(), strict=True)
    assert all(torch.equal(a.grad, b.grad) for a, b in pairs)


def _saved_operands(model: nn.Module, x: torch.Tensor):
    """(output, the data pointer of the gate_up output, the multiply's saved operands): the pointer
    recorded by a hook that keeps no reference to the tensor, the operands unpacked through the
    module's saved-tensor hooks after it returned."""
    seen = {}
    hooks = [
        model.gate_up.register_forward_hook(lambda m, a, out: seen.update(ptr=out.data_ptr())),
        model.down.register_forward_pre_hook(lambda m, a: seen.update(node=a[0].grad_fn)),
    ]
    try:
        out = model(x)
    finally:
        for hook in hooks:
            hook.remove()
    node = seen["node"]
    return out, seen["ptr"], (node._saved_self, node._saved_other)


@pytest.mark.parametrize("u_first", [False, True])
@pytest.mark.parametrize("tokens", [(BATCH, SEQ), (5,), (1,)])  # rows: several doublings, a partial one, one
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_y_and_u_move_into_the_gate_up_output_with_the_same_gradients(u_first, tokens, dtype):
    # No fresh memory for u: y and u end up, dense, in the storage g and u came in.
    plain, gated = _fused_pair(dtype, u_first=u_first)
    x = torch.randn(*tokens, HIDDEN, dtype=dtype, requires_grad=True)
    out_plain, _, want = _saved_operands(plain, x)
    out, ptr, got = _saved_operands(gated, x)
    assert all(t.untyped_storage().data_ptr() == ptr for t in got)
    assert all(a.is_contiguous() and torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert torch.equal(out, out_plain)
    for o in (out_plain, out):
        o.float().square().sum().backward()
    pairs = zip(plain.parameters(), gated.parameters(), strict=True)
    assert all(torch.equal(a.grad, b.grad) for a, b in pairs)


@pytest.mark.parametrize(
    ("module", "keep", "moves"),
    [
        ("gate_up", lambda out: out, False),  # y would overwrite its g half
        ("gate_up", lambda out: out[..., :INTERMEDIATE], False),  # g itself
        ("act", lambda y: y[1:], False),  # y's storage would not be freed
        ("act", lambda y: y, True),  # y keeps its storage and values; the saved copy moves
    ],
    ids=["gate_up output", "g", "view of y", "y"],
)
def test_a_tensor_held_outside_the_module_keeps_its_values(module, keep, moves):
    # A forward hook keeps a tensor. Where moving y and u would overwrite it or keep both y's and
    # gate_up's storage, nothing moves and u is copied out as before.
    plain, gated = _fused_pair()
    kept = []
    getattr(gated, module).register_forward_hook(
        lambda m, a, out: kept.append((keep(out), keep(out).clone()))
    )
    x = torch.randn(BATCH, SEQ, HIDDEN, requires_grad=True)
    out_plain, _, want = _saved_operands(plain, x)
    out, ptr, got = _saved_operands(gated, x)
    assert torch.equal(kept[0][0], kept[0][1])
    assert [t.untyped_storage().data_ptr() == ptr for t in got] == [moves, moves]
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    for o in (out_plain, out):
        o.square().sum().backward()
    pairs = zip(plain.parameters(), gated.parameters(), strict=True)
    assert all(torch.equal(a.grad, b.grad) for a, b in pairs)


@pytest.mark.parametrize(
    ("module", "keep"),
    [
        ("gate_up", None),
        ("gate_up", lambda out: out),
        ("gate_up", lambda out: out[..., :INTERMEDIATE]),
        ("gate_up", lambda out: out.view(-1, 2 * INTERMEDIATE)),
        ("act", lambda g: g),
    ],
    ids=["nothing held", "gate_up output", "a half of it", "a view of it", "act's input g"],
)
@pytest.mark.parametrize("u_first", [False, True], ids=["g first", "u first"])
@pytest.mark.parametrize("bias", [True, False], ids=["addmm", "mm"])
def test_a_hook_holding_the_gate_up_output_keeps_its_values_with_or_without_bias(bias, u_first, module, keep):
    # A forward hook keeps the gate_up output, a view of it or act's input g (a view of it): y and u
    # must not move into its storage, whatever view bookkeeping says (without a bias the output
    # itself is g's and u's _base, and holding it adds no tensor on the storage). Held by no one,
    # they move, and g's half is freed: the product's bytes and g's.
    plain, gated = _fused_pair(u_first=u_first, bias=bias)
    kept = []

    def hold(m, args, out):
        t = keep(args[0] if module == "act" else out)
        kept.append((t, t.clone()))

    if keep is not None:
        getattr(gated, module).register_forward_hook(hold)
    x = torch.randn(BATCH, SEQ, HIDDEN, requires_grad=True)
    out_plain, _, want = _saved_operands(plain, x)
    out, ptr, got = _saved_operands(gated, x)
    for o in (out_plain, out):
        o.square().sum().backward()
    assert len(kept) == (keep is not None)
    assert all(torch.equal(held, reference) for held, reference in kept)
    assert [t.untyped_storage().data_ptr() == ptr for t in got] == [keep is None] * 2
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    pairs = zip(plain.parameters(), gated.parameters(), strict=True)
    assert all(torch.equal(a.grad, b.grad) for a, b in pairs)
    if keep is None:
        inputs = {"x": torch.randn(BATCH, SEQ, HIDDEN, requires_grad=True)}
        assert _held_bytes(plain, inputs) - _held_bytes(gated, inputs) == 2 * BATCH * SEQ * INTERMEDIATE * 4


@pytest.mark.parametrize("moves", [True, False], ids=["moved", "u copied"])
def test_the_saved_operands_are_freed_once_their_nodes_have_run(moves):
    # After the multiply's and the activation's backward, nothing holds y and u (moved into the
    # gate_up output, or y and a copy of u): their storage is gone before gate_up's own backward
    # runs, as torch's is, rather than kept by the hooks to the end of the module's backward.
    from torch.multiprocessing.reductions import StorageWeakRef

    _, gated = _fused_pair()
    seen, kept = {}, []
    if not moves:  # a hook holding the gate_up output: u is copied out instead
        gated.gate_up.register_forward_hook(lambda m, a, out: kept.append(out))
    gated.gate_up.register_forward_hook(lambda m, a, out: seen.update(node=out.grad_fn))
    gated.down.register_forward_pre_hook(lambda m, a: seen.update(mul=a[0].grad_fn))
    out = gated(torch.randn(BATCH, SEQ, HIDDEN, requires_grad=True))
    mul = seen.pop("mul")
    storages = [StorageWeakRef(t.untyped_storage()) for t in (mul._saved_self, mul._saved_other)]
    del mul
    freed = []
    seen["node"].register_prehook(lambda grads: freed.append([s.expired() for s in storages]))
    out.square().sum().backward()
    assert freed == [[True, True]]


def test_u_is_not_copied_out_of_a_gate_up_output_the_module_was_given():
    # The MLP gets gate_up from its caller, which saves it whole after the call: the hooked module
    # cannot see that save, so it must not copy u (the copy would add u's bytes): only the product goes.
    class Inner(nn.Module):
        def __init__(self):
            super().__init__()
            self.down, self.act = nn.Linear(INTERMEDIATE, HIDDEN), nn.SiLU()

        def forward(self, gate_up):
            g, u = gate_up.chunk(2, dim=-1)
            return self.down(self.act(g) * u)

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_up, self.mlp = nn.Linear(HIDDEN, 2 * INTERMEDIATE), Inner()

        def forward(self, x):
            gate_up = self.gate_up(x)
            return self.mlp(gate_up) + gate_up.square().mean()

    torch.manual_seed(0)
    plain, gated = Outer(), Outer()
    gated.load_state_dict(plain.state_dict())
    invact.patch(plain, gated=False)
    invact.patch(gated)
    inputs = {"x": torch.randn(BATCH, SEQ, HIDDEN, requires_grad=True)}
    assert _held_bytes(plain, inputs) - _held_bytes(gated, inputs) == BATCH * SEQ * INTERMEDIATE * 4


def test_fsdp2_fully_sharded_decoder_saves_the_products_and_matches(tmp_path):
    # FSDP2 (fully_shard) on one CPU process (gloo): its parameters become DTensors, gathered before
    # each layer's forward and freed after it. Gradients stay bitwise those of the unsharded patched
    # model, and the net memory held after the forward drops by the products, as unsharded.
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from invact.memory import saved_tensors

    label = "llama (SwiGLU)"
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        plain, gated = _pair(label)
        reference = _pair(label)[1]  # the same weights, left unsharded
        for m in (plain, gated):
            for layer in m.layers:
                fully_shard(layer)
            fully_shard(m)
        ids = {"input_ids": torch.randint(0, 128, (BATCH, SEQ))}
        assert _held_bytes(plain, ids) - _held_bytes(gated, ids) == _ideal(label)
        counted = [saved_tensors(m, **ids).saved_bytes for m in (plain, gated)]
        assert counted[0] - counted[1] == _ideal(label)
        for m in (reference, gated):
            m.zero_grad()
            m(**ids).last_hidden_state.square().mean().backward()
        for (name, a), b in zip(reference.named_parameters(), gated.parameters(), strict=True):
            assert torch.equal(a.grad, b.grad.full_tensor()), name
    finally:
        dist.destroy_process_group()


def test_per_sample_gradients_through_torch_func():
    # torch.func's grad refuses saved-tensor hooks (it disables them): the gated path stands aside.
    from torch.func import functional_call, grad, vmap

    grads = []
    for gated in (False, True):
        m = _mlp()
        invact.patch(m, gated=gated)
        params = {k: v.detach() for k, v in m.named_parameters()}

        def loss(p, x, m=m):
            return functional_call(m, p, (x.unsqueeze(0),)).square().sum()

        grads.append(
            vmap(grad(loss), in_dims=(None, 0))(
                params, torch.randn(4, HIDDEN, generator=torch.Generator().manual_seed(0))
            )
        )
    assert all(torch.equal(grads[0][k], grads[1][k]) for k in grads[0])


def test_under_compile_a_fused_gate_up_saves_no_more_than_compile_alone():
    """Under torch.compile the gated path stands aside; where g is a chunk of a fused gate_up output
    (which u keeps saved), InvAct runs torch's activation there, so the partitioner recomputes act(g)
    from g as it does for torch's model, instead of keeping y and its bits beside it."""
    from invact.memory import inductor_partition, saved_tensors

    class Fused(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_up, self.act, self.down = nn.Linear(16, 64), nn.SiLU(), nn.Linear(32, 16)

        def forward(self, x):
            g, u = self.gate_up(x).chunk(2, dim=-1)
            return self.down(self.act(g) * u)

    torch.manual_seed(0)
    x = torch.randn(4, 8, 16)
    figures = {}
    for name in ("torch", "patch"):
        model = Fused()
        if name == "patch":
            invact.patch(model)
            assert isinstance(model.act, invact.InvAct)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=inductor_partition)
        saved_tensors(compiled, x)  # compile outside the measurement
        figures[name] = saved_tensors(compiled, x).saved_bytes
    assert figures["patch"] <= figures["torch"], figures
