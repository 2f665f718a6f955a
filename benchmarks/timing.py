"""What the benchmark scripts share: timing calls on CPU or CUDA, naming the device, writing results."""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch


def timer(device: str) -> Callable[[Callable[[], None]], Callable[[], float]]:
    """timer(fn) runs fn once and returns a function that gives its milliseconds once called.

    CUDA: events recorded around the call with no synchronization between calls (as
    triton.testing.do_bench times), so the host queues work ahead as it does in training and its own
    per-call latency shows only where it, not the GPU, is the bottleneck; median_ms synchronizes
    before reading them. CPU: perf_counter around the call.

    What the events can miss: they time the current stream only, so work fn leaves on another stream,
    or queues after returning, falls outside them. speed.py therefore checks each median against
    wall_ms (synchronized wall clock) and device_busy_ms (the profiler, every stream)."""
    if device == "cuda":

        def run(fn):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            return lambda: start.elapsed_time(end)

        return run

    def run(fn):
        t0 = time.perf_counter()
        fn()
        ms = (time.perf_counter() - t0) * 1e3
        return lambda: ms

    return run


def device_busy_ms(fn: Callable[[], None], calls: int, device: str) -> float:
    """Milliseconds per call the device itself spends on fn's work: the profiler's self device time
    summed over every event (kernels, copies, fills) of `calls` calls, divided by `calls`. Unlike a
    step's time it leaves out time the GPU waits for the host. On CPU: the ops' self CPU time (only
    so that this runs on a machine without a GPU). One call runs first under the profiler, unrecorded: a
    compiled fn may trace again there (seen once: a Dynamo frame shared with other compiled models)."""
    from torch.profiler import ProfilerActivity, profile, schedule

    cuda = device == "cuda"
    activities = [ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]
    with profile(
        activities=activities, schedule=schedule(wait=0, warmup=1, active=calls), acc_events=True
    ) as prof:
        for i in range(calls + 1):
            fn()
            if cuda and i in (0, calls):  # the warm-up's kernels stay out of the recorded calls
                torch.cuda.synchronize()
            prof.step()
    attribute = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = [e for e in prof.key_averages() if not e.key.startswith("ProfilerStep")]  # the schedule's own
    return sum(getattr(event, attribute) for event in events) / calls / 1e3  # us -> ms


def wall_ms(fn: Callable[[], None], calls: int, device: str) -> float:
    """Wall-clock milliseconds per call of `calls` back-to-back calls, with the device synchronized
    before and after: nothing fn starts, on any stream, can finish outside it."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - t0) * 1e3 / calls


def median_ms(timings: list[Callable[[], float]]) -> float:
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return statistics.median(t() for t in timings)


def device_name(device: str) -> str:
    """'NVIDIA H100 80GB HBM3', or the CPU's model, torch's CPU capability (its kernels' vector ISA:
    AVX2, AVX512, ...) and thread count."""
    if device == "cuda":
        return torch.cuda.get_device_name()
    capability = torch.backends.cpu.get_cpu_capability()
    return f"cpu: {cpu_model()} ({capability}), {torch.get_num_threads()} threads"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_slug(device: str) -> str:
    """A file-name part for the device: 'h100-80gb-hbm3' for CUDA, 'cpu' for CPU."""
    return gpu_slug(torch.cuda.get_device_name()) if device == "cuda" else "cpu"


def gpu_slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100-80gb-hbm3'."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower().removeprefix("nvidia ")).strip("-")


def version(module: str) -> str | None:
    """The module's __version__; None where it is not installed."""
    try:
        return __import__(module).__version__
    except ImportError:
        return None


def peak_gbps() -> float | None:
    """The datasheet HBM bandwidth of this CUDA device (physics.DATASHEET_PEAKS); None if unknown."""
    from physics import device_peak

    peak = device_peak(torch.cuda.get_device_name())
    return peak.hbm_gbps if peak else None


RESULTS = Path(__file__).resolve().parent / "results"


def write_result(
    result: dict, kind: str, device: str, dtype: str | None = None, out: Path | None = None
) -> Path:
    """Write `result` as JSON to `out`, default results/<kind>_<device slug>[_<dtype>].json (float32, the
    default dtype, gets no suffix), and say where. Atomic: a temporary file in the same folder renamed
    over `out`, so a run that dies while writing leaves the previous result whole."""
    suffix = "" if dtype in (None, "float32") else f"_{dtype}"
    out = out or RESULTS / f"{kind}_{device_slug(device)}{suffix}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(result, indent=2) + "\n"
    with tempfile.NamedTemporaryFile("w", dir=out.parent, prefix=f".{out.name}.", delete=False) as f:
        f.write(text)
    os.replace(f.name, out)
    print(f"\nwritten to {out}")
    return out
