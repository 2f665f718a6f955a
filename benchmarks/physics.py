"""Physics checks for benchmark rows: the FLOP/s and bytes/s a timed step implies, against the device's
datasheet peaks. A row above the peak measured something other than what it names, so the scripts
refuse to write it.

Why this exists: the first H100 run (benchmarks/results/speed_h100-80gb-hbm3*.json) reported
"BERT-base (batch 64, seq 1024, 12 layers)" forward+backward in 30.7 ms fp32 and 21.3 ms bf16. That
step is 4.08e13 FLOPs (FlopCounterMode, meta device): 1.3 PFLOP/s in fp32 (peak 67 TFLOP/s without
TF32) and 1.9 PFLOP/s in bf16 (peak 989.5 dense). The cause was in speed.setups(): BERT's input
factory was a lambda reading the loop-level names b and s when called, and those were rebound to the
Llama row's (1, 512) before any row ran, so the "batch 64, seq 1024" row timed batch 1, seq 512
(2.9e11 FLOPs, 141x less; about 9 TFLOP/s, host-bound). See speed.py for the fix and the checks.

Pure parts (tested on CPU with made-up peaks): DevicePeak, device_peak, peak_tflops, rates,
row_violations, timing_violations. StepCount counts FLOPs and saved bytes of a step, on the meta device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

import torch


@dataclasses.dataclass(frozen=True)
class DevicePeak:
    """Dense datasheet peaks (no structured sparsity): TFLOP/s per math mode, HBM GB/s, and the L2
    size (bytes), which bounds what a step may read from cache instead of HBM."""

    name: str
    fp32_tflops: float  # CUDA cores, no tensor cores
    tf32_tflops: float  # tensor cores, fp32 matmuls with TF32 enabled
    bf16_tflops: float
    fp16_tflops: float
    hbm_gbps: float
    l2_bytes: int


_MB = 10**6
# NVIDIA H100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h100, "Technical
# Specifications"): H100 SXM FP32 67 TFLOPS, TF32 Tensor Core 989, BF16/FP16 Tensor Core 1,979, GPU
# memory bandwidth 3.35 TB/s; H100 NVL 60, 835, 1,671, 3.9 TB/s; H100 PCIe (earlier datasheet) 51, 756,
# 1,513, 2 TB/s. The tensor-core figures there are "with sparsity": dense is half. L2: 50 MB (NVIDIA
# H100 Tensor Core GPU Architecture whitepaper).
H100_SXM = DevicePeak("H100 SXM", 67.0, 494.5, 989.5, 989.5, 3350.0, 50 * _MB)
H100_NVL = DevicePeak("H100 NVL", 60.0, 417.5, 835.5, 835.5, 3900.0, 50 * _MB)
H100_PCIE = DevicePeak("H100 PCIe", 51.0, 378.0, 756.5, 756.5, 2000.0, 50 * _MB)
# NVIDIA H200 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h200): H200 SXM FP32 67 TFLOPS,
# TF32 989, BF16/FP16 1,979 (with sparsity), 4.8 TB/s; H200 NVL 60, 835, 1,671, 4.8 TB/s. Same GH100
# die as the H100: 50 MB L2.
H200_SXM = DevicePeak("H200 SXM", 67.0, 494.5, 989.5, 989.5, 4800.0, 50 * _MB)
H200_NVL = DevicePeak("H200 NVL", 60.0, 417.5, 835.5, 835.5, 4800.0, 50 * _MB)
# NVIDIA GH200 Grace Hopper Superchip datasheet: the H100-class GPU's FP32 67 TFLOPS, TF32 989, BF16/FP16
# 1,979 (with sparsity), memory bandwidth up to 4.9 TB/s (HBM3e; 4 TB/s with HBM3). Its name contains
# "H200", so it is matched first, with the larger bandwidth.
GH200 = DevicePeak("GH200", 67.0, 494.5, 989.5, 989.5, 4900.0, 50 * _MB)
# NVIDIA A100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/a100): FP32 19.5 TFLOPS, TF32
# 156 (312 with sparsity), BF16/FP16 312 (624); memory bandwidth 80GB SXM 2,039 GB/s, 80GB PCIe 1,935,
# 40GB (SXM and PCIe) 1,555. L2: 40 MB (NVIDIA A100 Tensor Core GPU Architecture whitepaper).
A100_80GB_SXM = DevicePeak("A100 80GB SXM", 19.5, 156.0, 312.0, 312.0, 2039.0, 40 * _MB)
A100_80GB_PCIE = DevicePeak("A100 80GB PCIe", 19.5, 156.0, 312.0, 312.0, 1935.0, 40 * _MB)
A100_40GB = DevicePeak("A100 40GB", 19.5, 156.0, 312.0, 312.0, 1555.0, 40 * _MB)


def _family_max(name: str, *peaks: DevicePeak) -> DevicePeak:
    """The largest of each figure over a family: for a name that says only 'H100' or 'A100', a bound
    no member exceeds, so it never flags a valid row (it may miss a marginal one)."""
    fields = [f.name for f in dataclasses.fields(DevicePeak) if f.name != "name"]
    return DevicePeak(name, *(max(getattr(p, f) for p in peaks) for f in fields))


# Matched in order against torch.cuda.get_device_name() (case-insensitive substring), specific names
# first: 'NVIDIA H100 80GB HBM3' is the SXM board, 'NVIDIA A100-SXM4-80GB', 'NVIDIA A100 80GB PCIe',
# 'NVIDIA A100-PCIE-40GB', 'NVIDIA H200', 'NVIDIA H200 NVL', 'NVIDIA GH200 480GB'.
DATASHEET_PEAKS: tuple[tuple[str, DevicePeak], ...] = (
    ("H100 80GB HBM3", H100_SXM),
    ("H100 SXM", H100_SXM),
    ("H100 NVL", H100_NVL),
    ("H100 PCIe", H100_PCIE),
    ("H100", _family_max("H100 (variant unknown: family maximum)", H100_SXM, H100_NVL, H100_PCIE)),
    ("GH200", GH200),
    ("H200 NVL", H200_NVL),
    ("H200", H200_SXM),
    ("A100-SXM4-80GB", A100_80GB_SXM),
    ("A100-SXM-80GB", A100_80GB_SXM),
    ("A100 80GB PCIe", A100_80GB_PCIE),
    ("A100-SXM4-40GB", A100_40GB),
    ("A100-PCIE-40GB", A100_40GB),
    ("A100", _family_max("A100 (variant unknown: family maximum)", A100_80GB_SXM, A100_80GB_PCIE, A100_40GB)),
)


def device_peak(device_name: str) -> DevicePeak | None:
    """The datasheet peaks of the CUDA device torch names `device_name`; None for a device not in
    DATASHEET_PEAKS (no check; the scripts say so)."""
    lowered = device_name.lower()
    return next((peak for key, peak in DATASHEET_PEAKS if key.lower() in lowered), None)


def fp32_matmul_mode() -> str:
    """How this process runs fp32 matmuls on CUDA: 'tf32' where TF32 is enabled (by
    torch.backends.cuda.matmul.fp32_precision, the global torch.backends.fp32_precision, allow_tf32
    or set_float32_matmul_precision('high'); the first reflects them all where it exists), 'bf16' with
    set_float32_matmul_precision('medium') (bf16 tensor cores allowed: the generous bound), else
    'ieee'."""
    matmul = torch.backends.cuda.matmul
    try:
        precision = torch.get_float32_matmul_precision()
    except RuntimeError:  # torch >= 2.9 refuses to read the legacy setting once the new API was used
        precision = None
    if precision == "medium":
        return "bf16"
    new = getattr(matmul, "fp32_precision", None)
    if new is not None:
        return "tf32" if new == "tf32" else "ieee"
    return "tf32" if matmul.allow_tf32 or precision == "high" else "ieee"


def peak_tflops(peak: DevicePeak, dtype: str, fp32_matmul: str = "ieee") -> float:
    """The peak a step's matmul FLOPs are held to: bf16/fp16 tensor cores for those dtypes; for
    float32 the TF32 tensor-core peak only where TF32 was enabled in that run (bf16's where 'medium'
    precision allowed bf16), else the CUDA cores' fp32 peak."""
    if dtype == "bfloat16":
        return peak.bf16_tflops
    if dtype == "float16":
        return peak.fp16_tflops
    if dtype != "float32":
        raise ValueError(f"no peak for dtype {dtype!r}")
    return {"ieee": peak.fp32_tflops, "tf32": peak.tf32_tflops, "bf16": peak.bf16_tflops}[fp32_matmul]


def rates(flops: float, nbytes: float, ms: float) -> tuple[float, float]:
    """(TFLOP/s, GB/s) of `flops` and `nbytes` done in `ms` milliseconds."""
    return flops / ms / 1e9, nbytes / ms / 1e6


def row_violations(
    name: str,
    figures: Mapping[str, tuple[float, float, float]],
    peak: DevicePeak,
    dtype: str,
    fp32_matmul: str = "ieee",
) -> list[str]:
    """One-line errors for a row whose timings imply more than the device can do. `figures`: {timing
    key: (ms, FLOPs, minimum bytes)} of one step. FLOPs are held to peak_tflops. Bytes are held to the
    HBM peak after crediting one L2's worth (data a step may find in cache instead of HBM: the same
    input tensors are read step after step), so a lower bound of bytes never flags a valid row."""
    limit = peak_tflops(peak, dtype, fp32_matmul)
    mode = {"ieee": "fp32 (TF32 off)", "tf32": "TF32", "bf16": "bf16"}[fp32_matmul]
    label = mode if dtype == "float32" else dtype
    errors = []
    for key, (ms, flops, nbytes) in figures.items():
        if not ms > 0:
            errors.append(f"{name}: {key} = {ms} ms is not a positive time")
            continue
        tflops, _ = rates(flops, nbytes, ms)
        if tflops > limit:
            errors.append(f"{name}: {key} {ms:.3f} ms for {flops:.3g} FLOP is {tflops:.1f} TFLOP/s, above "
                          f"the {peak.name} datasheet peak of {limit:.1f} TFLOP/s ({label})")  # fmt: skip
        _, gbps = rates(flops, max(0.0, nbytes - peak.l2_bytes), ms)
        if gbps > peak.hbm_gbps:
            errors.append(f"{name}: {key} {ms:.3f} ms to move at least {nbytes:.3g} bytes is {gbps:.0f} GB/s "
                          f"from HBM (less the {peak.l2_bytes / 1e6:.0f} MB L2), above the {peak.name} "
                          f"datasheet peak of {peak.hbm_gbps:.0f} GB/s")  # fmt: skip
    return errors


# How far below an independent measure of the same step a CUDA-event time may fall before the events
# are taken to have missed work (a backward on another stream, work queued after the end event). No
# GPU run has yet recorded both; the spread of timings of one step in the committed H100 runs is at
# most a factor 1.66 (the widest interquartile range of per-round ratios: 1.80-2.98, bf16 gelu_tanh,
# precision-bit), so a factor 2 stays outside the noise seen. (The BERT row's events were not at
# fault: they timed correctly the smaller setup that ran; the peak and the input-shape check catch it.)
EVENT_TOLERANCE = 2.0


def timing_violations(
    name: str, event_ms: Mapping[str, float], reference_ms: Mapping[str, float], what: str,
    tolerance: float = EVENT_TOLERANCE,
) -> list[str]:  # fmt: skip
    """One-line errors where the CUDA-event time of a key falls below its reference (wall clock of
    synchronized steps, or the profiler's device-busy time: neither can miss work on any stream) by
    more than `tolerance`."""
    errors = []
    for key, reference in reference_ms.items():
        ms = event_ms[key]
        if ms * tolerance < reference:
            errors.append(f"{name}: {key} {ms:.3f} ms by CUDA events, but {reference:.3f} ms by {what}: the "
                          f"events missed part of the step")  # fmt: skip
    return errors


def peak_note(device_name: str, peak: DevicePeak | None, dtype: str, fp32_matmul: str) -> str:
    """One line saying what the rows were checked against, or that they were not."""
    if peak is None:
        return f"no datasheet peak known for {device_name!r}: rows NOT checked against a peak"
    mode = f", fp32 matmuls {fp32_matmul}" if dtype == "float32" else ""
    return (f"checked against the {peak.name} datasheet: {peak_tflops(peak, dtype, fp32_matmul):.1f} "
            f"TFLOP/s ({dtype}{mode}), {peak.hbm_gbps:.0f} GB/s HBM")  # fmt: skip


def _footprint(t: torch.Tensor) -> tuple[int, int]:
    """(storage identity, bytes): the tensor's bytes, capped by its storage's (an expanded view)."""
    storage = t.untyped_storage()
    return storage._cdata, min(t.numel() * t.element_size(), storage.nbytes())


def _footprints(tensors: Iterable[torch.Tensor]) -> dict[int, int]:
    out: dict[int, int] = {}
    for t in tensors:
        key, nbytes = _footprint(t)
        out[key] = max(out.get(key, 0), nbytes)
    return out


class StepCount:
    """Context manager around one step (meant for the meta device, where it costs no arithmetic and
    holding every saved storage costs no memory): `flops` (torch.utils.flop_counter.FlopCounterMode:
    matmuls, convolutions, attention; elementwise ops count nothing) and the storages autograd saves
    for backward, for minimum_bytes. Attention is counted as a fused kernel saves it (_FusedAttention)."""

    def __init__(self) -> None:
        from torch.utils.flop_counter import FlopCounterMode

        self._counter = FlopCounterMode(display=False)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._attention = _FusedAttention(self)
        self.saved: dict[int, int] = {}
        self._alive: list[torch.UntypedStorage] = []
        self.flops = 0

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if self._attention.depth:  # the math path's internals: see _FusedAttention
            return t
        key, nbytes = _footprint(t)
        self.saved[key] = max(self.saved.get(key, 0), nbytes)
        # Held until the count is dropped: a storage is known by its address, which a storage
        # allocated after this one is freed (a gradient in the backward) would otherwise take over.
        self._alive.append(t.untyped_storage())
        return t

    def __enter__(self) -> StepCount:
        self._counter.__enter__()
        self._hooks.__enter__()
        self._attention.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._attention.__exit__(*exc)
        self._hooks.__exit__(*exc)
        self._counter.__exit__(*exc)
        self.flops = self._counter.get_total_flops()

    def minimum_bytes(self, reads: Iterable[torch.Tensor], writes: Iterable[torch.Tensor],
                      saved: bool = True) -> int:  # fmt: skip
        """A lower bound of the bytes the step moves: each of `reads` (tensors that exist before it:
        inputs, dy, parameters) read once, each of `writes` (what outlives it: the output, gradients)
        written once, and, with `saved`, each storage autograd saved read once more by the backward
        and, unless it is one of those (an input, a parameter, the output), written once by the
        forward. Per storage, the largest view of it that was seen (a lower bound of what is touched)."""
        known = _footprints(reads)
        written = _footprints(writes)
        total = sum(known.values()) + sum(nbytes for key, nbytes in written.items() if key not in known)
        known.update(written)
        if saved:
            total += sum(nbytes if key in known else 2 * nbytes for key, nbytes in self.saved.items())
        return total


class _FusedAttention(torch.overrides.TorchFunctionMode):
    """Counts scaled_dot_product_attention as the fused kernels a GPU runs save it: query, key, value
    and the output (their logsumexp left out), not as the math path the meta device takes, whose
    saved (batch, heads, seq, seq) scores, probabilities and dropout mask (about 10 GB a layer for the
    paper's BERT row in fp32) no flash or memory-efficient kernel writes. The FLOPs are the same
    either way: the math path's two batched products forward, four backward, as FlopCounterMode's
    formula for the fused ops."""

    def __init__(self, count: StepCount) -> None:
        super().__init__()
        self.count, self.depth = count, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not torch.nn.functional.scaled_dot_product_attention:
            return func(*args, **kwargs)
        self.depth += 1
        try:
            out = func(*args, **kwargs)
        finally:
            self.depth -= 1
        if torch.is_grad_enabled():
            for t in (*args[:3], out):
                self.count._pack(t)
        return out


def forward_read_parameters(model: torch.nn.Module) -> list[torch.Tensor]:
    """The parameters a forward reads in full: all but embedding tables (a lookup reads only the rows
    of the ids; counted as nothing, which keeps the bytes a lower bound)."""
    tables = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    return [p for p in model.parameters() if id(p) not in tables]
