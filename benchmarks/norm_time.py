"""Time of an inverted norm (invact.norm.InvNorm) against the module it replaces: forward + backward
on (rows, width) inputs, per norm variant of the spec (one class each: coeffs/norms.json), fp32 and
bf16. The two alternate call by call in interleaved rounds (drift hits both); each figure is the median
over rounds of the mean per call. Beside each time, the effective GB/s of the bytes a fused norm must
move (forward: read x, write y; backward: read dy and x or y, write dx; parameters aside), to hold
against the machine's memory bandwidth. Writes benchmarks/results/norm_time_<device>.json and prints a
markdown table.

On CPU, glibc's malloc serves an allocation above its mmap threshold with fresh pages, and moves that
threshold up when such a block is freed: which side of a pair pays the page faults of its 16 MiB
tensors changes from round to round (measured: 2,400-3,300 minor faults per call on one side, none on
the other, alternating; the LayerNorm fp32 row moved between 1.17x and 1.65x over runs). So the
thresholds are fixed at start (mallopt: mmap above 32 MiB, the most glibc allows, and no trimming
below 1 GiB): both sides reuse the heap, as PyTorch's caching allocator does on a GPU. The faults
per call of each side are in the result; --default-malloc keeps glibc's moving thresholds.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
from pathlib import Path

import torch

from timing import cpu_model, device_name, write_result

# glibc's mallopt parameters (malloc.h) and the values set: the largest mmap threshold glibc accepts
# (HEAP_MAX's half on 64-bit: 32 MiB), and a trim threshold above anything the benchmark frees.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD, TRIM_THRESHOLD = 32 * 2**20, 2**30


def steady_malloc() -> str | None:
    """Fix glibc's malloc thresholds (see the module docstring); what was set, or None where the C
    library is not glibc or refuses."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None
    if not (mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        return None
    return (
        f"glibc malloc, mmap threshold {MMAP_THRESHOLD >> 20} MiB, trim threshold {TRIM_THRESHOLD >> 20} MiB"
    )


def _faults() -> int:
    """Minor page faults of this process so far (0 where the platform does not count them)."""
    try:
        import resource
    except ImportError:
        return 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _module(qualname: str, width: int, dtype: torch.dtype, device: str) -> torch.nn.Module:
    from invact.norm import CLASSES, VARIANTS

    module, _, name = qualname.rpartition(".")
    m = getattr(importlib.import_module(module), name)(width)
    offset = VARIANTS[CLASSES[qualname]].offset
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        m.weight.copy_(torch.randn(width, generator=g) * 0.1 + (0.0 if offset else 1.0))
        if getattr(m, "bias", None) is not None:
            m.bias.copy_(torch.randn(width, generator=g) * 0.1)
    return m.to(device=device, dtype=dtype)


def classes() -> dict[str, str]:
    """variant -> the first class of the spec that imports here."""
    from invact.norm import CLASSES

    found: dict[str, str] = {}
    for cls, variant in CLASSES.items():
        module, _, name = cls.rpartition(".")
        try:
            getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
        found.setdefault(variant, cls)
    return found


def measure(variant: str, qualname: str, rows: int, width: int, dtype, device: str, calls: int, rounds: int):
    from invact import norm

    theirs = _module(qualname, width, dtype, device)
    ours = norm.replacement(theirs, norm.match(theirs)[0])
    x = torch.randn(rows, width, device=device).to(dtype)
    dy = torch.randn(rows, width, device=device).to(dtype)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def step(module):
        module(x.detach().requires_grad_()).backward(dy)

    for module in (theirs, ours):
        for _ in range(max(calls // 5, 2)):
            step(module)
    samples, faults = ([], []), [0, 0]
    for r in range(rounds):
        for side in (0, 1) if r % 2 == 0 else (1, 0):
            module = (theirs, ours)[side]
            sync()
            f0, t0 = _faults(), time.perf_counter()
            for _ in range(calls):
                step(module)
            sync()
            samples[side].append((time.perf_counter() - t0) / calls * 1e3)
            faults[side] += _faults() - f0
    torch_ms, invact_ms = statistics.median(samples[0]), statistics.median(samples[1])
    moved = 5 * rows * width * x.element_size()  # x, y; dy, x or y, dx
    return {
        "variant": variant,
        "class": qualname,
        "dtype": str(dtype).removeprefix("torch."),
        "rows": rows,
        "width": width,
        "torch_ms": torch_ms,
        "invact_ms": invact_ms,
        "ratio": invact_ms / torch_ms,
        "torch_gbs": moved / torch_ms / 1e6,
        "invact_gbs": moved / invact_ms / 1e6,
        "torch_faults_per_call": faults[0] / (rounds * calls),
        "invact_faults_per_call": faults[1] / (rounds * calls),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    parser.add_argument("--rows", type=int, default=4096, help="rows (tokens) per call (default 4096)")
    parser.add_argument("--width", type=int, default=1024, help="the normalized width (default 1024)")
    parser.add_argument(
        "--dtypes", nargs="+", choices=["float32", "bfloat16"], default=["float32", "bfloat16"]
    )
    parser.add_argument("--calls", type=int, default=10, help="calls per round (default 10)")
    parser.add_argument("--rounds", type=int, default=9, help="rounds; the median is reported (default 9)")
    parser.add_argument("--threads", type=int, default=None, help="torch's CPU threads (default: torch's)")
    parser.add_argument("--small", action="store_true", help="a smoke run: 64 x 64, 2 calls, 3 rounds")
    parser.add_argument("--default-malloc", action="store_true",
                        help="keep glibc's moving mmap threshold (default: fixed, see above)")  # fmt: skip
    parser.add_argument("--out", default=None, help="JSON path (default results/norm_time_<device>.json)")
    args = parser.parse_args(argv)
    if args.small:
        args.rows, args.width, args.calls, args.rounds = 64, 64, 2, 3
    for name in ("rows", "width", "calls", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be positive")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible")
    if args.threads:
        torch.set_num_threads(args.threads)
    fixed = None if args.default_malloc or args.device != "cpu" else steady_malloc()
    allocator = fixed or "the C library's malloc, as set"
    rows = []
    for variant, qualname in sorted(classes().items()):
        for dtype in args.dtypes:
            row = measure(variant, qualname, args.rows, args.width, getattr(torch, dtype), args.device,
                          args.calls, args.rounds)  # fmt: skip
            rows.append(row)
            print(f"measured {variant} {dtype}: {row['ratio']:.2f}x", file=sys.stderr, flush=True)
    name = device_name(args.device)
    print(f"\n{name}, torch {torch.__version__}: forward + backward of "
          f"({args.rows}, {args.width}), median of {args.rounds} interleaved rounds; "
          f"{allocator}\n")  # fmt: skip
    print("| variant (class) | dtype | torch ms | InvAct ms | InvAct / torch | torch GB/s | InvAct GB/s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        cls = r["class"].rpartition(".")[2]
        print(f"| {r['variant']} ({cls}) | {r['dtype']} | {r['torch_ms']:.2f} | {r['invact_ms']:.2f} | "
              f"{r['ratio']:.2f} | {r['torch_gbs']:.1f} | {r['invact_gbs']:.1f} |")  # fmt: skip
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    result = {"device": name, "cpu": cpu_model(), "torch": torch.__version__,
              "threads": torch.get_num_threads(), "allocator": allocator,
              "settings": settings, "rows": rows}  # fmt: skip
    write_result(result, "norm_time", args.device, out=Path(args.out) if args.out else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
