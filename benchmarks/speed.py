"""Forward+backward time of InvAct against torch, side by side in one process: the paper's setups.

Setups (the paper's time table, A100): the bare activation (gelu, gelu_tanh, silu, quick_gelu, and softplus,
which is monotone and stores no bit), Linear+GELU, an MLP block, GeGLU, BERT-base and a
Llama-3.1-8B-shaped decoder (SiLU), each as torch eager, InvAct bits, InvAct precision-bit and (with
--compile) torch.compile of the torch model. Runs are interleaved (torch, bits, precision-bit,
compile, then the same order rotated by one, ...): each variant's median of --repeats is reported, and
its ratio to torch is the median of the per-round ratios (each round runs every variant once, back to
back, so a slow spell of a shared machine hits both sides of a ratio), with their quartiles. On CPU it
also times the backward kernel alone against a torch pass moving the same bytes (back to back, and
with the caches emptied before each call: from memory), and it reports the first call in a fresh
process with cold and warm kernel caches. CUDA timings use CUDA events. Sizes: --preset paper is the
paper's (for a GPU), cpu is scaled down for a 2-core machine, --small is a smoke run. On CUDA it also
reports the bandwidth of the bare Triton kernels, and per row the time the GPU itself is busy per
step (profiler), torch against InvAct bits, which leaves out time the GPU waits for the host. Writes
benchmarks/results/speed_<device>.json and prints a markdown table.

Every row also carries the FLOPs of its step and a lower bound of the bytes it moves (step_costs: the
timed step run on the meta device), and the TFLOP/s and GB/s each of its times implies. On CUDA a row
above the device's datasheet peak (physics.py), or whose CUDA-event times the synchronized wall clock
or the profiler contradicts, is refused: exit status 1, one line per error, nothing written. This
exists because the first H100 run's "BERT-base (batch 64, seq 1024)" row timed batch 1, seq 512 (a
lambda in setups() read b and s after the Llama row rebound them) and reported 1.3 PFLOP/s in fp32;
rows now declare their input shapes and measure_row checks them.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from physics import (
    DevicePeak,
    StepCount,
    device_peak,
    forward_read_parameters,
    fp32_matmul_mode,
    peak_note,
    rates,
    row_violations,
    timing_violations,
)
from torch import nn

import invact
from invact.activation.activations import ACTIVATIONS

from timing import device_busy_ms, device_name, median_ms, timer, version, wall_ms, write_result
from tune import kernel_bandwidth

# (elements of the bare activation, tokens x width of the Linear/MLP/GeGLU rows, BERT batch x seq x
# layers, Llama batch x seq x layers; on CPU a Llama-style decoder layer of the rows' width, batch x
# seq: the shape at which a compiled patched layer took 1.08-1.09x compiled torch's while invact's ops
# ran their Python in the compiled graph)
PRESETS = {
    "paper": {
        "elements": 2**25,
        "tokens": 2**15,
        "width": 2**10,
        "bert": (64, 1024, 12),
        "llama": (1, 512, 2),
    },
    "cpu": {
        "elements": 2**22,
        "tokens": 2**12,
        "width": 2**9,
        "bert": (1, 256, 2),
        "llama": (1, 128, 1),
        "decoder": (4, 256),
    },
    "small": {
        "elements": 2**12,
        "tokens": 2**6,
        "width": 2**5,
        "bert": (1, 16, 1),
        "llama": (1, 8, 1),
        "decoder": (1, 8),
    },
}
TORCH_ACTIVATIONS = {
    "gelu": nn.GELU,
    "gelu_tanh": lambda: nn.GELU(approximate="tanh"),
    "silu": nn.SiLU,
    "quick_gelu": lambda: _QuickGELU(),
    "softplus": nn.Softplus,  # monotone: InvAct stores no bit
}


class _QuickGELU(nn.Module):
    def forward(self, x):
        return ACTIVATIONS["quick_gelu"].torch_forward(x)


class GeGLU(nn.Module):
    """x -> gelu(x W_g) * (x W_u): the gated block of the paper's GeGLU row."""

    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.proj, self.act = nn.Linear(width, 2 * hidden), nn.GELU()

    def forward(self, x):
        gate, up = self.proj(x).chunk(2, dim=-1)
        return self.act(gate) * up


class Setup(NamedTuple):
    """A row of the table: its name, model factory, input factory (keyword arguments of the model), and
    the input shapes its name states, fixed where the row is declared; measure_row checks the inputs
    the factory makes against them before timing anything."""

    name: str
    make_model: Callable[[], nn.Module]
    make_inputs: Callable[[], dict]
    shapes: dict[str, tuple[int, ...]]


def _floats(shape: tuple[int, ...]) -> Callable[[], dict]:
    """A factory of a random float `input` of `shape`, the shape bound now. A lambda written in
    setups() over its local names would read them when called, after they were rebound: that is how
    the first H100 run's "BERT-base (batch 64, seq 1024)" row timed the Llama row's batch 1, seq 512."""
    return lambda: {"input": torch.randn(shape)}


def _token_ids(shape: tuple[int, ...]) -> Callable[[], dict]:
    """A factory of random `input_ids` of `shape` (ids below 1000), the shape bound now (see _floats)."""
    return lambda: {"input_ids": torch.randint(0, 1000, shape)}


def setups(preset: dict, small: bool) -> list[Setup]:
    """The rows of the table, in order, for a preset's sizes."""
    n, t, w = preset["elements"], preset["tokens"], preset["width"]
    rows = []
    for name, make in TORCH_ACTIVATIONS.items():
        model = lambda make=make: nn.Sequential(make())  # noqa: E731 - patch() replaces children
        rows.append(Setup(f"{name} ({n} elements)", model, _floats((n,)), {"input": (n,)}))
    tokens = {"input": (t, w)}
    rows += [
        Setup(f"Linear+GELU ({t} x {w})", lambda w=w: nn.Sequential(nn.Linear(w, w), nn.GELU()),
              _floats((t, w)), tokens),
        Setup(f"MLP ({t}, {w} -> {4 * w} -> {w})", lambda w=w: nn.Sequential(nn.Linear(w, 4 * w), nn.GELU(),
                                                                              nn.Linear(4 * w, w)),
              _floats((t, w)), tokens),
        Setup(f"GeGLU ({t}, {w} -> {4 * w})", lambda w=w: GeGLU(w, 4 * w), _floats((t, w)), tokens),
    ]  # fmt: skip
    try:
        import transformers
    except ImportError:
        return rows
    b, s, layers = preset["bert"]
    bert = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4} if small else {}
    bert_config = dict(
        num_hidden_layers=layers, max_position_embeddings=s, attn_implementation="sdpa", **bert
    )
    rows.append(Setup(
        f"BERT-base (batch {b}, seq {s}, {layers} layers)",
        lambda config=bert_config: transformers.BertModel(transformers.BertConfig(**config)),
        _token_ids((b, s)), {"input_ids": (b, s)},
    ))  # fmt: skip
    b, s, layers = preset["llama"]  # rebinds b, s, layers: every factory above has bound its own
    llama = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8)
    if small:
        llama = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
    llama_config = dict(num_hidden_layers=layers, vocab_size=32000, attn_implementation="sdpa", **llama)
    rows.append(Setup(
        f"Llama-3.1-8B-shaped (batch {b}, seq {s}, {layers} layers)",
        lambda config=llama_config: transformers.LlamaModel(transformers.LlamaConfig(**config)),
        _token_ids((b, s)), {"input_ids": (b, s)},
    ))  # fmt: skip
    if "decoder" in preset:
        b, s = preset["decoder"]
        heads = dict(num_attention_heads=max(w // 64, 1), num_key_value_heads=max(w // 256, 1))
        decoder = dict(hidden_size=w, intermediate_size=w * 8 // 3 // 16 * 16, num_hidden_layers=1,
                       vocab_size=1000, attn_implementation="sdpa", **heads)  # fmt: skip
        rows.append(Setup(
            f"Llama-style decoder layer (hidden {w}, batch {b}, seq {s})",
            lambda config=decoder: transformers.LlamaModel(transformers.LlamaConfig(**config)),
            _token_ids((b, s)), {"input_ids": (b, s)},
        ))  # fmt: skip
    return rows


class BenchmarkError(RuntimeError):
    """A row that would not time what it names: main prints it in one line and writes nothing."""


def check_inputs(setup: Setup, inputs: dict) -> None:
    """Raise BenchmarkError unless the factory's inputs have the shapes the row's name states."""
    actual = {k: tuple(v.shape) for k, v in inputs.items()}
    if actual != {k: tuple(v) for k, v in setup.shapes.items()}:
        raise BenchmarkError(f"{setup.name}: its input factory makes {actual}, its name states "
                             f"{setup.shapes}: the row would time another setup")  # fmt: skip


def _step(model: nn.Module, inputs: dict) -> Callable[[], None]:
    """One forward + backward(dy); float inputs get requires_grad so bare activations have a backward.
    dy is drawn once (seeded) and reused, so no loss computation dilutes the ratio. Gradients are
    zeroed in place, not freed: on CPU a freed gradient is allocated again, and the page faults of
    refilling hundreds of fresh MB (the embedding's gradient in the Llama row) took 130 to 670 ms per
    step from one step to the next, the same work for every variant.

    The returned step has two attributes: `model`, and `probe`, None while timing; where set (the
    warm-up's last call, the count on the meta device), probe(kwargs, out, dy) is called after the
    backward and before the gradients are zeroed, to see what the step read, wrote and reached."""
    dy: list[torch.Tensor] = []

    def step():
        kwargs = {k: v.detach().requires_grad_() if v.is_floating_point() else v for k, v in inputs.items()}
        out = model(**kwargs) if "input" not in kwargs else model(kwargs["input"])
        out = getattr(out, "last_hidden_state", out)
        if not dy:  # on the meta device (counting) there is nothing to draw
            seeded = torch.Generator().manual_seed(1)
            dy.append(
                torch.empty_like(out) if out.is_meta else torch.randn(out.shape, generator=seeded).to(out)
            )
        out.backward(dy[0])
        if step.probe is not None:
            step.probe(kwargs, out, dy[0])
        model.zero_grad(set_to_none=False)

    step.model, step.probe = model, None
    return step


def _invact_copy(model: nn.Module, mode: str) -> nn.Module:
    patched = copy.deepcopy(model)
    invact.patch(patched, mode=mode)
    for name, child in list(patched.named_children()):
        if isinstance(child, _QuickGELU):  # this file's stand-in for transformers' QuickGELUActivation
            setattr(patched, name, invact.InvActQuickGELU(mode=mode))
    return patched


def _counting(step: Callable[[], None], usage: list[tuple[int, float]]) -> Callable[[], None]:
    """step, appending to `usage` the page faults (minor: fresh pages touched the first time, 4 KiB
    each) and the system CPU time (ms, every thread) each call takes. On a VM a fault costs about 2 us
    (a 2-core KVM EPYC: 0.13 s of system time for the 74k faults of one GeGLU step), so a step that
    touches hundreds of MB of fresh memory spends much of its time in the kernel, however fast its
    arithmetic: the Llama row's weight gradients take 1.3 GB of fresh pages a step."""
    import resource

    def run():
        before = resource.getrusage(resource.RUSAGE_SELF)
        step()
        after = resource.getrusage(resource.RUSAGE_SELF)
        usage.append((after.ru_minflt - before.ru_minflt, (after.ru_stime - before.ru_stime) * 1e3))

    return run


def allocator() -> str:
    """The malloc this process runs with: tcmalloc or jemalloc where one is loaded (LD_PRELOAD), else
    the C library's. glibc hands a freed block of 32 MB or more back to the kernel at once, so every
    large tensor lands on fresh pages; tcmalloc keeps them for the next allocation."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "unknown"
    for name in ("tcmalloc", "jemalloc", "mimalloc"):
        if name in maps:
            return name
    return "the C library's malloc"


GPU_BUSY_CALLS = 5  # steps profiled per variant for the GPU's busy time (CUDA only)
# Steps per variant timed back to back between two synchronizations (CUDA only): the wall-clock check
# of the events' medians (physics.timing_violations). Few: the paper's fp32 BERT step takes about a
# second (4.1e13 FLOPs at the fp32 peak's 67 TFLOP/s is 0.61 s).
WALL_CALLS = 3

# Each timing key of a row, and the variant whose minimum bytes it moves (step_costs): torch.compile may
# recompute what eager saves, so its bound counts no saved tensors.
BYTES_OF = {"torch_ms": "torch", "invact_ms": "invact", "precision_bit_ms": "precision_bit",
            "compile_ms": "compile", "invact_compile_ms": "compile", "torch_gpu_ms": "torch",
            "invact_gpu_ms": "invact", "compile_gpu_ms": "compile",
            "invact_compile_gpu_ms": "compile"}  # fmt: skip
# The variants whose GPU busy time a CUDA row reports (those the row timed), and the busy-time ratios:
# (ratio key, variant, baseline). The compiled pair shows whether a compiled step's extra time is the
# host's (busy time equal) or the device's.
BUSY = ("torch", "invact", "compile", "invact_compile")
BUSY_RATIOS = (
    ("invact_gpu_ratio", "invact", "torch"),
    ("invact_compile_gpu_ratio", "invact_compile", "compile"),
)


def _count(model: nn.Module, inputs: dict) -> tuple[int, int, int]:
    """(FLOPs, minimum bytes, minimum bytes without saved tensors) of one _step on `model` and
    `inputs` (meta device): the second call, the one like every timed call, checked equal in FLOPs to
    the first (a step whose work shrinks after its first call, a cache, would show)."""
    step, seen = _step(model, inputs), {}

    def probe(kwargs, out, dy):
        grads = [v.grad for v in (*kwargs.values(), *model.parameters()) if v.grad is not None]
        seen.update(reads=[*kwargs.values(), dy, *forward_read_parameters(model)], writes=[out, *grads])

    step.probe = probe
    with StepCount() as first:
        step()
    with StepCount() as count:
        step()
    if count.flops != first.flops:
        raise BenchmarkError(f"a step counts {count.flops:.4g} FLOPs after a first of {first.flops:.4g}")
    return count.flops, count.minimum_bytes(**seen), count.minimum_bytes(**seen, saved=False)


def step_costs(setup: Setup, dtype: torch.dtype = torch.float32) -> dict:
    """FLOPs and minimum bytes of one timed step: counted once per setup, on the meta device (shapes
    only, no arithmetic: the paper's BERT row counts in seconds on a CPU), by running the very _step
    that is timed on a model and inputs from the row's own factories, so what is counted is what runs
    (a tiny run scaled up would trust a scaling formula instead). One FLOP count serves every
    variant: FlopCounterMode counts matmuls and attention, InvAct changes only the elementwise
    activations (checked: its models count the same), and torch.compile's partitioner does not
    recompute matmuls. Bytes (StepCount.minimum_bytes) differ: what each variant saves; for the bare
    activations that is exactly what the kernels move (torch: 5 element sizes per element; InvAct bits
    5 plus 1/4 byte)."""
    with torch.device("meta"):
        model = setup.make_model().to(dtype).train()
        inputs = {k: v.to(dtype) if v.is_floating_point() else v for k, v in setup.make_inputs().items()}
    check_inputs(setup, inputs)
    flops, min_bytes = {}, {}
    for variant, mode in (("torch", None), ("invact", "bits"), ("precision_bit", "precision_bit")):
        flops[variant], min_bytes[variant], unsaved = _count(
            model if mode is None else _invact_copy(model, mode), inputs
        )
        if mode is None:
            min_bytes["compile"] = unsaved
    if len(set(flops.values())) > 1:
        raise BenchmarkError(f"{setup.name}: FLOPs differ between variants: {flops}")
    return {"flops": flops["torch"], "min_bytes": min_bytes}


def figures(row: dict) -> dict[str, tuple[float, float, float]]:
    """{timing key: (ms, FLOPs, minimum bytes)} of a measured row, for physics.row_violations."""
    return {k: (row[k], row["flops"], row["min_bytes"][v]) for k, v in BYTES_OF.items() if k in row}


def _check_training(name: str, key: str, model: nn.Module) -> None:
    """Raise BenchmarkError if any module of the model is in eval mode (dropout off: not the training
    step the row names)."""
    frozen = next((n or "the model" for n, m in model.named_modules() if not m.training), None)
    if frozen is not None:
        raise BenchmarkError(f"{name}: {key} runs {frozen} in eval mode, not the training step it names")


def _backward_probe(name: str, key: str, model: nn.Module):
    """A _step probe that raises BenchmarkError unless the step's backward reached the float inputs
    and the model's first parameter (the bottom of the network: embeddings, the first Linear), with a
    gradient not all zero. The gradients were zeroed in place by the call before, so a nonzero one was
    written by this call's backward, and reading it (a synchronization on CUDA) sees the finished
    backward, not one still queued."""
    first = next((p for p in model.parameters() if p.requires_grad), None)

    def probe(kwargs, out, dy):
        targets = [(f"input {k!r}", v) for k, v in kwargs.items() if v.requires_grad]
        targets += [("first parameter", first)] if first is not None else []
        for what, t in targets:
            if t.grad is None or not bool(t.grad.ne(0).any()):
                raise BenchmarkError(f"{name}: {key}'s step left its {what} without a gradient: its "
                                     f"backward did not run through the model")  # fmt: skip

    return probe


def measure_row(setup: Setup, device, dtype, repeats, compile_model) -> dict:
    name = setup.name
    costs = step_costs(setup, dtype)  # on the meta device, before anything is timed
    torch.manual_seed(0)
    model = setup.make_model().to(device=device, dtype=dtype).train()
    cpu_inputs = setup.make_inputs()
    check_inputs(setup, cpu_inputs)
    inputs = {k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype)
              for k, v in cpu_inputs.items()}  # fmt: skip
    variants = {
        "torch_ms": _step(model, inputs),
        "invact_ms": _step(_invact_copy(model, "bits"), inputs),
        "precision_bit_ms": _step(_invact_copy(model, "precision_bit"), inputs),
    }
    if compile_model:  # both compiled: does InvAct keep its cost under torch.compile (host time included)?
        variants["compile_ms"] = _step(torch.compile(copy.deepcopy(model)), inputs)
        variants["invact_compile_ms"] = _step(torch.compile(_invact_copy(model, "bits")), inputs)
    clock = timer(device)
    for key, step in variants.items():  # warm-up: compilation (numba, Triton, inductor), allocator
        _check_training(name, key, step.model)
        step()
        step.probe = _backward_probe(name, key, step.model)  # the same step as timed, checked once
        step()
        step.probe = None
    timed = dict(variants)
    times = {k: [] for k in variants}
    usage = {k: [] for k in variants}  # CPU: (page faults, system ms) per step
    if device == "cpu":
        variants = {k: _counting(step, usage[k]) for k, step in variants.items()}
    order = list(variants)
    for round_ in range(repeats):  # the order rotates, so no variant always runs first (or after another)
        for k in order[round_ % len(order) :] + order[: round_ % len(order)]:
            times[k].append(clock(variants[k]))
    row = {"name": name, **{k: median_ms(v) for k, v in times.items()}}
    row["input_shapes"] = {k: list(v.shape) for k, v in inputs.items()}
    for k, counts in usage.items():
        if counts:
            label = k.removesuffix("_ms")
            row[f"{label}_page_faults"] = statistics.median(faults for faults, _ in counts)
            row[f"{label}_system_ms"] = statistics.median(system for _, system in counts)
    ratios = [("invact_ms", "invact_ratio", "torch_ms")]
    ratios.append(("precision_bit_ms", "precision_bit_ratio", "torch_ms"))
    if compile_model:
        ratios.append(("invact_compile_ms", "invact_compile_ratio", "compile_ms"))
    for variant, ratio, baseline in ratios:
        base_ms = [t() for t in times[baseline]]
        per_round = [t() / base for t, base in zip(times[variant], base_ms, strict=True)]
        q1, median, q3 = statistics.quantiles(per_round, n=4) if len(per_round) > 1 else per_round * 3
        row[ratio], row[f"{ratio}_quartiles"] = median, [q1, q3]
    if device == "cuda":  # the GPU's own time per step, without time it waits for the host
        for variant in (v for v in BUSY if f"{v}_ms" in timed):
            row[f"{variant}_gpu_ms"] = device_busy_ms(timed[f"{variant}_ms"], GPU_BUSY_CALLS, device)
        for ratio, variant, baseline in BUSY_RATIOS:
            if f"{variant}_gpu_ms" in row:
                row[ratio] = row[f"{variant}_gpu_ms"] / row[f"{baseline}_gpu_ms"]
        for k, step in timed.items():  # what the events must not fall far below (check_result)
            row[f"{k.removesuffix('_ms')}_wall_ms"] = wall_ms(step, WALL_CALLS, device)
    row.update(costs)
    achieved = {k: rates(*fig[1:], fig[0]) for k, fig in figures(row).items()}
    row["tflops"] = {k: tflops for k, (tflops, _) in achieved.items()}
    row["gbps"] = {k: gbps for k, (_, gbps) in achieved.items()}
    return row


def check_result(result: dict, peak: DevicePeak | None) -> list[str]:
    """One-line errors for every row of `result` that cannot be right: CUDA-event medians far below the
    synchronized wall clock or the profiler's busy time of the same step (work outside the events),
    and, where the device's peak is known (`peak`), figures above it (physics.row_violations, with the
    run's dtype and fp32 matmul mode). Pure: reads only `result`."""
    errors = []
    fp32_matmul = result.get("physics", {}).get("fp32_matmul", "ieee")
    for row in result["rows"]:
        if "error" in row:
            continue
        wall = {k: row[f"{k[:-3]}_wall_ms"] for k in BYTES_OF if f"{k[:-3]}_wall_ms" in row}
        errors += timing_violations(row["name"], row, wall, "the wall clock of synchronized steps")
        busy = {f"{v}_ms": row[f"{v}_gpu_ms"] for v in BUSY if f"{v}_gpu_ms" in row}
        errors += timing_violations(row["name"], row, busy, "the profiler's device-busy time")
        if peak is not None:
            errors += row_violations(row["name"], figures(row), peak, result["dtype"], fp32_matmul)
    return errors


def finish(result: dict, peak: DevicePeak | None, device: str, out: Path | None) -> int:
    """Write `result` (atomically) unless check_result finds an error; then print each error in one
    line and return 1, writing nothing."""
    errors = check_result(result, peak)
    for error in errors:
        print(f"speed.py: refusing to write the results: {error}", file=sys.stderr)
    if errors:
        return 1
    write_result(result, "speed", device, result["dtype"], out)
    return 0


def release_row() -> None:
    """What one row leaves behind, dropped before the next: Dynamo's compiled frames (every row compiles
    nn.Sequential.forward again for its module types, and past torch._dynamo.config.recompile_limit, 8,
    Dynamo runs the frame eager: on the first H100 run with compile columns, the rows after quick_gelu
    timed eager code in their compile columns), then the device's cached blocks. Called after the
    row's except clause has ended: an exception's traceback keeps the failed step's tensors alive."""
    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


# Fresh interpreters timed with warm caches; their median is reported. One such run on a shared 2-core
# VM measured 1.37 s where four more in the same minutes took 0.52-0.57 s.
WARM_RUNS = 3


def first_call_seconds(device: str) -> dict:
    """Wall time of the first InvAct GELU forward+backward in a fresh interpreter: `cold`, with empty
    kernel caches (numba's and Triton's, in a new directory: everything compiles), then `warm`, the
    median of WARM_RUNS more fresh interpreters with the caches the first one left (what every later
    run of a user's script pays; each run's time in `warm_runs`)."""
    import os
    import tempfile

    code = (
        "import time, torch, invact\n"
        f"x = torch.randn(2**20, device={device!r}, requires_grad=True)\n"
        "t = time.perf_counter(); invact.InvActGELU()(x).sum().backward()\n"
        f"{'torch.cuda.synchronize()' if device == 'cuda' else ''}\n"
        "print(time.perf_counter() - t)\n"
    )
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "NUMBA_CACHE_DIR": cache, "TRITON_CACHE_DIR": cache}
        runs = []
        for _ in range(1 + WARM_RUNS):  # the first with empty caches
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                                 env=env)  # fmt: skip
            if out.returncode != 0:  # its last line of stderr names the error, not CalledProcessError's
                last = (out.stderr.strip().splitlines() or ["no output"])[-1]
                raise BenchmarkError(f"the first-call timing's fresh interpreter failed: {last}")
            runs.append(float(out.stdout.strip().splitlines()[-1]))
    return {"cold": runs[0], "warm": statistics.median(runs[1:]), "warm_runs": runs[1:]}


# Rounds of the CPU backward table (at least): each takes a few ms, while a shared VM's memory speed
# drifts over seconds (the same-bytes pass measured 0.9 to 1.9 ms for 2^22 elements within minutes on
# a 2-core EPYC); many short interleaved rounds keep the median ratio steady.
BANDWIDTH_ROUNDS = 61


def numba_target() -> str:
    """The CPU numba compiles the kernels for: NUMBA_CPU_NAME if set (say haswell, with
    NUMBA_CPU_FEATURES=+avx2,+fma for AVX2 code on an AVX-512 machine), else the host's; with the
    features NUMBA_CPU_FEATURES names, where it is set."""
    import numba
    from llvmlite import binding

    name = numba.config.CPU_NAME or binding.get_host_cpu_name()
    features = numba.config.CPU_FEATURES
    return f"{name} ({features})" if features is not None else name


def cpu_kernel() -> str:
    """Which numba backward the fitted two-branch activations run here: the near tables of the
    instruction set numba compiles for (invact.activation._lookup), or the polynomial in g."""
    from invact.activation import _lookup

    names = {"avx512": "AVX-512", "avx2": "AVX2"}
    isa = _lookup.instruction_set()
    return f"near tables ({names[isa]})" if isa else "polynomial in g"


def last_level_cache_bytes(caches: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int:
    """The largest CPU cache of CPU 0, in bytes, as Linux's sysfs gives it (index*/size, "32768K");
    0 where it says nothing."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    sizes = []
    for path in caches.glob("index*/size"):
        text = path.read_text().strip()
        if text[:-1].isdigit() and text[-1] in units:
            sizes.append(int(text[:-1]) * units[text[-1]])
    return max(sizes, default=0)


# Bytes read between timed calls "from memory", in last-level caches (at least EVICT_MIN_BYTES where
# sysfs names none): on a 2-core EPYC (32 MB L3) reading 4x the L3 before each call brought the
# same-bytes pass on 2^22 elements (48 MB) to the speed it has on 2^24 (192 MB, which no cache holds),
# 31-34 against 36-40 GB/s, where back to back it ran at 60-95 GB/s, part of it from the L3.
EVICT_CACHES = 4
EVICT_MIN_BYTES = 2**27


def cpu_backward_bandwidth(elements: int, repeats: int, cache_bytes: int) -> list[dict]:
    """Per activation of the bare rows: InvAct's CPU backward (bits mode, fp32, `elements`: allocating
    dx, the numba kernel) and the kernel alone (dx given), against a torch pass moving the same bytes
    but the bits: torch.mul(y, dy, out=dx), which reads two fp32 tensors and writes one, as the kernel
    does (plus n/8 bytes of bits). Interleaved; ratios are medians of per-round ratios. Also torch's
    own backward op (aten's <act>_backward, or autograd's for a composition), which allocates its dx as
    ours does.

    Twice: back to back, where whatever part of the tensors the last-level cache holds is read from it
    (2^22 fp32 elements are 48 MB for the three, near a server's L3), and "from memory", the kernel and
    the pass each timed after a read of a buffer of EVICT_CACHES times the last-level cache (of
    `cache_bytes`, last_level_cache_bytes), so that
    both read their inputs from DRAM, as a training step's backward reads activations saved long
    before. The first shows where the kernel's arithmetic limits it; the second its distance from the
    memory's bandwidth."""
    from invact.activation import _numba
    from invact.activation.activations import ACTIVATIONS

    evict = torch.ones(max(EVICT_CACHES * cache_bytes, EVICT_MIN_BYTES) // 4)
    rows = []
    for name, make in TORCH_ACTIVATIONS.items():
        act = ACTIVATIONS[name]
        x = torch.randn(elements, generator=torch.Generator().manual_seed(0))
        dy = torch.randn(elements, generator=torch.Generator().manual_seed(1))
        y, bits = _numba.forward(act, x, False)
        dx, kernel_dx = torch.empty_like(y), torch.empty_like(y)
        kernel = act.cpu.backward_kernel if act.monotone else act.cpu.backward_kernel_bits
        kernel_args = (y.numpy(), *(() if act.monotone else (bits.numpy(),)), dy.numpy(), kernel_dx.numpy())
        xg = x.clone().requires_grad_()
        torch_y = make()(xg)
        steps = {
            "backward_ms": lambda act=act, y=y, bits=bits, dy=dy: _numba.backward(act, y, bits, dy, False),
            "kernel_ms": lambda kernel=kernel, args=kernel_args: kernel(*args),
            "same_bytes_ms": lambda y=y, dy=dy, dx=dx: torch.mul(y, dy, out=dx),
            "torch_backward_ms": lambda t=torch_y, x=xg, g=dy: torch.autograd.grad(t, x, g, True),
        }
        for step in steps.values():  # warm-up: kernel loading, allocator
            step()
            step()
        ms = _cpu_rounds(steps, repeats)
        row = {"activation": name, "elements": elements, **{k: float(np.median(v)) for k, v in ms.items()}}
        row["bits_bytes"] = (elements + 7) // 8 if not act.monotone else 0
        row["ratio_to_same_bytes"] = float(np.median(ms["backward_ms"] / ms["same_bytes_ms"]))
        row["kernel_ratio_to_same_bytes"] = float(np.median(ms["kernel_ms"] / ms["same_bytes_ms"]))
        row["same_bytes_gbps"] = 3 * 4 * elements / row["same_bytes_ms"] / 1e6
        ms = _cpu_rounds({k: steps[k] for k in ("kernel_ms", "same_bytes_ms")}, repeats, before=evict.sum)
        row["kernel_from_memory_ms"] = float(np.median(ms["kernel_ms"]))
        row["same_bytes_from_memory_ms"] = float(np.median(ms["same_bytes_ms"]))
        row["kernel_ratio_from_memory"] = float(np.median(ms["kernel_ms"] / ms["same_bytes_ms"]))
        row["same_bytes_from_memory_gbps"] = 3 * 4 * elements / row["same_bytes_from_memory_ms"] / 1e6
        row["evict_bytes"] = evict.numel() * 4
        rows.append(row)
    return rows


def _cpu_rounds(
    steps: dict[str, Callable[[], object]], repeats: int, before: Callable[[], object] = lambda: None
):
    """Each step's milliseconds in `repeats` rounds, every round calling the steps once in order, each
    call after an untimed `before()`: {name: array of repeats}."""
    clock = timer("cpu")
    times = {k: [] for k in steps}
    for _ in range(repeats):
        for k, step in steps.items():
            before()
            times[k].append(clock(step))
    return {k: np.array([t() for t in v]) for k, v in times.items()}


EPILOG = """Each row also reports the FLOPs of its step (torch.utils.flop_counter, counted on the meta
device), a lower bound of the bytes it moves, and the TFLOP/s and GB/s its times imply. On CUDA the
script refuses to write (exit status 1, one line per error on stderr) a row above the device's
datasheet peak (physics.DATASHEET_PEAKS: H100, H200, A100; fp32, TF32 where enabled, bf16/fp16, HBM),
or whose CUDA-event times fall far below the synchronized wall clock or the profiler's busy time of
the same step; an unknown device is not checked, and the output says so. Before timing, each row's
inputs must have the shapes its name states, every variant must be in training mode, and its
backward must reach the inputs and the first parameter."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=EPILOG)
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    parser.add_argument("--device", choices=["cpu", "cuda"], default=default_device)
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument(
        "--preset", choices=["paper", "cpu"], help="sizes (default: paper on cuda, cpu on cpu)"
    )
    small_help = "a smoke run: tiny sizes, 3 repeats, no compile unless --compile"
    parser.add_argument("--small", action="store_true", help=small_help)
    parser.add_argument("--repeats", type=int, default=25, help="timed runs per variant; medians reported")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="also time torch.compile of the torch model and of InvAct's (default: on for "
                        "cuda; off with --small unless given)")  # fmt: skip
    parser.add_argument("--only", nargs="*", help="run only rows whose name contains one of these words")
    parser.add_argument("--out", type=Path, help="JSON path (default benchmarks/results/speed_<device>.json)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    if args.repeats < 1:
        parser.error("--repeats must be positive")
    preset = PRESETS["small" if args.small else args.preset or ("paper" if args.device == "cuda" else "cpu")]
    repeats = 3 if args.small else args.repeats
    compile_model = (args.device == "cuda") if args.compile is None else args.compile
    compile_model = compile_model and not (args.small and args.compile is None)
    dtype = getattr(torch, args.dtype)
    # Before any row: a fresh interpreter needs device memory that a row's cached blocks could hold (on
    # the first H100 run with compile columns, the subprocess failed after the rows and took them along).
    try:
        first_call = first_call_seconds(args.device)
    except BenchmarkError as e:
        print(f"speed.py: {e}", file=sys.stderr)
        return 1
    rows = []
    for setup in setups(preset, args.small):
        if args.only and not any(w.lower() in setup.name.lower() for w in args.only):
            continue
        try:
            row = measure_row(setup, args.device, dtype, repeats, compile_model)
        except torch.OutOfMemoryError as e:  # a row too big for this device: say so, keep the others
            row = {"name": setup.name, "error": f"out of memory: {str(e).splitlines()[0]}"}
        except BenchmarkError as e:  # a row that would not time what it names: nothing is written
            print(f"speed.py: {e}", file=sys.stderr)
            return 1
        rows.append(row)
        print(f"measured {setup.name}", flush=True)
        release_row()
    if not rows:
        parser.error(f"--only {args.only} matched no row")
    cache_bytes = last_level_cache_bytes() if args.device == "cpu" else None
    peak = device_peak(torch.cuda.get_device_name()) if args.device == "cuda" else None
    fp32_matmul = fp32_matmul_mode()
    note = (peak_note(device_name(args.device), peak, args.dtype, fp32_matmul) if args.device == "cuda" else
            "CPU: rows not checked against a peak (no datasheet table for CPUs)")  # fmt: skip
    result = {
        "device": device_name(args.device),
        "torch": torch.__version__,
        "triton": version("triton"),
        "numba": version("numba"),
        "numba_target": numba_target() if args.device == "cpu" else None,
        "cpu_kernel": cpu_kernel() if args.device == "cpu" else None,
        "allocator": allocator() if args.device == "cpu" else None,
        "last_level_cache_bytes": cache_bytes,
        "dtype": args.dtype,
        "settings": {
            "preset": "small" if args.small else args.preset,
            "repeats": repeats,
            "compile": compile_model,
        },
        "first_call_s": first_call,
        "physics": {"peak": dataclasses.asdict(peak) if peak else None, "fp32_matmul": fp32_matmul,
                    "note": note},
        "rows": rows,
    }  # fmt: skip
    if args.device == "cpu" and not args.only:
        rounds = repeats if args.small else max(repeats, BANDWIDTH_ROUNDS)
        result["cpu_backward"] = cpu_backward_bandwidth(preset["elements"], rounds, cache_bytes)
    if args.device == "cuda":
        result["kernel_bandwidth"] = kernel_bandwidth(dtype, preset["elements"], repeats)
    print(markdown(result))
    return finish(result, peak, args.device, args.out)


def markdown(result: dict) -> str:
    has_compile = any("compile_ms" in r for r in result["rows"])
    head = ["setup", "torch (ms)", "InvAct bits", "ratio (quartiles)", "precision-bit", "ratio (quartiles)"]
    if has_compile:
        head += ["torch.compile (ms)", "InvAct + torch.compile (ms)", "ratio to torch.compile"]
    target = f", numba compiling for {result['numba_target']}" if result.get("numba_target") else ""
    target += f", backward by {result['cpu_kernel']}" if result.get("cpu_kernel") else ""
    target += f", allocator: {result['allocator']}" if result.get("allocator") else ""
    lines = [f"\n{result['device']}{target}, {result['dtype']}, forward+backward, medians\n",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]  # fmt: skip
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['name']} | {r['error']} |")
            continue
        cells = [r["name"], f"{r['torch_ms']:.3f}", f"{r['invact_ms']:.3f}", _ratio(r, "invact_ratio")]
        cells += [f"{r['precision_bit_ms']:.3f}", _ratio(r, "precision_bit_ratio")]
        if has_compile:
            cells += [f"{r['compile_ms']:.3f}", f"{r['invact_compile_ms']:.3f}"]
            cells.append(_ratio(r, "invact_compile_ratio"))
        lines.append("| " + " | ".join(cells) + " |")
    busy = [r for r in result["rows"] if "invact_gpu_ms" in r]
    if busy:  # time the GPU itself spends per step (profiler): host-bound rows differ from the above
        compiled = any("invact_compile_gpu_ms" in r for r in busy)
        head = "| setup | GPU busy per step, torch (ms) | InvAct bits (ms) | ratio |"
        head += " torch.compile (ms) | InvAct + torch.compile (ms) | ratio |" if compiled else ""
        lines += ["", head, "|---|---|---|---|" + ("---|---|---|" if compiled else "")]
        for r in busy:
            cells = [r["name"], f"{r['torch_gpu_ms']:.3f}", f"{r['invact_gpu_ms']:.3f}",
                     f"{r['invact_gpu_ratio']:.3f}x"]  # fmt: skip
            if compiled:
                cells += [f"{r['compile_gpu_ms']:.3f}", f"{r['invact_compile_gpu_ms']:.3f}",
                          f"{r['invact_compile_gpu_ratio']:.3f}x"]  # fmt: skip
            lines.append("| " + " | ".join(cells) + " |")
    faults = [r for r in result["rows"] if "torch_page_faults" in r]
    if faults:  # CPU: where a step's time goes to the kernel's page faults, not to the arithmetic
        lines += ["", "| setup | page faults per step, torch | InvAct bits | system time per step, torch "
                  "(ms) | InvAct bits (ms) |", "|---|---|---|---|---|"]  # fmt: skip
        for r in faults:
            lines.append(f"| {r['name']} | {r['torch_page_faults']:.0f} | {r['invact_page_faults']:.0f} | "
                         f"{r['torch_system_ms']:.1f} | {r['invact_system_ms']:.1f} |")  # fmt: skip
    first = result["first_call_s"]
    lines.append(f"\nfirst InvAct call in a fresh process: {first['cold']:.2f} s with empty kernel caches, "
                 f"{first['warm']:.2f} s with the caches it left (median of "
                 f"{', '.join(f'{t:.2f}' for t in first['warm_runs'])})")  # fmt: skip
    if "cpu_backward" in result:
        head = "| CPU backward | same bytes, torch.mul (ms) | kernel alone (ms) | ratio | whole backward (ms)"
        lines += ["", head + " | ratio | torch's backward (ms) |", "|---|---|---|---|---|---|---|"]
        for r in result["cpu_backward"]:
            lines.append(f"| {r['activation']} ({r['elements']} fp32) | {r['same_bytes_ms']:.2f} "
                         f"({r['same_bytes_gbps']:.0f} GB/s) | {r['kernel_ms']:.2f} | "
                         f"{r['kernel_ratio_to_same_bytes']:.2f}x | {r['backward_ms']:.2f} | "
                         f"{r['ratio_to_same_bytes']:.2f}x | {r['torch_backward_ms']:.2f} |")  # fmt: skip
        evicted, cache = result["cpu_backward"][0]["evict_bytes"], result["last_level_cache_bytes"]
        size = f"{cache / 2**20:.0f} MB" if cache else "not given by sysfs"
        read = f"after reading {evicted / 2**20:.0f} MB; last-level cache {size}"
        lines += ["", f"From memory (each call timed {read}):", ""]
        lines += ["| CPU backward | same bytes (ms) | kernel alone (ms) | ratio |", "|---|---|---|---|"]
        for r in result["cpu_backward"]:
            pass_ms = f"{r['same_bytes_from_memory_ms']:.2f} ({r['same_bytes_from_memory_gbps']:.0f} GB/s)"
            lines.append(f"| {r['activation']} | {pass_ms} | {r['kernel_from_memory_ms']:.2f} | "
                         f"{r['kernel_ratio_from_memory']:.2f}x |")  # fmt: skip
    costed = [r for r in result["rows"] if "tflops" in r]
    if costed:  # what each time implies: FlopCounterMode FLOPs and a lower bound of bytes per step
        labels = {"torch_ms": "torch", "invact_ms": "InvAct bits", "precision_bit_ms": "precision-bit",
                  "compile_ms": "torch.compile", "invact_compile_ms": "InvAct + torch.compile",
                  "torch_gpu_ms": "torch, GPU busy", "invact_gpu_ms": "InvAct bits, GPU busy",
                  "compile_gpu_ms": "torch.compile, GPU busy",
                  "invact_compile_gpu_ms": "InvAct + torch.compile, GPU busy"}  # fmt: skip
        keys = [k for k in labels if k in costed[0]["tflops"]]
        head = ["setup", "GFLOP per step", "MB per step, torch (at least)"]
        head += [f"{labels[k]}: TFLOP/s, GB/s" for k in keys]
        lines += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in costed:
            cells = [r["name"], f"{r['flops'] / 1e9:.4g}", f"{r['min_bytes']['torch'] / 1e6:.4g}"]
            cells += [f"{r['tflops'][k]:.3g}, {r['gbps'][k]:.3g}" for k in keys]
            lines.append("| " + " | ".join(cells) + " |")
    if "physics" in result:
        lines.append(f"\n{result['physics']['note']}")
    if "kernel_bandwidth" in result:
        bw = result["kernel_bandwidth"]
        rates = f"forward {bw['forward_gbps']:.0f} GB/s, backward {bw['backward_gbps']:.0f} GB/s"
        peak = f", datasheet peak {bw['peak_gbps']:.0f} GB/s" if bw["peak_gbps"] else ""
        lines.append(f"bare kernels: {rates}, plain copy {bw['copy_gbps']:.0f} GB/s{peak}")
    return "\n".join(lines)


def _ratio(row: dict, key: str) -> str:
    """'1.012x (0.98-1.05)': the median per-round ratio and its quartiles."""
    q1, q3 = row[f"{key}_quartiles"]
    return f"{row[key]:.3f}x ({q1:.2f}-{q3:.2f})"


if __name__ == "__main__":
    raise SystemExit(main())
