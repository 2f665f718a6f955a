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
# The whole step's peaks take 8-60 s a config on a 2-core AMD EPYC (a forward's table 1-6 s): CI runs
# them on the two smallest configs (and the smallest Llama's other commands), the rest under the full
# marker (make test-full), which the commit that moved the planner into its package ran.
FULL = {
    plan_outputs.key(c, "step")
    for c in plan_outputs.CONFIGS
    if c.name not in {plan_outputs.ONE, "qwen2.5-0.5b-shaped.json"}
}
CASES = [
    pytest.param(
        config,
        command,
        marks=[pytest.mark.full] if plan_outputs.key(config, command) in FULL else [],
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
