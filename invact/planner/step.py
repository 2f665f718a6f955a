"""The peak of a whole training step, predicted on the meta device: `Step(config, recipe).peak(batch,
seq)` runs one step of a transformers model built from its config (forward with labels, the loss,
backward, AdamW's step, the gradients set to None) with shapes only under invact.planner.live_bytes'
LiveBytes, so the peak is that of a real step's live bytes: weights, gradients, optimizer state,
inputs, what the forward saves and what forward and backward allocate and free on the way (the eager
loss's logits and their fp32 copies, a layer's backward buffers, AdamW's foreach temporaries).
`step_peaks(config, batch, seq)` plans each recipe (invact.planner.recipes) eager and patched, without
and with checkpointing, at a shape or at the largest that fits (invact.planner.fits), on one device
or per rank of FSDP2 (invact.planner.sharding).

AdamW runs its foreach implementation, the default on CUDA. Its state exists from the second step on,
as in a training run: the peak is that of a step after the first (Step creates the state with one step
of zero gradients). Imports transformers (and peft for "lora") only when called; never downloads.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.autograd.graph import _engine_run_backward

import invact
from invact._meta import standing_for
from invact.loss.parallel import planning
from invact.planner.as_on_device import tensors_in, values_as_on_device
from invact.planner.autocast import Autocast
from invact.planner.config import build_model, load_config, positions
from invact.planner.fits import BATCH_CAP, SEQ_CAP, largest
from invact.planner.inputs import training_inputs
from invact.planner.live_bytes import LiveBytes, cpu_matmul_workspace
from invact.planner.meta_outputs import MetaOutputs
from invact.planner.options import (
    DEFAULT_RANK,
    DEFAULT_RECIPES,
    DEVICES,
    SEQ_MULTIPLE,
    TERMS,
    PlanError,
    check_positive,
    parse_size,
)
from invact.planner.quantized import gemm_4bit_workspace, quant_state_tensors, quantize_nf4
from invact.planner.recipes import RECIPES, Recipe, add_lora, disable_checkpointing, enable_checkpointing
from invact.planner.sharding import Sharding
from invact.planner.tensor_parallel import TensorParallel


class Step:
    """A model built from `config` on the meta device (or given, on any device) and set up for
    `recipe`, with its AdamW; `peak(batch, seq)` the peak live bytes of one training step.

    The model starts eager; `patch()` applies invact.patch() (after which it stays patched).
    `checkpointing` toggles Hugging Face's gradient checkpointing per call of peak(). `ranks`: FSDP2 over
    that many ranks (invact.planner.sharding); `tp`: one rank of that many under transformers' tensor
    parallelism (invact.planner.tensor_parallel: the model, a meta one, sharded in place), with `ranks` the
    ranks of the whole job (tp x the FSDP2 ranks). AdamW runs its foreach implementation, the default on
    CUDA; under `tp` its for-loop (foreach refuses the mix of DTensor and plain parameters transformers'
    tensor parallelism leaves: "got mixed torch.Tensor and DTensor", torch 2.13)."""

    def __init__(self, config, recipe: str | Recipe = "bf16", *, rank: int = DEFAULT_RANK,
                 model: nn.Module | None = None, images: int | None = None, image_size: int | None = None,
                 device: str = "cuda", ranks: int | None = None, tp: int | None = None) -> None:  # fmt: skip
        if device not in DEVICES:
            raise PlanError(f"unknown device {device!r} (choose from {', '.join(DEVICES)})")
        self.device = device
        self.recipe = RECIPES[recipe] if isinstance(recipe, str) else recipe
        check_positive("the LoRA rank", rank)
        self.rank = rank
        if model is None:
            model, self.attention = build_model(load_config(config)[0], self.recipe.dtype)
        else:
            self.attention = getattr(model.config, "_attn_implementation", None)
        if tp is not None and self.recipe.lora:
            raise PlanError(f"tensor parallelism under LoRA adapters is not planned: plan --tp with "
                            f"{' or '.join(r for r in RECIPES if not RECIPES[r].lora)}")  # fmt: skip
        self.tensor_parallel = TensorParallel(model, tp) if tp is not None else None
        if self.recipe.quantized:
            if ranks is not None:
                raise PlanError(
                    "FSDP2 over a 4-bit base (FSDP-QLoRA) is not planned: plan --recipe qlora on one GPU"
                )
            model = quantize_nf4(model, self.recipe.autocast)
        self.base = model
        self.model = add_lora(model, rank, float32=self.recipe.quantized) if self.recipe.lora else model
        # autocast on the meta device: invact.planner.autocast's, as on `device`
        meta = next(model.parameters()).is_meta
        self.autocast = Autocast(device, self.recipe.autocast) if self.recipe.autocast and meta else None
        self.model.train()
        self.images, self.image_size = images, image_size
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        # FSDP2 over `ranks` ranks (invact.planner.sharding): the optimizer steps on each rank's shards
        dp = self._fsdp_ranks(ranks, tp) if ranks is not None else None
        self.sharding = Sharding(self.model, dp) if dp is not None and (tp is None or dp > 1) else None
        self.stepped = self.sharding.trainable if self.sharding is not None else self.trainable
        # foreach: the default on CUDA (torch.optim's _default_to_fused_or_foreach), not on CPU or meta
        self.optimizer = torch.optim.AdamW(self.stepped, lr=1e-5, foreach=tp is None)
        for p in self.stepped:  # the state AdamW creates in its first step
            p.grad = torch.zeros_like(p)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.patched = self.settled = False
        # the meta ops' outputs by signature, for every step this Step follows (invact.planner.meta_outputs)
        self._outputs = MetaOutputs()

    def patch(self) -> None:
        invact.patch(self.model)
        self.patched = True
        self.settled = False

    def _settle(self, inputs: dict) -> None:
        """One forward of the patched meta model, unfollowed: patch()'s gated-product hooks take
        themselves off a module whose first call shows them of no use (invact.mlp.gated: a QLoRA MLP
        under autocast saves no product), so a training run's steps after its first run without them,
        and the planned step is such a step (a real Step's warm-up step does the same)."""
        with self._modes(), self._region(), torch.enable_grad():
            del self.model(**inputs).loss
        self.settled = True

    @contextlib.contextmanager
    def _modes(self) -> Iterator[None]:
        """What a step of this Step runs under: on the meta device the planner's modes (as on a device),
        meta tensors standing for the device planned for, and the meta autocast of a recipe with one."""
        with contextlib.ExitStack() as stack:
            if self._on_meta():
                stack.enter_context(values_as_on_device())
            stack.enter_context(standing_for(self.device))
            if self.autocast is not None:
                stack.enter_context(self.autocast)
            if self.tensor_parallel is not None:  # patch()'s loss over the vocabulary's shards
                stack.enter_context(planning(self.tensor_parallel.ranks))
            yield

    def _state(self) -> list[torch.Tensor]:
        return [t for s in self.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]

    def inputs(self, batch: int, seq: int) -> dict:
        return training_inputs(self.base, batch, seq, self.images, self.image_size, self.recipe.dtype)[0]

    def _region(self):
        """The forward's autocast region: the recipe's autocast (on the meta device,
        invact.planner.autocast's)."""
        if self.recipe.autocast is None:
            return contextlib.nullcontext()
        if self.autocast is not None:
            return self.autocast.region()
        device = next(self.model.parameters()).device.type
        return torch.autocast(device, dtype=self.recipe.autocast)

    def run(self, inputs: dict) -> None:
        """One training step on `inputs`: forward with labels (under the recipe's autocast), backward of
        the loss, AdamW's step, the gradients set to None."""
        with self._region():
            loss = self.model(**inputs).loss
        loss.backward()
        del loss
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def follow(self, inputs: dict) -> LiveBytes:
        """One training step on `inputs` (as run()) under a LiveBytes, on the meta device under the
        planner's modes (and autocast's, for a mixed recipe): the LiveBytes, closed, with its peak."""
        sharding = self.sharding
        params = sharding.tensors() if sharding is not None else self.model.parameters()
        # with a 4-bit base, the constants bitsandbytes keeps beside each weight
        weights = [*params, *self.model.buffers(), *quant_state_tensors(self.model)]
        given = [t for t in tensors_in(inputs) if not t.is_cpu or not self._on_meta()]
        # the gradients: the parameters' (under FSDP2 the unsharded ones, until reduced) and the shards'
        with_grads = self.trainable if sharding is None else [*self.trainable, *self.stepped]

        def grads() -> int:
            storages = [p.grad.untyped_storage() for p in with_grads if p.grad is not None]
            return sum({s._cdata: s.nbytes() for s in storages}.values())

        outputs = self._outputs if self._on_meta() else None
        # a plan adds what ops allocate inside themselves: a 4-bit layer's dequantized weight, and for a CPU
        # its bf16 matmuls' buffers (a real step's ops are followed as they are: Step.follow on one counts
        # no workspace)
        planned = ((cpu_matmul_workspace, self.device == "cpu"), (gemm_4bit_workspace, self.recipe.quantized))
        workspaces = [w for w, used in planned if used]
        workspace = None
        if self._on_meta() and workspaces:
            workspace = (
                workspaces[0] if len(workspaces) == 1 else lambda f, a: sum(w(f, a) for w in workspaces)
            )
        uncounted = self.model.parameters() if sharding is not None else ()
        live = LiveBytes({"weights": weights, "optimizer": self._state(), "inputs": given}, grads, outputs,
                         workspace, uncounted)  # fmt: skip
        if sharding is not None:
            sharding.attach(live)
        if self.tensor_parallel is not None:
            self.tensor_parallel.attach(self.patched)
        try:
            with self._modes(), live:
                live.phase = "forward"
                with self._region():
                    loss = self.model(**inputs).loss
                live.phase = "backward"
                if sharding is not None:
                    sharding.backward()
                # The engine itself, not loss.backward(): a torch function mode is off while it handles a
                # call, and the planner's (values_as_on_device) would then be off for the whole
                # backward, checkpointing's recompute of the forward included.
                _engine_run_backward((loss,), (torch.ones_like(loss),), False, False, (), True, True)
                del loss
                if sharding is not None:  # FSDP2's final callback: what the backward left reduced
                    sharding.finish()
                live.phase = "step"
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
                if self.tensor_parallel is not None:
                    self.tensor_parallel.release()
        finally:
            if self.tensor_parallel is not None:
                self.tensor_parallel.detach()
            if sharding is not None:
                sharding.detach()
                for p in self.trainable:
                    p.grad = None
            live.close()
            self.optimizer.zero_grad(set_to_none=True)
        return live

    def peak(self, batch: int, seq: int, *, checkpointing: bool = False) -> dict:
        """The peak live bytes of one training step at input_ids (batch, seq), and its terms:
        {peak_bytes, terms: {TERMS key: bytes live at the peak}, phase (where the peak is: "forward",
        "backward" or "step"), op (the aten op that allocated last before it)}."""
        if checkpointing:
            enable_checkpointing(self.base, self.autocast.contexts if self.autocast is not None else None)
        else:
            disable_checkpointing(self.base)
        inputs = self.inputs(batch, seq)
        if self.patched and not self.settled and self._on_meta():
            self._settle(inputs)
        live = self.follow(inputs)
        terms = {key: live.at_peak.get(key, 0) for key in TERMS}
        terms["gradients"] = live.peak_grads
        terms["backward"] -= live.peak_grads
        return {
            "peak_bytes": live.peak,
            # the peak of forward and backward, which grows with the tokens (the optimizer step's does not)
            "activation_peak_bytes": max(live.peaks.get("forward", 0), live.peaks.get("backward", 0)),
            "terms": terms,
            "phase": live.peak_phase,
            "op": str(live.peak_op) if live.peak_op is not None else None,
        }

    @staticmethod
    def _fsdp_ranks(ranks: int, tp: int | None) -> int:
        """FSDP2's ranks: all of them, or with `tp` the data parallel ones (ranks / tp)."""
        if tp is None:
            return ranks
        if ranks % tp:
            raise PlanError(f"{ranks} GPUs do not split into tensor parallel groups of {tp}")
        return ranks // tp

    def _on_meta(self) -> bool:
        return next(self.model.parameters()).is_meta


VARIANTS = ((False, False), (False, True), (True, False), (True, True))  # (patched, checkpointing), in order


def _by(step: Step, searched: str, batch: int | None, seq: int | None, checkpointing: bool):
    """x -> step's peak at sequence x (searched "seq") or batch x."""
    if searched == "seq":
        return lambda x: step.peak(batch, x, checkpointing=checkpointing)
    return lambda x: step.peak(x, seq, checkpointing=checkpointing)


def _search(batch: int | None, seq: int | None, fits, recipes, ranks: int | None) -> tuple:
    """(the budget in bytes, None without `fits`; what is searched: "seq", "batch" or None; the batch,
    1 where the sequence is searched at none), the arguments checked: PlanError for a bad one."""
    for name, value in (("batch", batch), ("seq", seq), ("ranks", ranks)):
        if value is not None:  # None: searched, or one device
            check_positive(name, value)
    budget = None if fits is None else (parse_size(fits) if isinstance(fits, str) else fits)
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0):
        raise PlanError(f"the memory to fit in must be a positive number of bytes, got {fits!r}")
    unknown = [r for r in recipes if r not in RECIPES]
    if unknown or not recipes:
        choices = ", ".join(RECIPES)
        raise PlanError(f"unknown recipe {unknown[0] if unknown else None!r} (choose from {choices})")
    searched = None
    if budget is not None:
        searched = "batch" if batch is None and seq is not None else "seq"
        batch = 1 if searched == "seq" and batch is None else batch
    elif batch is None or seq is None:
        raise PlanError("give --batch and --seq, or --fits with one of them")
    return budget, searched, batch


def _rows(step: Step, batch: int, seq: int | None, budget: int | None, searched: str | None,
          cap: int | None) -> list[dict]:  # fmt: skip
    """step_peaks' rows for `step`'s recipe, one per VARIANTS entry (patching `step` on the way)."""
    rows = []
    for patched, checkpointing in VARIANTS:
        if patched and not step.patched:
            step.patch()
        if searched:
            answer, peak, count = largest(_by(step, searched, batch, seq, checkpointing), budget,
                                          SEQ_MULTIPLE if searched == "seq" else 1, cap)  # fmt: skip
            shape = (batch, answer) if searched == "seq" else (answer, seq)
        else:
            peak, count, shape = step.peak(batch, seq, checkpointing=checkpointing), 1, (batch, seq)
        rows.append({"recipe": step.recipe.name, "patched": patched, "checkpointing": checkpointing,
                     "batch": shape[0], "seq": shape[1], **peak, "peaks": count})  # fmt: skip
    return rows


def step_peaks(config, batch: int | None, seq: int | None, *, recipes=DEFAULT_RECIPES,
               rank: int = DEFAULT_RANK, fits: int | str | None = None, device: str = "cuda",
               images: int | None = None, image_size: int | None = None,
               ranks: int | None = None, tp: int | None = None) -> dict:  # fmt: skip
    """The peak of one training step of the model `config` describes (a config object or dict, or the
    path of a config JSON file), eager and after invact.patch(), without and with gradient
    checkpointing, for each recipe in `recipes` (RECIPES' names), predicted on the meta device.

    Without `fits`: at input_ids (batch, seq). With `fits` (bytes, or a size parse_size reads): the
    longest sequence (a multiple of SEQ_MULTIPLE, at most the config's max_position_embeddings) at
    `batch` whose peak fits, or with `seq` given and `batch` None the largest batch (at most
    BATCH_CAP); 0 where none fits.

    Returns a JSON-ready dict: config (the path or None), model_type, model_class, dtype ("bfloat16"),
    device, rank, batch, seq, fits_bytes (None without fits), searched ("seq", "batch" or None), cap
    (the largest value searched), rows: one per recipe and variant, in RECIPES' then VARIANTS' order,
    {recipe, patched, checkpointing, batch, seq (the answer where searched), peak_bytes, terms (TERMS
    key -> bytes live at the peak), phase, op, peaks (how many steps were planned)}; with fits a row
    where nothing fits has seq (or batch) 0 and the peak at the smallest one tried.

    `ranks` (None: one device): the peak on each of `ranks` devices that train the model with FSDP2
    (`fully_shard` on each decoder layer, then the root; invact.planner.sharding), each with `batch` x
    `seq` of its own; the result's `ranks` says which (1 plans one device: FSDP2 on one rank keeps each
    parameter once, as one device does).

    `tp` (None: no tensor parallelism): the peak on each of `tp` devices that train the model under
    transformers' tensor parallelism (its tp_plan; invact.planner.tensor_parallel), all on one `batch` x
    `seq`; with `ranks` as well, FSDP2 over the ranks / tp data parallel groups. The result's `tp` says
    which. The LoRA recipes are not planned under `tp` (PlanError)."""
    budget, searched, batch = _search(batch, seq, fits, recipes, ranks)
    if tp is not None:
        check_positive("tp", tp)
    config, path = load_config(config)
    if searched == "seq":  # the longest sequence the config's positions take
        cap = (positions(config) or (None, SEQ_CAP))[1]
    else:
        cap = BATCH_CAP if searched else None
    rows, model_class = [], None
    for name in recipes:
        step = Step(config, name, rank=rank, device=device, images=images, image_size=image_size,
                    ranks=ranks if ranks != 1 or tp is not None else None, tp=tp)  # fmt: skip
        model_class = type(step.base).__name__
        rows += _rows(step, batch, seq, budget, searched, cap)
    return {
        "config": path,
        "model_type": getattr(config, "model_type", None),
        "model_class": model_class,
        "dtype": "bfloat16",
        "device": device,
        "ranks": ranks,
        "tp": tp,
        "rank": rank,
        "batch": batch,
        "seq": seq,
        "fits_bytes": budget,
        "searched": searched,
        "cap": cap,
        "rows": rows,
    }
