"""invact.mlp.experts: a MoE's experts under torch.compile run as invact::experts_linear and
invact::experts_gated_down, which compute what transformers' grouped experts compute and save no
gated product, so compile + patch() keeps what eager patch() keeps."""

import copy

import pytest
import torch

import invact
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


class _Hidden(torch.nn.Module):
    """model(input_ids=ids).last_hidden_state as a module of the ids."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids).last_hidden_state


def _model(family: str, dtype=torch.float32):
    config_cls, model_cls, extra = FAMILIES[family]
    config = getattr(transformers, config_cls)(**SIZE, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).to(dtype).train()
    invact.patch(model)
    return model


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_patch_takes_each_layers_experts(family):
    model = _model(family)
    taken = [m for m in model.modules() if isinstance(m.__dict__.get("forward"), experts.Forward)]
    assert len(taken) == model.config.num_hidden_layers


def test_another_experts_implementation_is_left_to_its_own_forward():
    config_cls, model_cls, extra = FAMILIES["Mixtral"]
    config = getattr(transformers, config_cls)(**SIZE, **extra, experts_implementation="eager")
    model = getattr(transformers, model_cls)(config)
    invact.patch(model)
    assert not any(isinstance(m.__dict__.get("forward"), experts.Forward) for m in model.modules())


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_compiled_fullgraph_matches_eager_patch(family):
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
    compiled, the ops keep gate_up's output and recompute y, and the partitioner finds no product."""
    model = _Hidden(_model(family, dtype))
    ids = torch.randint(0, 500, (2, 24))
    with count_saved(model) as eager:
        model(ids).sum().backward()
    torch._dynamo.reset()
    compiled = torch.compile(copy.deepcopy(model), backend=inductor_partition)
    saved_tensors(compiled, ids)  # compile outside the measurement
    assert saved_tensors(compiled, ids).saved_bytes <= eager.report.saved_bytes
