"""The peak of a whole training step, predicted on the meta device: `Step(config, recipe).peak(batch,
seq)` runs one step of a transformers model built from its config (forward with labels, the loss,
backward, AdamW's step, the gradients set to None) with shapes only, and follows every storage it
allocates, so the peak is that of a real step's live bytes: weights, gradients, optimizer state,
inputs, what the forward saves and what forward and backward allocate and free on the way (the eager
loss's logits and their fp32 copies, a layer's backward buffers, AdamW's foreach temporaries).

How the bytes are followed: a TorchDispatchMode (below autograd: every op of the step, the backward's
and the optimizer's included, reaches it) notes each output's storage with a weak reference to it
(torch.UntypedStorage._weak_ref, the StorageImpl's own count, so views and autograd's saved copies
keep it alive exactly as they keep a real storage alive). The live total rises by a storage's bytes
when an op first returns it and falls when its last reference goes. The mode checks the weak
references only when the total (stale entries included, so never below the true total) would pass
the peak so far: a step of a 16-layer model checks a few hundred times, not at each of its ops.
Where autograd sums two gradients of one tensor it adds in place in a plain step, out of place under a
dispatch mode: LiveBytes counts such a sum as in place (LiveBytes._summed_in_place). Storage bytes
are the bytes a tensor asks for (an allocator rounds up: CUDA's caching allocator to
512 bytes), and what a kernel allocates inside itself without an op (a workspace) is not seen, but
for one a plan for a CPU adds: a bf16 matmul's copy of its second operand where that operand is at
most CPU_PACKED_N columns wide (cpu_matmul_workspace: a loss's d hidden = d logits x W of a model
whose hidden size is that small).

Recipes (RECIPES): "bf16", the model and AdamW's state in bf16; "mixed", fp32 weights and AdamW state,
the forward under autocast to bf16 (on the meta device invact._autocast's rules for the device
planned for); "lora", a frozen bf16 base with PEFT's
LoRA adapters (bf16, rank `rank`, dropout 0) on every Linear but the output head, AdamW on them. Each
with or without Hugging Face's gradient checkpointing (`activation_checkpointing_enable`, torch's
non-reentrant checkpoint, every decoder layer). AdamW runs its foreach implementation, the default
on CUDA. Its state exists from the second step on, as in a training run: the peak is that of a
step after the first (Step creates the state with one step of zero gradients).

Imports transformers (and peft for "lora") only when called; never downloads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
import warnings
from collections.abc import Iterable

import torch
from torch import nn
from torch.autograd.graph import _engine_run_backward
from torch.utils._python_dispatch import TorchDispatchMode

import invact
from invact._autocast import Autocast
from invact._meta import standing_for
from invact._meta_outputs import MetaOutputs
from invact.plan_options import (
    DEFAULT_RANK,
    DEFAULT_RECIPES,
    DEVICES,
    RECIPE_LABELS,
    SEQ_MULTIPLE,
    read_size,
)
from invact.planner import (
    PlanError,
    _output_tensors,
    _values_as_on_device,
    build_model,
    load_config,
    training_inputs,
)
from invact.sharding import Sharding

_ADD = torch.ops.aten.add.Tensor
# What a tensor type without a dispatch of its own has (torch.Tensor, nn.Parameter and their plain
# subclasses); DTensor and other wrapper subclasses define their own __torch_dispatch__
_NO_DISPATCH = torch._C._disabled_torch_dispatch_impl


def _fake(types) -> bool:
    """Whether a FakeTensor is among `types` (read from its module where something loaded it: importing
    it loads sympy, which `import invact` does not)."""
    module = sys.modules.get("torch._subclasses.fake_tensor")
    return module is not None and any(issubclass(t, module.FakeTensor) for t in types)


_expired = torch.UntypedStorage._expired
_free = torch.UntypedStorage._free_weak_ref


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A way people fine-tune: the model's dtype, whether the base is frozen under LoRA adapters, the
    dtype autocast computes in (None: no autocast)."""

    name: str
    label: str
    dtype: torch.dtype
    lora: bool = False
    autocast: torch.dtype | None = None


RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        Recipe("bf16", RECIPE_LABELS["bf16"], torch.bfloat16),
        Recipe(
            "mixed",
            RECIPE_LABELS["mixed"],
            torch.float32,
            autocast=torch.bfloat16,
        ),  # fmt: skip
        Recipe(
            "lora",
            RECIPE_LABELS["lora"],
            torch.bfloat16,
            lora=True,
        ),  # fmt: skip
    )
}

# The terms of a peak, in the order --explain lists them: key -> what the bytes are.
TERMS: dict[str, str] = {
    "weights": "weights: the model's parameters and buffers",
    "gradients": "gradients: .grad of the trainable parameters, live at the peak",
    "optimizer": "optimizer state: AdamW's exp_avg, exp_avg_sq and step, per trainable parameter",
    "inputs": "inputs: input_ids and labels (and images)",
    "forward": "forward: what the forward allocated and is still live (saved for backward, the loss)",
    "backward": "backward: what backward allocated and is still live (gradients of activations)",
    "step": "optimizer step: AdamW's temporaries (foreach: one per parameter at once)",
    "sharding": "FSDP2: gathered parameters (the root's, a layer's), all-gather and reduce-scatter buffers",
}


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


_MM = (torch.ops.aten.mm.default, torch.ops.aten.mm.out)
_ADDMM = (torch.ops.aten.addmm.default, torch.ops.aten.addmm.out)
# The widest second operand (N columns) that a bf16 matmul on CPU copies whole into each thread's
# buffer, and the multiple its K rows are padded to there. torch sends a CPU bf16 mm/addmm to oneDNN's
# brgemm matmul, which repacks B (K x N) into its blocked layout in a scratchpad that torch's CPU
# allocator provides (the profiler sees it, a dispatch mode does not). Measured (torch 2.13, oneDNN
# 3.12, 2-core Intel Xeon with AMX, 1 and 2 threads; mm and addmm alike): with A and B row-major, M from
# 2 to 1024, K from 64 to 128256 and 2 <= N <= 32, the scratchpad is threads x roundup(K, 32) x 32 x 2
# bytes and 5.6 to 11.6 KiB more (N = 8: 8 times B's bytes at 2 threads, 4 at one). Not planned, since
# it is other sizes: N from 40 on (at K = 32000 a third to four fifths of B's bytes in all: K in
# blocks), M = 1 (a GEMV), B stored transposed (a Linear's weight as x W^T: the same copy at M >= 64 and
# K <= 32000, little or none at K >= 40000 or M <= 32) and fp16. A head of hidden size 32 and a
# vocabulary of 32000 has d hidden = d logits x W (K = 32000, N = 32, W row-major) take 3.9 MiB at 2
# threads, twice its bf16 weight, while the patched loss's chunk of logits and its fp32 weight-gradient
# sum are alive: without it benchmarks/step_plan.py's patched llama_tied rows were 0.80-0.94 of the
# measured peak (LoRA 0.80-0.84, mixed 0.93-0.94, bf16 0.90-0.91).
CPU_PACKED_N = 32
CPU_PACKED_K = 32
# torch takes a 2-D bf16 matmul to oneDNN only where M x K x N is above this (ATen's
# mkldnn/Matmul.cpp, checksize: mkldnn_gemm_min_size); below it, its own kernel, which has no scratchpad.
MKLDNN_GEMM_MIN_SIZE = 16 * 16 * 16


@functools.cache
def _onednn_bf16() -> bool:
    """Whether torch sends a CPU bf16 matmul to oneDNN on this machine. ATen asks ideep for bf16 support
    (mkldnn_bf16_device_check), which an x86 CPU has from AVX-512 on (avx512_core; AMX and avx512_bf16
    run it natively); on an AVX2 CPU torch runs its own bf16 kernel, which allocates nothing inside
    (measured: 2-core AMD EPYC, AVX2, torch 2.13: (64 x 32000) x (32000 x 32) in bf16 allocated its
    output alone, where the planned scratchpad is 3.9 MiB). AVX2 CPUs with AVX-NE-CONVERT, which oneDNN
    also takes, are read as AVX2 here (unmeasured)."""
    check = getattr(torch.cpu, "_is_avx512_supported", None)
    return True if check is None else bool(check())


def cpu_matmul_workspace(func, args, threads: int | None = None) -> int:
    """Bytes a CPU matmul allocates inside itself, as planned (0 where none is planned): a bf16 mm or
    addmm of a row-major A (M x K, M >= 2) by a row-major B (K x N) with 2 <= N <= CPU_PACKED_N, which
    torch runs with oneDNN (M x K x N above MKLDNN_GEMM_MIN_SIZE, on a CPU it sends bf16 matmuls to
    oneDNN on: _onednn_bf16), copies B whole, K padded to
    CPU_PACKED_K and N to CPU_PACKED_N, into a buffer for each of `threads` threads
    (torch.get_num_threads() where None: a plan for a CPU is for the machine it runs on). Other
    matmuls' buffers (a few hundred KiB a thread at 2 threads) are not planned."""
    if func in _MM:
        a, b = args[0], args[1]
    elif func in _ADDMM:
        a, b = args[1], args[2]
    else:
        return 0
    if a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16 or a.dim() != 2 or b.dim() != 2:
        return 0
    if not _onednn_bf16():
        return 0
    (m, k), n = a.shape, b.shape[1]
    if not 2 <= n <= CPU_PACKED_N or m < 2 or m * k * n <= MKLDNN_GEMM_MIN_SIZE:
        return 0
    if a.stride(1) != 1 or b.stride(1) != 1:
        return 0
    k = -(-k // CPU_PACKED_K) * CPU_PACKED_K
    return (threads or torch.get_num_threads()) * k * CPU_PACKED_N * b.element_size()


class LiveBytes(TorchDispatchMode):
    """Follows the live bytes of every storage an op returns while it is active, and their peak.

    `known`: {label: tensors alive before} (weights, optimizer state, inputs), counted from the start
    under their label. `phase`: the label the caller sets for what is allocated next ("forward",
    "backward", "step"). At the peak: `peak` (bytes), `at_peak` ({label: live bytes}), `peak_phase`,
    `peak_op` (the op whose outputs made it) and `peak_grads`, the bytes `grads()` gave then (the
    live gradients, allocated in backward: counted under "backward" too). `peaks`: {phase: the peak
    while it ran}, each exact (a phase's peak below the overall one is followed too).

    `workspace(func, args)`: bytes an op allocates and frees inside itself (a kernel's scratch memory,
    no op's output), alive while it runs with its outputs (cpu_matmul_workspace for a plan for a CPU):
    a peak there counts them under the phase."""

    def __init__(self, known: dict[str, Iterable[torch.Tensor]] | None = None, grads=lambda: 0,
                 outputs: MetaOutputs | None = None, workspace=None,
                 uncounted: Iterable[torch.Tensor] = ()) -> None:  # fmt: skip
        super().__init__()
        self.grads = grads
        self.outputs = outputs  # a meta step's ops, called through it (invact._meta_outputs)
        self.workspace = workspace
        self.live: dict[int, tuple[int, int, str]] = {}  # storage key -> (weak ref, bytes, label)
        self.by_label: dict[str, int] = {}
        self.total = 0
        # storages never counted, whatever op returns them (views of them included): under FSDP2's plan
        # the model's full parameters, whose bytes invact.sharding's buffers stand for
        for t in uncounted:
            storage = t.untyped_storage()
            self.live.setdefault(storage._cdata, (storage._weak_ref(), 0, "uncounted"))
        for label, tensors in (known or {}).items():
            self.phase = label
            for t in tensors:
                self._note(t)
        self.phase = "known"
        self.peak, self.peak_op, self.peak_phase, self.peak_grads = self.total, None, "known", 0
        self.at_peak = dict(self.by_label)
        self.peaks: dict[str, int] = {}

    def _note(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        entry = self.live.get(key)
        if entry is not None:
            if not _expired(entry[0]):
                return
            self._drop(key, entry)
        nbytes = storage.nbytes()
        self.live[key] = (storage._weak_ref(), nbytes, self.phase)
        self.total += nbytes
        self.by_label[self.phase] = self.by_label.get(self.phase, 0) + nbytes

    def _drop(self, key: int, entry: tuple[int, int, str]) -> None:
        _free(entry[0])
        del self.live[key]
        self.total -= entry[1]
        self.by_label[entry[2]] -= entry[1]

    def _sweep(self) -> None:
        for key, entry in list(self.live.items()):
            if _expired(entry[0]):
                self._drop(key, entry)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(getattr(t, "__torch_dispatch__", _NO_DISPATCH) is not _NO_DISPATCH for t in types):
            if _fake(types):
                # DTensor's sharding propagation runs some ops (embedding) on fake tensors: no storage to
                # count, and a fake tensor's dispatch does not run under another mode
                return func(*args, **(kwargs or {}))
            # a tensor subclass (FSDP2's and tensor parallel's DTensor parameters, gradients, optimizer
            # state and activations): its own dispatch runs the op on its plain local tensors, which come
            # back here
            return NotImplemented
        summed = self._summed_in_place(func, args, kwargs) if self.phase == "backward" else None
        kwargs = kwargs or {}
        out = func(*args, **kwargs) if self.outputs is None else self.outputs(func, args, kwargs)
        for t in _output_tensors(out):
            self._note(t)
        if summed is not None:
            self._moved(summed, out)
        scratch = self.workspace(func, args) if self.workspace is not None else 0
        phase_peak = self.peaks.get(self.phase, 0)
        if self.total + scratch > phase_peak:
            # the total counts storages freed since the last sweep: only above a peak does it matter
            self._sweep()
            now = self.total + scratch
            if now > phase_peak:
                self.peaks[self.phase] = now
            if now > self.peak:
                self.peak, self.peak_op, self.peak_phase = now, func, self.phase
                self.at_peak = dict(self.by_label)
                if scratch:
                    self.at_peak[self.phase] = self.at_peak.get(self.phase, 0) + scratch
                self.peak_grads = self.grads() if self.phase != "forward" else 0
        return out

    @staticmethod
    def _summed_in_place(func, args, kwargs) -> torch.Tensor | None:
        """The gradient autograd would add another into in place, where this call is that sum.

        Autograd sums two gradients of one tensor (its input buffer) in place, into the one only the
        buffer holds, a dense tensor of the sum's shape and dtype; on the meta device and under any
        dispatch mode (this one) it adds them out of place (torch/csrc/autograd/input_buffer.cpp,
        can_accumulate_inplace: a tensor there is "subclass-like"), which would hold one more
        gradient: a tied embedding's, vocabulary x hidden, where its two gradients meet. Taken as
        that sum: add.Tensor of two tensors of one shape, dtype and contiguous layout, without alpha,
        while backward runs, the first (else the second) held once (its storage's use count 2: its
        tensor and the storage asked for here)."""
        if func is not _ADD or kwargs or len(args) != 2:
            return None
        a, b = args
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.shape != b.shape:
            return None
        if a.dtype != b.dtype or not (a.is_contiguous() and b.is_contiguous()):
            return None
        for t in (a, b):
            if t._base is None and torch._C._storage_Use_Count(t.untyped_storage()._cdata) == 2:
                return t
        return None

    def _moved(self, into: torch.Tensor, out) -> None:
        """`out` took `into`'s place (an in-place sum): `into`'s bytes leave the total now."""
        key = _storage_key(into)
        entry = self.live.get(key)
        if entry is not None and isinstance(out, torch.Tensor) and out.untyped_storage().nbytes() == entry[1]:
            self._drop(key, entry)

    def close(self) -> None:
        """Drops the weak references (each keeps its StorageImpl's shell)."""
        for ref, _, _ in self.live.values():
            _free(ref)
        self.live.clear()


def _enable_checkpointing(model: nn.Module, context_fn=None) -> None:
    """Hugging Face's gradient checkpointing as training code turns it on (transformers 5:
    activation_checkpointing_enable; before: gradient_checkpointing_enable), torch's non-reentrant
    checkpoint around each decoder layer; `context_fn` checkpoint's, where given."""
    kwargs = {"use_reentrant": False, **({"context_fn": context_fn} if context_fn else {})}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(kwargs)
        else:
            model.gradient_checkpointing_enable(kwargs)


def _disable_checkpointing(model: nn.Module) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if hasattr(model, "activation_checkpointing_disable"):
            model.activation_checkpointing_disable()
        else:
            model.gradient_checkpointing_disable()


def add_lora(model: nn.Module, rank: int) -> nn.Module:
    """`model` with PEFT's LoRA adapters of `rank` (alpha 2 x rank, dropout 0, in the base's dtype) on
    every Linear but the output head (PEFT's "all-linear"), the base frozen. PlanError without peft."""
    try:
        import peft
    except ImportError:
        raise PlanError("the lora recipe needs PEFT: pip install peft") from None
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules="all-linear")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return peft.get_peft_model(model, config, autocast_adapter_dtype=False)


class Step:
    """A model built from `config` on the meta device (or given, on any device) and set up for
    `recipe`, with its AdamW; `peak(batch, seq)` the peak live bytes of one training step.

    The model starts eager; `patch()` applies invact.patch() (after which it stays patched).
    `checkpointing` toggles Hugging Face's gradient checkpointing per call of peak()."""

    def __init__(self, config, recipe: str | Recipe = "bf16", *, rank: int = DEFAULT_RANK,
                 model: nn.Module | None = None, images: int | None = None, image_size: int | None = None,
                 device: str = "cuda", ranks: int | None = None) -> None:  # fmt: skip
        if device not in DEVICES:
            raise PlanError(f"unknown device {device!r} (choose from {', '.join(DEVICES)})")
        self.device = device
        self.recipe = RECIPES[recipe] if isinstance(recipe, str) else recipe
        if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
            raise PlanError(f"the LoRA rank must be a positive integer, got {rank!r}")
        self.rank = rank
        if model is None:
            model, self.attention = build_model(load_config(config)[0], self.recipe.dtype)
        else:
            self.attention = getattr(model.config, "_attn_implementation", None)
        self.base = model
        self.model = add_lora(model, rank) if self.recipe.lora else model
        # autocast on the meta device: invact._autocast's, as on `device`
        meta = next(model.parameters()).is_meta
        self.autocast = Autocast(device, self.recipe.autocast) if self.recipe.autocast and meta else None
        self.model.train()
        self.images, self.image_size = images, image_size
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        # FSDP2 over `ranks` ranks (invact.sharding): the optimizer steps on each rank's shards
        self.sharding = Sharding(self.model, ranks) if ranks is not None else None
        self.stepped = self.sharding.trainable if self.sharding is not None else self.trainable
        # foreach: the default on CUDA (torch.optim's _default_to_fused_or_foreach), not on CPU or meta
        self.optimizer = torch.optim.AdamW(self.stepped, lr=1e-5, foreach=True)
        for p in self.stepped:  # the state AdamW creates in its first step
            p.grad = torch.zeros_like(p)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.patched = False
        # the meta ops' outputs by signature, for every step this Step follows (invact._meta_outputs)
        self._outputs = MetaOutputs()

    def patch(self) -> None:
        invact.patch(self.model)
        self.patched = True

    def _state(self) -> list[torch.Tensor]:
        return [t for s in self.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]

    def inputs(self, batch: int, seq: int) -> dict:
        return training_inputs(self.base, batch, seq, self.images, self.image_size, self.recipe.dtype)[0]

    def _region(self):
        """The forward's autocast region: the recipe's autocast (on the meta device, invact._autocast's)."""
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
        weights = [*params, *self.model.buffers()]
        given = [t for t in _output_tensors(inputs) if not t.is_cpu or not self._on_meta()]
        # the gradients: the parameters' (under FSDP2 the unsharded ones, until reduced) and the shards'
        with_grads = self.trainable if sharding is None else [*self.trainable, *self.stepped]

        def grads() -> int:
            storages = [p.grad.untyped_storage() for p in with_grads if p.grad is not None]
            return sum({s._cdata: s.nbytes() for s in storages}.values())

        outputs = self._outputs if self._on_meta() else None
        # a plan for a CPU adds what its bf16 matmuls allocate inside themselves (a real step's ops are
        # followed as they are: Step.follow on one counts no workspace)
        workspace = cpu_matmul_workspace if self._on_meta() and self.device == "cpu" else None
        uncounted = self.model.parameters() if sharding is not None else ()
        live = LiveBytes({"weights": weights, "optimizer": self._state(), "inputs": given}, grads, outputs,
                         workspace, uncounted)  # fmt: skip
        if sharding is not None:
            sharding.attach(live)
        try:
            meta = _values_as_on_device() if self._on_meta() else contextlib.nullcontext()
            autocast = self.autocast if self.autocast is not None else contextlib.nullcontext()
            with meta, standing_for(self.device), autocast, live:
                live.phase = "forward"
                with self._region():
                    loss = self.model(**inputs).loss
                live.phase = "backward"
                if sharding is not None:
                    sharding.backward()
                # The engine itself, not loss.backward(): a torch function mode is off while it handles a
                # call, and the planner's (_values_as_on_device) would then be off for the whole
                # backward, checkpointing's recompute of the forward included.
                _engine_run_backward((loss,), (torch.ones_like(loss),), False, False, (), True, True)
                del loss
                if sharding is not None:  # FSDP2's final callback: what the backward left reduced
                    sharding.finish()
                live.phase = "step"
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
        finally:
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
            _enable_checkpointing(self.base, self.autocast.contexts if self.autocast is not None else None)
        else:
            _disable_checkpointing(self.base)
        live = self.follow(self.inputs(batch, seq))
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

    def _on_meta(self) -> bool:
        return next(self.model.parameters()).is_meta


# The longest sequence searched where the config gives no max_position_embeddings: 2^20 tokens.
SEQ_CAP = 2**20
# The largest batch searched.
BATCH_CAP = 2**14


def parse_size(text: str) -> int:
    """Bytes of a size such as "24GiB", "80 GB", "24G" (binary), "1.5TiB" or "25769803776"
    (invact.plan_options.read_size); PlanError for anything else or a size that is not positive."""
    try:
        return read_size(text)
    except ValueError as e:
        raise PlanError(str(e)) from None


def largest(peak, budget: int, step: int, cap: int) -> tuple[int, dict, int]:
    """(the largest multiple x of `step` in [step, cap] with peak(x)["peak_bytes"] <= budget, 0 where
    not even `step` fits; peak(x) there, or peak(step) where nothing fits; how many peaks it computed).
    peak must not decrease as x grows. Each guess is the secant through the two nearest points known,
    rounded down to a multiple of `step` and kept inside the bracket, through peak(x)'s
    "activation_peak_bytes" where it has them (forward's and backward's peak, close to affine in the
    sequence and the batch; the optimizer step's, which does not grow, can make the whole peak flat):
    four or five peaks answer."""
    known: dict[int, dict] = {}

    def fits(x: int) -> bool:
        if x not in known:
            known[x] = peak(x)
        return known[x]["peak_bytes"] <= budget

    def bytes_at(x: int) -> int:  # what the secant follows: the part of the peak that grows with x
        fits(x)
        return known[x].get("activation_peak_bytes", known[x]["peak_bytes"])

    def down(value: float) -> int:
        return int(value) // step * step

    cap = max(step, down(cap))
    # Two probes first, 16 and 32 steps (most answers lie beyond them, and a secant through the smallest
    # sizes extrapolates from fixed costs); the smallest size only where the first does not fit.
    first = min(cap, 16 * step)
    if not fits(first):
        if first == step or not fits(step):
            return 0, known[step], len(known)
        low, high = step, first
    else:
        low, high = first, None
        x = min(cap, 2 * first)
    while high is None:  # grow: extrapolate through the last two points that fit
        if x <= low:
            return low, known[low], len(known)
        if not fits(x):
            high = x
            break
        before, low = low, x
        if low >= cap:
            return low, known[low], len(known)
        slope = (bytes_at(low) - bytes_at(before)) / (low - before)
        guess = low + (budget - bytes_at(low)) / slope if slope > 0 else 2 * low
        # at most 8 times as far: a peak still flat there (the gradients' end of backward) has no slope
        x = min(cap, 8 * low, max(low + step, down(guess)))
    moved = None  # the end the last guess moved; where a secant moves the same end twice, it bisects
    while high - low > step:  # narrow: the secant through the bracket's ends
        rise = bytes_at(high) - bytes_at(low)
        if rise > 0 and moved != "twice":
            guess = low + (budget - bytes_at(low)) * (high - low) / rise
        else:
            guess = (low + high) / 2
        x = min(high - step, max(low + step, down(guess)))
        side = "low" if fits(x) else "high"
        low, high = (x, high) if side == "low" else (low, x)
        moved = "twice" if side == moved else side
    return low, known[low], len(known)


VARIANTS = ((False, False), (False, True), (True, False), (True, True))  # (patched, checkpointing), in order


def _positions(config) -> int:
    """The longest sequence the config's positions take: max_position_embeddings (or n_positions) of
    its text model, else SEQ_CAP."""
    for source in (getattr(config, "text_config", None), config):
        for name in ("max_position_embeddings", "n_positions"):
            value = getattr(source, name, None)
            if isinstance(value, int) and value > 0:
                return value
    return SEQ_CAP


def _check_positive(**values) -> None:
    for name, value in values.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise PlanError(f"{name} must be a positive integer, got {value!r}")


def _by(step: Step, searched: str, batch: int | None, seq: int | None, checkpointing: bool):
    """x -> step's peak at sequence x (searched "seq") or batch x."""
    if searched == "seq":
        return lambda x: step.peak(batch, x, checkpointing=checkpointing)
    return lambda x: step.peak(x, seq, checkpointing=checkpointing)


def plan_step(config, batch: int | None, seq: int | None, *, recipes=DEFAULT_RECIPES,
              rank: int = DEFAULT_RANK, fits: int | str | None = None, device: str = "cuda",
              images: int | None = None, image_size: int | None = None,
              ranks: int | None = None) -> dict:  # fmt: skip
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
    (`fully_shard` on each decoder layer, then the root; invact.sharding), each with `batch` x `seq` of
    its own; the result's `ranks` says which (1 plans one device: FSDP2 on one rank keeps each parameter
    once, as one device does)."""
    _check_positive(batch=batch, seq=seq, ranks=ranks)
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
    config, path = load_config(config)
    cap = (_positions(config) if searched == "seq" else BATCH_CAP) if searched else None
    rows, model_class = [], None
    for name in recipes:
        step = Step(config, name, rank=rank, device=device, images=images, image_size=image_size,
                    ranks=ranks if ranks != 1 else None)  # fmt: skip
        model_class = type(step.base).__name__
        for patched, checkpointing in VARIANTS:
            if patched and not step.patched:
                step.patch()
            if searched:
                answer, peak, count = largest(_by(step, searched, batch, seq, checkpointing), budget,
                                              SEQ_MULTIPLE if searched == "seq" else 1, cap)  # fmt: skip
                shape = (batch, answer) if searched == "seq" else (answer, seq)
            else:
                peak, count, shape = step.peak(batch, seq, checkpointing=checkpointing), 1, (batch, seq)
            rows.append({"recipe": name, "patched": patched, "checkpointing": checkpointing,
                         "batch": shape[0], "seq": shape[1], **peak, "peaks": count})  # fmt: skip
    return {
        "config": path,
        "model_type": getattr(config, "model_type", None),
        "model_class": model_class,
        "dtype": "bfloat16",
        "device": device,
        "ranks": ranks,
        "rank": rank,
        "batch": batch,
        "seq": seq,
        "fits_bytes": budget,
        "searched": searched,
        "cap": cap,
        "rows": rows,
    }
