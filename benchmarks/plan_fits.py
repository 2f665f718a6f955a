"""The longest sequence whose whole training step fits a GPU's memory, by `invact plan --fits`
(invact.planner.step.step_peaks, predicted on the meta device, planned as on CUDA), for the committed
configs shaped as public models, in 24 and 80 GiB, at batch 1: full fine-tuning in bf16 and LoRA
(rank 16, bf16), eager and after patch(), without and with Hugging Face's gradient checkpointing.
Writes benchmarks/results/plan_fits.json and its markdown table (the README's) to plan_fits.md
beside it; prints the time each config took. `--models Llama-3.1-8B --recipes qlora --out
benchmarks/results/plan_fits_qlora.json`: the README's QLoRA rows.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from timing import RESULTS, cpu_model, write_result

CONFIGS = Path(__file__).resolve().parent / "configs"
# shaped like: config file
MODELS = {
    "Qwen2.5-0.5B": "qwen2.5-0.5b-shaped.json",
    "Llama-3.2-1B": "llama-3.2-1b-shaped.json",
    "Llama-3.1-8B": "llama-3.1-8b-shaped.json",
}
BUDGETS = ("24GiB", "80GiB")
# recipe -> its label, in the table's order; the README's main table plans the first two (the default)
RECIPES = {"lora": "LoRA r16", "bf16": "full", "qlora": "QLoRA r16 (nf4)"}
DEFAULT_RECIPES = ("lora", "bf16")


def _cell(row: dict, cap: int) -> str:
    seq = row["seq"]
    if not seq:
        return "none"
    text = f"{seq / 1024:.1f}K".replace(".0K", "K")
    return f">={text}" if seq >= cap else text


def table(result: dict) -> str:
    """One row per model, recipe and budget: eager's and patch()'s longest sequence, without and with
    checkpointing."""
    lines = [
        "| shaped like | fine-tuning | GPU memory | eager | patch() | eager, checkpointing | "
        "patch(), checkpointing |",
        "|---|---|---|---|---|---|---|",
    ]
    for plan in result["plans"]:
        rows = {(r["recipe"], r["patched"], r["checkpointing"]): r for r in plan["rows"]}
        for recipe, label in [(r, label) for r, label in RECIPES.items() if (r, False, False) in rows]:
            cells = [_cell(rows[recipe, p, c], plan["cap"]) for c in (False, True) for p in (False, True)]
            lines.append(f"| {plan['model']} | {label} | {plan['budget']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--budgets", nargs="+", default=list(BUDGETS), metavar="SIZE")
    parser.add_argument("--recipes", nargs="+", choices=list(RECIPES), default=list(DEFAULT_RECIPES))
    parser.add_argument("--out", type=Path, default=RESULTS / "plan_fits.json")
    args = parser.parse_args(argv)
    import transformers

    from invact.planner.step import step_peaks

    transformers.utils.logging.set_verbosity_error()
    plans = []
    for name in args.models:
        for budget in args.budgets:
            start = time.perf_counter()
            plan = step_peaks(CONFIGS / MODELS[name], 1, None, recipes=tuple(args.recipes), fits=budget)
            seconds = time.perf_counter() - start
            plan["config"] = f"benchmarks/configs/{MODELS[name]}"
            plans.append({"model": name, "budget": budget, "seconds": round(seconds, 1), **plan})
            print(f"planned {name} in {budget}: {seconds:.1f} s", flush=True)
    result = {"batch": 1, "cpu": cpu_model(), "transformers": transformers.__version__, "plans": plans}
    print(table(result))
    path = write_result(result, "plan_fits", "cpu", out=args.out)
    path.with_suffix(".md").write_text(table(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
