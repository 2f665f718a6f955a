"""Under torch.compile, what each of invact's op kinds does to a real-shape training step: compile
alone against compile + patch() of one kind at a time (activation; activation with the gated MLP;
norm; loss) and of all of them, time and peak. A kind that does not lower the compiled step's peak
should step aside under compile; one that does should cost no time (docs/patching.md says per kind
what was found).

The step is benchmarks/gpu_quick.py's (forward with labels, loss, backward, AdamW, grads to None; batch
4 x seq 2048, bf16) on the Llama-3.2-1B-shaped config with --layers layers (4 by default: the kinds
other than the loss act per layer, and compiling more layers costs minutes). Median ms of 8 steps after
3 warm-up steps, the allocator's peak over them. Writes benchmarks/results/compile_kinds_<device>.json.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from gpu_quick import _step_row

from timing import device_name, version, write_result

MODEL = "Llama-3.2-1B-shaped, 8 layers"  # gpu_quick.STEP_MODELS' entry (its layers set by --layers)
# patch() keywords per kind: the others left out
KINDS = {
    "activation": dict(gated=False, norms=False, loss=False),
    "activation + gated MLP": dict(gated=True, norms=False, loss=False),
    "norm": dict(exclude="*", gated=False, norms=True, loss=False),
    "loss": dict(exclude="*", gated=False, norms=False, loss=True),
    "all (patch())": {},
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    parser.add_argument("--small", action="store_true", help="tiny shapes on any device (a check it runs)")
    parser.add_argument("--kinds", nargs="+", choices=list(KINDS), default=list(KINDS), metavar="KIND",
                        help="the kinds to try (default all): " + "; ".join(KINDS))  # fmt: skip
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.small:
        parser.error("no CUDA device is visible (or --small, a check that it runs)")
    t0 = time.perf_counter()
    steps = 3 if args.small else 8
    common = (args.small, device, torch.bfloat16, steps, args.layers)
    rows = [{"kind": "none (compile alone)", **_step_row(MODEL, "compile", *common)}]
    for kind in args.kinds:
        torch._dynamo.reset()
        rows.append({"kind": kind, **_step_row(MODEL, "compile+patch", *common, KINDS[kind])})
        print(
            f"  {kind}: {rows[-1]['ms']:.1f} ms, peak {(rows[-1]['peak_bytes'] or 0) / 2**30:.2f} GiB",
            flush=True,
        )
    base = rows[0]
    print("| kind under compile | ms | x compile | peak GiB | x compile peak |\n|---|---|---|---|---|")
    for r in rows:
        peak = (r["peak_bytes"] or 0) / 2**30
        ratio = r["peak_bytes"] / base["peak_bytes"] if base["peak_bytes"] else float("nan")
        print(f"| {r['kind']} | {r['ms']:.1f} | {r['ms'] / base['ms']:.3f} | {peak:.2f} | {ratio:.3f} |")
    result = {"device": device_name(device), "torch": torch.__version__, "triton": version("triton"),
              "transformers": version("transformers"), "layers": args.layers, "rows": rows,
              "seconds": time.perf_counter() - t0}  # fmt: skip
    write_result(result, "compile_kinds", device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
