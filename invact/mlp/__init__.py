"""The MLP's home: which modules patch() hooks or runs as one op (the parents of the activations it
replaces), its decision (gated products measured by invact.activation's forward with example inputs),
and the replacement (`fuse`, and invact.mlp.gated's recompute hooks through `recompute_products`). The
MLP block as one autograd Function and its custom ops are invact.mlp.op; a MoE's experts' ops
invact.mlp.experts.

Three forwards are recognised, by the module's traced graph (torch.fx, one level deep), not by class name:
gated, down(act(gate(x)) * up(x)) (Llama's MLP and its many copies), plain, down(act(up(x)))
(nn.Sequential(Linear, act, Linear); CLIP's, GPT-NeoX's and Phi's MLPs), and a fused gate_up, down(act(g) * u)
with g, u = gate_up(x).chunk(2, -1) (Phi-3's; under torch.compile only, below), with act an InvAct and the
projections plain nn.Linear (nn.Linear's forward: the class, or a subclass that keeps it). `fuse` sets a
Forward on such a module: its calls run the projections, the activation and the multiply as one Function whose
one Python node in backward replaces five autograd nodes (three for the plain form), and which saves what the
modules save without the gated product h = y * u: x, y = act(g) with its bits, u, and the weights (h is
recomputed in backward, as invact.mlp.gated's hooks recompute it, without their Python call per saved tensor).
Measured on a 2-core Intel Xeon (AVX-512), 1 thread, benchmarks/host_time.py --rounds 41, forward + backward
at batch 4 (torch's modules = 1): SwiGLU MLP 16-32-16 with the gated hooks 1.90x, as this Function 1.15x; the
plain MLP 16-64-16 1.12x.

Under torch.compile the gated form runs its modules' projections and activation, then down(y * u) as
the custom op invact::gated_linear; a fused gate_up (Phi-3's MLP, recognised too, with no eager
Function) runs gate_up(x), then invact::gate_up_linear; the plain form runs the module's forward (the
activation's op saves the y the down projection keeps). Both ops are defined in invact.mlp.op. A MoE's
experts module runs invact.mlp.experts' ops under compile (one they do not take, its reason appended
to its activation's Decision: _experts_note), and any other hooked gated module with three
projections (T5's) a selective checkpoint that recomputes its product (Recomputed).

A module whose forward calls its activation as a function, down(f(gate(x)) * up(x)) or down(f(up(x)))
with f torch calls that compute a spec activation (torchtitan's FeedForward, nanochat's MLP), is found
by match_functional (invact.mlp.functional checks what the calls compute) and fused the same way
(fuse_functional), with a Decision of its own (kind "mlp", `_functional`); its calls the Function does
not take run its own forward, which calls the function (no recompute hooks: the product is saved there).

A call the Function does not take runs the module's own forward (under invact.mlp.gated's recompute
hooks for the gated form): under torch.compile (above), inside
torch.func transforms, under autocast of a dtype autocast does not cast, with keyword arguments,
with hooks on a child or global module hooks, a child that is no longer a plain nn.Linear (PEFT's
LoRA wraps it after patch()), a 4-D or strided input, or dtypes that differ.
"""

from __future__ import annotations

import dataclasses
import dis
import functools
import inspect
import logging
import operator
from typing import NamedTuple

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from invact import kinds
from invact._budget import _transforms_active, traces_custom_ops
from invact._traced import as_ops
from invact.activation import _bits
from invact.activation.activations import ACTIVATIONS
from invact.activation.modules import InvAct
from invact.activation.ops import _is_wrapped, invact
from invact.identity import swap
from invact.kinds import Decision, Found, Kind, Options
from invact.mlp import experts, functional
from invact.mlp.gated import _Hooks
from invact.mlp.op import _apply, gate_up_linear, gated_linear

log = logging.getLogger("invact")

_MULTIPLY = (operator.mul, torch.mul, torch.Tensor.mul)
_LEAF_PARAMETER = (nn.Parameter, torch.Tensor)  # not a tensor subclass (DTensor, a quantized weight)


def _linear(module) -> bool:
    """`module` is an nn.Linear that computes nn.Linear's forward from its own weight and bias parameters:
    the class itself, or a subclass that changes neither the forward nor what `weight` and `bias` are
    (torchtitan's configurable Linear); not one with a forward of its own (bitsandbytes' Linear4bit), nor
    a parametrized one (torch.nn.utils.parametrize: `weight` a property, computed by child modules)."""
    cls = type(module)
    if cls is nn.Linear:
        return True
    if not isinstance(module, nn.Linear) or module._modules or cls.forward is not nn.Linear.forward:
        return False
    own = cls.__mro__[: cls.__mro__.index(nn.Linear)]
    return not any("weight" in vars(k) or "bias" in vars(k) for k in own)


class Pattern(NamedTuple):
    """The children of a recognised MLP, by name: `gate` None for the plain form; `up_first`: the
    forward calls up before gate."""

    up: str
    gate: str | None
    act: str
    down: str
    up_first: bool = False
    chunked: bool = False  # gate and up are the halves of one projection (`up` names it, `gate` too)
    # The activation (a name in ACTIVATIONS) where the forward calls it as a function (invact.mlp.functional;
    # `act` is then ""); None where `act` names an InvAct child.
    function: str | None = None


class _OneLevel(torch.fx.Tracer):
    """Traces a module's own forward, every submodule it calls one call_module node."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return True


def match(module: nn.Module) -> Pattern | None:
    """The Pattern where `module`'s forward, traced one level deep, is exactly down(act(gate(x)) *
    up(x)) (either operand order) or down(act(up(x))), x its one argument, act an InvAct and the
    projections plain nn.Linear; None for any other forward, or one that does not trace."""
    nodes = _traced_nodes(module, (3, 4))
    if nodes is None:
        return None
    inputs = [n for n in nodes if n.op == "placeholder"]
    if len(inputs) != 1 or any(n.kwargs and not _halves(n) for n in nodes if n.op != "output"):
        return None
    x, children = inputs[0], module._modules

    def called(node, arg) -> str | None:
        """The child `node` calls on `arg` alone, its result used once."""
        ok = isinstance(node, torch.fx.Node) and node.op == "call_module" and node.args == (arg,)
        return node.target if ok and len(node.users) == 1 and node.target in children else None

    down = nodes[-1].args[0] if nodes[-1].op == "output" else None
    if not isinstance(down, torch.fx.Node) or len(down.args) != 1:
        return None
    h = down.args[0]
    found = None
    if len(nodes) == 5 and isinstance(h, torch.fx.Node) and h.op == "call_module" and h.args:
        up = called(h.args[0], x)
        found = Pattern(up, None, called(h, h.args[0]), called(down, h))
    elif len(nodes) == 7 and h.op == "call_function" and h.target in _MULTIPLY and len(h.args) == 2:
        for a, b in (h.args, h.args[::-1]):
            if isinstance(a, torch.fx.Node) and a.op == "call_module" and len(a.args) == 1:
                gate = a.args[0]
                found = Pattern(called(b, x), called(gate, x), called(a, gate), called(down, h),
                                nodes.index(b) < nodes.index(gate))  # fmt: skip
                if None not in found[:4] and len(h.users) == 1:
                    break
    elif len(nodes) == 9 and h.op == "call_function" and h.target in _MULTIPLY and len(h.args) == 2:
        found = _chunked(h, x, called, down)
    if found is not None and found.chunked:
        linear = [found.up, found.down]
        ok = None not in found[:4] and isinstance(children[found.act], InvAct)
        return found if ok and all(_linear(children[n]) for n in linear) else None
    if found is None or None in (found.up, found.act, found.down) or found.up == found.gate:
        return None
    linear = [found.up, found.down] + ([] if found.gate is None else [found.gate])
    if not isinstance(children[found.act], InvAct) or not all(_linear(children[n]) for n in linear):
        return None
    return found


def _traced_nodes(module: nn.Module, children: tuple[int, ...]) -> list[torch.fx.Node] | None:
    """The nodes of `module`'s forward traced one level deep, or None: where its forward was replaced
    on the instance (accelerate's hooks, ours), it has another number of children than `children`,
    or its forward stores an attribute (tracing runs the forward's Python with proxies, which such a
    store would leave behind), or it does not trace."""
    if "forward" in module.__dict__:
        return None
    code = getattr(type(module).forward, "__code__", None)
    if (
        len(module._modules) not in children
        or code is None
        or any(i.opname in ("STORE_ATTR", "DELETE_ATTR", "STORE_GLOBAL") for i in dis.get_instructions(code))
    ):
        return None
    try:
        return list(_OneLevel().trace(module).nodes)
    except Exception:  # noqa: BLE001 - any failure to trace means: not this structure
        return None


_VARIADIC = inspect.CO_VARARGS | inspect.CO_VARKEYWORDS


def match_functional(module: nn.Module) -> tuple[Pattern, float] | None:
    """(the Pattern, the largest distance in ulps between its activation's calls and the spec's op) where
    `module`'s forward, traced one level deep, is exactly down(f(gate(x)) * up(x)) (either operand
    order) or down(f(up(x))), x its one argument, the projections plain nn.Linear children and f torch
    calls on one tensor that compute an activation of the spec (invact.mlp.functional); None for any
    other forward, or one that does not trace."""
    # Traced only where the forward takes one argument (self, x): a model's forward (a causal LM with two
    # children, its body and head) is never traced for this.
    code = getattr(type(module).forward, "__code__", None)
    if code is None or code.co_argcount != 2 or code.co_kwonlyargcount or code.co_flags & _VARIADIC:
        return None
    nodes = _traced_nodes(module, (2, 3))
    if nodes is None or nodes[-1].op != "output" or not isinstance(nodes[-1].args[0], torch.fx.Node):
        return None
    inputs = [n for n in nodes if n.op == "placeholder"]
    down = nodes[-1].args[0]
    children = module._modules
    if len(inputs) != 1 or down.op != "call_module" or len(down.args) != 1 or down.kwargs:
        return None
    x, h = inputs[0], down.args[0]

    def projection(node) -> str | None:
        """The child nn.Linear `node` calls on x alone."""
        ok = (
            isinstance(node, torch.fx.Node)
            and node.op == "call_module"
            and node.args == (x,)
            and not node.kwargs
        )
        return node.target if ok and _linear(children.get(node.target)) else None

    # (gate's node or None, up's node, the activation's output): the activation's calls start at a
    # projection's output, which chain() then checks
    projections = [n for n in nodes if projection(n) is not None]
    candidates = []
    if (
        isinstance(h, torch.fx.Node)
        and h.op == "call_function"
        and h.target in _MULTIPLY
        and len(h.args) == 2
    ):
        for a, b in (h.args, h.args[::-1]):
            if (
                b in projections
                and len(b.users) == 1
                and isinstance(a, torch.fx.Node)
                and a.op != "call_module"
            ):
                candidates += [(n, b, a) for n in projections if n is not b]
    if isinstance(h, torch.fx.Node):  # plain: a multiply may be the activation's own (x * sigmoid(x))
        candidates += [(None, n, h) for n in projections]
    for gate, up, out in candidates:
        root = up if gate is None else gate
        calls = functional.chain(root, out)
        if calls is None or not _linear(children.get(down.target)):
            continue
        used = {x, nodes[-1], down, up, *calls} | ({h, gate} if gate is not None else set())
        if used != set(nodes) or any(n.kwargs for n in nodes if n not in calls and n.op != "output"):
            continue
        if not set(root.users) <= set(calls) or (gate is not None and len(h.users) != 1):
            continue
        found = functional.which(calls, root)
        if found is None:
            return None
        name, ulps = found
        first = up if gate is None else min(up, gate, key=nodes.index)
        pattern = Pattern(up.target, None if gate is None else gate.target, "", down.target,
                          gate is not None and first is up, function=name)  # fmt: skip
        return pattern, ulps
    return None


def _halves(node: torch.fx.Node) -> bool:
    """`node` is t.chunk(2, dim=-1) (or chunk(2, -1)): a fused gate_up output split in its halves."""
    if node.op != "call_method" or node.target != "chunk":
        return False
    args = (*node.args[1:], *node.kwargs.values())
    return len(node.args) >= 2 and args == (2, -1) and set(node.kwargs) <= {"dim"}


def _chunked(h: torch.fx.Node, x: torch.fx.Node, called, down: torch.fx.Node) -> Pattern | None:
    """The Pattern of down(act(g) * u) (either operand order) with g, u = gate_up(x).chunk(2, -1), h
    the multiply (Phi-3's MLP); None for anything else."""
    for a, b in (h.args, h.args[::-1]):
        if not (isinstance(a, torch.fx.Node) and a.op == "call_module" and len(a.args) == 1):
            continue
        g, u = a.args[0], b
        if not all(isinstance(n, torch.fx.Node) and n.target is operator.getitem and len(n.users) == 1
                   for n in (g, u)):  # fmt: skip
            continue
        halves = g.args[0]
        if u.args[0] is not halves or (g.args[1], u.args[1]) != (0, 1) or not _halves(halves):
            continue
        if len(halves.users) != 2 or len(h.users) != 1:
            continue
        gate_up = called(halves.args[0], x)
        return Pattern(gate_up, gate_up, called(a, g), called(down, h), chunked=True)
    return None


_GLOBAL_HOOKS = tuple(
    getattr(torch.nn.modules.module, name, {})
    for name in ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks",
                 "_global_backward_hooks")
)  # fmt: skip
_any_autocast = torch._C._is_any_autocast_enabled


def _bare(module: nn.Module) -> bool:
    """Calling `module` runs its class's forward and nothing else: no hooks, no forward of its own."""
    return not (
        module._forward_pre_hooks or module._forward_hooks or module._backward_pre_hooks
        or module._backward_hooks or "forward" in module.__dict__
    )  # fmt: skip


def _parameters(module: nn.Module, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(weight, bias) of a plain nn.Linear of this dtype whose call runs its forward alone; None for
    any other module. Read from _parameters, where nn.Module's attribute lookup finds them (FSDP2
    puts its unsharded parameters there too): that lookup is a Python __getattr__ call each time."""
    if not _linear(module) or not _bare(module):
        return None
    parameters = module._parameters
    w, b = parameters["weight"], parameters["bias"]
    if type(w) not in _LEAF_PARAMETER or w.dtype is not dtype or (b is not None and b.dtype is not dtype):
        return None
    return w, b


def _cast_for(down: nn.Linear, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """down's (weight, bias), cast as F.linear's autocast casts them for an input like x, which an op
    (no autocast kernel) does not."""
    weight, bias = down.weight, down.bias
    device = x.device.type
    if torch.is_autocast_enabled(device):
        compute = torch.get_autocast_dtype(device)
        weight = weight.to(compute)
        bias = bias if bias is None else bias.to(compute)
    return weight, bias


class Forward:
    """The forward `fuse` sets on a recognised module (an instance attribute: nn.Module calls
    self.forward). `hooks`: invact.mlp.gated's recompute hooks of a gated module, entered around its own
    forward where the Function does not serve a call; None for the plain form."""

    def __init__(self, module: nn.Module, pattern: Pattern, hooks=None, mode: str = "bits") -> None:
        self.module, self.pattern, self.hooks = module, pattern, hooks
        self.mode = mode  # the activation's mode where the forward calls it as a function (pattern.function)

    def __call__(self, *args, **kwargs):
        module = self.module
        if torch.compiler.is_compiling():
            if traces_custom_ops():
                return self._traced(args, kwargs)
            # under torch.func (see invact.activation.ops.invact) or a memory budget (invact._budget):
            # its modules
            return type(module).forward(module, *args, **kwargs)
        if (
            len(args) == 1
            and not kwargs
            and torch.is_grad_enabled()
            and not (_transforms_active() or any(_GLOBAL_HOOKS))
        ):
            out = self._fused(args[0])
            if out is not None:
                return out
            if self.pattern.function is not None and self.pattern.gate is not None and self._wrapped():
                # projections a wrapper runs (tensor parallel's DTensor modules, through their hooks): each
                # called as it is, the activation and product on their outputs (the rank's shards), as
                # under torch.compile: the activation saves its output (and bits) in place of its input
                return self._traced(args, kwargs, wrapped=True)
        hooks = self.hooks
        if hooks is None:
            return type(module).forward(module, *args, **kwargs)
        hooks.pre(module, args, kwargs)
        output = None
        try:
            output = type(module).forward(module, *args, **kwargs)
        finally:
            hooks.post(module, args, kwargs, output)
        return output

    def _wrapped(self) -> bool:
        """Whether a projection of the module runs more than nn.Linear's forward on plain parameters:
        hooks, a forward of its own, or tensor-subclass parameters (tensor parallel's DTensor modules)."""
        children, (up, gate, _, down, *_) = self.module._modules, self.pattern
        for name in (up, gate, down):
            child = children[name]
            if not _bare(child) or any(type(p) not in _LEAF_PARAMETER for p in child._parameters.values()
                                       if p is not None):  # fmt: skip
                return True
        return False

    def _traced(self, args: tuple, kwargs: dict, wrapped: bool = False):
        """A call under torch.compile: the gated form's projections and activation as its modules run
        them (hooks, a PEFT-wrapped gate or up included), then down(y * u) as invact::gated_linear;
        the module's own forward where down is no longer a plain nn.Linear, for the plain form (the
        activation's op saves y, which down keeps too) and for any other call. `wrapped` (eager, a
        functional MLP whose projections a wrapper runs: Forward._wrapped): down(y * u) by its module
        whatever down is."""
        module = self.module
        children, (up, gate, act, down, up_first, chunked, function) = module._modules, self.pattern
        down = children[down]
        if (
            gate is None
            or len(args) != 1
            or kwargs
            or not isinstance(args[0], torch.Tensor)
            or not torch.is_grad_enabled()
            or (function is None and not isinstance(children[act], InvAct))
            or not (wrapped or (_linear(down) and _bare(down)))
        ):
            return type(module).forward(module, *args, **kwargs)
        x = args[0]
        if chunked:  # the fused gate_up's output, then the rest as one op (see gate_up_linear)
            gate_up = children[up](x)
            weight, bias = _cast_for(down, gate_up)
            if gate_up.dtype is not weight.dtype or gate_up.shape[-1] % 2:
                return type(module).forward(module, *args, **kwargs)
            return gate_up_linear(gate_up, weight, bias, children[act].activation)
        if up_first:
            u = children[up](x)
            g = children[gate](x)
        else:
            g = children[gate](x)
            u = children[up](x)
        y = children[act](g) if function is None else invact(g, function, self.mode)
        if wrapped:
            return down(y * u)
        weight, bias = _cast_for(down, y)
        if y.dtype is not u.dtype or y.dtype is not weight.dtype:
            return down(y * u)
        return gated_linear(y, u, weight, bias)

    def _fused(self, x) -> torch.Tensor | None:
        """The Function's output, or None where it does not serve this call."""
        if (
            self.pattern.chunked  # eager: the module's forward under the gated hooks
            or not isinstance(x, torch.Tensor)
            or _is_wrapped(x)
            or not x.is_floating_point()
            or x.dim() not in (2, 3)  # F.linear runs a bias-free 4-D input by matmul, a biased by add
            or not x.is_contiguous()  # a strided 3-D input by matmul and add, not on its rows
        ):
            return None
        dtype = compute = x.dtype
        if _any_autocast():
            device = x.device.type
            if torch.is_autocast_enabled(device):
                compute = torch.get_autocast_dtype(device)  # what F.linear casts x and the weights to
                if compute is not dtype and dtype is not torch.float32:
                    return None  # autocast casts float32 alone
        children, (up, gate, act, down, *_, function) = self.module._modules, self.pattern
        if function is not None:
            activation, mode = function, self.mode
        else:
            act = children[act]
            if not isinstance(act, InvAct) or type(act).forward is not InvAct.forward or not _bare(act):
                return None
            activation, mode = act.activation, act.mode
        up, down = _parameters(children[up], dtype), _parameters(children[down], dtype)
        gate = (None, None) if gate is None else _parameters(children[gate], dtype)
        if up is None or down is None or gate is None:
            return None
        if not (x.requires_grad or up[0].requires_grad or down[0].requires_grad) and (
            gate[0] is None or not gate[0].requires_grad
        ):
            return None  # nothing to save: the modules as they are
        precision_bit = mode == "precision_bit"
        if precision_bit and not _bits.supports_precision_bit(compute):
            return None  # the activation raises its own error for the dtype
        gated = gate[0] is not None
        return _apply(x, x if gated else None, *up, *gate, *down, ACTIVATIONS[activation], precision_bit,
                      self.pattern.up_first, compute)  # fmt: skip


class FusedMLP(nn.Module):
    """What `fuse` makes a recognised MLP (in place, invact.identity: a subclass of its own class, which
    keeps its forward; the instance's Forward takes the calls): a repr that says so."""

    def invact_repr(self) -> str:
        forward = self.__dict__.get("forward")
        pattern = forward.pattern if isinstance(forward, Forward) else None
        if pattern is not None and pattern.chunked:
            return repr("gated MLP of a fused gate_up: one op under torch.compile")
        form = "gated" if pattern is not None and pattern.gate is not None else "plain"
        if pattern is not None and pattern.function is not None:
            return repr(f"{form} MLP calling {pattern.function} as a function, as one Function")
        return repr(f"{form} MLP as one Function")


def fuse(module: nn.Module, hooks=None, gated: bool = True) -> Pattern | None:
    """Set Forward as `module`'s forward where match() recognises it: the plain form always, the gated
    form only with `gated` (gated=False keeps the product saved, as the activation-only patch does),
    with `hooks` (invact.mlp.gated's recompute hooks) for its calls the Function does not take. Returns the
    Pattern set, or None (nothing set: not recognised, fused already, or gated and not `gated`)."""
    pattern = match(module)
    if pattern is None or (pattern.gate is not None and not gated):
        return None
    module.forward = Forward(module, pattern, hooks if pattern.gate is not None else None)
    swap(module, FusedMLP)
    return pattern


def fuse_functional(module: nn.Module, mode: str) -> Pattern | None:
    """Set Forward as `module`'s forward where match_functional() recognises it (an activation called as
    a function: its calls the Function does not take run the module's own forward, which calls it);
    the Pattern set, or None."""
    found = match_functional(module)
    if found is None:
        return None
    module.forward = Forward(module, found[0], None, mode)
    swap(module, FusedMLP)
    return found[0]


# What a Recomputed module's compiled forward saves: the outputs of invact's ops (the activation's y and
# bits), of matrix products, and of random ops (a dropout's mask: recomputing it would draw again); any
# other op is recomputed in backward from those (the gated product y * u, views, a cast or a clone).
_SAVED_OPS = frozenset((torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default))


def _policy(ctx, op, *args, **kwargs):
    saved = op in _SAVED_OPS or getattr(op, "namespace", None) == "invact"
    if saved or torch.Tag.nondeterministic_seeded in getattr(op, "tags", ()):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.MUST_RECOMPUTE


@functools.cache
def _keeping_ops(mode_type: type) -> type:
    """A subclass of a selective checkpoint's dispatch mode under which invact's ops are recorded as ops
    (invact._traced.as_ops) while it handles a call: the policy then sees invact's op, not its body."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        with as_ops():
            return mode_type.__torch_dispatch__(self, func, types, args, kwargs)

    return type(f"KeepingOps{mode_type.__name__}", (mode_type,), {"__torch_dispatch__": __torch_dispatch__})


def _contexts():
    modes = create_selective_checkpoint_contexts(_policy)
    for mode in modes:
        mode.__class__ = _keeping_ops(type(mode))
    return modes


class Recomputed:
    """Under torch.compile, the gated hooks' counterpart for a gated module that neither `fuse` nor
    invact.mlp.experts takes (T5's gated MLP: its product passes a dropout and a dtype check before the
    down projection, so its forward is no form `match` recognises): the module's forward as a
    selective checkpoint (torch.utils.checkpoint, use_reentrant=False) whose policy (_policy) saves
    invact's and the matrix products' outputs and recomputes the rest, the product among them. Without
    it the partitioner saves the product for the down projection (measured on T5 with dropout 0: one
    product per layer more than eager patch(); with it, the same bytes). Set only on a module with an
    InvAct child and at least three nn.Linear children (gate, up, down); outside compile, under
    torch.func or a memory budget (see Forward), its own forward."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    @classmethod
    def set(cls, module: nn.Module) -> bool:
        children = module._modules.values()
        linear = sum(type(c) is nn.Linear for c in children)
        if "forward" in module.__dict__ or linear < 3 or not any(isinstance(c, InvAct) for c in children):
            return False
        module.forward = cls(module)
        return True

    def __call__(self, *args, **kwargs):
        module = self.module
        forward = type(module).forward
        if not (traces_custom_ops() and torch.is_grad_enabled()):
            return forward(module, *args, **kwargs)
        return checkpoint(forward, module, *args, use_reentrant=False, context_fn=_contexts, **kwargs)


def recompute_products(module: nn.Module) -> bool:
    """Hook `module` so that nothing it runs saves a copy of a gated product act(g) * u (see the
    module docstring; nested hooked modules stand aside for the outermost). Where its forward is an
    MLP invact.mlp recognises, that Function serves its calls instead, these hooks only those it does
    not take (invact.mlp.Forward). Idempotent; returns
    False if it was hooked already (or its hooks removed themselves: see _Hooks)."""
    if getattr(module, "_invact_recompute_products", False):
        return False
    hooks = _Hooks()
    if fuse(module, hooks) is None:
        hooks.handles = [
            module.register_forward_pre_hook(hooks.pre, with_kwargs=True),
            module.register_forward_hook(hooks.post, with_kwargs=True, always_call=True),
        ]
        if not experts.fuse(module):  # a MoE's experts: its compiled calls as invact.mlp.experts' ops
            Recomputed.set(module)
    module._invact_recompute_products = True
    for act in module.modules():
        if isinstance(act, InvAct):
            act._invact_notes_calls = True  # its forward records (x, y) in the innermost scope
    return True


def decide(model: nn.Module, options: Options, plan: list[Decision]) -> Found:
    """With options.gated, name in each replaced activation's Decision.gated the module to hook (its
    parent): every one without example inputs (harmless where it holds no product); with them, those
    where the activation kind's forward measured a gated product (set there), and the parents of
    InvAct modules whose mode alone changes (nothing measured). Adds no decision of its own."""
    functional_decisions = _functional(model, options, plan)
    names = [d.name for d in functional_decisions]
    if not options.gated:
        return Found(plan + functional_decisions, names)

    def hooked(d: Decision) -> bool:
        if d.kind != "activation" or not d.replace or d.gated is not None:
            return False
        owner, attr = kinds.parent(model, d.name)
        return options.example_inputs is None or isinstance(getattr(owner, attr, None), InvAct)

    refined = [dataclasses.replace(d, gated=kinds.parent_name(d.name)) if hooked(d) else d for d in plan]
    return Found([_experts_note(model, d) for d in refined] + functional_decisions, names)


# The name of a functional MLP's decision: the module, then what its forward calls ("layers.0.mlp" and
# an activation NAME: "layers.0.mlp.forward:NAME"), so that kinds.parent_name gives the module.
_CALLS = ".forward:"


def _functional(model: nn.Module, options: Options, plan: list[Decision]) -> list[Decision]:
    """One Decision (kind "mlp") per module whose forward is a gated or plain MLP calling its activation as
    a function (match_functional): replaced, its forward then one Function that saves x, y and its bits
    (and u, the gated form), or left alone with the reason. Without example inputs as with them: the
    Function's saved tensors are its own, a subset of what the module's ops save (no dropout or other
    op stands between them: the forward is exactly the form), so it never saves more. A module fused
    by an earlier patch() gets a decision where the mode changes."""
    decided = {kinds.parent_name(d.name) for d in plan}
    decisions = []
    for name, module in model.named_modules():
        forward = module.__dict__.get("forward")
        if isinstance(forward, Forward) and forward.pattern.function is not None:
            pattern, ulps, again = forward.pattern, None, True
        elif name in decided or len(module._modules) not in (2, 3):
            continue
        else:
            found = match_functional(module)
            if found is None:
                continue
            (pattern, ulps), again = found, False
        full = f"{name}{_CALLS}{pattern.function}" if name else _CALLS[1:] + pattern.function
        cls = kinds.qualname(module)
        form = "gated" if pattern.gate is not None else "plain"
        if again:
            if forward.mode != options.mode and kinds.selected(full, options.include, options.exclude):
                decisions.append(Decision(full, cls, True, f"already one Function: mode {forward.mode!r} -> "
                                                           f"{options.mode!r}", kind=KIND.name))  # fmt: skip
            continue
        exact = "exactly" if ulps == 0 else f"within {ulps:g} ulp (its own composition of torch ops)"
        y = "y" if ACTIVATIONS[pattern.function].monotone else "y and its bits"
        does = (f"its forward calls {pattern.function} as a function (reproduced {exact}) in a {form} MLP: "
                f"one Function saving x, {y}{', u' if form == 'gated' else ''}")  # fmt: skip
        if not kinds.selected(full, options.include, options.exclude):
            decisions.append(Decision(full, cls, False, "excluded by include/exclude", kind=KIND.name))
        elif form == "gated" and not options.gated:
            decisions.append(Decision(full, cls, False, f"gated=False keeps its product saved; {does}",
                                      kind=KIND.name))  # fmt: skip
        else:
            decisions.append(Decision(full, cls, True, does, gated=name if form == "gated" else None,
                                      kind=KIND.name))  # fmt: skip
    return decisions


def _experts_note(model: nn.Module, d: Decision) -> Decision:
    """`d`, its reason extended where the module it hooks is a MoE's experts module whose compiled calls
    invact.mlp.experts does not take (hooked in eager mode all the same), with why."""
    if d.gated is None or not experts.is_experts(module := model.get_submodule(d.gated)):
        return d
    why = experts.refusal(module, act=False)
    if why is None:
        return d
    why = f"under torch.compile its experts run their own forward: {why}"
    return dataclasses.replace(d, reason=f"{d.reason}; {why}")


def apply(model: nn.Module, plan: list[Decision], options: Options) -> list[str]:
    """Hook the modules the plan names in Decision.gated (recompute_products), and those holding InvAct
    modules an earlier patch(gated=False) made; then run every plain MLP among the parents of InvAct
    modules as one Function (fuse: the same saved tensors, less host time), also where no gated product
    was measured or gated=False. Replaces no module: returns []."""
    decided = {d.name for d in plan}
    earlier = [n for n, m in model.named_modules(remove_duplicate=False) if isinstance(m, InvAct)]
    earlier = {kinds.parent_name(n) for n in earlier
               if n not in decided and kinds.selected(n, options.include, options.exclude)}  # fmt: skip
    if options.gated:
        parents = {d.gated for d in plan if d.replace and d.gated is not None}
        for name in sorted(parents | earlier):
            if recompute_products(model.get_submodule(name)):
                log.info("invact.patch: %s saves no copy of a gated product (recomputed in backward)",
                         name or "the model")  # fmt: skip
    parents = {kinds.parent_name(d.name) for d in plan if d.replace and d.kind == "activation"}
    for name in sorted(parents | earlier):
        fuse(model.get_submodule(name), gated=False)
    taken = []
    for d in plan:  # the MLPs calling their activation as a function (_functional)
        if d.kind == KIND.name and d.replace:
            module = model.get_submodule(kinds.parent_name(d.name))
            forward = module.__dict__.get("forward")
            if isinstance(forward, Forward):
                forward.mode = options.mode
            elif fuse_functional(module, options.mode) is None:
                continue
            taken.append(d.name)
    return taken


KIND = Kind("mlp", decide, apply)
