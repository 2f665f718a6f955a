"""A forward on the meta device as on a device, for what meta tensors cannot do by themselves
(`values_as_on_device`): transformers' check for packed sequences is answered as for position ids a
model builds from input_ids alone (None), F.scaled_dot_product_attention runs the kernel torch picks
on CPU for the same shapes, dtype, mask and dropout (on meta it would always take the math path, which
saves the attention probabilities: batch x heads x seq x seq), and CPU tensors whose values the forward
reads (token ids, image grids) meet the meta ones as meta twins of their storages (_AsOnDevice).
`tensors_in(value)`: the tensors an output or an op's arguments hold."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from invact.planner.autocast import meta_regions


@contextlib.contextmanager
def values_as_on_device() -> Iterator[set[str]]:
    """While the meta forward runs: answer what transformers reads from tensor values as a real
    forward of these inputs would (CPU inputs meet meta tensors as meta twins: _AsOnDevice), and run
    F.scaled_dot_product_attention with the kernel torch picks on CPU. Yields the set of kernels used
    ("flash", "math", ...)."""
    kernels: set[str] = set()
    try:
        import transformers.masking_utils as masking
    except ImportError:  # pragma: no cover - transformers too old for the shared mask code
        masking = None
    original = getattr(masking, "find_packed_sequence_indices", None)

    def find_packed_sequence_indices(position_ids, *args, **kwargs):
        # The model builds position ids 0..seq-1 in every row from input_ids alone: one sequence per
        # row, for which transformers returns None. Meta tensors cannot say so.
        if position_ids.is_meta:
            return None
        return original(position_ids, *args, **kwargs)

    if original is not None:
        masking.find_packed_sequence_indices = find_packed_sequence_indices
    try:
        with _AsOnDevice(kernels), meta_regions():
            yield kernels
    finally:
        if original is not None:
            masking.find_packed_sequence_indices = original


def _sdpa_arguments(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                    enable_gqa=False):  # fmt: skip
    return query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa


def _stand_in(t: torch.Tensor, keep: tuple[int, ...] = (-3, -1)) -> torch.Tensor:
    """A small CPU tensor like t for torch's kernel choice: its dtype, the dimensions `keep` (a query's,
    key's or value's head count and head size, dims -3 and -1; a mask's head count alone: its last two
    dimensions broadcast over the stand-ins' one query and one key), every other dimension 1."""
    shape = [1] * t.dim()
    for dim in keep:
        if t.dim() >= -dim:
            shape[dim] = t.shape[dim]
    return torch.zeros(shape, dtype=t.dtype).requires_grad_(t.requires_grad and t.is_floating_point())


def tensors_in(output) -> list[torch.Tensor]:
    """The tensors `output` holds (a model's output, an op's arguments): itself, or in its mappings (a
    ModelOutput is one), lists and tuples. Other objects are not looked into (invact.loss's
    PendingLogits would compute its logits)."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, Mapping):
        return [t for v in output.values() for t in tensors_in(v)]
    if isinstance(output, (list, tuple)):
        return [t for v in output for t in tensors_in(v)]
    return []


def _replaced(value, replace):
    """value with each tensor t in it (as tensors_in finds them) replaced by replace(t)."""
    if isinstance(value, torch.Tensor):
        return replace(value)
    if isinstance(value, (list, tuple)):
        items = [_replaced(item, replace) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, dict):
        return {key: _replaced(item, replace) for key, item in value.items()}
    return value


_INDEXING = (torch.Tensor.__getitem__, torch.Tensor.__setitem__)


def _is_mask(t) -> bool:
    return isinstance(t, torch.Tensor) and t.is_cpu and t.dtype == torch.bool and t.dim() > 0


# Tensor methods that write into their first argument (besides those named with a trailing "_")
_IN_PLACE = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
                       "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__",
                       "__irshift__"})  # fmt: skip


def _writes(func) -> bool:
    name = getattr(func, "__name__", "")
    return name in _IN_PLACE or (name.endswith("_") and not name.startswith("__"))


class _AsOnDevice(TorchFunctionMode):
    """The meta forward as on a device, for what meta tensors cannot do by themselves:

    - F.scaled_dot_product_attention on meta tensors: the fused CPU flash kernel where torch picks it
      on CPU for these dtypes, head sizes, mask and dropout (its saved q, k, v, output and logsumexp
      are what CUDA's flash kernel saves too; a boolean mask becomes the additive mask in q's dtype
      that F.scaled_dot_product_attention makes of it and the kernel saves); the math path
      otherwise. Records the kernel in `kernels`.
    - CPU tensors (the inputs whose values the forward reads, and what it computes from them alone)
      keep their values: `.to()` towards the meta device leaves them on CPU, and where one meets a
      meta tensor in an op it takes part as its meta twin, a meta tensor of the same dtype, shape,
      strides and offset into a meta storage of its storage's size, one per storage (a storage saved
      twice, or through two views, counts once), as it would be on the device. Zero-dimensional CPU
      tensors take part as they are (torch mixes them with any device's). A CPU storage an op has
      written a meta value into no longer has values: it takes part as its twin from then on. A CPU
      boolean mask indexing a meta tensor is taken as the indices of its True elements
      (_masks_as_indices)."""

    def __init__(self, kernels: set[str]) -> None:
        super().__init__()
        self.kernels = kernels
        self.twins: dict[int, tuple[torch.UntypedStorage, torch.Tensor]] = {}  # CPU storage -> twin's
        self.written: set[int] = set()  # CPU storages an op wrote a meta value into
        self.indices: dict[tuple, tuple] = {}  # a CPU boolean mask -> (the indices of its True elements, it)

    def _twin(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage._cdata
        if key not in self.twins:  # the CPU tensor kept beside it: its storage's identity stays its own
            twin = torch.empty(storage.nbytes(), dtype=torch.uint8, device="meta").untyped_storage()
            self.twins[key] = (twin, t)
        twin = torch.empty(0, dtype=t.dtype, device="meta")
        return twin.set_(self.twins[key][0], t.storage_offset(), t.size(), t.stride())

    def _masks_as_indices(self, index):
        """An index with each CPU boolean mask in it as the indices of its True elements (one int64
        tensor per dimension of the mask, computed on CPU once per mask storage): the same elements, in
        a form a meta tensor can be indexed with (its own nonzero has no values to count). Autograd then
        keeps those indices where a real forward keeps the mask: 8 bytes per dimension of the mask and
        selected element for its one byte per element (Qwen3-VL's deepstack: the image tokens' rows of
        the hidden states)."""

        def indices(mask: torch.Tensor) -> tuple:
            key = mask.untyped_storage()._cdata, mask.storage_offset(), mask.shape, mask.stride()
            if key not in self.indices:
                # the mask kept beside them: its key stays its own
                self.indices[key] = (mask.nonzero(as_tuple=True), mask)
            return self.indices[key][0]

        if _is_mask(index):
            return indices(index)
        if isinstance(index, tuple) and any(_is_mask(item) for item in index):
            return tuple(i for item in index for i in (indices(item) if _is_mask(item) else (item,)))
        return index

    def _meets_meta(self, t: torch.Tensor) -> bool:
        return t.is_cpu and (t.dim() > 0 or t.untyped_storage()._cdata in self.written)

    def _as_on_device(self, func, args, kwargs):
        """(args, kwargs) with the CPU tensors that meet a meta tensor as their twins; None where none do."""
        if func in _INDEXING and len(args) > 1 and isinstance(args[0], torch.Tensor) and args[0].is_meta:
            args = (args[0], self._masks_as_indices(args[1]), *args[2:])
        flat = list(tensors_in((args, kwargs)))
        cpu = [t for t in flat if t.is_cpu]
        if not cpu:
            return None
        written = any(t.untyped_storage()._cdata in self.written for t in cpu)
        if not written and not any(t.is_meta for t in flat):
            return None
        first = args[0] if args else None
        if isinstance(first, torch.Tensor) and first.is_cpu and _writes(func):
            self.written.add(first.untyped_storage()._cdata)
        return _replaced((args, kwargs), lambda t: self._twin(t) if self._meets_meta(t) else t)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.to and args and isinstance(args[0], torch.Tensor) and args[0].is_cpu:
            if args[0].untyped_storage()._cdata not in self.written:
                out = func(*args, **kwargs)
                # towards the meta device (no data is copied there): the values stay on CPU, in out's dtype
                return args[0].to(out.dtype) if out.is_meta else out
        twins = self._as_on_device(func, args, kwargs)
        if twins is not None:
            args, kwargs = twins
        if func in _GROUPED_MM and _meta_float32_grouped(*args, **kwargs):
            return _MetaGroupedMM.apply(args[0], args[1])
        if func is not F.scaled_dot_product_attention or not args or not args[0].is_meta:
            return func(*args, **kwargs)
        q, k, v, mask, dropout, causal, scale, gqa = _sdpa_arguments(*args, **kwargs)
        with torch.enable_grad():
            choice = torch._fused_sdp_choice(
                _stand_in(q), _stand_in(k), _stand_in(v), None if mask is None else _stand_in(mask, (-3,)),
                dropout, causal, scale=scale, enable_gqa=gqa,
            )  # fmt: skip
        if choice == torch.nn.attention.SDPBackend.FLASH_ATTENTION.value:
            self.kernels.add("flash")
            if mask is not None and mask.dtype == torch.bool:
                # as F.scaled_dot_product_attention does before its kernels: an additive mask in q's dtype
                # (0 where True, -inf where False), the tensor the kernel saves
                mask = torch.zeros_like(mask, dtype=q.dtype)
            flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
            return flash(q, k, v, dropout, causal, attn_mask=mask, scale=scale)[0]
        self.kernels.add("math" if choice == torch.nn.attention.SDPBackend.MATH.value else str(choice))
        return func(*args, **kwargs)


_GROUPED_MM = tuple(f for f in (getattr(F, "grouped_mm", None), getattr(torch, "_grouped_mm", None)) if f)


def _meta_float32_grouped(a=None, b=None, *args, **kwargs) -> bool:
    """A grouped matmul of float32 meta tensors, (tokens, in) by (experts, in, out), as transformers'
    MoE experts run it with float32 weights (mixed precision: grouped_mm has no autocast rule), whose
    meta kernel takes bf16 alone."""
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.is_meta and b.is_meta
            and a.dtype == b.dtype == torch.float32 and a.dim() == 2 and b.dim() == 3)  # fmt: skip


class _MetaGroupedMM(torch.autograd.Function):
    """A float32 grouped matmul on the meta device, shapes only: its output (tokens, out), both inputs
    kept for backward, their gradients allocated there, as the CPU and CUDA kernels' autograd does."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a.new_empty(a.shape[0], b.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        return torch.empty_like(a), torch.empty_like(b)
