"""The per-GPU planner (invact.planner.step with `ranks`, invact.planner.sharding; with `tp`,
invact.planner.tensor_parallel) against real sharded steps: for every run in results/fsdp_peaks_cpu.json
(benchmarks/fsdp_peaks.py: fully_shard on each decoder layer and the root, gloo on the CPU, the bf16
recipe, 2 and 4 ranks, eager and patch()), the peak `invact plan --gpus N --fsdp --device cpu` predicts
for one rank, beside the largest rank's measured peak; for every run in results/tp_peaks_cpu.json
(fsdp_peaks.py --tp: transformers' tp_plan), the peak `invact plan --tp N --device cpu` predicts. Writes
results/fsdp_plan_cpu.json and .md, or with --tp results/tp_plan_cpu.json and .md (the tables
docs/patching.md shows).

    python benchmarks/fsdp_peaks.py --matrix         # the real FSDP2 steps (about 5 minutes on 2 cores)
    python benchmarks/fsdp_plan.py                   # the predictions beside them (seconds)
    python benchmarks/fsdp_peaks.py --tp --matrix    # the real tensor parallel steps
    python benchmarks/fsdp_plan.py --tp
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
MIB = 2**20


def predict(run: dict) -> dict:
    """The planner's peak for one rank of `run` (a fsdp_peaks row): the same config, recipe bf16, ranks
    (FSDP2's, or tensor parallel's where the run's "parallel" is "tp"), batch and seq per rank, eager or
    patch(), planned for a CPU (the measured steps' device)."""
    import torch

    from invact.planner.config import build_model, load_config
    from invact.planner.step import Step

    config = load_config({k: v for k, v in run["config"].items() if k != "name"})[0]
    model, _ = build_model(config, torch.bfloat16)
    tp = (run.get("tp") or run["ranks"]) if run.get("parallel") == "tp" else None  # its TP group's ranks
    fsdp = tp is None or tp < run["ranks"]  # FSDP2 across the TP groups, or alone
    step = Step(None, "bf16", model=model, device="cpu", ranks=run["ranks"] if fsdp else None, tp=tp)
    if run["patched"]:
        step.patch()
    return step.peak(run["batch"], run["seq"], checkpointing=run.get("checkpointing", False))


def measured(run: dict) -> int:
    """The largest rank's measured peak of `run`: its row figure (LiveBytes told of FSDP2's resizes);
    under tensor parallelism each rank's lower of its two measured steps (the row's and plain
    LiveBytes', one quantity there where no storage is resized): a step that ran after gloo's worker
    threads still held a collective's buffers (an all-gather's output, released when its work object
    goes) shows them on top, at random (llama-tp, 2 ranks, seq 128: rank 0 8.78 MiB in one step, 8.03 in
    the other and in two earlier runs of the matrix)."""
    if run.get("parallel") == "tp":
        return max(min(r["peak_bytes"], r["livebytes"]["peak_bytes"]) for r in run["per_rank"])
    return max(r["peak_bytes"] for r in run["per_rank"])


def compare(peaks: dict) -> dict:
    rows = []
    for run in peaks["runs"]:
        if "error" in run:
            continue
        start = time.perf_counter()
        plan = predict(run)
        measured_bytes = measured(run)
        rows.append({"model": run["config"]["name"], "ranks": run["ranks"], "tp": run.get("tp") or None,
                     "patched": run["patched"],
                     "checkpointing": run.get("checkpointing", False),
                     "batch": run["batch"], "seq": run["seq"], "measured_bytes": measured_bytes,
                     "predicted_bytes": plan["peak_bytes"],
                     "ratio": round(plan["peak_bytes"] / measured_bytes, 4),
                     "phase": plan["phase"], "measured_phase": run["per_rank"][0]["phase"],
                     "plan_seconds": round(time.perf_counter() - start, 2)})  # fmt: skip
    first = peaks["runs"][0]
    kind = "tp" if first.get("parallel") == "tp" else "fsdp"
    return {"benchmark": f"{kind}_plan", "machine": first["machine"], "torch": first["torch"],
            "transformers": first["transformers"], "rows": rows}  # fmt: skip


def table(result: dict) -> str:
    lines = ["| model | ranks | seq / rank | | checkpointing | measured peak / rank | predicted "
             "| predicted / measured |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in result["rows"]:
        tp = r.get("tp")
        ranks = f"{r['ranks']} (TP {tp} x FSDP2 {r['ranks'] // tp})" if tp and tp < r["ranks"] else r["ranks"]
        lines.append(
            f"| {r['model']} | {ranks} | {r['seq']} | {'patch()' if r['patched'] else 'eager'} "
            f"| {'on' if r['checkpointing'] else 'off'} "
            f"| {r['measured_bytes'] / MIB:.3f} MiB | {r['predicted_bytes'] / MIB:.3f} MiB "
            f"| {r['ratio']:.4f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", action="store_true", help="tensor parallel: results/tp_peaks_cpu.json")
    parser.add_argument("--peaks", type=Path, help="default results/fsdp_peaks_cpu.json (--tp: tp_peaks)")
    parser.add_argument("--out", type=Path, help="default results/fsdp_plan_cpu.json (--tp: tp_plan)")
    args = parser.parse_args(argv)
    kind = "tp" if args.tp else "fsdp"
    args.peaks = args.peaks or RESULTS / f"{kind}_peaks_cpu.json"
    args.out = args.out or RESULTS / f"{kind}_plan_cpu.json"
    sys.path.insert(0, str(HERE))
    import transformers

    from timing import write_result

    transformers.utils.logging.set_verbosity_error()
    result = compare(json.loads(args.peaks.read_text()))
    print(table(result))
    write_result(result, result["benchmark"], "cpu", out=args.out)
    args.out.with_suffix(".md").write_text(table(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
