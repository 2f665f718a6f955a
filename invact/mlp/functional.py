"""Activations called as functions inside an MLP's forward (`w2(f(w1(x)) * w3(x))` with f a torch function,
torchtitan's FeedForward; `c_proj(f(c_fc(x)))` with f two torch calls, nanochat's), found by what they
compute, not by name.

invact.mlp.match traces a module's forward one level deep (torch.fx). Where the activation's place
in a gated or plain MLP holds no module but a few torch calls on one tensor (`chain`: the nodes whose
only tensor input, directly or through each other, is the projection's output), those calls are run
on probes and compared with every activation of the spec (`which`): the first whose torch forward
they reproduce in fp32 and bf16, within ULPS units in the last place, is the activation. So
every functional form of every spec activation is found without a list of forms (torch.nn.functional's
functions with their arguments, compositions such as `x * torch.sigmoid(x)`, the spec's own torch
forwards; docs/patching.md lists forms tested), and a form that computes something else (a dropout, a
clamp, a scale) is no activation.
"""

from __future__ import annotations

import functools

import torch

from invact import _generated
from invact.activation.activations import ACTIVATIONS

# The most a form may differ from the spec's torch forward, in units in the last place of its dtype:
# an activation written as a composition rounds more than once (x * torch.sigmoid(x): the sigmoid's
# rounding, then the product's), measured 1 ulp from the spec's one op in fp32 and bf16 on CPU (probes
# below).
# InvAct's forward is the spec's op, so such a model's forward changes by at most this much.
ULPS = 1


def _probe(dtype: torch.dtype) -> torch.Tensor:
    """Inputs covering every activation's branches and tails in `dtype`: a dense grid over [-24, 24],
    the values around each branch split, both dtype extremes' neighbourhoods (large finite values)."""
    grid = torch.linspace(-24.0, 24.0, 9601, dtype=torch.float64)
    splits = torch.tensor([a.threshold for a in ACTIVATIONS.values() if a.threshold is not None],
                          dtype=torch.float64)  # fmt: skip
    near = (splits[:, None] + torch.linspace(-0.01, 0.01, 41, dtype=torch.float64)).flatten()
    big = torch.tensor([-1e4, -300.0, -90.0, 90.0, 300.0, 1e4], dtype=torch.float64)
    return torch.cat([grid, near, big]).to(dtype)


# fp32 and bf16: both have fp32's exponent range, so a composition's intermediates round as its output
# does. Not fp16: there an intermediate can be subnormal where the output is not (torch.sigmoid(-10) =
# 4.5e-5 keeps 5 bits), so x * torch.sigmoid(x) lies 9 ulps from the spec's op (measured), which rounds once:
# the spec's op is the more accurate of the two, and a check in fp16 would refuse a form for that.
_DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def _probes() -> dict[torch.dtype, torch.Tensor]:
    return {dtype: _probe(dtype) for dtype in _DTYPES}


def _ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest distance between a and b in units in the last place of b's dtype at the larger of
    the two magnitudes (inf where one is non-finite and they differ)."""
    same = (a == b) | (a.isnan() & b.isnan())
    if bool(same.all()):
        return 0.0
    big = torch.maximum(a.abs(), b.abs())
    ulp = torch.nextafter(big, torch.full_like(big, float("inf"))) - big
    distance = (a.double() - b.double()).abs() / ulp.double()
    return float(torch.where(same, 0.0, distance).max())


def chain(root: torch.fx.Node, out: torch.fx.Node) -> list[torch.fx.Node] | None:
    """The nodes computing `out` from `root` alone (out included, in graph order): every node between
    them takes tensor inputs only from root or each other (any other argument a constant), is a
    call_function or call_method, and is used only inside the chain (out by one consumer); None where
    `out` depends on anything else (another input, a module, an attribute)."""
    found: dict[torch.fx.Node, None] = {}
    todo = [out]
    while todo:
        node = todo.pop()
        if node is root or node in found:
            continue
        if node.op not in ("call_function", "call_method"):
            return None
        found[node] = None
        for arg in node.all_input_nodes:
            todo.append(arg)
    if not found or root not in {a for n in found for a in n.all_input_nodes}:
        return None
    inside = set(found) | {root}
    for node in found:
        users = set(node.users)
        if node is out:
            if len(users) != 1 or users & inside:
                return None
        elif not users <= inside:
            return None
    order = {n: i for i, n in enumerate(out.graph.nodes)}
    return sorted(found, key=order.__getitem__)


def _run(nodes: list[torch.fx.Node], root: torch.fx.Node, x: torch.Tensor) -> torch.Tensor:
    """The chain's value at root = x, its calls run as the forward runs them."""
    env = {root: x}

    def value(a):
        return torch.fx.node.map_arg(a, env.__getitem__)

    for node in nodes:
        args, kwargs = value(node.args), value(node.kwargs)
        if node.op == "call_function":
            env[node] = node.target(*args, **kwargs)
        else:
            self_, *rest = args
            env[node] = getattr(self_, node.target)(*rest, **kwargs)
    return env[nodes[-1]]


def which(nodes: list[torch.fx.Node], root: torch.fx.Node) -> tuple[str, float] | None:
    """(the spec activation the chain computes, its largest distance in ulps over the probes), or None
    where it reproduces none within ULPS in every probe dtype (or fails to run on a tensor)."""
    outputs = {}
    try:
        with torch.no_grad():
            for dtype, x in _probes().items():
                y = _run(nodes, root, x.clone())
                if not isinstance(y, torch.Tensor) or y.shape != x.shape or y.dtype != dtype:
                    return None
                if not torch.equal(y, _run(nodes, root, x.clone())):  # random (a dropout): no activation
                    return None
                outputs[dtype] = y
    except Exception:  # noqa: BLE001 - a call that does not run on a plain tensor computes no activation
        return None
    # An activation that a call in the chain names comes first (torch.nn.functional.NAME is the spec's
    # NAME), where two of the spec compute the same function at their default arguments.
    called = {_generated.FUNCTIONS.get(f"torch.nn.functional.{getattr(n.target, '__name__', '')}")
              for n in nodes if n.op == "call_function"}  # fmt: skip
    for name in sorted(ACTIVATIONS, key=lambda a: (a not in called, a)):
        forward = ACTIVATIONS[name].torch_forward
        worst = 0.0
        for dtype, x in _probes().items():
            worst = max(worst, _ulps(outputs[dtype], forward(x)))
            if worst > ULPS:
                break
        if worst <= ULPS:
            return name, worst
    return None
