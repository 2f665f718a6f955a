"""invact.mlp.experts: a MoE's experts under torch.compile run as invact::experts_linear and
invact::experts_gated_down, which compute what transformers' grouped experts compute and save no
gated product, so compile + patch() keeps what eager patch() keeps.

Which layout a family's experts have depends on the transformers installed (_layout): 5.x builds one
experts module of 3-D weights ("fused", the layout invact.mlp.experts takes; 5.17 sets fewer layout
flags than 5.24, see test_the_flags_5_17_lacks_mean_what_it_computes), 4.x an nn.ModuleList of per-expert
MLPs ("per-expert", each an ordinary gated MLP that invact.mlp's fuse takes). A test of one layout is
skipped, with the reason, where transformers builds the other."""

import copy
import functools

import pytest
import torch

import invact
import invact.mlp
from invact.activation.activations import ACTIVATIONS
from invact.memory import count_saved, inductor_partition, saved_tensors
from invact.mlp import experts

transformers = pytest.importorskip("transformers")

# float64 sums of at most 2 k = 16 products, in another order than the reference's: each result within
# 16 roundings of its terms' magnitude, here bounded by 64 eps of the largest result
FP64_TOLERANCE = 64 * torch.finfo(torch.float64).eps
# compile + patch() against eager patch() in float32 (aot_eager: the same kernels, the products
# summed per expert in another order and routed back by index_copy_ instead of a gather): measured on an
# AMD EPYC Zen 4 at most 5e-7 on the outputs (of size ~1) and 5.1e-5 relative on the gradients (the
# routers' small gradients); 20x that for other CPUs' kernels
FP32_OUTPUT_TOLERANCE = 1e-5
FP32_GRADIENT_TOLERANCE = 1e-3

# (experts, rows per expert): one expert with no rows, so its weight gradient must come back zero
ROWS = (3, 0, 5, 2)
HIDDEN, K = 6, 8


def _routed(dtype):
    torch.manual_seed(0)
    x = torch.randn(sum(ROWS), HIDDEN, dtype=dtype, requires_grad=True)
    w_gate_up = torch.randn(len(ROWS), 2 * K, HIDDEN, dtype=dtype, requires_grad=True)
    w_down = torch.randn(len(ROWS), HIDDEN, K, dtype=dtype, requires_grad=True)
    offsets = torch.cumsum(torch.tensor(ROWS), 0)
    return x, w_gate_up, w_down, offsets


def _reference(x, w_gate_up, w_down, activation):
    """Each expert's rows through F.linear, torch's activation and F.linear, under autograd."""
    act, out, start = ACTIVATIONS[activation].torch_forward, [], 0
    for e, rows in enumerate(ROWS):
        g, u = torch.nn.functional.linear(x[start : start + rows], w_gate_up[e]).chunk(2, dim=-1)
        out.append(torch.nn.functional.linear(act(g) * u, w_down[e]))
        start += rows
    return torch.cat(out)


@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
def test_the_ops_are_the_per_expert_modules_in_float64(activation):
    x, w_gate_up, w_down, offsets = _routed(torch.float64)
    gate_up = experts.experts_linear(x, w_gate_up, offsets)
    out = experts.experts_gated_down(gate_up, w_down, offsets, activation)
    want = _reference(x, w_gate_up, w_down, activation)
    dout = torch.randn_like(out)
    got_grads = torch.autograd.grad(out, (x, w_gate_up, w_down), dout)
    want_grads = torch.autograd.grad(want, (x, w_gate_up, w_down), dout)
    assert not got_grads[2][1].any()  # the expert with no rows
    for a, b in zip((out, *got_grads), (want, *want_grads), strict=True):
        assert (a - b).abs().max() <= FP64_TOLERANCE * max(b.abs().max(), 1)


SIZE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=500, attn_implementation="sdpa")  # fmt: skip
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24)
FAMILIES = {
    "Mixtral": ("MixtralConfig", "MixtralModel", dict(num_local_experts=8, num_experts_per_tok=2)),
    "Qwen2-MoE": ("Qwen2MoeConfig", "Qwen2MoeModel", dict(MOE, shared_expert_intermediate_size=48)),
    "Qwen3-MoE": ("Qwen3MoeConfig", "Qwen3MoeModel", dict(MOE, head_dim=8)),
}
# the experts' intermediate size (K) and the shared expert's (0: none) of each family, from FAMILIES
EXPERT_INTERMEDIATE = {"Mixtral": (SIZE["intermediate_size"], 0), "Qwen2-MoE": (24, 48), "Qwen3-MoE": (24, 0)}
TOKENS, TOP_K = 2 * 24, 2  # the ids below: batch 2, sequence 24; num_experts_per_tok


class _Hidden(torch.nn.Module):
    """model(input_ids=ids).last_hidden_state as a module of the ids."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids).last_hidden_state


class _Block(torch.nn.Module):
    """A decoder layer's sparse MoE block (router, experts, a shared expert where the family has one)
    as a module of the hidden states: its output, without the router logits transformers 4.x returns
    beside it."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        out = self.block(x)
        return out[0] if isinstance(out, tuple) else out


def _config(family: str, **kwargs):
    config_cls, _, extra = FAMILIES[family]
    return getattr(transformers, config_cls)(**{**SIZE, **extra, **kwargs})


def _model(family: str, dtype=torch.float32, **patch):
    torch.manual_seed(0)
    model = getattr(transformers, FAMILIES[family][1])(_config(family)).to(dtype).train()
    invact.patch(model, **patch)
    return model


def _moe_block(layer: torch.nn.Module) -> torch.nn.Module:
    """The sparse MoE block of a decoder layer: `mlp`, or `block_sparse_moe` (transformers 4.x's Mixtral)."""
    block = layer._modules.get("mlp")
    return block if block is not None else layer._modules["block_sparse_moe"]


@functools.cache
def _layout(family: str) -> str:
    """The layout of the family's experts in the installed transformers: "fused", one module of 3-D
    weights, or "per-expert", an nn.ModuleList of MLPs."""
    config = _config(family, num_hidden_layers=1)
    found = _moe_block(getattr(transformers, FAMILIES[family][1])(config).layers[0]).experts
    if isinstance(found, torch.nn.ModuleList):
        return "per-expert"
    assert experts.is_experts(found), type(found)
    return "fused"


LAYOUTS = {"fused": "one module of 3-D weights", "per-expert": "an nn.ModuleList of per-expert MLPs"}


def _needs(family: str, layout: str) -> None:
    if (built := _layout(family)) != layout:
        pytest.skip(f"transformers {transformers.__version__} builds {family}'s experts as {LAYOUTS[built]}, "
                    f"not {LAYOUTS[layout]}")  # fmt: skip


def _experts_modules(model):
    return [_moe_block(layer).experts for layer in model.layers]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_patch_takes_each_layers_experts(family):
    _needs(family, "fused")
    model = _model(family)
    taken = [m for m in model.modules() if isinstance(m.__dict__.get("forward"), experts.Forward)]
    assert len(taken) == model.config.num_hidden_layers
    assert all(experts.refusal(m) is None for m in taken)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_expert_of_a_module_list_runs_as_a_gated_mlp(family):
    """transformers 4.x: each expert is an MLP of its own (nn.Linear gate, up and down), which
    invact.mlp's fuse runs as one Function: the outputs and gradients of patch(gated=False), bitwise
    (as tests/invact/test_mlp.py checks for one MLP), less every gated product act(g) * u saved:
    TOP_K rows of K per token and the shared expert's row, per layer."""
    _needs(family, "per-expert")
    plain, gated = _model(family, gated=False), _model(family)
    for model in (plain, gated):
        assert not any(isinstance(m.__dict__.get("forward"), experts.Forward) for m in model.modules())
    assert all(isinstance(e.__dict__.get("forward"), invact.mlp.Forward)
               for module in _experts_modules(gated) for e in module)  # fmt: skip
    ids = torch.randint(0, 500, (2, 24))
    results = []
    for model in (plain, gated):
        with count_saved(model) as counted:
            out = model(input_ids=ids).last_hidden_state
        out.square().sum().backward()
        results.append((counted.report.saved_bytes, out.detach(), [p.grad for p in model.parameters()]))
    (plain_bytes, plain_out, plain_grads), (gated_bytes, gated_out, gated_grads) = results
    assert torch.equal(gated_out, plain_out)
    for a, b in zip(gated_grads, plain_grads, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)
    k, shared = EXPERT_INTERMEDIATE[family]
    products = plain.config.num_hidden_layers * TOKENS * (TOP_K * k + shared) * 4  # float32
    assert plain_bytes - gated_bytes == products


def test_another_experts_implementation_is_left_to_its_own_forward():
    _needs("Mixtral", "fused")
    model = getattr(transformers, FAMILIES["Mixtral"][1])(_config("Mixtral", experts_implementation="eager"))
    decisions = [d for d in invact.plan(model) if d.gated is not None and d.gated.endswith("experts")]
    assert len(decisions) == model.config.num_hidden_layers
    assert all("experts implementation 'eager', not 'grouped_mm'" in d.reason for d in decisions)
    invact.patch(model)
    assert not any(isinstance(m.__dict__.get("forward"), experts.Forward) for m in model.modules())


def test_the_flags_5_17_lacks_mean_what_it_computes():
    """transformers 5.17 sets no has_post_expert_norm and no _is_expert_parallel (5.24 sets both): its
    experts apply no norm after the experts, and its expert-parallel shard says so by a num_experts
    below its weights' count. Each flag a layout the ops do not compute is refused, with its reason."""
    _needs("Mixtral", "fused")
    torch.manual_seed(0)
    model = getattr(transformers, FAMILIES["Mixtral"][1])(_config("Mixtral"))
    invact.patch(model)
    module = _experts_modules(model)[0]
    as_5_17 = copy.deepcopy(module)
    for flag in ("has_post_expert_norm", "_is_expert_parallel"):
        as_5_17.__dict__.pop(flag, None)
    assert experts.match(as_5_17)
    cases = [  # (attribute, its value, or None: removed; what the refusal says)
        ("has_bias", True, "biases (has_bias=True)"),
        ("has_post_expert_norm", True, "a norm after the experts"),
        ("post_expert_norm", torch.nn.Identity(), "no has_post_expert_norm"),  # a norm no flag describes
        ("_is_expert_parallel", True, "expert-parallel"),
        ("num_experts", 4, "num_experts 4 for weights of 8 experts"),  # 5.17's expert-parallel shard
        ("is_transposed", None, "no is_transposed attribute"),
    ]
    for attribute, value, reason in cases:
        refused = copy.deepcopy(as_5_17)
        if value is None:
            del refused.__dict__[attribute]
        else:
            setattr(refused, attribute, value)
        assert not experts.match(refused), attribute
        assert reason in experts.refusal(refused), (attribute, experts.refusal(refused))


SHARDS = {"unsharded": None, "5.24's flag": ("_is_expert_parallel", True), "5.17's count": ("num_experts", 4)}


@pytest.mark.parametrize("shard", SHARDS.values(), ids=SHARDS.keys())
def test_compiled_a_module_sharded_after_patch_runs_its_own_forward(shard, monkeypatch):
    """A module patch() took, then sharded for expert parallelism (5.24 sets _is_expert_parallel, 5.17
    a num_experts below its weights' count): its compiled calls run its own forward, not the ops. Its
    own forward is a stand-in here (these weights are not sharded, so transformers' would fail)."""
    _needs("Mixtral", "fused")
    torch.manual_seed(0)
    model = getattr(transformers, FAMILIES["Mixtral"][1])(_config("Mixtral"))
    invact.patch(model)
    module = _experts_modules(model)[0]
    monkeypatch.setattr(type(module), "forward", lambda self, x, index, weights: x * 2)
    if shard is not None:
        setattr(module, *shard)
    ops = []

    def backend(gm, example_inputs):
        ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    x = torch.randn(TOKENS, SIZE["hidden_size"], requires_grad=True)
    index, weights = torch.randint(0, 4, (TOKENS, TOP_K)), torch.rand(TOKENS, TOP_K)
    torch._dynamo.reset()
    torch.compile(module, backend=backend)(x, index, weights)
    assert any("experts_gated_down" in op for op in ops) is (shard is None), ops


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_compiled_fullgraph_matches_eager_patch(family):
    # transformers 4.x's sparse MoE block loops over the experts torch.nonzero finds hit, which
    # torch.compile(fullgraph=True) cannot trace, patched or not (measured on 4.57.6: a data-dependent
    # UserError from an unpatched Mixtral block)
    _needs(family, "fused")
    model = _Hidden(_model(family))
    ids = torch.randint(0, 500, (2, 24))
    results = []
    torch._dynamo.reset()
    for run in (model, torch.compile(model, fullgraph=True, backend="aot_eager")):
        model.zero_grad()
        out = run(ids)
        out.square().sum().backward()
        results.append((out.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    (eager, eager_grads), (compiled, compiled_grads) = results
    assert (compiled - eager).abs().max() <= FP32_OUTPUT_TOLERANCE
    assert len(eager_grads) == len(compiled_grads)
    for a, b in zip(compiled_grads, eager_grads, strict=True):
        assert (a - b).abs().max() <= FP32_GRADIENT_TOLERANCE * b.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_compiled_it_saves_no_more_than_eager_patch(family, dtype):
    """Eager patch() keeps each expert's y and its bits beside u (both halves of gate_up's output);
    compiled, the ops keep gate_up's output and recompute y, and the partitioner finds no product
    (per-expert MLPs, transformers 4.x: invact.mlp's op for each).

    One layer's MoE block, not the whole model: with attention, what compile saves depends on torch
    and not on invact. Under compile before torch 2.14, transformers (masking_utils) does not skip the
    causal mask (dynamo reads torch.compiler.is_exporting() as True there, pytorch#176499), so SDPA
    gets a mask and k, v repeated to every head: the whole 2-layer Mixtral here, float32, compiled
    saved 244544 bytes on torch 2.11 (transformers 5.17 and 5.24 alike, 244160) against eager
    patch()'s 232384, a (2, 1, 24, 24) mask and (2, 4, 24, 8) k, v for (2, 2, 24, 8) among them;
    unpatched models the same. The block alone, measured (bytes, float32, compiled / eager patch()):
    Mixtral 84544 / 86336 on torch 2.11, 84544 / 86240 on 2.13; without the experts' ops
    (experts.fuse off) 109920 and 109472, more than eager on both."""
    model = _model(family, dtype)
    block = _Block(_moe_block(model.layers[0]))
    x = torch.randn(2, 24, SIZE["hidden_size"], dtype=dtype, requires_grad=True)
    with count_saved(block) as eager:
        block(x).sum().backward()
    torch._dynamo.reset()
    compiled = torch.compile(copy.deepcopy(block), backend=inductor_partition)
    saved_tensors(compiled, x)  # compile outside the measurement
    assert saved_tensors(compiled, x).saved_bytes <= eager.report.saved_bytes
