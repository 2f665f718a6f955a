"""What an op returns on the meta device, remembered by its arguments' shapes: invact plan runs a model's
step on the meta device (shapes, no values), where many of torch's meta kernels are Python (torch._refs,
torch._prims): measured on a 2-core Intel Xeon, torch 2.13, an elementwise mul of two meta tensors took
171 us, logaddexp 2.2 ms, one foreach op of AdamW over 146 tensors 20 to 35 ms, against 23 us for a
matmul's C++ meta kernel. A step repeats the same ops on the same shapes in every layer, and a search
over sequence lengths repeats whole steps: MetaOutputs runs each op once per distinct signature and
then builds fresh outputs of the same shapes, strides and dtypes (torch.empty_strided), which is what
the meta kernel would return.

Which calls it answers from memory: those whose tensors are all on the meta device, whose other
arguments are plain values (numbers, dtypes, devices, None, strings, and lists and tuples of these),
and whose op returns fresh tensors that alias nothing (no alias annotation in the op's schema, no
mutated argument, no output in an input's storage: aten._unsafe_view's schema has no annotation) each
in a storage of its own, just large enough for its shape and strides. An
in-place op that changes no metadata (`inplace`: named with a trailing underscore, it writes its first
argument, a tensor or tensor list, and is not torch.Tag.inplace_view: mul_, AdamW's _foreach_addcdiv_)
returns its first argument, or nothing, once its signature has run once. Any other
call, and any call that raised, runs the op itself every time.
"""

from __future__ import annotations

import torch

from invact.planner.as_on_device import tensors_in

_PLAIN = (bool, int, float, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


def inplace(func) -> bool:
    """Whether the op `func` (an OpOverload) is an in-place op by its schema: aten names them with a
    trailing underscore, and their first argument, a Tensor or Tensor[], is written (`Tensor(a!)`).
    torch.Tag.inplace says the same from torch 2.13 on (absent before); the schema is read on every
    torch, and tests/invact/test_meta_outputs.py checks it against the tag where the tag exists."""
    schema = func._schema
    first = schema.arguments[0] if schema.arguments else None
    return bool(
        schema.name.endswith("_")
        and first is not None
        and str(first.type) in ("Tensor", "List[Tensor]")
        and first.alias_info is not None
        and first.alias_info.is_write
    )


class _NoKey(Exception):
    """An argument or output this memory does not describe."""


def _key(value):
    if isinstance(value, torch.Tensor):
        if not value.is_meta:
            raise _NoKey
        return (value.shape, value.stride(), value.dtype, value.storage_offset())
    if isinstance(value, (list, tuple)):
        return (type(value), tuple(_key(v) for v in value))
    if isinstance(value, _PLAIN):
        return (type(value), value)  # True and 1 are equal keys otherwise
    raise _NoKey


def _fresh_storage_bytes(t: torch.Tensor) -> int:
    """The bytes of the smallest storage that holds t at offset 0."""
    if t.numel() == 0:
        return 0
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    return (last + 1) * t.element_size()


def _template(value, storages: set):
    if isinstance(value, torch.Tensor):
        storage = value.untyped_storage()
        fresh = value.storage_offset() == 0 and storage.nbytes() == _fresh_storage_bytes(value)
        if not value.is_meta or not fresh or storage._cdata in storages:
            raise _NoKey
        storages.add(storage._cdata)
        return (torch.Tensor, value.shape, value.stride(), value.dtype)
    if isinstance(value, (list, tuple)):
        return (type(value), tuple(_template(v, storages) for v in value))
    if isinstance(value, _PLAIN):
        return (object, value)
    raise _NoKey


def _build(template):
    kind = template[0]
    if kind is torch.Tensor:
        return torch.empty_strided(template[1], template[2], dtype=template[3], device="meta")
    if kind is object:
        return template[1]
    return kind(_build(t) for t in template[1])


class MetaOutputs:
    """Calls ops as a TorchDispatchMode would (`outputs(func, args, kwargs)`), remembering the outputs'
    shapes per signature (the module docstring says which calls)."""

    def __init__(self) -> None:
        self.known: dict = {}  # (func, key of args, key of kwargs) -> template, or _INPLACE
        self.kinds: dict = {}  # func -> "fresh", "inplace" or None
        self.hits = self.calls = 0

    def _kind(self, func) -> str | None:
        kind = self.kinds.get(func, False)
        if kind is False:
            schema, tags = func._schema, func.tags
            if inplace(func) and torch.Tag.inplace_view not in tags and len(schema.returns) <= 1:
                kind = "inplace"
            elif schema.is_mutable or any(r.alias_info is not None for r in schema.returns):
                kind = None  # out= variants, views, metadata changes: always run
            else:
                kind = "fresh"
            self.kinds[func] = kind
        return kind

    def __call__(self, func, args, kwargs):
        self.calls += 1
        kind = self._kind(func)
        if kind is None:
            return func(*args, **kwargs)
        try:
            key = (func, _key(args), _key(tuple(kwargs.items())) if kwargs else None)
        except _NoKey:
            return func(*args, **kwargs)
        template = self.known.get(key)
        if template is not None:
            self.hits += 1
            if kind == "inplace":
                return args[0] if func._schema.returns else None
            return _build(template)
        out = func(*args, **kwargs)
        if kind == "inplace":
            self.known[key] = True
            return out
        # the inputs' storages: an output in one is a view whatever the schema says (_unsafe_view's)
        inputs = {t.untyped_storage()._cdata for t in tensors_in((args, kwargs))}
        try:
            self.known[key] = _template(out, inputs)
        except _NoKey:
            pass
        return out
