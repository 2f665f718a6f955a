"""What fits per GPU when the Llama-3.1-8B shape is fine-tuned in full (bf16 weights, gradients and AdamW
state) on 1, 2 and 8 GPUs of 24 and 80 GiB with FSDP2 (fully_shard on each decoder layer, then the
root): the longest sequence per GPU at batch 1, eager and patch(), without and with Hugging Face's
gradient checkpointing, as `invact plan benchmarks/configs/llama-3.1-8b-shaped.json --fits SIZE --gpus
N --fsdp --recipe bf16` answers (one GPU: `invact plan ... --fits SIZE --recipe bf16`, FSDP2 on one
rank keeps every parameter once). Writes results/fsdp_fits.json and .md (the README's table). With --tp:
the same on 2, 4 and 8 GPUs under transformers' tensor parallelism (`invact plan ... --fits SIZE --tp N`),
results/tp_fits.json and .md (docs/patching.md's table).

    python benchmarks/fsdp_fits.py         # about 2 minutes on a 2-core Xeon
    python benchmarks/fsdp_fits.py --tp
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
CONFIG = "benchmarks/configs/llama-3.1-8b-shaped.json"
GPUS = (1, 2, 8)
TP_GPUS = (2, 4, 8)
MEMORY = ("24GiB", "80GiB")


def plan(gpus: int, memory: str, tp: bool = False) -> dict:
    """The longest sequence per GPU of `gpus` with FSDP2, or with `tp` under tensor parallelism."""
    from invact.planner.step import step_peaks

    start = time.perf_counter()
    result = step_peaks(HERE.parent / CONFIG, 1, None, recipes=("bf16",), fits=memory,
                        ranks=None if tp else gpus, tp=gpus if tp else None)  # fmt: skip
    rows = [
        {k: r[k] for k in ("patched", "checkpointing", "seq", "peak_bytes", "phase")} for r in result["rows"]
    ]
    return {"gpus": gpus, "memory": memory, "cap": result["cap"], "rows": rows,
            "seconds": round(time.perf_counter() - start, 1)}  # fmt: skip


def _answer(seq: int, cap: int) -> str:
    return "none" if not seq else f">={seq}" if seq >= cap else str(seq)


def table(result: dict) -> str:
    first = "TP GPUs x memory" if result.get("benchmark") == "tp_fits" else "GPUs x memory"
    lines = [f"| {first} | eager | patch() | eager, checkpointing | patch(), checkpointing |",
             "|---|---|---|---|---|"]  # fmt: skip
    for p in result["plans"]:
        seqs = {(r["patched"], r["checkpointing"]): r["seq"] for r in p["rows"]}
        cells = [
            _answer(seqs[patched, ckpt], p["cap"]) for ckpt in (False, True) for patched in (False, True)
        ]
        lines.append(f"| {p['gpus']} x {p['memory'].replace('GiB', ' GiB')} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", action="store_true", help="tensor parallel: results/tp_fits.json")
    parser.add_argument("--out", type=Path, help="default results/fsdp_fits.json (--tp: tp_fits.json)")
    args = parser.parse_args(argv)
    kind = "tp" if args.tp else "fsdp"
    args.out = args.out or RESULTS / f"{kind}_fits.json"
    sys.path.insert(0, str(HERE))
    import transformers

    from timing import cpu_model, write_result

    transformers.utils.logging.set_verbosity_error()
    plans = []
    for memory in MEMORY:
        for gpus in TP_GPUS if args.tp else GPUS:
            plans.append(plan(gpus, memory, args.tp))
            print(f"{gpus} x {memory}: {plans[-1]['seconds']} s", flush=True)
    result = {"benchmark": f"{kind}_fits", "config": CONFIG, "recipe": "bf16", "batch": 1,
              "machine": cpu_model(), "plans": plans}  # fmt: skip
    print(table(result))
    write_result(result, f"{kind}_fits", "cpu", out=args.out)
    args.out.with_suffix(".md").write_text(table(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
