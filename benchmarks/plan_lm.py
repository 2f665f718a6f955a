"""What a causal LM's training step saves for backward, by `invact plan`
(invact.planner.forward.forward_saved,
meta device), for the committed configs shaped as public models: eager, after patch() and after
patch(loss=False), with labels (the loss computed), and what the head and loss hold. Writes
benchmarks/results/plan_lm.json and its markdown table to plan_lm.md beside it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from timing import RESULTS, write_result

CONFIGS = Path(__file__).resolve().parent / "configs"
# shaped like: config file
MODELS = {
    "Qwen2.5-0.5B": "qwen2.5-0.5b-shaped.json",
    "Llama-3.2-1B": "llama-3.2-1b-shaped.json",
    "Gemma-2-2B": "gemma-2-2b-shaped.json",
    "Llama-3.1-8B": "llama-3.1-8b-shaped.json",
}


def _head_loss(plan: dict) -> tuple[int, int]:
    (kind,) = [k for k in plan["kinds"] if k["kind"] == "head_loss"]
    return kind["eager_bytes"], kind["patched_bytes"]


def measure(name: str, batch: int, seq: int, dtype: str) -> dict:
    from invact.planner.forward import forward_saved

    path = CONFIGS / MODELS[name]
    plan = forward_saved(path, batch, seq, dtype)
    no_loss = forward_saved(path, batch, seq, dtype, loss=False)
    eager_head, patched_head = _head_loss(plan)
    return {
        "model": name,
        "config": f"benchmarks/configs/{MODELS[name]}",
        "eager_bytes": plan["eager_saved_bytes"],
        "patched_bytes": plan["patched_saved_bytes"],
        "no_loss_bytes": no_loss["patched_saved_bytes"],
        "head_loss_eager_bytes": eager_head,
        "head_loss_patched_bytes": patched_head,
    }


def table(result: dict) -> str:
    gib = 2**30
    lines = [
        f"batch {result['batch']} x seq {result['seq']}, {result['dtype']}, labels = input_ids",
        "",
        "| shaped like | eager | patch() | patch(loss=False) | head + loss, eager | head + loss, patch() |"
        " patch()'s head + loss / eager's |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        e = r["eager_bytes"]
        ratio = r["head_loss_patched_bytes"] / r["head_loss_eager_bytes"]
        lines.append(
            f"| {r['model']} | {e / gib:.2f} GiB | {r['patched_bytes'] / gib:.2f} GiB "
            f"({r['patched_bytes'] / e - 1:+.1%}) | {r['no_loss_bytes'] / gib:.2f} GiB "
            f"({r['no_loss_bytes'] / e - 1:+.1%}) | {r['head_loss_eager_bytes'] / gib:.2f} GiB | "
            f"{r['head_loss_patched_bytes'] / 2**20:.1f} MiB | {ratio:.2%} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", type=Path, default=RESULTS / "plan_lm.json")
    args = parser.parse_args(argv)
    import transformers

    transformers.utils.logging.set_verbosity_error()
    rows = []
    for name in args.models:
        rows.append(measure(name, args.batch, args.seq, args.dtype))
        print(f"planned {name}", flush=True)
    result = {"batch": args.batch, "seq": args.seq, "dtype": args.dtype,
              "transformers": transformers.__version__, "rows": rows}  # fmt: skip
    print(table(result))
    path = write_result(result, "plan_lm", "cpu", out=args.out)
    path.with_suffix(".md").write_text(table(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
