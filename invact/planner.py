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
Inside a module patch() hooks for gated products (invact.mlp.gated) the tensors reach the counter only
when the module returns; a saved-tensor hook stacked above the gated one on each module inside
notes where each was saved, so they are attributed as eager ones are.

Meta tensors hold no values, so what reads them is answered as a real forward of these inputs
would: transformers' check for packed sequences (position ids that restart inside a row) is None,
as for the position ids a model builds from input_ids alone; and F.scaled_dot_product_attention
runs the kernel torch picks on CPU for the same shapes, dtype, mask and dropout (on meta it would
always take the math path, which saves the attention probabilities: batch x heads x seq x seq).
Imports transformers only when called.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

import invact
from invact import kinds
from invact.activation import REPLACEABLE, SKIPPED, _is_activation_like
from invact.activation.modules import InvAct
from invact.loss import output_head
from invact.memory import count_saved
from invact.mlp.gated import multiply

# dtype names the planner takes -> torch dtype
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}

# kind -> label, in the order reports list them
KINDS: dict[str, str] = {
    "attention": "attention",
    "mlp_activations": "MLP activations",
    "gated_products": "gated products act(g)*u",
    "mlp_other": "MLP, other (linear inputs, u)",
    "norms": "norms",
    "head_loss": "head and loss (logits, log-softmax)",
    "other": "other (embeddings, residuals)",
}

_NORM = re.compile(r"norm", re.IGNORECASE)
_ATTENTION = re.compile(r"attention|attn", re.IGNORECASE)
_MLP = re.compile(r"mlp|feed_?forward|ffn", re.IGNORECASE)


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


def build_model(config, dtype: torch.dtype) -> tuple[nn.Module, str]:
    """(the causal-LM model of `config`, or its base model where it has none, on the meta device in
    `dtype`; the attention implementation: "sdpa", or "eager" where the model has no SDPA path).
    Remote code is never run or fetched. PlanError where transformers cannot build it."""
    from transformers import AutoModel, AutoModelForCausalLM

    failure = None
    for auto in (AutoModelForCausalLM, AutoModel):
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
    forward of input_ids alone would, and run F.scaled_dot_product_attention with the kernel torch
    picks on CPU. Yields the set of kernels used ("flash", "math", ...)."""
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
        with _AttentionAsOnCpu(kernels):
            yield kernels
    finally:
        if original is not None:
            masking.find_packed_sequence_indices = original


def _sdpa_arguments(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                    enable_gqa=False):  # fmt: skip
    return query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa


def _stand_in(t: torch.Tensor) -> torch.Tensor:
    """A small CPU tensor like t for torch's kernel choice: its dtype, its head count and head size
    (dims -3 and -1), every other dimension 1."""
    shape = [1] * t.dim()
    for dim in (-3, -1):
        if t.dim() >= -dim:
            shape[dim] = t.shape[dim]
    return torch.zeros(shape, dtype=t.dtype).requires_grad_(t.requires_grad and t.is_floating_point())


class _AttentionAsOnCpu(TorchFunctionMode):
    """F.scaled_dot_product_attention on meta tensors: the fused CPU flash kernel where torch picks it
    on CPU for these dtypes, head sizes, mask and dropout (its saved q, k, v, output and logsumexp are
    what CUDA's flash kernel saves too); the math path otherwise. Records the kernel in `kernels`."""

    def __init__(self, kernels: set[str]) -> None:
        super().__init__()
        self.kernels = kernels

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention or not args or not args[0].is_meta:
            return func(*args, **kwargs)
        q, k, v, mask, dropout, causal, scale, gqa = _sdpa_arguments(*args, **kwargs)
        with torch.enable_grad():
            choice = torch._fused_sdp_choice(
                _stand_in(q), _stand_in(k), _stand_in(v), None if mask is None else _stand_in(mask),
                dropout, causal, scale=scale, enable_gqa=gqa,
            )  # fmt: skip
        if choice == torch.nn.attention.SDPBackend.FLASH_ATTENTION.value:
            self.kernels.add("flash")
            flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
            return flash(q, k, v, dropout, causal, attn_mask=mask, scale=scale)[0]
        self.kernels.add("math" if choice == torch.nn.attention.SDPBackend.MATH.value else str(choice))
        return func(*args, **kwargs)


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
    saved. Forward hooks on every module keep the stack of modules running. Where a module's
    saved-tensor hooks are not this counter's (invact.mlp.gated's, which hand tensors over at the hooked
    module's return), each module inside stacks a hook above them that notes where each tensor was
    saved and passes it on."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.kinds = _own_kinds(model)
        self.stack: list[nn.Module] = []
        self.pushed: list[object] = []  # per running module: the hooks it stacked, or None
        self.top_before: list[object] = []  # per running module: the saved-tensor hooks at its call
        self.kind_of: dict[int, str] = {}  # storage identity -> kind, for counted storages
        self.notes: dict[int, str] = {}  # the same, noted inside a gated module until it returns
        self.activation_nodes: dict[int, object] = {}  # id -> the autograd node of an activation output
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
            self.activation_nodes[id(output.grad_fn)] = output.grad_fn

    def _kind(self, t: torch.Tensor) -> str:
        found = multiply(t)
        if found is not None and any(id(n) in self.activation_nodes for n in found[1]):
            return "gated_products"
        base = t if t._base is None else t._base
        if base.grad_fn is not None and id(base.grad_fn) in self.activation_nodes:
            return "mlp_activations"  # an activation's output, wherever it is saved
        if self.after_head and self.stack and self.stack[-1] is self.model:
            return "head_loss"  # saved by the model's own forward after its head: the loss
        for module in reversed(self.stack):
            if module in self.kinds:
                return self.kinds[module]
        return "other"

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
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, dict) or hasattr(output, "values"):
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
) -> dict:
    """What one training forward of input_ids (batch, seq) saves for backward, eager and after
    `invact.patch(model, gated=gated, norms=norms, loss=loss)`, for the transformers model `config`
    describes (a config object, a config dict, or the path of a config JSON file or of a folder
    holding config.json), built on the meta device in `dtype`. Nothing is allocated or downloaded.
    With `labels` (the default) a model whose forward takes labels (a causal LM) gets labels =
    input_ids, so the forward computes its loss, as a training step does, and the head and loss count
    as their own kind; labels=False runs the forward without them (no loss: the logits are the
    output).

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
      labels (whether labels were passed: also False where the forward takes none).
    PlanError for input it cannot take."""
    for name, value in (("batch", batch), ("seq", seq)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise PlanError(f"{name} must be a positive integer, got {value!r}")
    torch_dtype = parse_dtype(dtype)
    path = None
    if isinstance(config, (str, os.PathLike)):
        path = str(config)
        config = read_config(config)
    if isinstance(config, dict):
        config = build_config(config)
    model, attention = build_model(config, torch_dtype)
    model.train()
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    inputs = {"input_ids": ids}
    parameters = inspect.signature(model.forward).parameters
    if "input_ids" not in parameters:
        raise PlanError(f"{type(model).__name__}'s forward takes no input_ids: invact plan runs models of "
                        "token ids")  # fmt: skip
    if "use_cache" in parameters:
        inputs["use_cache"] = False
    labels = labels and "labels" in parameters
    if labels:
        inputs["labels"] = ids
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
        "output_bytes": eager["output_bytes"],
        "patched_output_bytes": patched["output_bytes"],
        "input_bytes": ids.numel() * ids.element_size(),
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
