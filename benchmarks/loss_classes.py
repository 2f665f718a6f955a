"""Which of transformers' language-model classes patch() computes the loss of from hidden states: every
class the installed transformers exports whose name ends in ForCausalLM, LMHeadModel,
ForConditionalGeneration or ForSpeechSeq2Seq, decided from its source alone (invact.loss.class_decision:
no model is built). For each, taken (and by which loss: transformers' causal-LM loss, or a cross-entropy
on the head's output) or left alone with the reason, which names what its forward does instead.

"Before" is the rule patch() had until it decided by what a model computes: the class's loss type
(named for the class, as transformers names it) is "ForCausalLM" and its forward takes labels.

Writes benchmarks/results/loss_classes.{json,md} (no machine in the name: the decisions depend on the
transformers version, which the files state, not on the CPU) and prints the counts.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
import warnings
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
SUFFIXES = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration", "ForSpeechSeq2Seq")


def class_names() -> list[str]:
    """The model classes (PreTrainedModel subclasses: not the Auto factories) the installed transformers
    exports with one of SUFFIXES, sorted."""
    import transformers

    pattern = re.compile(f"({'|'.join(SUFFIXES)})$")
    names = sorted(n for n in dir(transformers) if pattern.search(n))
    model = transformers.PreTrainedModel
    return [n for n in names if isinstance(c := getattr(transformers, n), type) and issubclass(c, model)]


def decisions() -> dict[str, dict]:
    """name -> {"taken", "reason", "before"} for every class of class_names()."""
    import transformers
    from transformers.loss.loss_utils import LOSS_MAPPING

    import invact.loss as L
    from invact.loss import source

    rows = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in class_names():
            cls = getattr(transformers, name)
            taken, reason = L.class_decision(cls)
            causal = source._class_loss_type(cls, LOSS_MAPPING) == "ForCausalLM"
            before = causal and source._labels_at(cls) is not None
            rows[name] = {"taken": taken, "reason": reason, "before": before}
    return rows


def counts(rows: dict[str, dict]) -> dict:
    """The totals: classes, taken before and now, and now by reason."""
    return {
        "classes": len(rows),
        "taken_before": sum(r["before"] for r in rows.values()),
        "taken": sum(r["taken"] for r in rows.values()),
        "by_reason": dict(collections.Counter(_kind(r) for r in rows.values()).most_common()),
    }


def _kind(row: dict) -> str:
    """A reason without what is particular to a class (its quoted line, its attribute)."""
    reason = re.sub(r"`.*", "...", row["reason"])
    return re.sub(r"self\.\w+", "self.<attr>", reason)


def markdown(result: dict) -> str:
    c = result["counts"]
    lines = [
        f"transformers {result['transformers']}: {c['classes']} classes named *{', *'.join(SUFFIXES)}; "
        f"patch() computes the loss from hidden states for {c['taken']} (before deciding by what a model "
        f"computes: {c['taken_before']}).",
        "",
        "| decision | classes |",
        "|---|---|",
    ]
    lines += [f"| {kind} | {n} |" for kind, n in c["by_reason"].items()]
    lines += ["", "| class | taken | reason |", "|---|---|---|"]
    for name, row in result["classes"].items():
        lines.append(f"| {name} | {'yes' if row['taken'] else 'no'} | {row['reason'].replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out", type=Path, default=RESULTS / "loss_classes.json", help="JSON path (.md beside)"
    )
    args = parser.parse_args(argv)
    import transformers

    rows = decisions()
    result = {"transformers": transformers.__version__, "counts": counts(rows), "classes": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(result))
    c = result["counts"]
    print(f"{c['classes']} classes: {c['taken']} taken (before: {c['taken_before']})")
    for kind, n in c["by_reason"].items():
        print(f"  {n:4d}  {kind}")
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
