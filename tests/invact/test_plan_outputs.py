"""`invact plan` answers as committed: every committed config's output (tests/invact/plan_outputs.py
says which commands, and writes the file afresh), character for character. A change to the planner's
code that moves an answer fails here; one meant to move it rewrites the file, and its diff shows what
moved."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import plan_outputs  # noqa: E402

sys.path.pop(0)

EXPECTED = json.loads(plan_outputs.OUTPUTS.read_text(encoding="utf-8"))
# The vision-language configs' and Gemma 3's steps take 30-60 s each on a 2-core AMD EPYC (the other
# commands 1-20 s): CI runs them under the full marker (make test-full).
SLOW = {"gemma-3-4b-shaped.json step", "qwen2.5-vl-3b-shaped.json step"}
CASES = [
    pytest.param(
        config,
        command,
        marks=[pytest.mark.full] if plan_outputs.key(config, command) in SLOW else [],
        id=plan_outputs.key(config, command),
    )
    for config in plan_outputs.CONFIGS
    for command in plan_outputs.commands(config)
]


def test_every_command_has_its_output():
    assert sorted(EXPECTED) == sorted(
        plan_outputs.key(c, cmd) for c in plan_outputs.CONFIGS for cmd in plan_outputs.commands(c)
    )


@pytest.mark.parametrize(("config", "command"), CASES)
def test_output_unchanged(config, command, monkeypatch):
    monkeypatch.chdir(plan_outputs.ROOT)
    status, text = plan_outputs.run(config, command)
    assert status == 0
    assert text == EXPECTED[plan_outputs.key(config, command)]
