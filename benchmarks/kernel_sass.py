"""Static cost of the Triton kernels on an H100, from any machine: each kernel is compiled for sm_90
(Triton's compiler and the ptxas it ships need no GPU), disassembled with the nvdisasm it ships, and
its SASS instructions are counted per element. The kernels are straight-line code, each thread
handling block / (32 num_warps) elements once, so the count per element is the count over that.

The budget beside it: how many instructions per element the GPU can issue in the time its memory
moves the kernel's bytes (the same-bytes copy's GB/s measured by benchmarks/tune.py, read from
results/tune_<device>.json). A kernel within budget is memory-bound; one over it is compute-bound, and
its predicted GB/s is the copy's times budget / instructions. Calibration against tune.py on the H100
(kernels as they were then): gelu's bf16 backward, 111 instructions per element against a budget of
75, predicted 1846 GB/s and measured 1852; its bf16 forward, 65 against 50, predicted 2123 and
measured 2402: a conservative estimate there. Writes results/kernel_sass_<tune device>.json and
prints a markdown table.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from timing import RESULTS, gpu_slug, version, write_result

# The H100 SXM's issue rate (NVIDIA H100 Tensor Core GPU Architecture whitepaper): 132 SMs, each of 4
# sub-partitions issuing one warp instruction (32 threads) per clock, at the 1980 MHz boost clock.
SMS, LANES_PER_CLOCK, CLOCK_HZ = 132, 4 * 32, 1.98e9
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_INSTRUCTION = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")


def sass_counts(cubin: bytes) -> collections.Counter:
    """Opcode -> count over a cubin's SASS (nvdisasm from Triton's NVIDIA backend)."""
    import triton

    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        command = [str(nvdisasm), "-c", f.name]
        listing = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    return collections.Counter(m.group(1) for line in listing.splitlines() if (m := _INSTRUCTION.match(line)))


def bytes_per_element(kernel: str, element_size: int, saves_bits: bool) -> float:
    """What the kernel must move per element: forward reads x, writes y (and an eighth of a byte of
    bits); backward reads y and dy, writes dx (and reads the bits)."""
    tensors = 2 if kernel == "forward" else 3
    return tensors * element_size + (0.125 if saves_bits else 0.0)


def measure(names: list[str], copy_gbps: dict[str, float]) -> list[dict]:
    from invact import _triton
    from invact.activations import ACTIVATIONS

    issue_rate = SMS * LANES_PER_CLOCK * CLOCK_HZ  # thread-instructions per second
    rows = []
    for name in names:
        act = ACTIVATIONS[name]
        for kernel in ("forward", "backward"):
            config = _triton.CONFIGS[kernel]
            per_thread = config.block // (32 * config.num_warps)
            for dtype_name, dtype in DTYPES.items():
                counts = sass_counts(_triton.compile_for(kernel, act, dtype, False).asm["cubin"])
                per_element = sum(counts.values()) / per_thread
                moved = bytes_per_element(kernel, dtype.itemsize, not act.monotone)
                copy = copy_gbps[dtype_name] * 1e9
                budget = issue_rate * moved / copy
                rows.append({
                    "activation": name, "kernel": kernel, "dtype": dtype_name,
                    "instructions_per_element": per_element, "budget_per_element": budget,
                    "bytes_per_element": moved, "copy_gbps": copy_gbps[dtype_name],
                    "predicted_gbps": copy_gbps[dtype_name] * min(1.0, budget / per_element),
                    "top_opcodes": dict(counts.most_common(6)),
                })  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--only", nargs="*", help="activations (default: all)")
    default_tune = RESULTS / "tune_h100-80gb-hbm3.json"
    parser.add_argument("--tune", type=Path, default=default_tune, help="tune.py's JSON (default: H100's)")
    parser.add_argument("--out", type=Path, help="JSON path (default results/kernel_sass_<device>.json)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET"):
        parser.error("unset TRITON_INTERPRET: the kernels must be compiled, not interpreted")
    if not args.tune.is_file():
        parser.error(f"--tune {args.tune}: no such file (benchmarks/tune.py on a GPU writes it)")
    from invact.activations import ACTIVATIONS

    names = args.only or sorted(ACTIVATIONS)
    unknown = sorted(set(names) - set(ACTIVATIONS))
    if unknown:
        parser.error(f"unknown activation(s) {', '.join(unknown)}; known: {', '.join(sorted(ACTIVATIONS))}")
    tune = json.loads(args.tune.read_text())
    copy_gbps = {d: tune["dtypes"][d]["default"]["copy_gbps"] for d in DTYPES}
    rows = measure(names, copy_gbps)
    print(f"\nsm_90 SASS per element against {tune['device']}'s budget (copy GB/s: {args.tune.name})\n")
    print("| activation | kernel | dtype | instructions | budget | predicted GB/s | copy GB/s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        cost = f"{r['instructions_per_element']:.1f} | {r['budget_per_element']:.1f}"
        rates = f"{r['predicted_gbps']:.0f} | {r['copy_gbps']:.0f}"
        print(f"| {r['activation']} | {r['kernel']} | {r['dtype']} | {cost} | {rates} |")
    result = {"device": tune["device"], "target": "sm_90", "triton": version("triton"), "rows": rows}
    out = args.out or RESULTS / f"kernel_sass_{gpu_slug(tune['device'])}.json"
    write_result(result, "kernel_sass", "cuda", out=out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
