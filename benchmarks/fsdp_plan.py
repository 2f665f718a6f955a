"""The per-GPU planner (invact.planner.step with `ranks`, invact.planner.sharding) against real FSDP2
steps: for every run in results/fsdp_peaks_cpu.json (benchmarks/fsdp_peaks.py: fully_shard on each
decoder layer and the root, gloo on the CPU, the bf16 recipe, 2 and 4 ranks, eager and patch()), the peak
`invact plan --gpus N --fsdp --device cpu` predicts for one rank, beside the largest rank's measured
peak. Writes results/fsdp_plan_cpu.json and .md (the table docs/patching.md shows).

    python benchmarks/fsdp_peaks.py --matrix   # the real steps (about 5 minutes on 2 cores)
    python benchmarks/fsdp_plan.py             # the predictions beside them (seconds)
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
    """The planner's peak for one rank of `run` (a fsdp_peaks row): the same config, recipe bf16, ranks,
    batch and seq per rank, eager or patch(), planned for a CPU (the measured steps' device)."""
    import torch

    from invact.planner.config import build_model, load_config
    from invact.planner.step import Step

    config = load_config({k: v for k, v in run["config"].items() if k != "name"})[0]
    model, _ = build_model(config, torch.bfloat16)
    step = Step(None, "bf16", model=model, device="cpu", ranks=run["ranks"])
    if run["patched"]:
        step.patch()
    return step.peak(run["batch"], run["seq"], checkpointing=run.get("checkpointing", False))


def compare(peaks: dict) -> dict:
    rows = []
    for run in peaks["runs"]:
        if "error" in run:
            continue
        start = time.perf_counter()
        plan = predict(run)
        measured = max(r["peak_bytes"] for r in run["per_rank"])
        rows.append({"model": run["config"]["name"], "ranks": run["ranks"], "patched": run["patched"],
                     "checkpointing": run.get("checkpointing", False),
                     "batch": run["batch"], "seq": run["seq"], "measured_bytes": measured,
                     "predicted_bytes": plan["peak_bytes"], "ratio": round(plan["peak_bytes"] / measured, 4),
                     "phase": plan["phase"], "measured_phase": run["per_rank"][0]["phase"],
                     "plan_seconds": round(time.perf_counter() - start, 2)})  # fmt: skip
    first = peaks["runs"][0]
    return {"benchmark": "fsdp_plan", "machine": first["machine"], "torch": first["torch"],
            "transformers": first["transformers"], "rows": rows}  # fmt: skip


def table(result: dict) -> str:
    lines = ["| model | ranks | seq / rank | | checkpointing | measured peak / rank | predicted "
             "| predicted / measured |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in result["rows"]:
        lines.append(
            f"| {r['model']} | {r['ranks']} | {r['seq']} | {'patch()' if r['patched'] else 'eager'} "
            f"| {'on' if r['checkpointing'] else 'off'} "
            f"| {r['measured_bytes'] / MIB:.3f} MiB | {r['predicted_bytes'] / MIB:.3f} MiB "
            f"| {r['ratio']:.4f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peaks", type=Path, default=RESULTS / "fsdp_peaks_cpu.json")
    parser.add_argument("--out", type=Path, default=RESULTS / "fsdp_plan_cpu.json")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(HERE))
    import transformers

    from timing import write_result

    transformers.utils.logging.set_verbosity_error()
    result = compare(json.loads(args.peaks.read_text()))
    print(table(result))
    write_result(result, "fsdp_plan", "cpu", out=args.out)
    args.out.with_suffix(".md").write_text(table(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
