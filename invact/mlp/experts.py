"""A mixture of experts' gated MLPs under torch.compile: part of the MLP's home (invact.mlp), which
hooks an experts module like any module holding a gated product and hands it here for compiled calls.

Hugging Face transformers (5.x) keeps a MoE layer's experts in one module with 3-D weights, gate_up_proj
(experts, 2 k, hidden) and down_proj (experts, hidden, k), and by default ("grouped_mm") runs every
routed (token, expert) pair at once: the pairs sorted by expert, gate_up = x_e gate_up_proj[e]^T per
expert's rows, act(g) * u for g, u = gate_up.chunk(2, -1), then down_proj, the routing weights, the
pairs summed per token. In eager mode invact.mlp.gated's hooks keep its product act(g) * u unsaved
(recomputed in backward); under torch.compile hooks stand aside, and the partitioner saves the product
for the down projection's weight gradient. This module takes such a module's compiled calls: the same
steps, with the down projection and the product as the custom op invact::experts_gated_down, which
saves gate_up (as invact::gate_up_linear does for one MLP) and recomputes act(g) * u in backward, and
the gate_up projection as invact::experts_linear.

Recognised by structure, not class name (`match`): 3-D parameters gate_up_proj (E, 2k, h) and
down_proj (E, h, k), an InvAct act_fn, no biases, weights not transposed, halves concatenated
([gate; up]), no norm after the experts, not sharded for expert parallelism, transformers' default gate
(act(g) * u), and the grouped_mm implementation selected in its config. Any other call runs the
module's own forward; an experts module not taken gets its reason (`refusal`) in the plan, appended to
its activation's (invact.mlp.decide). The flags are read as each transformers version sets them:
has_post_expert_norm and _is_expert_parallel are in transformers 5.24 and not in 5.17 (see _FLAGS and
refusal). transformers 4.x keeps the experts as an nn.ModuleList of per-expert MLPs with 2-D nn.Linear
weights, not this module's layout: each expert is an ordinary gated MLP, which invact.mlp's fuse takes
as any other (tests/invact/test_experts.py checks it on the transformers installed).

Each op's body loops over the experts in Python (an op's body runs eagerly, so the group sizes read
from the offsets are plain integers there): exact, and on a CPU as fast as grouped matrix products; on
a GPU each expert is its own launch. The sum over a token's experts is in the input's dtype, as
transformers' grouped_mm forward sums.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from invact._budget import traces_custom_ops
from invact.activation.activations import ACTIVATIONS
from invact.activation.modules import InvAct


def _groups(offsets: torch.Tensor) -> list[tuple[int, int, int]]:
    """(expert, first row, end row) of each expert with rows; `offsets` the running row counts (E,)."""
    ends = offsets.tolist()
    starts = [0, *ends[:-1]]
    return [(e, s, t) for e, (s, t) in enumerate(zip(starts, ends, strict=True)) if t > s]


def gate_up_grad(dh: torch.Tensor, g: torch.Tensor, u: torch.Tensor, y: torch.Tensor, act) -> torch.Tensor:
    """The gradient of a fused gate_up output (g, u halves, y = act(g)) from dh, that of act(g) * u:
    [dh u f'(g), dh y] (invact.mlp's gate_up_linear and experts_gated_down here). f'(g) in float64 (the
    generated view's exact derivative), rounded once: an op's body runs below autograd, so torch's own
    derivative formula is not at hand there."""
    return torch.cat([(dh * u) * act.df(g.double()).to(g.dtype), dh * y], dim=-1)


# x (S, h) rows sorted by expert, weight (E, n, h): out[rows of e] = x[rows of e] weight[e]^T
def _linear_impl(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    out = x.new_zeros((x.shape[0], weight.shape[1]))
    for e, s, t in _groups(offsets):
        out[s:t] = F.linear(x[s:t], weight[e])
    return out


def _linear_backward_impl(
    dout: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dweight) of _linear_impl; an expert with no rows gets a zero weight gradient."""
    dx, dweight = torch.zeros_like(x), torch.zeros_like(weight)
    for e, s, t in _groups(offsets):
        dx[s:t] = dout[s:t].mm(weight[e])
        dweight[e] = dout[s:t].t().mm(x[s:t])
    return dx, dweight


experts_linear = torch.library.custom_op("invact::experts_linear", _linear_impl, mutates_args=())
_experts_linear_backward = torch.library.custom_op(
    "invact::experts_linear_backward", _linear_backward_impl, mutates_args=()
)


@experts_linear.register_fake
def _(x, weight, offsets):
    return x.new_empty((x.shape[0], weight.shape[1]))


@_experts_linear_backward.register_fake
def _(dout, x, weight, offsets):
    return torch.empty_like(x), torch.empty_like(weight)


def _linear_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _linear_autograd(ctx, dout):
    x, weight, offsets = ctx.saved_tensors
    dx, dweight = _experts_linear_backward(dout, x, weight, offsets)
    return dx, dweight, None


experts_linear.register_autograd(_linear_autograd, setup_context=_linear_setup)


# gate_up (S, 2k) rows sorted by expert, weight (E, h, k): out[rows of e] = (act(g) * u) weight[e]^T for
# g, u = gate_up.chunk(2, -1), act torch's activation `activation` (invact.activation.activations.ACTIVATIONS)
def _gated_down_impl(gate_up: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor,
                     activation: str) -> torch.Tensor:  # fmt: skip
    g, u = gate_up.chunk(2, dim=-1)
    h = ACTIVATIONS[activation].torch_forward(g) * u
    out = gate_up.new_zeros((gate_up.shape[0], weight.shape[1]))
    for e, s, t in _groups(offsets):
        out[s:t] = F.linear(h[s:t], weight[e])
    return out


def _gated_down_backward_impl(
    dout: torch.Tensor, gate_up: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, activation: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dgate_up, dweight) of _gated_down_impl: act(g) and the product recomputed."""
    g, u = gate_up.chunk(2, dim=-1)
    act = ACTIVATIONS[activation]
    y = act.torch_forward(g)  # bitwise the forward's
    h = y * u
    dh, dweight = torch.zeros_like(h), torch.zeros_like(weight)
    for e, s, t in _groups(offsets):
        dh[s:t] = dout[s:t].mm(weight[e])
        dweight[e] = dout[s:t].t().mm(h[s:t])
    return gate_up_grad(dh, g, u, y, act), dweight


experts_gated_down = torch.library.custom_op("invact::experts_gated_down", _gated_down_impl, mutates_args=())
_experts_gated_down_backward = torch.library.custom_op(
    "invact::experts_gated_down_backward", _gated_down_backward_impl, mutates_args=()
)


@experts_gated_down.register_fake
def _(gate_up, weight, offsets, activation):
    return gate_up.new_empty((gate_up.shape[0], weight.shape[1]))


@_experts_gated_down_backward.register_fake
def _(dout, gate_up, weight, offsets, activation):
    return torch.empty_like(gate_up), torch.empty_like(weight)


def _gated_down_setup(ctx, inputs, output) -> None:
    gate_up, weight, offsets, activation = inputs
    ctx.activation = activation
    ctx.save_for_backward(gate_up, weight, offsets)


def _gated_down_autograd(ctx, dout):
    gate_up, weight, offsets = ctx.saved_tensors
    dgate_up, dweight = _experts_gated_down_backward(dout, gate_up, weight, offsets, ctx.activation)
    return dgate_up, dweight, None, None


experts_gated_down.register_autograd(_gated_down_autograd, setup_context=_gated_down_setup)


def _default_gate(module: nn.Module) -> bool:
    """The module's class gates as transformers' default does (act(g) * u on the halves)."""
    import sys

    moe = sys.modules.get("transformers.integrations.moe")
    default = getattr(moe, "_default_apply_gate", None)
    return default is not None and getattr(type(module), "_apply_gate", None) is default


# The layout flags transformers' use_experts_implementation sets on an experts module: (attribute, the
# value the ops here compute, the value an absent attribute means, or None: it must be there).
# has_post_expert_norm is in transformers 5.24 and not in 5.17, whose experts forwards apply no norm
# after the experts (transformers/integrations/moe.py there): absent, it means False, unless the module
# has a post_expert_norm (a norm whose use no flag says).
_FLAGS = (
    ("has_gate", True, None, "no gate (an up projection alone)"),
    ("is_concatenated", True, None, "its gate and up halves interleaved"),
    ("is_transposed", False, None, "its weights transposed"),
    ("has_bias", False, None, "biases"),
    ("has_post_expert_norm", False, False, "a norm after the experts"),
)


def is_experts(module: nn.Module) -> bool:
    """`module` holds a MoE's experts as 3-D weights (transformers 5.x): a gate_up_proj or an up_proj and a
    down_proj, each (experts, out, in) or transposed. transformers 4.x keeps them as an nn.ModuleList of
    MLPs instead, each an ordinary gated MLP that invact.mlp's fuse takes (test_experts.py checks it)."""
    params = module._parameters
    down = params.get("down_proj")
    up = params.get("gate_up_proj", params.get("up_proj"))
    return down is not None and up is not None and down.dim() == 3 and up.dim() == 3


def refusal(module: nn.Module, act: bool = True) -> str | None:
    """Why match() does not take `module`, an experts module (is_experts), in words; None where it
    does. `act`: also require an InvAct act_fn (False where the plan decides, before the activation is
    replaced)."""
    params = module._parameters
    gate_up, down = params.get("gate_up_proj"), params.get("down_proj")
    if gate_up is None or down is None or gate_up.dim() != 3 or down.dim() != 3:
        return "no 3-D gate_up_proj and down_proj"
    experts, two_k, hidden = gate_up.shape
    if down.shape != (experts, hidden, two_k // 2) or two_k % 2:
        return f"weights {tuple(gate_up.shape)} and {tuple(down.shape)}, not (E, 2k, h) and (E, h, k)"
    for name, computed, absent, words in _FLAGS:
        value = module.__dict__.get(name, absent)
        unflagged = name not in module.__dict__ and name == "has_post_expert_norm"
        if unflagged and "post_expert_norm" in module._modules:
            value = None  # a norm no flag describes
        if value is None:
            return f"no {name} attribute"
        if value != computed:
            return f"{words} ({name}={value!r})"
    # expert parallelism: transformers 5.24 sets _is_expert_parallel, and the ids then hold sentinels
    # past the last expert; 5.17 sets no flag, and its sharding (distributed/tensor_parallel.py,
    # MoEParamShard) sets num_experts to the rank's count while the weights (DTensors) keep all experts
    if module.__dict__.get("_is_expert_parallel", False):
        return "expert-parallel (_is_expert_parallel: its ids hold sentinels past its experts)"
    if (count := getattr(module, "num_experts", None)) != experts:
        return f"num_experts {count!r} for weights of {experts} experts (an expert-parallel shard)"
    implementation = getattr(module.__dict__.get("config"), "_experts_implementation", None)
    if implementation != "grouped_mm":
        return f"experts implementation {implementation!r}, not 'grouped_mm'"
    if not _default_gate(module):
        return "a gate of its own (not transformers' act(g) * u)"
    if act and not isinstance(module._modules.get("act_fn"), InvAct):
        return "an act_fn invact did not replace"
    return None


def match(module: nn.Module) -> bool:
    """`module` is an experts module whose compiled calls Forward takes (see the module docstring)."""
    return is_experts(module) and refusal(module) is None


class Forward:
    """The forward set on a matched experts module (an instance attribute): under torch.compile (not
    under torch.func or a memory budget: see invact.mlp.Forward) the ops above; otherwise, the
    module's own forward (under invact.mlp.gated's hooks in eager mode)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, hidden_states, top_k_index, top_k_weights):
        module = self.module
        act = module._modules.get("act_fn")
        if (
            not traces_custom_ops()
            or not isinstance(act, InvAct)
            or not torch.is_grad_enabled()
            or hidden_states.dim() != 2
            or hidden_states.dtype is not module.gate_up_proj.dtype
            # sharded for expert parallelism after patch() (see refusal)
            or module.__dict__.get("_is_expert_parallel", False)
            or getattr(module, "num_experts", None) != module.gate_up_proj.shape[0]
        ):
            return type(module).forward(module, hidden_states, top_k_index, top_k_weights)
        experts = module.gate_up_proj.shape[0]
        tokens, top_k = top_k_index.shape
        # every (token, expert) pair, sorted by expert; the rows of expert e end at offsets[e]
        ids = top_k_index.reshape(-1)
        order = torch.argsort(ids, stable=True)
        counts = ids.new_zeros(experts).index_add_(0, ids, torch.ones_like(ids))
        offsets = torch.cumsum(counts, 0)  # a fixed shape (a bincount's would depend on the ids)
        x = hidden_states[order // top_k]
        gate_up = experts_linear(x, module.gate_up_proj, offsets)
        out = experts_gated_down(gate_up, module.down_proj, offsets, act.activation)
        weighted = out * top_k_weights.reshape(-1)[order].unsqueeze(-1)  # promoted as transformers' is
        pairs = torch.empty_like(weighted).index_copy_(0, order, weighted)  # back in (token, k) order
        return pairs.view(tokens, top_k, -1).sum(dim=1).to(hidden_states.dtype)


def fuse(module: nn.Module) -> bool:
    """Set Forward as `module`'s forward where match() takes it; True if set."""
    if "forward" in module.__dict__ or not match(module):
        return False
    module.forward = Forward(module)
    return True
