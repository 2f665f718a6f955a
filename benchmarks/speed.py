"""Forward+backward time of InvAct against torch's own activation, side by side in one process.

Rows (this version): the bare activation on N elements, for gelu, gelu_tanh, silu and quick_gelu,
torch eager vs InvAct bits vs InvAct precision-bit. Timing: runs interleaved (torch, bits, precision
bit, torch, ...), median of --repeats each; on CUDA with CUDA events. Also the first-call latency of
InvAct in a fresh process (numba compiles the CPU kernel on first use). Prints a markdown table and
writes benchmarks/results/speed_<device>.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import invact
from invact.activations import ACTIVATIONS

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MODULES = {
    "gelu": lambda mode: invact.InvActGELU(mode=mode),
    "gelu_tanh": lambda mode: invact.InvActGELU("tanh", mode=mode),
    "silu": lambda mode: invact.InvActSiLU(mode=mode),
    "quick_gelu": lambda mode: invact.InvActQuickGELU(mode=mode),
}


def _timer(device: str):
    if device == "cuda":

        def run(fn):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end)

        return run

    def run(fn):
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    return run


def fwd_bwd(fn, x, dy):
    def step():
        xx = x.detach().requires_grad_()
        fn(xx).backward(dy)

    return step


def bench_activation(name: str, n: int, dtype: torch.dtype, device: str, repeats: int) -> dict:
    torch.manual_seed(0)
    x = torch.randn(n, device=device, dtype=dtype)
    dy = torch.randn(n, device=device, dtype=dtype)
    steps = {
        "torch_ms": fwd_bwd(ACTIVATIONS[name].torch_forward, x, dy),
        "invact_ms": fwd_bwd(MODULES[name]("bits"), x, dy),
        "precision_bit_ms": fwd_bwd(MODULES[name]("precision_bit"), x, dy),
    }
    timer = _timer(device)
    for step in steps.values():  # warm up: compilation, allocator
        step()
        step()
    times = {k: [] for k in steps}
    for _ in range(repeats):
        for k, step in steps.items():
            times[k].append(timer(step))
    row = {"name": f"{name} ({n} elements)", **{k: statistics.median(v) for k, v in times.items()}}
    row["invact_ratio"] = row["invact_ms"] / row["torch_ms"]
    row["precision_bit_ratio"] = row["precision_bit_ms"] / row["torch_ms"]
    return row


def first_call_seconds(name: str, n: int, device: str) -> float:
    """Wall time of the first InvAct forward+backward in a fresh interpreter (imports excluded)."""
    code = (
        "import time, torch, invact\n"
        f"x = torch.randn({n}, device={device!r}, requires_grad=True)\n"
        f"m = {{'gelu': invact.InvActGELU(), 'gelu_tanh': invact.InvActGELU('tanh'),"
        f" 'silu': invact.InvActSiLU(), 'quick_gelu': invact.InvActQuickGELU()}}[{name!r}]\n"
        "t = time.perf_counter(); m(x).sum().backward(); print(time.perf_counter() - t)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=600
    )
    return float(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--elements", type=int, default=2**22, help="elements per tensor (default 2^22)")
    parser.add_argument("--repeats", type=int, default=25, help="timed runs per variant; medians reported")
    parser.add_argument("--small", action="store_true", help="a quick smoke run (2^12 elements, 3 repeats)")
    parser.add_argument("--out", type=Path, help="JSON path (default benchmarks/results/speed_<device>.json)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    if args.small:
        args.elements, args.repeats = 2**12, 3
    if args.elements < 1 or args.repeats < 1:
        parser.error("--elements and --repeats must be positive")
    dtype = getattr(torch, args.dtype)
    rows = []
    for name in MODULES:
        row = bench_activation(name, args.elements, dtype, args.device, args.repeats)
        row["first_call_s"] = first_call_seconds(name, args.elements, args.device)
        rows.append(row)
    device = (
        torch.cuda.get_device_name()
        if args.device == "cuda"
        else f"cpu: {platform.processor() or platform.machine()}"
    )
    print(f"{device}, {args.dtype}, forward+backward, median of {args.repeats} (ms)\n")
    print("| setup | torch | InvAct bits | ratio | precision-bit | ratio | first call (s) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        cells = [r["name"], f"{r['torch_ms']:.2f}", f"{r['invact_ms']:.2f}", f"{r['invact_ratio']:.2f}x"]
        cells += [
            f"{r['precision_bit_ms']:.2f}",
            f"{r['precision_bit_ratio']:.2f}x",
            f"{r['first_call_s']:.2f}",
        ]
        print("| " + " | ".join(cells) + " |")
    result = {
        "device": device,
        "torch": torch.__version__,
        "triton": _version("triton"),
        "numba": _version("numba"),
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "settings": {"elements": args.elements, "repeats": args.repeats},
        "rows": rows,
    }
    out = args.out or RESULTS / f"speed_{args.device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwritten to {out}")
    return 0


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except ImportError:
        return None


if __name__ == "__main__":
    raise SystemExit(main())
