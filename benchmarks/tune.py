"""Sweep the Triton kernels' launch configuration on the GPU at hand: block (elements per program) x
num_warps, so block / (32 num_warps) elements per thread. For each kernel (the bits forward x -> y,
bits and the backward y, bits, dy -> dx of gelu) and dtype it reports achieved GB/s (bytes the kernel
must move over its median time) next to a same-bytes device copy and the datasheet, marks the best
configuration and how close the default (invact.activation._triton.CONFIGS) comes to it. Writes
benchmarks/results/tune_<device>.json and prints a markdown table. --device cpu --small runs the
kernels under TRITON_INTERPRET=1 on tiny tensors (a smoke run: its GB/s mean nothing).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from pathlib import Path

import torch

from timing import device_name, median_ms, peak_gbps, timer, write_result

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def kernel_bandwidth(dtype: torch.dtype, n: int, repeats: int, configs=None, device: str = "cuda") -> dict:
    """GB/s of the bare Triton gelu forward and backward (bits mode) on n elements, and of a plain
    copy moving the forward's bytes (2 n element_size). `configs`: {"forward": Config, "backward":
    Config}, default invact.activation._triton.CONFIGS."""
    from invact.activation import _triton
    from invact.activation.activations import ACTIVATIONS

    configs = configs or _triton.CONFIGS
    gelu = ACTIVATIONS["gelu"]
    x = torch.randn(n, device=device, dtype=dtype)
    dy = torch.randn_like(x)
    clock = timer(device)
    y, bits = _triton.forward(gelu, x, False, configs["forward"])
    fwd = median_ms([clock(lambda: _triton.forward(gelu, x, False, configs["forward"]))
                     for _ in range(repeats)])  # fmt: skip
    bwd = median_ms([clock(lambda: _triton.backward(gelu, y, bits, dy, False, configs["backward"]))
                     for _ in range(repeats)])  # fmt: skip
    copy_ms = median_ms([clock(lambda: y.copy_(x)) for _ in range(repeats)])
    size = x.element_size()
    gbps = lambda nbytes, ms: nbytes / ms / 1e6  # noqa: E731
    return {
        "elements": n,
        "forward_ms": fwd,
        "backward_ms": bwd,
        "copy_ms": copy_ms,
        "forward_gbps": gbps(2 * n * size + (n + 7) // 8, fwd),  # read x, write y and the bits
        "backward_gbps": gbps(3 * n * size + (n + 7) // 8, bwd),  # read y, dy and the bits, write dx
        "copy_gbps": gbps(2 * n * size, copy_ms),
        "peak_gbps": peak_gbps() if device == "cuda" else None,
    }


def sweep(dtype: torch.dtype, n: int, repeats: int, blocks, warps, device: str) -> list[dict]:
    from invact.activation._triton import Config

    rows = []
    for block, num_warps in itertools.product(blocks, warps):
        if block < 32 * num_warps:  # fewer elements than threads: idle lanes, never the best
            continue
        config = Config(block, num_warps)
        bw = kernel_bandwidth(dtype, n, repeats, {"forward": config, "backward": config}, device)
        rows.append({"block": block, "num_warps": num_warps, **bw})
        print(f"{dtype} block {block:5d} warps {num_warps:2d}: forward {bw['forward_gbps']:7.0f} GB/s, "
              f"backward {bw['backward_gbps']:7.0f} GB/s", flush=True)  # fmt: skip
    return rows


def summary(results: dict) -> str:
    head = ["kernel", "dtype", "best block x warps", "GB/s", "default", "GB/s", "default / best", "copy GB/s",
            "datasheet GB/s"]  # fmt: skip
    lines = [f"\n{results['device']}, gelu, bits mode, {results['elements']} elements, medians of "
             f"{results['repeats']}\n", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]  # fmt: skip
    for dtype, entry in results["dtypes"].items():
        for kernel in ("forward", "backward"):
            best, default = entry["best"][kernel], entry["default"][kernel]
            peak = entry["default"]["peak_gbps"]
            cells = [kernel, dtype, f"{best['block']} x {best['num_warps']}", f"{best['gbps']:.0f}",
                     f"{default['block']} x {default['num_warps']}", f"{default['gbps']:.0f}",
                     f"{default['gbps'] / best['gbps']:.2f}", f"{entry['default']['copy_gbps']:.0f}",
                     f"{peak:.0f}" if peak else ""]  # fmt: skip
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    parser.add_argument("--device", choices=["cpu", "cuda"], default=default_device)
    parser.add_argument("--small", action="store_true", help="tiny tensors, two configs (CPU smoke run)")
    parser.add_argument("--elements", type=int, default=2**25, help="tensor size (default 2^25, the paper's)")
    parser.add_argument("--repeats", type=int, default=50, help="timed calls per configuration; medians")
    parser.add_argument("--blocks", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    parser.add_argument("--warps", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    parser.add_argument("--out", type=Path, help="JSON path (default benchmarks/results/tune_<device>.json)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    if args.device == "cpu":
        if not args.small:
            parser.error("--device cpu needs --small: the interpreter's timings mean nothing")
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton compiles anything
    if args.repeats < 1 or args.elements < 1:
        parser.error("--repeats and --elements must be positive")
    try:
        from invact.activation import _triton
    except ImportError:
        parser.error("triton is not installed")
    for block, num_warps in itertools.product(args.blocks, args.warps):
        try:
            _triton.Config(block, num_warps)
        except ValueError as e:
            parser.error(str(e))
    n, repeats, blocks, warps = args.elements, args.repeats, args.blocks, args.warps
    if args.small:
        n, repeats, blocks, warps = 5000, 2, [1024, 2048], [4]
    results = {"device": device_name(args.device), "torch": torch.__version__,
               "triton": _triton.triton.__version__, "elements": n, "repeats": repeats,
               "dtypes": {}}  # fmt: skip
    for name in args.dtypes:
        rows = sweep(DTYPES[name], n, repeats, blocks, warps, args.device)
        default = kernel_bandwidth(DTYPES[name], n, repeats, device=args.device)
        entry = {"configs": rows, "best": {}, "default": default}
        for kernel in ("forward", "backward"):
            best = max(rows, key=lambda r, k=kernel: r[f"{k}_gbps"])
            entry["best"][kernel] = {"block": best["block"], "num_warps": best["num_warps"],
                                     "gbps": best[f"{kernel}_gbps"]}  # fmt: skip
            config = _triton.CONFIGS[kernel]
            default[kernel] = {"block": config.block, "num_warps": config.num_warps,
                               "gbps": default[f"{kernel}_gbps"]}  # fmt: skip
        results["dtypes"][name] = entry
    print(summary(results))
    write_result(results, "tune", args.device, out=args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
