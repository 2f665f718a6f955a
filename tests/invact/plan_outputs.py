"""What `invact plan` prints for each committed config (benchmarks/configs/*.json), kept in
tests/invact/data/plan_outputs.json so a change to the planner's code that changes an answer shows:
test_plan_outputs.py runs the same commands and compares, character for character.

`python tests/invact/plan_outputs.py` writes the file afresh (after a change meant to move the answers;
the diff of the JSON shows which moved); `python tests/invact/plan_outputs.py qlora` the named commands'
outputs alone. The commands: each config's saved-bytes table and its --json,
and the step's peaks with --explain for the default recipes (on the meta device, for cuda: nothing in them
depends on this machine's CPU), at batch 1 x seq 512 (an encoder-decoder or a vision model's image
tokens included); on the smallest Llama also mixed precision, QLoRA, FSDP2 over 4 GPUs and --fits."""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "benchmarks" / "configs").glob("*.json"))
OUTPUTS = Path(__file__).with_name("data") / "plan_outputs.json"

# The arguments after the config's path, one command each
COMMANDS: dict[str, list[str]] = {
    "table": ["--batch", "1", "--seq", "512"],
    "json": ["--batch", "1", "--seq", "512", "--json"],
    "step": ["--batch", "1", "--seq", "512", "--explain"],
}
# Commands run on one config alone (the smallest Llama): the other recipes' and options' paths
ONE = "llama-3.2-1b-shaped.json"
ONE_COMMANDS: dict[str, list[str]] = {
    "mixed": ["--batch", "1", "--seq", "512", "--explain", "--recipe", "mixed"],
    "fsdp": ["--batch", "2", "--seq", "256", "--explain", "--gpus", "4", "--fsdp"],
    "fits": ["--fits", "24GiB", "--recipe", "lora"],
    "qlora": ["--batch", "1", "--seq", "512", "--explain", "--recipe", "qlora"],
}


def commands(config: Path) -> dict[str, list[str]]:
    """The commands run on `config`: name -> the arguments after its path."""
    return {**COMMANDS, **(ONE_COMMANDS if config.name == ONE else {})}


def key(config: Path, command: str) -> str:
    return f"{config.name} {command}"


def run(config: Path, command: str) -> tuple[int, str]:
    """(exit status, stdout) of `invact plan CONFIG ARGS` run in this process, the path as committed
    (relative to the repository's root)."""
    from invact.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = main(["plan", str(config.relative_to(ROOT)), *commands(config)[command]])
    return status, out.getvalue()


def main(only: list[str]) -> None:
    """Writes every command's output, or with `only` (command names) those alone, the rest kept."""
    import os

    os.chdir(ROOT)
    outputs = json.loads(OUTPUTS.read_text(encoding="utf-8")) if only and OUTPUTS.exists() else {}
    for config in CONFIGS:
        for command in [c for c in commands(config) if not only or c in only]:
            status, text = run(config, command)
            if status:
                sys.exit(f"invact plan {config.name} {command}: exit status {status}")
            outputs[key(config, command)] = text
            print(f"{key(config, command)}: {len(text)} characters", file=sys.stderr)
    OUTPUTS.parent.mkdir(exist_ok=True)
    tmp = OUTPUTS.with_suffix(".tmp")
    tmp.write_text(json.dumps(outputs, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    tmp.replace(OUTPUTS)


if __name__ == "__main__":
    main(sys.argv[1:])
