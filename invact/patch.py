"""`invact.patch(model)` and `invact.plan(model)`: each op kind InvAct replaces (the activation, the MLP,
the norm, the loss), in order, decides for its modules, then each in turn replaces them in place
(each module stays the same object, an instance of its own class: invact.identity).

This module only loops: what finds, decides and replaces lives in each kind's home (invact.activation,
invact.mlp, invact.norm, invact.loss), through the interface of invact.kinds. Classes are matched by
their qualified name, so neither transformers nor timm is imported here. Modules left alone are logged
on the "invact" logger with the reason, and listed by `plan(model)`.
"""

from __future__ import annotations

import fnmatch
import logging

from torch import nn

from invact import activation, loss, mlp, norm
from invact.kinds import Decision, Kind, Options, glob_patterns

log = logging.getLogger("invact")

# The op kinds, in the order plan() asks them to decide and patch() to apply: the MLP's decision
# follows the activations replaced, the norm's and the loss's stand alone.
KINDS: tuple[Kind, ...] = (activation.KIND, mlp.KIND, norm.KIND, loss.KIND)

__all__ = ["KINDS", "Decision", "patch", "plan"]


def plan(
    model: nn.Module,
    *,
    include=None,
    exclude=None,
    mode: str = "bits",
    example_inputs=None,
    gated=True,
    norms: bool = True,
    loss: bool = True,
):
    """What patch() would do: one Decision per activation-like module or activation function attribute
    (replaced or left alone, and why). Changes nothing.

    `include`/`exclude`: glob patterns on module names (a string or several), e.g.
    `"encoder.layer.*.intermediate.*"`; a pattern that matches no activation is a ValueError.
    `example_inputs`: a tensor, a tuple of positional arguments or a dict of keyword arguments for
    one training-mode forward of the model (RNG state and train/eval modes are restored). With them
    each activation is replaced only where that saves memory, measured: its output must be what a
    later op saves (not so after dropout or a reduction) and nothing may modify it in place. Without
    them, known risky patterns are left alone: in nn.Sequential, Dropout(p > 0) or an in-place module
    right after it; a module that applies `activation_dropout` to it (transformers' BART- and
    wav2vec2-style layers) or holds a Dropout named for it (timm's Mlp `drop1`); and for an activation
    function attribute any Dropout(p > 0) in its module.

    `gated`: each replaced activation's Decision names in `gated` the module patch() hooks so that it
    saves no copy of a gated product act(g) * u (see patch()); with example inputs only where such a
    product is measured, and `gated_bytes` gives its bytes.

    `norms`: also one Decision (kind "norm") per normalization module (a class of the norm spec, or a
    leaf module named like one): replaced by invact.norm.InvNorm where its forward matches one of the
    spec's formulas bitwise on a probe, unless in nn.Sequential Dropout(p > 0) or an in-place module
    follows it (then the next layer saves another tensor than its output, or overwrites it). With
    `example_inputs` each norm is measured instead: replaced only where the bytes saved inside it
    (eager: x, its statistics, Hugging Face's fp32 copies) exceed what the inverted norm keeps (rstd,
    the 4-bit residuals of the variants that have them, and y itself where no later op saves it), and
    nothing modifies its output in place; `saved_bytes` gives the difference.

    `loss`: also one Decision (kind "loss") for a causal LM's head (invact.loss.head_of: a Hugging Face
    model whose loss is transformers' causal-LM loss and whose output embeddings are an nn.Linear),
    named for the head: replaced means a training forward with labels computes the loss from the
    hidden state and the head's weight a chunk of rows at a time (no logits kept; its output's
    `logits` computed on demand, invact.loss.PendingLogits). include/exclude do not apply to it."""
    return _plan(model, _options(include, exclude, mode, example_inputs, gated, norms, loss))


def _options(include, exclude, mode: str, example_inputs, gated: bool, norms: bool, loss: bool) -> Options:
    if mode not in ("bits", "precision_bit"):
        raise ValueError(f"mode must be 'bits' or 'precision_bit', got {mode!r}")
    return Options(glob_patterns(include, "include"), glob_patterns(exclude, "exclude"), mode,
                   example_inputs, gated, norms, loss)  # fmt: skip


def _plan(model: nn.Module, options: Options) -> list[Decision]:
    """Each kind's decisions in turn (KINDS); a ValueError, before anything changes, for an include or
    exclude pattern that matches nothing any kind found."""
    decisions, names = [], []
    for kind in KINDS:
        decisions, found = kind.decide(model, options, decisions)
        names += found
    for what, patterns in (("include", options.include), ("exclude", options.exclude)):
        for p in patterns or ():
            if not any(fnmatch.fnmatchcase(n, p) for n in names):
                example = f" (they look like {names[0]!r})" if names else " (the model has none)"
                raise ValueError(f"{what} pattern {p!r} matches no activation's or norm's name{example}")
    return decisions


def patch(
    model: nn.Module,
    *,
    include=None,
    exclude=None,
    mode: str = "bits",
    example_inputs=None,
    gated: bool = True,
    norms: bool = True,
    loss: bool = True,
) -> list[str]:
    """Replace, in place, every activation that InvAct reproduces exactly and that saves memory; return
    their names. Arguments as for plan(); with `example_inputs` the saving is measured per activation
    and nothing that would add memory is replaced.

    `gated` (default True): also hook the module holding each InvAct activation (its parent: the MLP)
    so that nothing in it saves a copy of a gated product act(g) * u (the down projection's input, be
    it nn.Linear, PEFT's LoRA layer or a functional call in MoE experts): it is recomputed from the y
    and u the multiply saves (invact.mlp.gated). With `example_inputs`, only modules where such a product
    is measured are hooked (plan()'s Decision.gated). gated=False keeps the activation-only behaviour.

    Each module is changed in place (invact.identity): the same object, still an instance of its
    class, under its class name, with its parameters, attributes and hooks, so a module shared by
    several parents stays shared. Works on any device and dtype, on a model whose parameters are on
    the meta device (inside `with torch.device("meta")` too), and inside wrappers such as PEFT's. An
    already patched module whose mode differs from `mode` is switched to it. Activations left alone
    are logged on the "invact" logger (INFO) with the reason. A model loaded again (from_pretrained,
    a fresh instance) holds torch's activations: patch it again.

    `norms` (default True): also make each normalization layer whose
    formula InvAct reproduces (RMSNorm, LayerNorm and their Hugging Face and timm variants, checked on
    a probe: see plan()) an invact.norm.InvNorm in place, which saves its output and rstd instead of
    its input. norms=False leaves every norm as it is (it does not undo an earlier
    patch(norms=True): a model loaded again holds torch's norms).

    `loss` (default True): a causal LM (see plan()) called in training mode with labels and gradients
    enabled computes its loss and gradients from the last hidden state and the head's weight, a chunk of
    rows at a time (invact.loss): no (tokens x vocab) logits kept for backward or materialized whole, the
    model's own loss semantics kept (label shift, ignore_index, num_items_in_batch, logits_to_keep,
    softcapping and logit scales); its output's `logits` is then None. Inference, eval mode and calls
    without labels are unchanged. loss=False leaves the head as it is."""
    options = _options(include, exclude, mode, example_inputs, gated, norms, loss)
    decisions = _plan(model, options)
    for d in decisions:
        if not d.replace:
            log.info("invact.patch: left %s (%s) alone: %s", d.name, d.cls, d.reason)
    replaced = []
    for kind in KINDS:
        replaced += kind.apply(model, decisions, options)
    return replaced
