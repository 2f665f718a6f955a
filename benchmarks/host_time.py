"""Host time per call of torch's GELU and of InvAct's, layer by layer: microseconds of the host's clock
per call over a small tensor (2^16 elements by default), so on a GPU the device never holds the host
back and what is measured is the Python and dispatch cost a small layer waits for. Each figure is the
median over rounds of the mean over `--calls` calls, after warm-up. Writes
benchmarks/results/host_time_<device>.json and prints a markdown table.

Layers: the backend's bare forward and backward (invact.ops' bodies, kernels included), InvAct's
forward through the module (autograd recording), and forward + backward(dy) with autograd's device
threads on and off (on CUDA the engine runs backward on a per-device thread, and a Python backward
must be handed to it).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from timing import device_name, write_result


def _per_call_us(fn: Callable[[], object], calls: int, rounds: int, sync: Callable[[], None]) -> float:
    for _ in range(max(calls // 10, 2)):  # warm-up: compilation, allocator, caches
        fn()
    sync()
    means = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        means.append((time.perf_counter() - t0) / calls * 1e6)
        sync()
    return statistics.median(means)


def measure(device: str, n: int, calls: int, rounds: int) -> list[dict]:
    import invact
    from invact import ops

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    x = torch.randn(n, device=device)
    dy = torch.randn_like(x)
    leaf = x.clone().requires_grad_()
    y, bits = ops._forward_impl(x, "gelu", False)
    ours, theirs = invact.InvActGELU(), torch.nn.GELU()

    def step(module: torch.nn.Module) -> Callable[[], None]:
        return lambda: module(x.detach().requires_grad_()).backward(dy)

    layers = [
        ("torch GELU forward, recording autograd", lambda: theirs(leaf)),
        ("InvAct GELU forward, recording autograd", lambda: ours(leaf)),
        ("InvAct backend forward alone", lambda: ops._forward_impl(x, "gelu", False)),
        ("InvAct backend backward alone", lambda: ops._backward_impl(dy, y, bits, "gelu", False)),
        ("torch GELU forward + backward", step(theirs)),
        ("InvAct GELU forward + backward", step(ours)),
    ]
    rows = [{"layer": name, "us": _per_call_us(fn, calls, rounds, sync)} for name, fn in layers]
    threaded = torch.autograd.is_multithreading_enabled()
    try:
        torch.autograd.set_multithreading_enabled(False)
        for name, module in (("torch", theirs), ("InvAct", ours)):
            us = _per_call_us(step(module), calls, rounds, sync)
            rows.append({"layer": f"{name} GELU forward + backward, autograd on one thread", "us": us})
    finally:
        torch.autograd.set_multithreading_enabled(threaded)
    return rows


def main(argv: list[str] | None = None) -> int:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    parser.add_argument("--device", choices=["cpu", "cuda"], default=default_device)
    parser.add_argument("--elements", type=int, default=2**16, help="elements per call (default 2^16)")
    parser.add_argument("--calls", type=int, default=300, help="calls per round (default 300)")
    parser.add_argument("--rounds", type=int, default=7, help="rounds; the median is reported (default 7)")
    parser.add_argument("--out", default=None, help="JSON path (default results/host_time_<device>.json)")
    args = parser.parse_args(argv)
    for name in ("elements", "calls", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be positive")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible")
    rows = measure(args.device, args.elements, args.calls, args.rounds)
    name = device_name(args.device)
    print(f"\n{name}, GELU on {args.elements} fp32 elements, host microseconds per call\n")
    print("| layer | us per call |\n|---|---|")
    for row in rows:
        print(f"| {row['layer']} | {row['us']:.1f} |")
    result = {"device": name, "torch": torch.__version__, "elements": args.elements, "calls": args.calls,
              "rounds": args.rounds, "rows": rows}  # fmt: skip
    write_result(result, "host_time", args.device, out=Path(args.out) if args.out else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
