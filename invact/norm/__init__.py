"""The norm's home: which modules patch() replaces (a class of the norm spec, or a leaf module named like
one, whose forward matches a variant bitwise on a probe: `match`), the decision with its reason, and the
replacement, InvNorm (in place: invact.identity), which saves y instead of x. The variants' formulas,
the inverted backward and its exactness bound, the autograd Function and the custom ops are
invact.norm.op; the backward's kernels invact.norm._cpu (numba) and invact.norm._triton (CUDA)."""

from __future__ import annotations

import dataclasses
import warnings
import weakref

import torch
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module

from invact import kinds
from invact._budget import _transforms_active, budgeted
from invact.callers import inplace_use
from invact.identity import original_class, swap
from invact.kinds import Decision, Found, Kind, Options
from invact.memory import parameter_storages
from invact.norm import functional
from invact.norm.op import (
    _MODULES,
    CLASSES,
    FIND,
    VARIANTS,
    Variant,
    _apply_norm,
    _failing_of,
    _is_wrapped,
    _keep_x_traced,
    _known,
    _Norm,
    _read_back,
    _record,
    backward,
    decode_residual,
    default_eps,
    encode_residual,
    forward,
    invertible,
    keeps_residual,
    refresh,
)

__all__ = ["KIND", "VARIANTS", "InvNorm", "backward", "decode_residual", "encode_residual", "forward",
           "invertible", "match", "refresh", "replacement"]  # fmt: skip


def _unchanged(checked: tuple, w, b) -> bool:
    """Whether the parameters w and b are those an InvNorm's check (`_invact_checked`) was made on, as
    they were then (the same tensors, the same versions)."""
    (rw, rb), (vw, vb), _, _ = checked
    return (w is None if rw is None else rw() is w and w._version == vw) and (
        b is None if rb is None else rb() is b and b._version == vb
    )


def _stale_peers(module: nn.Module, weight) -> list:
    """The other InvNorms known to the op whose parameters changed since their own last check and whose
    weight is a plain tensor on `weight`'s device: their checks can share `module`'s read back. Never a
    sharded (DTensor) weight: its check gathers it, a collective every rank must make at the same point."""
    if weight is None or weight.is_meta or hasattr(weight, "full_tensor"):
        return []
    device, peers = weight.device, []
    for other in list(_MODULES.values()):
        checked = other._invact_checked
        if other is module or checked is None:
            continue
        params = other._parameters
        w, b = params.get("weight"), params.get("bias")
        if (
            w is not None
            and type(w) in (torch.Tensor, nn.Parameter)
            and w.device == device
            and not _unchanged(checked, w, b)
        ):
            peers.append(other)
    return peers


class InvNorm(nn.Module):
    """A normalization over the last dimension that saves its output and per-row rstd for backward
    (see the module docstring).

    Two ways to have one. patch() (through `invert`) makes a norm it replaces an InvNorm in place: its
    class becomes a subclass of its own class and of this one (invact.identity), so it keeps its
    parameters, its epsilon attribute, its class name and `isinstance` with its class. Or build one:
    `variant`, a name in VARIANTS; `weight`, `bias`: parameters (None where there are none); `eps`:
    the epsilon (None: torch's RMSNorm default), held under `eps_name` (default: the variant's own
    name, "eps" or "variance_epsilon"); `replaces`: a note for the repr.

    What the forward reads: the variant (`_invact_variant`), the parameters in `_parameters` (where
    nn.Module keeps them, FSDP2's unsharded ones too), and the epsilon under `_invact_eps_name`."""

    _invact_variant: str
    _invact_eps_name: str
    # (weak references to the parameters, their versions and y's dtype), invertible: see _invertible
    _invact_checked: tuple | None = None
    # the dtypes of y for which the parameters failed the check when last made: a traced call keeps x
    _invact_keep_x: tuple = ()

    def __init__(
        self, variant: str, weight, bias, eps: float | None, replaces: str = "", eps_name: str | None = None
    ) -> None:
        super().__init__()
        if variant not in VARIANTS:
            raise ValueError(f"unknown norm variant {variant!r} (choose from {', '.join(VARIANTS)})")
        self.weight, self.bias = weight, bias
        self.eps_name = eps_name or VARIANTS[variant].eps
        setattr(self, self.eps_name, eps)
        self.replaces = replaces
        self._invact_variant, self._invact_eps_name = variant, self.eps_name
        _known(self)

    def __getstate__(self):
        # copies and pickles check afresh: weak references neither pickle nor point at a copy's tensors
        return {**super().__getstate__(), "_invact_checked": None}

    def __setstate__(self, state):  # a copy or an unpickled one: known to the op and to a traced call
        super().__setstate__(state)
        _known(self)

    def _invertible(self, dtype: torch.dtype) -> bool:
        """invertible() of the parameters, computed again only when one of them is another tensor or
        has changed (its version: an optimizer step bumps it). Weak references: a parameter replaced
        (to_empty, loading) is neither kept alive nor mistaken for a new one at its address. Checked
        again, it checks with it every other InvNorm whose parameters changed since its own check
        (_stale_peers): an optimizer step changes them all, and the first norm of the next forward
        reads back one answer per device for all of them, not each norm one (on CUDA a device sync)."""
        params = self._parameters
        w, b = params.get("weight"), params.get("bias")
        checked = self._invact_checked
        if checked is not None and checked[2] == dtype and _unchanged(checked, w, b):
            return checked[3]
        todo = [(self, dtype), *((m, m._invact_checked[2]) for m in _stale_peers(self, w))]
        failing = _read_back([_failing_of(m, d) for m, d in todo])
        for (module, d), fails in zip(todo, failing, strict=True):
            module._remember(d, not fails)
        return not failing[0]

    def _remember(self, dtype: torch.dtype, answer: bool) -> None:
        """Keep `answer`, invertible() of the parameters as they are now for y in `dtype` (_invertible)."""
        params = self._parameters
        w, b = params.get("weight"), params.get("bias")
        _known(self)
        _record(self, dtype, answer)  # what a traced call keeps follows (see _MODULES)
        refs = tuple(None if t is None else weakref.ref(t) for t in (w, b))
        versions = tuple(None if t is None else t._version for t in (w, b))
        self._invact_checked = (refs, versions, dtype, answer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v = VARIANTS[self._invact_variant]
        eps = getattr(self, self._invact_eps_name)
        eps = default_eps(v, x.dtype) if eps is None else eps
        params = self._parameters
        weight, bias = params.get("weight"), params.get("bias")
        recording = torch.is_grad_enabled() and (
            x.requires_grad
            or (weight is not None and weight.requires_grad)
            or (bias is not None and bias.requires_grad)
        )
        compiling = torch.compiler.is_compiling()  # (asked once: a Python call of two frames)
        if hasattr(x, "_local_tensor"):  # a DTensor: tensor parallel's SequenceParallel (_sharded)
            return self._sharded(x, weight, bias, eps, v)
        if (
            not recording
            or _transforms_active()
            # the partitioner may recompute torch's ops to meet a memory budget (invact._budget)
            or (compiling and budgeted())
            or (x.dtype == torch.float64 and v.upcast == "float32")  # the module lowers it: nothing to keep
        ):
            return forward(x, weight, bias, eps, v)[0]
        if compiling:  # traced as the custom op (see _op_forward)
            _keep_x_traced(id(self), x.dtype)  # the parameters checked as the call is traced (_TRACED)
            keep_x = x.dtype in self._invact_keep_x  # a guard: traced again where it changes
            op = torch.ops.invact.norm_forward
            return op(x, weight, bias, eps, self._invact_variant, keep_x, id(self))[0]
        if _is_wrapped(x):  # a dead torch.func wrapper: autograd.Function.apply unwraps it
            return _Norm.apply(x, weight, bias, eps, v, self._invertible)
        return _apply_norm(x, weight, bias, eps, v, self._invertible)

    def _sharded(self, x, weight, bias, eps: float, v) -> torch.Tensor:
        """A DTensor x (tensor parallel's SequenceParallel: the rows sharded over the sequence, the normalized
        last dimension whole on every rank): the same op on this rank's rows, the parameters' local copies
        (replicated) with their gradients left partial sums (Partial), as eager's DTensor ops leave them;
        y a DTensor placed as x. The next projection saves the all-gathered copy of y, not these rows, so the
        call saves y's rows beside it, in place of x's; eager's DTensor rms_norm keeps more than x's rows
        (the native Llama of tests/invact/_tp_workers.py with SequenceParallel norms, 2 ranks, its MLPs
        running their own forward: 1.45 MiB a rank saved with the norms' own forward, 1.30 inverted in fp32;
        0.90 and 0.68 in bf16). The module's own
        forward where the last dimension is sharded, x is a partial sum, a parameter is not replicated, or no
        gradient is recorded."""
        from torch.distributed.tensor import DTensor, Partial

        last, placements = x.dim() - 1, x.placements
        params = [t for t in (weight, bias) if t is not None]
        recording = torch.is_grad_enabled() and (x.requires_grad or any(t.requires_grad for t in params))
        if (
            not recording
            or torch.compiler.is_compiling()
            or any(p.is_partial() or (p.is_shard() and p.dim % x.dim() == last) for p in placements)
            or any(not hasattr(t, "_local_tensor") or t.device_mesh != x.device_mesh for t in params)
            or any(not p.is_replicate() for t in params for p in t.placements)
        ):
            original = original_class(self)
            return (original.forward(self, x) if not issubclass(original, InvNorm)
                    else forward(x, weight, bias, eps, v)[0])  # fmt: skip
        partial = [Partial()] * x.device_mesh.ndim
        w = None if weight is None else weight.to_local(grad_placements=partial)
        b = None if bias is None else bias.to_local(grad_placements=partial)
        # invertible() of the parameters' local tensors, cached by their versions (an optimizer's step on the
        # DTensor changes its local tensor in place)
        check = functional._check(None if weight is None else weight._local_tensor,
                                  None if bias is None else bias._local_tensor, v)  # fmt: skip
        y = _apply_norm(x.to_local(), w, b, eps, v, check)
        return DTensor.from_local(
            y, x.device_mesh, placements, run_check=False, shape=x.shape, stride=x.stride()
        )

    def invact_repr(self) -> str:
        """What the patch is, for the repr of a patched module (invact.identity)."""
        return repr(self._invact_variant)

    def extra_repr(self) -> str:
        weight = self._parameters.get("weight")
        shape = tuple(weight.shape) if weight is not None else ()
        eps = getattr(self, self._invact_eps_name)
        return f"{self._invact_variant!r}, {shape}, eps={eps}, replaces={self.replaces!r}"


def is_candidate(module: nn.Module) -> bool:
    """A module patch() considers: a class of the spec, or a leaf module whose class name matches its
    pattern (FIND); never an InvNorm."""
    if isinstance(module, InvNorm):
        return False
    if kinds.qualname(module) in CLASSES:
        return True
    return not any(True for _ in module.children()) and bool(FIND.search(type(module).__name__))


def _probe_tensors(module: nn.Module, v: Variant, dtype: torch.dtype, generator: torch.Generator):
    """(x, parameters) for one probe: 5 rows of the module's width on CPU, the parameters random
    (weight near its offset's 1, so every variant's y is well away from zero) in their own dtypes."""
    weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
    # a module with neither weight nor normalized_shape normalizes rows of any width: 8 stands for all
    d = weight.shape[-1] if weight is not None else getattr(module, "normalized_shape", (8,))[-1]
    x = torch.randn(5, d, generator=generator).to(dtype)
    params = {}
    if weight is not None:
        w = torch.randn(d, generator=generator) * 0.25 + (0.0 if v.offset else 1.0)
        params["weight"] = w.to(weight.dtype if weight.dtype.is_floating_point else torch.float32)
    if bias is not None:
        params["bias"] = (torch.randn(d, generator=generator) * 0.25).to(bias.dtype)
    return x, params


# The attribute names modules hold epsilon under (Hugging Face's copies use both for one formula: Llama's
# RMSNorm `variance_epsilon`, Llama 4's `eps`): a variant's own name (the spec's `eps`) is tried first.
EPS_NAMES = ("eps", "variance_epsilon")


def _eps_names(v: Variant) -> tuple[str, ...]:
    """The names tried for variant v's epsilon, its own first."""
    return tuple(dict.fromkeys((v.eps, *EPS_NAMES)))


def eps_name(module: nn.Module, v: Variant) -> str | None:
    """The attribute `module` holds its epsilon under, for variant v; None where it has none."""
    return next((n for n in _eps_names(v) if hasattr(module, n)), None)


def _structure(module: nn.Module, v: Variant) -> str | None:
    """Why the module cannot be variant v whatever its forward computes; None if it can."""
    weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
    if weight is not None and not (isinstance(weight, nn.Parameter) and weight.dim() == 1):
        return "its weight is not a 1-D parameter"
    shape = getattr(module, "normalized_shape", None)
    if shape is not None and len(tuple(shape)) != 1:
        return f"it normalizes over {len(tuple(shape))} dimensions (InvNorm: the last one)"
    if bias is not None and not (isinstance(bias, nn.Parameter) and v.bias):
        return "it adds a bias the formula has not" if not v.bias else "its bias is not a parameter"
    name = eps_name(module, v)
    if name is None:
        return f"it has no epsilon attribute ({' or '.join(_eps_names(v))})"
    eps = getattr(module, name)
    if not (isinstance(eps, float) or (eps is None and v.name == "rms_torch")):
        return f"its {name} is {eps!r}, not a float"
    if any(True for _ in module.buffers()):
        return "it holds buffers"
    return None


_MATCHED: dict[tuple, tuple[str | None, str]] = {}


def match(module: nn.Module) -> tuple[str | None, str]:
    """(variant, why) for a candidate module: the first variant (the spec's class entry first) whose
    formula gives the module's own forward output bitwise on probes in float32 and bfloat16 (CPU,
    random parameters of the module's shapes and dtypes), else (None, why not). Remembered per class
    and the dtypes and kinds of what the module holds (what the probe's answer depends on)."""
    names = ("weight", "bias", *EPS_NAMES, "normalized_shape")
    held = (getattr(module, a, None) for a in names)
    key = (type(module), *((getattr(t, "dtype", None), getattr(t, "shape", None), type(t)) for t in held))
    if key not in _MATCHED:
        _MATCHED[key] = _match(module)
    return _MATCHED[key]


def _match(module: nn.Module) -> tuple[str | None, str]:
    listed = CLASSES.get(kinds.qualname(module))
    order = ([listed] if listed else []) + [n for n in VARIANTS if n != listed]
    reasons = []
    for name in order:
        v = VARIANTS[name]
        why = _structure(module, v)
        if why is None:
            why = _differs(module, v)
        if why is None:
            return name, f"computes the {name!r} formula (checked bitwise on a probe)"
        reasons.append(f"{name}: {why}")
    if listed:
        return None, "matches no norm formula: " + reasons[0]
    return None, "matches no norm formula of the spec"


def _differs(module: nn.Module, v: Variant) -> str | None:
    generator = torch.Generator(device="cpu").manual_seed(0)
    # torch's rms_norm warns of mixed dtypes (a 16-bit x, an fp32 weight); the probe is of the formula,
    # not of an autocast region patch() may be called in, nor of a default device it may be called
    # under: inside `with torch.device("meta")` (how from_pretrained and accelerate's
    # init_empty_weights build a model) the probe's tensors and those its forward makes would be meta
    # tensors, whose values torch.equal cannot compare
    with warnings.catch_warnings(), torch.autocast("cpu", enabled=False), torch.device("cpu"):
        warnings.simplefilter("ignore")
        return _differs_quietly(module, v, generator)


def _differs_quietly(module: nn.Module, v: Variant, generator: torch.Generator) -> str | None:
    weight = getattr(module, "weight", None)
    own = weight.dtype if weight is not None and weight.dtype.is_floating_point else torch.float32
    compared = 0
    for dtype in dict.fromkeys((own, torch.float32, torch.bfloat16)):
        x, params = _probe_tensors(module, v, dtype, generator)
        eps = getattr(module, eps_name(module, v))
        try:
            # its forward, not its call: a module's forward hooks are not its formula, and FSDP2's (a unit
            # of its own, as transformers' fsdp_plan makes the final norm) would initialize the unit as
            # a root before the model's forward does, which FSDP2 then refuses
            with torch.no_grad(), _reparametrize_module(module, params, strict=False):
                theirs = module.forward(x)
        except Exception as e:  # noqa: BLE001 - any failure of the module's forward on the probe
            if dtype != own:  # an input of another dtype than its weight's, which it need not take
                continue
            return f"its forward fails on a probe ({type(e).__name__}: {str(e).splitlines()[0][:80]})"
        with torch.no_grad():
            ours = forward(
                x, params.get("weight"), params.get("bias"), default_eps(v, dtype) if eps is None else eps, v
            )[0]
        same = isinstance(theirs, torch.Tensor) and theirs.dtype == ours.dtype and torch.equal(theirs, ours)
        if not same:
            return f"its {dtype} output differs from the formula's on a probe"
        compared += 1
    return None if compared else "its forward runs on no probe"


def replacement(module: nn.Module, variant: str) -> InvNorm:
    """A new InvNorm that computes what `module` computes, holding its very parameters (`module` is
    left as it is: for comparing the two; patch() uses `invert`)."""
    name = eps_name(module, VARIANTS[variant])
    new = InvNorm(variant, getattr(module, "weight", None), getattr(module, "bias", None),
                  getattr(module, name), replaces=kinds.qualname(module), eps_name=name)  # fmt: skip
    new.train(module.training)
    return new


def invert(module: nn.Module, variant: str) -> InvNorm:
    """Make `module` an InvNorm of `variant` in place, keeping its class's identity (invact.identity):
    the same object, parameters and attributes. Returns it."""
    name = eps_name(module, VARIANTS[variant])
    swap(module, InvNorm, _invact_variant=variant, _invact_eps_name=name, _invact_checked=None)
    _known(module)
    return module


def decide(model: nn.Module, options: Options, plan: list[Decision]) -> Found:
    """With options.norms, one Decision (kind "norm") per normalization module (see invact.plan's
    `norms`), measured with options.example_inputs; the plan as it is without."""
    if not options.norms:
        return Found(plan, [])
    found = _found(model, options.include, options.exclude, options.example_inputs is None)
    names = [d.name for d in found]
    if options.example_inputs is not None:
        found = _measured(model, found, options.example_inputs)
    calls = _functional(model, options, {d.name for d in plan + found})
    return Found(plan + found + calls, names + [d.name for d in calls])


_CALLS = ".forward:"  # a forward's norm calls: "<module>.forward:rms_norm", as invact.mlp names its MLPs'


def _functional(model: nn.Module, options: Options, decided: set[str]) -> list[Decision]:
    """One Decision (kind "norm") per module whose forward calls torch's rms_norm or layer_norm as a function
    (invact.norm.functional.calls): its forward rewritten to call invact's (each call saving its output and
    rstd), or left alone with the reason. The output of such a call is what the next op (a projection, the
    attention) saves anyway; where nothing does, it is as large as the input the call no longer saves."""
    decisions = []
    for name, module in model.named_modules():
        if is_candidate(module) or isinstance(module, InvNorm):  # a norm module: inverted as a module
            continue
        taken = module.__dict__.get("_invact_norm_calls")
        found, why = (list(taken), "") if taken else functional.calls(module)
        if not found and not why:
            continue
        function = found[0] if found and len(set(found)) == 1 else "norms"
        full = f"{name}{_CALLS}{function}" if name else _CALLS[1:] + function
        if full in decided:
            continue
        cls = kinds.qualname(module)
        if not found:
            decisions.append(Decision(full, cls, False, why, kind=KIND.name))
        elif not kinds.selected(full, options.include, options.exclude):
            decisions.append(Decision(full, cls, False, "excluded by include/exclude", kind=KIND.name))
        elif taken:
            continue  # rewritten by an earlier patch(): nothing to do
        else:
            counts = ", ".join(f"{found.count(f)} x {f}" for f in sorted(set(found)))
            why = f"its forward calls {counts} as functions: rewritten to invact's (saving output and rstd)"
            decisions.append(Decision(full, cls, True, why, kind=KIND.name))
    return decisions


def apply(model: nn.Module, plan: list[Decision], options: Options) -> list[str]:
    """Make each norm the plan replaces an InvNorm in place (a module shared by several parents once);
    their names."""
    mine = [d for d in plan if d.kind == KIND.name and d.replace]
    taken = []
    for d in mine:
        if _CALLS in d.name or d.name.startswith(_CALLS[1:]):  # a forward calling norms (_functional)
            if functional.rewrite(
                model.get_submodule(d.name.partition(_CALLS)[0] if _CALLS in d.name else "")
            ):
                taken.append(d.name)
            continue
        module = model.get_submodule(d.name)
        invert(module, match(module)[0])
        taken.append(d.name)
    return taken


def _found(model: nn.Module, include, exclude, static: bool) -> list[Decision]:
    """One Decision (kind "norm") per normalization module (see plan's `norms`); `static`: the known
    risky patterns decide (without example inputs)."""
    decisions = []
    for name, module in model.named_modules(remove_duplicate=False):
        if not is_candidate(module):
            continue
        cls = kinds.qualname(module)
        variant, why = match(module)
        if variant is None:
            decisions.append(Decision(name, cls, False, why, kind="norm"))
        elif not kinds.selected(name, include, exclude):
            decisions.append(Decision(name, cls, False, "excluded by include/exclude", kind="norm"))
        elif not name:
            decisions.append(Decision(name, cls, False, "the model itself is a norm: use invact.norm.InvNorm",
                                      kind="norm"))  # fmt: skip
        else:
            risk = _risk(model, name) if static else None
            decisions.append(Decision(name, cls, risk is None, risk or f"inverted: {why}", kind="norm"))
    return decisions


def _measured(model: nn.Module, decisions: list[Decision], example_inputs) -> list[Decision]:
    """The norm decisions to replace, re-decided by one training-mode forward of the unpatched model
    under saved-tensor hooks (see plan's `norms`)."""
    todo = {d.name: d for d in decisions if d.replace}
    if not todo:
        return decisions
    modules = {name: model.get_submodule(name) for name in todo}
    first = {}  # id(module) -> its first name (a shared module is measured once)
    for name, m in modules.items():
        first.setdefault(id(m), name)
    excluded = parameter_storages(model)
    stack: list[str] = []
    inside: dict[str, dict[int, int]] = {}  # name -> storage -> bytes, saved while it ran
    outputs: dict[str, list] = {}  # name -> [(output, its version at return)]
    elsewhere: set[int] = set()  # storages saved outside every measured norm

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in excluded and storage.nbytes():
            if stack:
                inside.setdefault(stack[-1], {})[ptr] = storage.nbytes()
            else:
                elsewhere.add(ptr)
        return t

    def enter(name: str) -> None:
        stack.append(name)

    def leave(name: str, output) -> None:
        stack.pop()
        if isinstance(output, torch.Tensor):  # held until the end: no later tensor takes its address
            outputs.setdefault(name, []).append((output, output._version))

    hooks = []
    for name, m in modules.items():
        if first[id(m)] == name:
            hooks.append(m.register_forward_pre_hook(lambda _m, _a, n=name: enter(n)))
            hooks.append(m.register_forward_hook(lambda _m, _a, out, n=name: leave(n, out)))
    kinds.training_forward(model, example_inputs, pack, hooks)
    result = []
    for d in decisions:
        if d.name not in todo:
            result.append(d)
            continue
        key = first[id(modules[d.name])]
        calls = outputs.get(key, [])
        if not calls:
            result.append(dataclasses.replace(d, replace=False, reason="not called by the example forward: "
                                              "nothing measured"))  # fmt: skip
            continue
        if any(y._version != version for y, version in calls):
            why = "an in-place op modifies its output later in the forward: the inverted norm saves it"
            result.append(dataclasses.replace(d, replace=False, reason=why))
            continue
        own = {y.untyped_storage().data_ptr() for y, _ in calls}
        freed = sum(n for ptr, n in inside.get(key, {}).items() if ptr not in own)
        cost = sum(
            _kept_bytes(modules[d.name], y, y.untyped_storage().data_ptr() in elsewhere) for y, _ in calls
        )
        if freed - cost <= 0:
            why = f"measured: inverting it would add {cost - freed} bytes (no later op saves its output)"
            result.append(dataclasses.replace(d, replace=False, spared_bytes=freed - cost, reason=why))
        else:
            why = f"measured: saves {freed - cost} bytes; {d.reason}"
            result.append(dataclasses.replace(d, spared_bytes=freed - cost, reason=why))
    return result


def _kept_bytes(module: nn.Module, y: torch.Tensor, saved_later: bool) -> int:
    """What an inverted norm keeps for one call with output y: rstd (fp32, one per row), the 4-bit
    residuals where its variant keeps them (invact.norm.keeps_residual), and y where no later op saves
    it."""
    rows = y.numel() // max(y.shape[-1], 1) if y.dim() else 1
    kept = 4 * rows + (0 if saved_later else y.untyped_storage().nbytes())
    variant, _ = match(module)
    if (
        variant is not None
        and getattr(module, "weight", None) is not None
        and keeps_residual(variant, y.dtype)
    ):
        kept += (y.numel() + 1) // 2
    return kept


def _risk(model: nn.Module, name: str) -> str | None:
    """In nn.Sequential, the module after a norm: Dropout(p > 0) (the next layer saves the dropped-out
    tensor, not y) or in place (it would overwrite the y backward reads); elsewhere, forward code that
    calls it and then modifies its output in place (invact.callers); None otherwise."""
    parent, attr = kinds.parent(model, name)
    if not isinstance(parent, nn.Sequential):
        use = inplace_use(model, name)
        if use is not None:
            return f"its output is modified in place after it ({use}): the inverted norm saves it"
        return None
    names = [n for n, _ in parent.named_children()]
    if attr not in names or names.index(attr) + 1 == len(names):
        return None
    after_name, after = list(parent.named_children())[names.index(attr) + 1]
    if isinstance(after, nn.modules.dropout._DropoutNd) and after.p > 0:
        return f"the next module, {after_name}, is Dropout(p={after.p}): the next layer saves another tensor"
    if getattr(after, "inplace", False) is True:
        return f"the next module, {after_name} ({type(after).__name__}), works in place on its output"
    return None


KIND = Kind("norm", decide, apply)
