"""The live bytes of a training step and their peak, followed op by op (`LiveBytes`): a
TorchDispatchMode (below autograd: every op of the step, the backward's and the optimizer's included,
reaches it) notes each output's storage with a weak reference to it (torch.UntypedStorage._weak_ref,
the StorageImpl's own count, so views and autograd's saved copies keep it alive exactly as they keep a
real storage alive). The live total rises by a storage's bytes when an op first returns it and falls
when its last reference goes. The mode checks the weak references only when the total (stale entries
included, so never below the true total) would pass the peak so far: a step of a 16-layer model checks
a few hundred times, not at each of its ops. Where autograd sums two gradients of one tensor it adds in
place in a plain step, out of place under a dispatch mode: LiveBytes counts such a sum as in place
(LiveBytes._summed_in_place). Storage bytes are the bytes a tensor asks for (an allocator rounds up:
CUDA's caching allocator to 512 bytes), and what a kernel allocates inside itself without an op (a
workspace) is not seen, but for one a plan for a CPU adds: a bf16 matmul's copy of its second operand
where that operand is at most CPU_PACKED_N columns wide (cpu_matmul_workspace: a loss's d hidden =
d logits x W of a model whose hidden size is that small)."""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from invact.planner.as_on_device import tensors_in
from invact.planner.meta_outputs import MetaOutputs

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
        self.outputs = outputs  # a meta step's ops, called through it (invact.planner.meta_outputs)
        self.workspace = workspace
        self.live: dict[int, tuple[int, int, str]] = {}  # storage key -> (weak ref, bytes, label)
        self.by_label: dict[str, int] = {}
        self.total = 0
        # storages never counted, whatever op returns them (views of them included): under FSDP2's plan
        # the model's full parameters, whose bytes invact.planner.sharding's buffers stand for
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
        for t in tensors_in(out):
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
