"""`forward_saved(config, batch, seq, dtype)`: the bytes one training forward of a transformers model
saves for backward, eager and after `invact.patch()`, measured on the meta device: the model is built
from its config with shapes only (invact.planner.config) and one forward of invact.planner.inputs' inputs
runs under invact.memory's saved-tensor counter, whose figures are those of a real forward (each
storage once, parameters and buffers excluded), as on a device (invact.planner.as_on_device). The engine of
`invact plan` without --step or --fits.

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
their causal LM, else the base model (invact.planner.config.build_model).
Imports transformers only when called.
"""

from __future__ import annotations

import inspect
import re

import torch
from torch import nn

import invact
from invact import kinds
from invact.activation import REPLACEABLE, SKIPPED, _is_activation_like
from invact.activation.modules import InvAct
from invact.loss import output_head
from invact.memory import count_saved
from invact.mlp.gated import multiply
from invact.planner.as_on_device import tensors_in, values_as_on_device
from invact.planner.config import build_model, load_config, parse_dtype
from invact.planner.inputs import training_inputs
from invact.planner.options import PlanError, check_positive, one_line

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


def _forward(model: nn.Module, inputs: dict) -> dict:
    """One training-mode forward on meta inputs under the attributed counter: saved bytes in total and
    per kind, the output's bytes not among them (the logits), and the attention kernels used."""
    counter = _Attributed(model)
    try:
        with values_as_on_device() as kernels, counter:
            output = model(**inputs)
            by_kind = counter.by_kind()
            saved = set(counter._storages)
            held = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors_in(output)}
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


def forward_saved(
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
    check_positive("batch", batch)
    check_positive("seq", seq)
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
    decisions = invact.plan(model, gated=gated, norms=norms, loss=loss)
    eager, patched = _eager_and_patched(model, inputs, gated=gated, norms=norms, loss=loss)
    asked = {"batch": batch, "seq": seq, "dtype": str(torch_dtype).removeprefix("torch."), "gated": gated,
             "norms": norms, "loss": loss, "labels": labels}  # fmt: skip
    return _result(config, path, model, inputs, described, attention, eager, patched, decisions, asked)


def _eager_and_patched(model: nn.Module, inputs: dict, **options) -> tuple[dict, dict]:
    """(_forward's counts of one eager forward, of one after invact.patch(model, **options)); PlanError
    where the forward cannot run on the meta device or fails on these inputs."""
    try:
        with torch.enable_grad():
            eager = _forward(model, inputs)
            invact.patch(model, **options)
            return eager, _forward(model, inputs)
    except (RuntimeError, NotImplementedError) as e:  # e.g. "Tensor.item() cannot be called on meta tensors"
        raise PlanError(
            f"the forward of {type(model).__name__} cannot run on the meta device (shapes only): "
            f"{one_line(e)}"
        ) from None
    except (AttributeError, KeyError, TypeError, ValueError, IndexError) as e:  # e.g. a config lacks a field
        raise PlanError(f"the forward of {type(model).__name__} fails on these inputs: "
                        f"{type(e).__name__}: {one_line(e)}") from None  # fmt: skip


def _result(config, path, model: nn.Module, inputs: dict, described: dict | None, attention: str, eager: dict,
            patched: dict, decisions, asked: dict) -> dict:  # fmt: skip
    """forward_saved's JSON-ready answer (its docstring lists the keys) from the two forwards' counts;
    `asked`: batch, seq, dtype, gated, norms, loss, labels, as planned."""
    return {
        "config": path,
        "model_type": getattr(config, "model_type", None),
        "model_class": type(model).__name__,
        **asked,
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
        "encoder_decoder": bool(getattr(model.config, "is_encoder_decoder", False)),
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
