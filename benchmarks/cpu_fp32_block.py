"""The CPU backward of a bf16 activation through fp32 blocks (invact.activation._numba.FP32_BLOCK) against
one block of the whole tensor (the conversion before blocks), with torch's own bf16 backward beside
them: median ms of `_numba.backward` (y, bits and dy from invact's forward) and of
torch.autograd.grad through torch's activation, at 2^18 to 2^24 elements, on torch's thread count.

Memory-bound: each element's backward reads y and dy (2 bytes each) and writes dx (2 bytes), plus the
fp32 round trip through the buffers (12 bytes written and read); the GB/s column counts the 6 bytes
alone, beside a bf16 copy's GB/s (2 bytes read and 2 written per element) measured in the same run.

Writes benchmarks/results/cpu_fp32_block_cpu.json (the machine in `device`) and prints the table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from timing import RESULTS, device_name, write_result

SIZES = (18, 20, 22, 24)  # log2 of the element counts
TORCH = {"gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu}


def _median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def measure(name: str, exponent: int) -> dict:
    from invact.activation import _numba
    from invact.activation.activations import ACTIVATIONS

    act, n = ACTIVATIONS[name], 2**exponent
    g = torch.Generator().manual_seed(exponent)
    x = (torch.randn(n, generator=g) * 3).to(torch.bfloat16)
    y, bits = _numba.forward(act, x, False)
    dy = torch.randn(n, generator=g).to(torch.bfloat16)
    leaf = x.clone().requires_grad_()
    repeats = max(9, min(101, 2**24 // n * 5))
    block = _numba.FP32_BLOCK
    row = {"activation": name, "elements": n}
    try:
        row["blocks_ms"] = _median_ms(lambda: _numba.backward(act, y, bits, dy, False), repeats)
        _numba.FP32_BLOCK = n
        row["one_block_ms"] = _median_ms(lambda: _numba.backward(act, y, bits, dy, False), repeats)
    finally:
        _numba.FP32_BLOCK = block
    row["torch_ms"] = _median_ms(lambda: torch.autograd.grad(TORCH[name](leaf), leaf, dy), repeats)
    row["blocks_gbps"] = 6 * n / row["blocks_ms"] / 1e6
    out = torch.empty_like(y)
    # the reference: a bf16 copy, 2 bytes read and 2 written per element
    row["copy_gbps"] = 4 * n / _median_ms(lambda: out.copy_(y), repeats) / 1e6
    return row


def main(argv=None) -> int:
    from invact.activation import _numba

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", type=int, default=list(SIZES), help="log2 element counts")
    args = parser.parse_args(argv)
    rows = []
    head = f"{'activation':>10} {'elements':>9} {'blocks':>9} {'one block':>10} {'torch':>9}"
    print(head, "  ms (GB/s of 6 B/elt; a bf16 copy's GB/s)")
    for name in TORCH:
        for exponent in args.sizes:
            row = measure(name, exponent)
            rows.append(row)
            times = f"{row['blocks_ms']:9.3f} {row['one_block_ms']:10.3f} {row['torch_ms']:9.3f}"
            rates = f"({row['blocks_gbps']:.1f}; {row['copy_gbps']:.1f})"
            print(f"{name:>10} {'2^' + str(exponent):>9} {times}   {rates}")
    result = {
        "device": device_name("cpu"),
        "torch": torch.__version__,
        "fp32_block": _numba.FP32_BLOCK,
        "rows": rows,
    }
    write_result(result, "cpu_fp32_block", "cpu", out=RESULTS / "cpu_fp32_block_cpu.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
