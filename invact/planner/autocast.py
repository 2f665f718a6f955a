"""Autocast on the meta device, for invact.planner.step's mixed-precision recipe: torch.autocast acts on
tensors of its own device type only (a meta tensor is never cast), so `Autocast(device)` casts as
autocast on `device` ("cuda" or "cpu") would, at the Python call the model makes.

Autocast casts at the aten op; a TorchFunctionMode sees the Python function the model calls
(F.linear, torch.matmul, Tensor.softmax, ...), one per op here. The rules, per device type, are
torch 2.13's (aten/src/ATen/autocast_mode.cpp), named by the Python functions that reach each op;
tests/invact/test_autocast_plan.py checks each against the dispatcher (an Autocast<device> kernel
is registered for its aten op) and, for "cpu", against torch.autocast's dtypes on CPU tensors:

- LOWER: floating arguments cast to the autocast dtype (bf16); a float32 leaf that requires grad (a
  weight) is cast once per autocast region and the cast kept to its end, as autocast's cache does.
- FP32: floating arguments cast to float32.
- FP32_DTYPE: run with dtype=float32 where no dtype is given (the op reads its 16-bit input and
  writes float32, without a float32 copy of the input).
Ops autocast only promotes (cat, stack: the widest dtype among the inputs) are left as they are, and
so are the two activation functions with autocast rules (the runtime names no activation: each is the
spec's; transformers' language models use neither).

While it is enabled, torch.is_autocast_enabled("meta"), torch.get_autocast_dtype("meta") and
invact.mlp's check answer as autocast on the device would, so invact's ops take their autocast
paths; `recompute()` is the context torch.utils.checkpoint runs a checkpointed region's recompute in
(context_fn): autocast again, with a cache of its own, as checkpoint replays autocast's state.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

_MATMULS = frozenset({"linear", "matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "addmm", "baddbmm",
                      "addbmm", "scaled_dot_product_attention", "conv1d", "conv2d", "conv3d",
                      "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
                      "vecdot"})  # fmt: skip
LOWER = {
    "cuda": _MATMULS | {"einsum", "addmv", "addr", "mv", "chain_matmul"},
    "cpu": _MATMULS,
}
_LOSSES = frozenset({"nll_loss", "mse_loss", "binary_cross_entropy_with_logits", "kl_div", "l1_loss",
                     "smooth_l1_loss", "huber_loss", "cdist"})  # fmt: skip
# fmt: off
FP32 = {
    "cuda": _LOSSES | {
        "layer_norm", "group_norm", "rms_norm", "exp", "log", "log10", "log2", "log1p", "expm1", "pow",
        "__pow__", "__rpow__", "rsqrt", "reciprocal", "erfinv", "logsumexp", "cosh", "sinh",
        "tan", "acos", "asin", "dist", "renorm",
        # F.cross_entropy: CUDA's rules are on the log_softmax (FP32_DTYPE) and nll_loss inside it, which
        # read a 16-bit input without a float32 copy; cast here (Hugging Face's losses upcast first)
        "cross_entropy",
    },
    "cpu": _LOSSES | {"cross_entropy", "prod"},
}
# fmt: on
# Rules a torch in the supported range may lack, kept where this torch registers them: torch 2.11 has no
# AutocastCUDA kernel for rms_norm, whose composite's own ops are then cast one by one inside the op,
# below what this mode sees (the planner's rms_norm under a CUDA autocast is then 16-bit throughout).
for _device, _name, _key in (("cuda", "rms_norm", "AutocastCUDA"),):
    if not torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{_name}", _key):
        FP32[_device] = FP32[_device] - {_name}
FP32_DTYPE = {
    "cuda": frozenset({"softmax", "log_softmax", "sum", "cumsum", "prod", "vector_norm"}),
    "cpu": frozenset(),
}
# Python function name -> the aten op its rule is registered for (where the names differ)
ATEN = {"__matmul__": "matmul", "__rmatmul__": "matmul", "__pow__": "pow.Tensor_Scalar",
        "__rpow__": "pow.Scalar", "pow": "pow.Tensor_Scalar", "vecdot": "linalg_vecdot",
        "conv_transpose2d": "conv_transpose2d.input", "conv_transpose3d": "conv_transpose3d.input",
        "softmax": "softmax.int", "log_softmax": "log_softmax.int", "vector_norm": "linalg_vector_norm",
        "cross_entropy": "cross_entropy_loss"}  # fmt: skip
# Rules on ops that are compositions on a device (no Autocast kernel of their own there)
COMPOSITE = {"cuda": frozenset({"cross_entropy"}), "cpu": frozenset()}


_ACTIVE: list[Autocast] = []  # the Autocasts entered, innermost last: what a meta region toggles


class _MetaRegion:
    """`torch.autocast("meta", enabled=...)` while meta_regions() is on: the innermost active Autocast
    (none: nothing to do) enabled or not for the region's body, as autocast on the device would be."""

    def __init__(self, dtype=None, enabled: bool = True, cache_enabled=None) -> None:  # torch.autocast's
        self.dtype, self.enabled = dtype, enabled
        self.before: tuple | None = None

    def __enter__(self):
        if _ACTIVE:
            active = _ACTIVE[-1]
            self.before = (active, active.enabled, active.dtype)
            active.enabled = self.enabled
            active.dtype = self.dtype or active.dtype
        return self

    def __exit__(self, *exc) -> None:
        if self.before is not None:
            active, active.enabled, active.dtype = self.before


@contextlib.contextmanager
def meta_regions():
    """Inside it, `torch.autocast(device_type="meta", ...)` (and torch.amp.autocast's) is a _MetaRegion:
    torch refuses "meta" as an autocast device type (RuntimeError: unsupported scalarType), and
    transformers 4.x's rotary embeddings open `torch.autocast(device_type=x.device.type,
    enabled=False)` to compute in float32, x on the meta device where invact plans. Other device
    types get torch's own autocast."""
    real = torch.autocast

    def autocast(device_type, *args, **kwargs):
        return _MetaRegion(*args, **kwargs) if device_type == "meta" else real(device_type, *args, **kwargs)

    owners = (torch, torch.amp)
    originals = [owner.autocast for owner in owners]
    for owner in owners:
        owner.autocast = autocast
    try:
        yield
    finally:
        for owner, original in zip(owners, originals, strict=True):
            owner.autocast = original


class Autocast(TorchFunctionMode):
    """torch.autocast(device, dtype) on meta tensors while `enabled` (see the module docstring)."""

    def __init__(self, device: str, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.device, self.dtype = device, dtype
        self.lower, self.fp32, self.fp32_dtype = LOWER[device], FP32[device], FP32_DTYPE[device]
        self.enabled = False
        self.cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._patched: contextlib.ExitStack | None = None

    def _cast(self, value, dtype: torch.dtype):
        if isinstance(value, torch.Tensor):
            if not value.is_floating_point() or value.dtype == dtype:
                return value
            if dtype is self.dtype and value.dtype == torch.float32 and value.is_leaf and value.requires_grad:
                key = id(value)
                if key not in self.cache:
                    self.cache[key] = (
                        value,
                        value.to(dtype),
                    )  # the weight kept with it: its id stays its own
                return self.cache[key][1]
            return value.to(dtype)
        if isinstance(value, (list, tuple)):
            return type(value)(self._cast(v, dtype) for v in value)
        return value

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.enabled:
            name = getattr(func, "__name__", None)
            if name in self.lower:
                args, kwargs = (
                    self._cast(args, self.dtype),
                    {k: self._cast(v, self.dtype) for k, v in kwargs.items()},
                )
            elif name in self.fp32:
                args = self._cast(args, torch.float32)
                kwargs = {k: self._cast(v, torch.float32) for k, v in kwargs.items()}
            elif name in self.fp32_dtype and kwargs.get("dtype") is None and args:
                first = args[0]
                if isinstance(first, torch.Tensor) and first.is_floating_point():
                    kwargs = {**kwargs, "dtype": torch.float32}
        return func(*args, **kwargs)

    # -- the autocast state invact's ops and transformers read
    def _is_enabled(self, original):
        def is_autocast_enabled(device_type=None):
            if device_type == "meta":
                return self.enabled
            if device_type is None:  # torch's no-argument form asks about CUDA (PEFT's LoRA layers ask it)
                return self.enabled if self.device == "cuda" else original()
            return original(device_type)

        return is_autocast_enabled

    def _get_dtype(self, original):
        def get_autocast_dtype(device_type):
            return self.dtype if device_type == "meta" else original(device_type)

        return get_autocast_dtype

    def _any(self, original):
        def any_enabled():
            return self.enabled or original()

        return any_enabled

    def __enter__(self):
        import invact.mlp as mlp
        from invact.norm import op as norm_op

        stack = contextlib.ExitStack()
        for owner, name, wrap in ((torch, "is_autocast_enabled", self._is_enabled),
                                  (torch, "get_autocast_dtype", self._get_dtype),
                                  (mlp, "_any_autocast", self._any)):  # fmt: skip
            original = getattr(owner, name)
            setattr(owner, name, wrap(original))
            stack.callback(setattr, owner, name, original)
        # invact.norm keeps the dtype F.layer_norm computes in per device type: meta's is this one's
        for key in [k for k in norm_op._AUTOCAST_LAYER_NORM if k[0] == "meta"]:
            del norm_op._AUTOCAST_LAYER_NORM[key]
        stack.callback(self._forget_layer_norm, norm_op)
        self._patched = stack
        _ACTIVE.append(self)
        stack.callback(_ACTIVE.remove, self)
        return super().__enter__()

    @staticmethod
    def _forget_layer_norm(norm_op) -> None:
        for key in [k for k in norm_op._AUTOCAST_LAYER_NORM if k[0] == "meta"]:
            del norm_op._AUTOCAST_LAYER_NORM[key]

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self.enabled = False
            self.cache.clear()
            if self._patched is not None:
                self._patched.close()
                self._patched = None

    @contextlib.contextmanager
    def region(self):
        """An autocast region (`with torch.autocast(...)`): enabled inside, its cast cache cleared on exit."""
        before, cache = self.enabled, self.cache
        self.enabled, self.cache = True, {}
        try:
            yield
        finally:
            self.enabled, self.cache = before, cache

    def contexts(self):
        """torch.utils.checkpoint's context_fn: (the forward's context, the recompute's: a region)."""
        return contextlib.nullcontext(), self.region()
