"""Static cost of the Triton kernels on an H100, from any machine: each kernel is compiled for sm_90
(Triton's compiler and the ptxas it ships need no GPU) as a launch specializes it (pointers 16-byte
aligned, as torch allocates them), disassembled with the nvdisasm it ships, and its SASS instructions are
counted per element (the activation's forward and backward, and the gated MLP's two kernels, which do
the activation's work and the product's). The kernels are straight-line code, each thread handling
block / (32 num_warps) elements once, so the count per element is the count over that.

The budget beside it: how many instructions per element the GPU can issue in the time its memory
moves the kernel's bytes (the same-bytes copy's GB/s measured by benchmarks/tune.py, read from
results/tune_<device>.json; fp16 takes bf16's copy: a copy moves bytes, not values). A kernel within
budget is memory-bound; one over it is compute-bound, and its predicted GB/s is the copy's times
budget / instructions.

Also the inverted norms' backward kernel (invact/norm/_triton.py) at width 4096, its static count
per row bounding the instructions per element from above (measure_norms). Each activation kernel
comes in the specializations a launch picks by n: no masks where n is a multiple of the block (1024:
every transformer shape here), masks per row of 8 elements where n is a multiple of 8 (a masked row
is masked whole, so each thread still loads its 8 elements as one vector); --tails adds the kernels
masked per element, whose 16-bit loads go one element at a time: they take any other n up to one
block, and past it only the last n % 8 elements (a second launch: invact.activation._triton._launch).
Calibration: on the H100, gelu's bf16 backward (as it was then: 111 instructions per element counted for
unaligned pointers, a specialization that never ran) measured 1852 GB/s against a copy of 2748; re-measure
with tune.py when a GPU is lent. Writes
results/kernel_sass_<tune device>.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import collections
import itertools
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
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_INSTRUCTION = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")


def sass_counts(cubin: bytes) -> collections.Counter:
    """Opcode -> count over a cubin's SASS (nvdisasm from Triton's NVIDIA backend), without the padding
    after the last EXIT (a branch to itself, then NOPs up to the next 128-byte boundary: never issued)."""
    import triton

    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        command = [str(nvdisasm), "-c", f.name]
        listing = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    opcodes = [m.group(1) for line in listing.splitlines() if (m := _INSTRUCTION.match(line))]
    last_exit = max((i for i, op in enumerate(opcodes) if op == "EXIT"), default=len(opcodes) - 1)
    if all(op in ("BRA", "NOP") for op in opcodes[last_exit + 1 :]):
        opcodes = opcodes[: last_exit + 1]
    return collections.Counter(opcodes)


# The tensors of a kernel's element size each element moves: forward reads x, writes y; backward reads
# y and dy, writes dx; the gated MLP's forward reads g and u, writes y and h = y * u; its backward reads
# y, u and dh, writes dg and du.
TENSORS = {"forward": 2, "backward": 3, "gated_forward": 4, "gated_backward": 5}


def bytes_per_element(kernel: str, element_size: int, saves_bits: bool) -> float:
    """What the kernel must move per element: its TENSORS and an eighth of a byte of bits (written
    forward, read backward) where it saves them."""
    return TENSORS[kernel] * element_size + (0.125 if saves_bits else 0.0)


def measure(names: list[str], copy_gbps: dict[str, float], tails: bool = False) -> list[dict]:
    from invact.activation import _triton
    from invact.activation.activations import ACTIVATIONS

    rows = []
    for name in names:
        act = ACTIVATIONS[name]
        for kernel in _triton.KERNELS:
            config = _triton.CONFIGS[kernel.removeprefix("gated_")]
            per_thread = config.block // (32 * config.num_warps)
            dtypes = DTYPES if not kernel.startswith("gated_") else {k: DTYPES[k] for k in GATED_DTYPES}
            variants = itertools.product(dtypes.items(), MASKS if tails else MASKS[:2])
            for (dtype_name, dtype), masks in variants:
                even, by_rows = masks == "none", masks != "elements"
                compiled = _triton.compile_for(kernel, act, dtype, False, even=even, rows=by_rows)
                moved = bytes_per_element(kernel, dtype.itemsize, not act.monotone)
                counts = sass_counts(compiled.asm["cubin"])
                rows.append(_row(name, kernel, dtype_name, masks, counts, per_thread, moved, copy_gbps))
    return rows


# The gated MLP's kernels in bf16 alone: the dtype real models run them in, and the binding one (fp32
# moves twice the bytes for about the same instructions; fp16 moves bf16's bytes with bf16's count).
GATED_DTYPES = ("bfloat16",)

# The kernels' mask specializations (invact.activation._triton._launch): n a multiple of the block, of 8,
# neither.
MASKS = ("none", "rows", "elements")


def _row(label: str, kernel: str, dtype_name: str, masks: str, counts: collections.Counter, per_thread: int,
         moved: float, copy_gbps: dict[str, float]) -> dict:  # fmt: skip
    """One kernel's row: its instructions per element (the count over `per_thread` elements) against
    the budget of `moved` bytes per element at the copy's GB/s, and the GB/s that predicts."""
    per_element = sum(counts.values()) / per_thread
    budget = SMS * LANES_PER_CLOCK * CLOCK_HZ * moved / (copy_gbps[dtype_name] * 1e9)
    return {
        "activation": label, "kernel": kernel, "dtype": dtype_name, "masks": masks,
        "instructions_per_element": per_element, "budget_per_element": budget,
        "bytes_per_element": moved, "copy_gbps": copy_gbps[dtype_name],
        "predicted_gbps": copy_gbps[dtype_name] * min(1.0, budget / per_element),
        "top_opcodes": dict(counts.most_common(6)),
    }  # fmt: skip


def norm_kernels() -> list[tuple[str, str, bool, bool]]:
    """The inverted norms' backward kernel (invact/norm/_triton.py) in each form the norm spec's variants
    compile it to, fp32 and bf16: (label, dtype, residuals, center), e.g. ("norm rms, residuals",
    "bfloat16", True, False)."""
    from invact.norm import VARIANTS, keeps_residual

    forms = {
        (dtype, keeps_residual(name, DTYPES[dtype]), v.center)
        for name, v in VARIANTS.items()
        for dtype in ("float32", "bfloat16")
    }
    order = sorted(forms, key=lambda f: (f[2], f[1], f[0] != "float32"))
    label = {False: "norm rms", True: "norm layer"}
    return [(label[c] + (", residuals" if r else ""), dtype, r, c) for dtype, r, c in order]


def measure_norms(copy_gbps: dict[str, float]) -> list[dict]:
    """The norm backward's rows. Its loop walks ROWS_PER_PROGRAM rows; the static count (the prologue,
    which loads and inverts the weights once per program, and the loop body once) over one row's
    elements per thread bounds the instructions per element from above. It moves y, dy and dx (and
    half a byte of residuals)."""
    from invact.norm import _triton as _norm_triton

    per_thread = _norm_triton.SASS_WIDTH // (32 * _norm_triton.SASS_WARPS)
    rows = []
    for label, dtype_name, residual, center in norm_kernels():
        dtype = DTYPES[dtype_name]
        counts = sass_counts(_norm_triton.compile_for(dtype, residual, center).asm["cubin"])
        moved = bytes_per_element("backward", dtype.itemsize, False) + (0.5 if residual else 0.0)
        rows.append(_row(label, "backward", dtype_name, "none", counts, per_thread, moved, copy_gbps))
    return rows


def copy_rates(tune: dict) -> dict[str, float]:
    """The same-bytes copy's GB/s per dtype from tune.py's JSON. A dtype it did not time takes the
    figure of one with the same element size (a copy moves bytes, not values: fp16 from bf16)."""
    timed = {d: tune["dtypes"][d]["default"]["copy_gbps"] for d in DTYPES if d in tune["dtypes"]}
    size = {d: t.itemsize for d, t in DTYPES.items()}
    rates = {}
    for d in DTYPES:
        same = [timed[t] for t in timed if size[t] == size[d]]
        if d not in timed and not same:
            raise ValueError(f"{tune['device']}: no copy timed for {d} or a dtype of its size")
        rates[d] = timed.get(d, same[0] if same else None)
    return rates


def main(argv: list[str] | None = None) -> int:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument(
        "--only", nargs="*", help="these activations only (default: all, and the norms' kernel)"
    )
    default_tune = RESULTS / "tune_h100-80gb-hbm3.json"
    parser.add_argument("--tune", type=Path, default=default_tune, help="tune.py's JSON (default: H100's)")
    parser.add_argument("--out", type=Path, help="JSON path (default results/kernel_sass_<device>.json)")
    tails = "also the kernels masked per element (n not a multiple of 8)"
    parser.add_argument("--tails", action="store_true", help=tails)
    no_norms = "leave out the inverted norms' backward kernel (invact/norm/_triton.py)"
    parser.add_argument("--no-norms", dest="norms", action="store_false", help=no_norms)
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET"):
        parser.error("unset TRITON_INTERPRET: the kernels must be compiled, not interpreted")
    if not args.tune.is_file():
        parser.error(f"--tune {args.tune}: no such file (benchmarks/tune.py on a GPU writes it)")
    from invact.activation.activations import ACTIVATIONS

    names = args.only or sorted(ACTIVATIONS)
    unknown = sorted(set(names) - set(ACTIVATIONS))
    if unknown:
        parser.error(f"unknown activation(s) {', '.join(unknown)}; known: {', '.join(sorted(ACTIVATIONS))}")
    tune = json.loads(args.tune.read_text())
    copy_gbps = copy_rates(tune)
    norms = args.norms and not args.only  # --only picks activations: the norms' kernel with none
    rows = measure(names, copy_gbps, args.tails) + (measure_norms(copy_gbps) if norms else [])
    print(f"\nsm_90 SASS per element against {tune['device']}'s budget (copy GB/s: {args.tune.name})\n")
    print("| activation | kernel | dtype | masks | instructions | budget | predicted GB/s | copy GB/s "
          "| share |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        cost = f"{r['instructions_per_element']:.1f} | {r['budget_per_element']:.1f}"
        share = r["predicted_gbps"] / r["copy_gbps"]
        rates = f"{r['predicted_gbps']:.0f} | {r['copy_gbps']:.0f} | {share:.0%}"
        print(f"| {r['activation']} | {r['kernel']} | {r['dtype']} | {r['masks']} | {cost} | {rates} |")
    result = {"device": tune["device"], "target": "sm_90", "triton": version("triton"), "rows": rows}
    out = args.out or RESULTS / f"kernel_sass_{gpu_slug(tune['device'])}.json"
    write_result(result, "kernel_sass", "cuda", out=out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
