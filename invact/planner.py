"""`plan_memory(config, batch, seq, dtype)`: the bytes one training forward of a transformers model saves
for backward, eager and after `invact.patch()`, measured on the meta device: the model is built from
its config with shapes only (no weights, no activations, nothing allocated, nothing downloaded) and
one forward runs under invact.memory's saved-tensor counter, whose figures are those of a real
forward (each storage once, parameters and buffers excluded). The engine of `invact plan`
(invact/cli.py).

Each saved storage is attributed to the module whose forward was running when it was first saved (a
stack kept by forward pre/post hooks), grouped by kind: attention, MLP activations, gated products
act(g) * u, the rest of the MLP, norms, other; an activation's output counts with the activation
wherever it is saved (in eager mode the multiply or the next Linear saves it, not the activation).
What a vision-language model's vision tower and its projector save counts under the same kinds,
prefixed "vision_", beside the language model's.
Inside a module patch() hooks for gated products (invact.mlp.gated) the tensors reach the counter only
when the module returns; a saved-tensor hook stacked above the gated one on each module inside
notes where each was saved, so they are attributed as eager ones are.

Models: a config with a vision tower (vision_config) builds its image-text-to-text class (the
*ForConditionalGeneration with the LM head), an encoder-decoder its sequence-to-sequence LM, others
their causal LM, else the base model. With images (`images` per sample, the default 1 where the
planner builds the model's image inputs), the batch carries pixel values at the tower's image size
(Qwen2-VL-style towers, which take any size: DEFAULT_IMAGE_SIDE square), and the images' tokens take
their part of `seq` (image_inputs).

Meta tensors hold no values, so what reads them is answered as a real forward of these inputs
would: transformers' check for packed sequences (position ids that restart inside a row) is None,
as for the position ids a model builds from input_ids alone; and F.scaled_dot_product_attention
runs the kernel torch picks on CPU for the same shapes, dtype, mask and dropout (on meta it would
always take the math path, which saves the attention probabilities: batch x heads x seq x seq).
With images, the integer inputs whose values the forward reads (the token ids, where the image
tokens are; Qwen's image grids and token types; Idefics3's pixels, whose all-zero images are
padding) are real CPU tensors: the forward computes on them as a real one does, and a CPU tensor
meets the meta ones as a meta twin of its storage (one per storage, so a storage saved twice counts
once), what it would be on the device.
Imports transformers only when called.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

import invact
from invact import kinds
from invact._autocast import meta_regions
from invact.activation import REPLACEABLE, SKIPPED, _is_activation_like
from invact.activation.modules import InvAct
from invact.loss import output_head
from invact.memory import count_saved
from invact.mlp.gated import multiply
from invact.plan_options import DEFAULT_IMAGE_SIDE, DTYPE_NAMES

# dtype names the planner takes -> torch dtype
DTYPES: dict[str, torch.dtype] = {name: getattr(torch, dtype) for name, dtype in DTYPE_NAMES.items()}

# kind -> label, in the order reports list them
KINDS: dict[str, str] = {
    "attention": "attention",
    "mlp_activations": "MLP activations",
    "gated_products": "gated products act(g)*u",
    "mlp_other": "MLP, other (linear inputs, u)",
    "norms": "norms",
    "head_loss": "head and loss (logits, log-softmax)",
    "other": "other (embeddings, residuals)",
    "vision_attention": "vision: attention",
    "vision_mlp_activations": "vision: MLP activations",
    "vision_gated_products": "vision: gated products act(g)*u",
    "vision_mlp_other": "vision: MLP, other",
    "vision_norms": "vision: norms",
    "vision_other": "vision: other (patches, merger, projector)",
}
# The kinds of what the vision tower and the projector into the language model save: each a text
# kind's (the head and loss excepted) under this prefix.
VISION = "vision_"


_NORM = re.compile(r"norm", re.IGNORECASE)
_ATTENTION = re.compile(r"attention|attn", re.IGNORECASE)
_MLP = re.compile(r"mlp|feed_?forward|ffn", re.IGNORECASE)
# The attribute names under which transformers' vision-language models hold their vision tower and the
# projector of its features into the language model (Qwen2-VL's visual, LLaVA's and Gemma 3's
# vision_tower and multi_modal_projector, Idefics3's vision_model and connector, ...).
_VISION_NAMES = re.compile(
    r"visual|vision_tower|vision_model|vision_encoder|image_encoder|vision_embed_tokens|"
    r"multi_modal_projector|mm_projector|connector|vision_projection|visual_projection"
)


class PlanError(ValueError):
    """Input the planner cannot take (a missing or invalid config file, a config transformers cannot
    build, a bad batch, seq or dtype); its message is one line."""


def _one_line(error: BaseException, limit: int = 240) -> str:
    """An exception's message on one line, cut at `limit` characters (transformers lists every model
    type in some messages)."""
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """A DTYPES name (or a torch dtype among them) as a torch dtype; PlanError otherwise."""
    if isinstance(name, torch.dtype) and name in DTYPES.values():
        return name
    if isinstance(name, str) and name.lower().removeprefix("torch.") in DTYPES:
        return DTYPES[name.lower().removeprefix("torch.")]
    raise PlanError(f"unknown dtype {name!r} (choose from {', '.join(DTYPES)})")


def read_config(path: str | os.PathLike) -> dict:
    """The dict of a Hugging Face config JSON file (or of `config.json` in a folder); PlanError for a
    missing or unreadable file or invalid JSON."""
    file = Path(path)
    if file.is_dir():
        file = file / "config.json"
    if not file.exists():
        raise PlanError(f"{file}: no such file")
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise PlanError(f"{file}: cannot read it: {_one_line(e)}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise PlanError(f"{file}: not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    if not isinstance(data, dict):
        raise PlanError(f"{file}: a config is a JSON object, got {type(data).__name__}")
    return data


def build_config(data: dict):
    """A transformers config from a config dict (its `model_type` picks the class); PlanError where
    transformers cannot build one."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    data = dict(data)
    model_type = data.pop("model_type", None)
    if not isinstance(model_type, str):
        raise PlanError("the config has no model_type: transformers cannot tell which model it describes")
    if model_type not in CONFIG_MAPPING:
        raise PlanError(f"transformers cannot build a config of model_type {model_type!r}: it knows no such "
                        "model type (remote code is not run)")  # fmt: skip
    try:
        return AutoConfig.for_model(model_type, **data)
    except Exception as e:  # transformers raises ValueError, TypeError, KeyError... for bad fields
        raise PlanError(f"transformers cannot build a {model_type!r} config: {_one_line(e)}") from None


def load_config(config) -> tuple:
    """(the transformers config of `config`: a config object, a config dict, or the path of a config
    JSON file or of a folder holding config.json; the path as given, or None)."""
    path = None
    if isinstance(config, (str, os.PathLike)):
        path = str(config)
        config = read_config(config)
    if isinstance(config, dict):
        config = build_config(config)
    return config, path


def _auto_classes(config) -> list:
    """The transformers auto classes build_model tries, in order: the image-text-to-text class for a
    config with a vision tower, the sequence-to-sequence LM for an encoder-decoder (the class with the
    LM head, so the head and the loss are in the plan), then the causal LM, then the base model."""
    import transformers

    autos = []
    if getattr(config, "vision_config", None) is not None:
        autos.append(transformers.AutoModelForImageTextToText)
    if getattr(config, "is_encoder_decoder", False):
        autos.append(transformers.AutoModelForSeq2SeqLM)
    return [*autos, transformers.AutoModelForCausalLM, transformers.AutoModel]


def build_model(config, dtype: torch.dtype) -> tuple[nn.Module, str]:
    """(the model of `config` with its LM head: its image-text-to-text class where it has a vision
    tower, its sequence-to-sequence LM where it is an encoder-decoder, else its causal LM, else its base
    model; on the meta device in `dtype`; the attention implementation: "sdpa", or "eager" where the
    model has no SDPA path). Remote code is never run or fetched. PlanError where transformers cannot
    build it."""
    failure = None
    for auto in _auto_classes(config):
        for attention in ("sdpa", "eager"):
            try:
                with torch.device("meta"):
                    model = auto.from_config(config, dtype=dtype, attn_implementation=attention,
                                             trust_remote_code=False)  # fmt: skip
                return model, attention
            except Exception as e:  # transformers raises ValueError, also others from model code
                if attention == "sdpa" and "scaled_dot_product_attention" in str(e):
                    continue  # this model has no SDPA path: its eager attention
                if failure is None or "Unrecognized configuration class" not in str(e):
                    failure = e  # the reason, rather than "no such auto class" where there is one
                break  # not this auto class (no causal LM for this config), or it cannot be built
    raise PlanError(f"transformers cannot build a model from this config: {_one_line(failure)}")


@contextlib.contextmanager
def _values_as_on_device() -> Iterator[set[str]]:
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


def _tensors(value) -> Iterator[torch.Tensor]:
    """The tensors in an op's arguments: value itself, or inside its lists, tuples and dicts."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _replaced(value, replace):
    """value with each tensor t in it (as _tensors finds them) replaced by replace(t)."""
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
        flat = list(_tensors((args, kwargs)))
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


def _own_kinds(model: nn.Module) -> dict[nn.Module, str]:
    """module -> the kind of what is saved while it runs (innermost module with a kind wins): an
    activation's, a norm's, an attention's, an MLP's (by class name, or as an activation's parent)."""
    kinds: dict[nn.Module, str] = {}
    parents: dict[int, list[nn.Module]] = {}
    for parent in model.modules():
        for child in parent.children():
            parents.setdefault(id(child), []).append(parent)
    for module in model.modules():
        cls = type(module).__name__
        if _is_activation(module):
            kinds[module] = "mlp_activations"
            for parent in parents.get(id(module), []):
                kinds.setdefault(parent, "mlp_other")
        elif _NORM.search(cls):
            kinds[module] = "norms"
        elif _ATTENTION.search(cls):
            kinds[module] = "attention"
        elif _MLP.search(cls):
            kinds.setdefault(module, "mlp_other")
    head = output_head(model)
    if head is not None:
        kinds[head] = "head_loss"
    return kinds


def _vision_modules(model: nn.Module) -> set[nn.Module]:
    """The modules of `model`'s vision tower and of the projector of its features into the language
    model, each with every module inside: those held under _VISION_NAMES, and any holding a config of
    the model's vision_config's class. Empty for a model without a vision_config."""
    vision_config = getattr(getattr(model, "config", None), "vision_config", None)
    if vision_config is None:
        return set()
    roots = [
        module
        for name, module in model.named_modules()
        if module is not model
        and (
            _VISION_NAMES.fullmatch(name.rsplit(".", 1)[-1])
            or isinstance(getattr(module, "config", None), type(vision_config))
        )
    ]
    return {inner for root in roots for inner in root.modules()}


def _is_activation(module: nn.Module) -> bool:
    qualname = kinds.qualname(module)
    return (
        isinstance(module, InvAct)
        or qualname in REPLACEABLE
        or qualname in SKIPPED
        or _is_activation_like(module)
    )


class _Attributed(count_saved):
    """count_saved that also attributes each counted storage to a kind (KINDS) by where it was first
    saved, a vision kind where that is inside the vision tower or its projector (an activation's
    output and a gated product where their activation is). Forward hooks on every module keep the
    stack of modules running. Where a module's saved-tensor hooks are not this counter's
    (invact.mlp.gated's, which hand tensors over at the hooked module's return), each module inside
    stacks a hook above them that notes where each tensor was saved and passes it on."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.kinds = _own_kinds(model)
        self.stack: list[nn.Module] = []
        self.pushed: list[object] = []  # per running module: the hooks it stacked, or None
        self.top_before: list[object] = []  # per running module: the saved-tensor hooks at its call
        self.kind_of: dict[int, str] = {}  # storage identity -> kind, for counted storages
        self.notes: dict[int, str] = {}  # the same, noted inside a gated module until it returns
        # id -> (the autograd node of an activation's output, the activation module)
        self.activation_nodes: dict[int, tuple] = {}
        self.vision = _vision_modules(model)
        self.model = model
        self.after_head = False  # the head has run: what the model itself saves next is its loss's
        self.handles = []
        for module in model.modules():
            self.handles += [
                module.register_forward_pre_hook(self._before, prepend=True),
                module.register_forward_pre_hook(self._enter),
                module.register_forward_hook(self._leave, always_call=True),
            ]
            if self.kinds.get(module) == "mlp_activations":
                self.handles.append(module.register_forward_hook(self._activation_output))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    @staticmethod
    def _top():
        return torch._C._autograd._top_saved_tensors_default_hooks(False)

    def _observing(self, top) -> bool:
        return top is not None and top[0] == self._pack

    def _before(self, module, args) -> None:  # runs before every other pre-hook of the module
        self.top_before.append(self._top())

    def _enter(self, module, args) -> None:  # runs after the module's other pre-hooks (invact.mlp.gated's)
        self.stack.append(module)
        before, top = self.top_before[-1], self._top()
        hooks = None
        if top is not None and top == before and not self._observing(top):
            pack = getattr(top[0], "inner", top[0])  # an enclosing module's note: the hook it notes for
            hooks = torch.autograd.graph.saved_tensors_hooks(self._noting(pack), top[1])
            hooks.__enter__()
        self.pushed.append(hooks)

    def _leave(self, module, args, output) -> None:  # after the module's other forward hooks
        hooks = self.pushed.pop()
        if hooks is not None:
            hooks.__exit__(None, None, None)
        self.top_before.pop()
        self.stack.pop()
        if self.kinds.get(module) == "head_loss":
            self.after_head = True
        if self._observing(self._top()):  # no gated module runs: what was noted has reached the counter
            self.notes.clear()

    def _activation_output(self, module, args, output) -> None:
        if isinstance(output, torch.Tensor) and output.grad_fn is not None:
            self.activation_nodes[id(output.grad_fn)] = (output.grad_fn, module)

    def _where(self, kind: str, module: nn.Module | None) -> str:
        """kind, as a vision kind where `module` is in the vision tower or its projector."""
        return VISION + kind if module in self.vision else kind

    def _kind(self, t: torch.Tensor) -> str:
        found = multiply(t)
        if found is not None:
            for node in found[1]:
                if id(node) in self.activation_nodes:
                    return self._where("gated_products", self.activation_nodes[id(node)][1])
        base = t if t._base is None else t._base
        if base.grad_fn is not None and id(base.grad_fn) in self.activation_nodes:
            # an activation's output, wherever it is saved
            return self._where("mlp_activations", self.activation_nodes[id(base.grad_fn)][1])
        if self.after_head and self.stack and self.stack[-1] is self.model:
            return "head_loss"  # saved by the model's own forward after its head: the loss
        for module in reversed(self.stack):
            if module in self.kinds:
                return self._where(self.kinds[module], module)
        return self._where("other", self.stack[-1] if self.stack else None)

    def _noting(self, pack):
        def note(t: torch.Tensor):
            kind = self._kind(t)
            # A gated product is not kept (it is recomputed), so its storage may be freed and its
            # identity reused before the module returns: not noted.
            if kind != "gated_products":
                self.notes.setdefault(t.untyped_storage()._cdata, kind)
            return pack(t)

        note.inner = pack
        return note

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if self._counts(t) and storage._cdata not in self.kind_of:
            self.kind_of[storage._cdata] = self.notes.get(storage._cdata) or self._kind(t)
        return super()._pack(t)

    _pack._invact_observer = True

    def by_kind(self) -> dict[str, int]:
        """Bytes per kind of the storages counted (call inside the context: it reads the storages)."""
        totals = dict.fromkeys(KINDS, 0)
        for key, (storage, _) in self._storages.items():
            totals[self.kind_of.get(key, "other")] += storage.nbytes()
        return totals


def _output_tensors(output) -> list[torch.Tensor]:
    """The tensors a model's output holds: itself, or in its mappings (a ModelOutput is one), lists and
    tuples. Other objects are not looked into (invact.loss's PendingLogits would compute its logits)."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, Mapping):
        return [t for v in output.values() for t in _output_tensors(v)]
    if isinstance(output, (list, tuple)):
        return [t for v in output for t in _output_tensors(v)]
    return []


def _forward(model: nn.Module, inputs: dict) -> dict:
    """One training-mode forward on meta inputs under the attributed counter: saved bytes in total and
    per kind, the output's bytes not among them (the logits), and the attention kernels used."""
    counter = _Attributed(model)
    try:
        with _values_as_on_device() as kernels, counter:
            output = model(**inputs)
            by_kind = counter.by_kind()
            saved = set(counter._storages)
            held = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in _output_tensors(output)}
    finally:
        counter.remove()
    if sum(by_kind.values()) != counter.report.saved_bytes:  # the attribution covers every storage once
        raise AssertionError("invact plan: the per-kind bytes do not add up to the saved total")
    return {
        "saved_bytes": counter.report.saved_bytes,
        "saved_storages": counter.report.saved_tensors,
        "by_kind": by_kind,
        "output_bytes": sum(n for key, n in held.items() if key not in saved),
        "kernels": kernels,
    }


def _storage_bytes(tensors) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        seen[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _image_family(model: nn.Module) -> str | None:
    """How `model`'s image inputs are built: "grid" where its forward takes image_grid_thw (Qwen2-VL,
    Qwen2.5-VL: flattened patches of any image size, and each image's (t, h, w) grid of patches),
    "tiles" where it takes pixel_attention_mask (Idefics3, SmolVLM: pixel values (batch, images,
    channels, side, side), each image one tile at the tower's image_size), "fixed" for other forwards
    that take pixel_values (LLaVA, Gemma 3, PaliGemma: (batch x images, channels, side, side) at the
    tower's image_size); None for a model without a vision tower or whose forward takes no pixel_values."""
    if getattr(model.config, "vision_config", None) is None:
        return None
    parameters = inspect.signature(model.forward).parameters
    if "pixel_values" not in parameters:
        return None
    if "image_grid_thw" in parameters:
        return "grid"
    return "tiles" if "pixel_attention_mask" in parameters else "fixed"


def _image_side(model: nn.Module, family: str, image_size: int | None) -> int:
    """The side in pixels of the square images `model` gets: its tower's image_size, or for a grid
    tower (any size) `image_size` or DEFAULT_IMAGE_SIDE, a multiple of its patch x merge size."""
    vision = model.config.vision_config
    if family == "grid":
        side = DEFAULT_IMAGE_SIDE if image_size is None else image_size
        step = vision.patch_size * vision.spatial_merge_size
        if side % step:
            patch, merge = vision.patch_size, vision.spatial_merge_size
            raise PlanError(f"image size {side} is not a multiple of {step} pixels ({patch}-pixel patches "
                            f"merged {merge} x {merge})")  # fmt: skip
        return side
    side = getattr(vision, "image_size", None)
    if not isinstance(side, int):
        raise PlanError(f"{type(model).__name__}'s vision config has no image_size")
    if image_size is not None and image_size != side:
        raise PlanError(f"{type(model).__name__}'s tower takes images of {side} x {side} pixels, not "
                        f"{image_size}")  # fmt: skip
    return side


def _pixels(model: nn.Module, family: str, batch: int, images: int, side: int, dtype: torch.dtype) -> dict:
    """The pixel inputs of `images` images per sample of `batch`, each `side` x `side` (_image_family
    says which). Meta tensors, but for what the forward reads the values of: the image grids (real
    (t, h, w) rows) and Idefics3's pixels and pixel mask (ones: no image is an all-zero padding image,
    no pixel padding), which are CPU tensors."""
    vision = model.config.vision_config
    channels = next((getattr(vision, n) for n in ("num_channels", "in_channels", "in_chans")
                     if isinstance(getattr(vision, n, None), int)), 3)  # fmt: skip
    count = batch * images
    if family == "grid":
        patch, frames, grid = vision.patch_size, vision.temporal_patch_size, side // vision.patch_size
        # an image is one temporal patch: its frame repeated temporal_patch_size times, as the processor does
        return {
            "pixel_values": torch.empty(count * grid * grid, channels * frames * patch * patch, dtype=dtype,
                                        device="meta"),
            "image_grid_thw": torch.tensor([[1, grid, grid]] * count),
        }  # fmt: skip
    if family == "tiles":
        return {
            "pixel_values": torch.ones(batch, images, channels, side, side, dtype=dtype),
            "pixel_attention_mask": torch.ones(batch, images, side, side, dtype=torch.bool),
        }
    return {"pixel_values": torch.empty(count, channels, side, side, dtype=dtype, device="meta")}


def _tokens_per_image(model: nn.Module, family: str, side: int, dtype: torch.dtype) -> int:
    """How many tokens of the language model's sequence one image takes: the rows of the features the
    model's get_image_features gives for one image, run on the meta device (shapes only)."""
    with torch.no_grad(), _values_as_on_device():
        output = model.get_image_features(**_pixels(model, family, 1, 1, side, dtype))
    features = _output_tensors(getattr(output, "pooler_output", output))
    return sum(t.numel() // t.shape[-1] for t in features)


def image_inputs(model: nn.Module, batch: int, seq: int, images: int | None, image_size: int | None,
                 dtype: torch.dtype) -> tuple[dict, dict | None]:  # fmt: skip
    """(the inputs of a training forward of `model` whose samples of `seq` tokens each carry `images`
    images, besides input_ids and labels: pixel values, image grids, token types; a description of the
    images for the report, None for a model without a vision tower).

    `images` None: 1 per sample where the model has a tower whose inputs this builds, else 0 (the
    description's note says why). Each image's tokens (as many as its features have rows) followed by
    one text token (where processors put an end-of-image token or a newline: it parts one image from
    the next) take the start of every sample's `seq`, one image after another; text tokens the rest.
    Token ids other than the image token's are 0: their values change nothing saved. Returned under
    "input_ids": the token ids, a CPU tensor (the forward reads where the image tokens are). Token
    types where the forward takes them: Qwen's mm_token_type_ids and Gemma 3's token_type_ids 1 at
    the image tokens; PaliGemma's token_type_ids 0 there (the images are the prefix) and 1 at the text
    (the suffix, which the loss learns). PlanError for images that cannot be built or do not fit."""
    if images is not None and (isinstance(images, bool) or not isinstance(images, int) or images < 0):
        raise PlanError(f"images must be a non-negative integer, got {images!r}")
    if image_size is not None and (isinstance(image_size, bool) or not isinstance(image_size, int)
                                   or image_size <= 0):  # fmt: skip
        raise PlanError(f"image size must be a positive integer, got {image_size!r}")
    family = _image_family(model)
    name = type(model).__name__
    if family is None:
        if images:
            raise PlanError(f"{name} takes no images (its config has no vision tower, or its forward no "
                            "pixel_values): plan it without --images")  # fmt: skip
        if image_size is not None:
            raise PlanError(f"{name} takes no images: plan it without --image-size")
        return {}, None
    described = {"per_sample": 0, "side": None, "tokens_per_image": 0, "image_tokens": 0, "text_tokens": seq,
                 "note": None}  # fmt: skip
    token = getattr(model.config, "image_token_id", None)
    asked = images is not None or image_size is not None  # else images are the default's: 1 if they can be
    try:
        side = _image_side(model, family, image_size)
        if not isinstance(token, int):
            raise PlanError(f"{name}'s config has no image_token_id: where its image tokens go is unknown")
    except PlanError as e:
        if asked:
            raise
        described["note"] = f"invact plan cannot build image inputs for {name}: {e}"
        return {}, described
    try:
        per_image = _tokens_per_image(model, family, side, dtype)
    except (RuntimeError, NotImplementedError, AttributeError, TypeError, ValueError) as e:
        reason = (f"invact plan cannot build image inputs for {name}: its get_image_features fails: "
                  f"{_one_line(e)}")  # fmt: skip
        if asked:
            raise PlanError(reason) from None
        described["note"] = reason
        return {}, described
    images = 1 if images is None else images
    if not images:
        return {}, described
    tokens = images * per_image
    if tokens + images > seq:
        raise PlanError(f"{images} image(s) of {per_image} tokens, each followed by a text token, take "
                        f"{tokens + images} tokens per sample: more than --seq {seq}")  # fmt: skip
    ids = torch.zeros(batch, seq, dtype=torch.long)
    for start in range(0, images * (per_image + 1), per_image + 1):
        ids[:, start : start + per_image] = token
    is_image = (ids == token).long()
    inputs = {"input_ids": ids, **_pixels(model, family, batch, images, side, dtype)}
    parameters = inspect.signature(model.forward).parameters
    if "mm_token_type_ids" in parameters:
        inputs["mm_token_type_ids"] = is_image
    if "token_type_ids" in parameters:
        inputs["token_type_ids"] = 1 - is_image if "paligemma" in model.config.model_type else is_image
    pixels = inputs["pixel_values"]
    described.update(per_sample=images, side=side, tokens_per_image=per_image, image_tokens=tokens,
                     text_tokens=seq - tokens, pixel_values=list(pixels.shape),
                     pixel_bytes=pixels.numel() * pixels.element_size())  # fmt: skip
    return inputs, described


def training_inputs(model: nn.Module, batch: int, seq: int, images: int | None, image_size: int | None,
                    dtype: torch.dtype, *, labels: bool = True) -> tuple[dict, dict | None]:  # fmt: skip
    """(the keyword inputs of one training forward of `model` on the meta device: input_ids (batch,
    seq), use_cache off, labels = input_ids where the forward takes labels and `labels` is set, the
    images of image_inputs, an encoder-decoder's all-ones masks; image_inputs' description). The
    shapes plan_memory documents."""
    parameters = inspect.signature(model.forward).parameters
    pictured, described = image_inputs(model, batch, seq, images, image_size, dtype)
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    inputs = {"input_ids": ids, **pictured}
    if "use_cache" in parameters:
        inputs["use_cache"] = False
    labels = labels and "labels" in parameters
    if labels:  # input_ids themselves where they are meta; with images a meta tensor beside the CPU ids
        inputs["labels"] = ids
    encoder_decoder = bool(getattr(model.config, "is_encoder_decoder", False))
    if encoder_decoder and not labels and "decoder_input_ids" in parameters:
        inputs["decoder_input_ids"] = ids
    if encoder_decoder:  # all-ones masks, as a tokenizer gives them (on CPU: BART's forward reads them)
        for name in ("attention_mask", "decoder_attention_mask"):
            if name in parameters:
                inputs[name] = torch.ones(batch, seq, dtype=torch.long)
    return inputs, described


def plan_memory(
    config,
    batch: int,
    seq: int,
    dtype: str | torch.dtype = "bfloat16",
    *,
    gated: bool = True,
    norms: bool = True,
    loss: bool = True,
    labels: bool = True,
    images: int | None = None,
    image_size: int | None = None,
) -> dict:
    """What one training forward of input_ids (batch, seq) saves for backward, eager and after
    `invact.patch(model, gated=gated, norms=norms, loss=loss)`, for the transformers model `config`
    describes (a config object, a config dict, or the path of a config JSON file or of a folder
    holding config.json), built on the meta device in `dtype`. Nothing is allocated or downloaded.
    With `labels` (the default) a model whose forward takes labels (a causal LM) gets labels =
    input_ids, so the forward computes its loss, as a training step does, and the head and loss count
    as their own kind; labels=False runs the forward without them (no loss: the logits are the
    output).

    A vision-language model (a config with a vision_config: its *ForConditionalGeneration class is
    built) gets `images` images per sample (default 1 where the planner builds its image inputs, else
    0; 0 plans text only), square, at its tower's image_size, or `image_size` (default
    DEFAULT_IMAGE_SIDE) pixels for a tower that takes any size (Qwen2-VL, Qwen2.5-VL); their tokens
    take the start of each sample's `seq`, the text the rest (image_inputs). What the vision tower
    and its projector save counts under the vision kinds. An encoder-decoder (T5, BART: its
    sequence-to-sequence LM) gets input_ids (batch, seq) for the encoder and labels (batch, seq), from
    which it makes the decoder's inputs (shifted right): the encoder and the decoder both run `seq`
    tokens (with labels=False the decoder gets decoder_input_ids = input_ids); and all-ones
    attention_mask and decoder_attention_mask, as a tokenizer gives them (CPU tensors: BART's decoder
    reads the values of the mask it would otherwise make on the meta device).

    Returns a JSON-ready dict; bytes are ints:
    - eager_saved_bytes, patched_saved_bytes: bytes autograd saves for backward (each storage once,
      parameters and buffers excluded), and change: patched / eager - 1;
    - kinds: [{kind, label, eager_bytes, patched_bytes}] in KINDS order (they add up to the totals);
    - output_bytes: bytes of eager's output not among the saved (the logits, (batch, seq, vocab) in
      dtype; with labels eager returns them beside the loss), patched_output_bytes the same after
      patch() (with labels, the loss alone: patch()'s loss path keeps no logits); input_bytes:
      input_ids (batch, seq) int64, which the embedding saves (so they are in the saved bytes);
    - parameter_bytes: the model's parameters and buffers, each storage once (not in the figures);
    - decisions: patch()'s decisions [{name, class, replace, reason, gated, kind}] (kind "activation",
      "norm" or "loss");
    - attention: {implementation ("sdpa" or "eager"), kernels (SDPA's kernels used: "flash", "math")};
    - model_type, model_class, config (the path, or None), batch, seq, dtype, gated, norms, loss,
      labels (whether labels were passed: also False where the forward takes none);
    - images: images per sample (0 for a model without images); image_inputs: None for a model
      without a vision tower, else {per_sample, side (pixels, square; None without images),
      tokens_per_image, image_tokens and text_tokens (per sample: they add up to seq), note (why
      there are no images by default, or None), and with images pixel_values (its shape) and
      pixel_bytes}; vision_eager_bytes, vision_patched_bytes: the vision kinds' sum;
    - encoder_decoder: whether the model is one (its decoder's sequence is seq tokens too).
    PlanError for input it cannot take."""
    for name, value in (("batch", batch), ("seq", seq)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise PlanError(f"{name} must be a positive integer, got {value!r}")
    torch_dtype = parse_dtype(dtype)
    config, path = load_config(config)
    model, attention = build_model(config, torch_dtype)
    model.train()
    parameters = inspect.signature(model.forward).parameters
    if "input_ids" not in parameters:
        raise PlanError(f"{type(model).__name__}'s forward takes no input_ids: invact plan runs models of "
                        "token ids")  # fmt: skip
    inputs, described = training_inputs(model, batch, seq, images, image_size, torch_dtype, labels=labels)
    labels = "labels" in inputs
    encoder_decoder = bool(getattr(model.config, "is_encoder_decoder", False))
    decisions = invact.plan(model, gated=gated, norms=norms, loss=loss)
    try:
        with torch.enable_grad():
            eager = _forward(model, inputs)
            invact.patch(model, gated=gated, norms=norms, loss=loss)
            patched = _forward(model, inputs)
    except (RuntimeError, NotImplementedError) as e:  # e.g. "Tensor.item() cannot be called on meta tensors"
        raise PlanError(
            f"the forward of {type(model).__name__} cannot run on the meta device (shapes only): "
            f"{_one_line(e)}"
        ) from None
    except (AttributeError, KeyError, TypeError, ValueError, IndexError) as e:  # e.g. a config lacks a field
        raise PlanError(f"the forward of {type(model).__name__} fails on these inputs: "
                        f"{type(e).__name__}: {_one_line(e)}") from None  # fmt: skip
    return {
        "config": path,
        "model_type": getattr(config, "model_type", None),
        "model_class": type(model).__name__,
        "batch": batch,
        "seq": seq,
        "dtype": str(torch_dtype).removeprefix("torch."),
        "gated": gated,
        "norms": norms,
        "loss": loss,
        "labels": labels,
        "eager_saved_bytes": eager["saved_bytes"],
        "patched_saved_bytes": patched["saved_bytes"],
        "change": patched["saved_bytes"] / eager["saved_bytes"] - 1 if eager["saved_bytes"] else 0.0,
        "eager_saved_storages": eager["saved_storages"],
        "patched_saved_storages": patched["saved_storages"],
        "kinds": [
            {
                "kind": kind,
                "label": label,
                "eager_bytes": eager["by_kind"][kind],
                "patched_bytes": patched["by_kind"][kind],
            }
            for kind, label in KINDS.items()
        ],
        "images": described["per_sample"] if described else 0,
        "image_inputs": described,
        "vision_eager_bytes": sum(v for k, v in eager["by_kind"].items() if k.startswith(VISION)),
        "vision_patched_bytes": sum(v for k, v in patched["by_kind"].items() if k.startswith(VISION)),
        "encoder_decoder": encoder_decoder,
        "output_bytes": eager["output_bytes"],
        "patched_output_bytes": patched["output_bytes"],
        "input_bytes": inputs["input_ids"].numel() * inputs["input_ids"].element_size(),
        "parameter_bytes": _storage_bytes((*model.parameters(), *model.buffers())),
        "attention": {
            "implementation": attention,
            "kernels": sorted(eager["kernels"] | patched["kernels"]),
        },
        "decisions": [
            {
                "name": d.name,
                "class": d.cls,
                "replace": d.replace,
                "reason": d.reason,
                "gated": d.gated,
                "kind": d.kind,
            }  # fmt: skip
            for d in decisions
        ],
    }
