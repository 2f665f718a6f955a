"""The `invact` command's answers that come before any planning (invact/cli.py): bad input is one line on
stderr and exit status 2, no traceback, decided before torch or transformers load; --version; the
top-level help; the warning for a --seq past the config's positions. What the command plans, and the
errors the planner finds (a model type transformers does not know, images that do not fit):
test_plan_command.py, test_plan_step.py, test_plan_multimodal.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY_LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                  max_position_embeddings=64)  # fmt: skip
# What the command must not have imported when it refuses bad input: these take seconds
# (invact.planner itself, its options and report, are the standard library's alone: the command imports them)
HEAVY = ("torch", "transformers", "invact.planner.config", "invact.planner.forward", "invact.planner.step")


def _run(*args: str, python: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *python, "-m", "invact", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)  # fmt: skip


def _imported(stderr: str) -> set[str]:
    """The modules `python -X importtime` reports importing (its lines: "import time: self | cumulative |
    name", the name indented by depth)."""
    lines = [line for line in stderr.splitlines() if line.startswith("import time:")]
    return {line.rsplit("|", 1)[-1].strip() for line in lines}


@pytest.fixture
def config(tmp_path) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_LLAMA))
    return path


# (case, the arguments after `invact plan CONFIG` ({config}: a valid config, {dir}: the test's folder;
# None: no config), a part of the one line that names the problem)
BAD = [
    ("missing file", ["{dir}/absent.json"], "absent.json: no such file"),
    ("missing file before --batch", ["{dir}/absent.json", "--seq", "8"], "absent.json: no such file"),
    ("folder without config.json", ["{dir}/empty"], "empty/config.json: no such file"),
    ("not JSON", ["{dir}/text.json"], "text.json: not valid JSON"),
    ("not an object", ["{dir}/list.json"], "a config is a JSON object, got list"),
    ("no model_type", ["{dir}/untyped.json"], "the config has no model_type"),
    ("--fits -5GiB", ["{config}", "--fits", "-5GiB"], "--fits: must be a positive size like 24GiB"),
    ("--fits 0", ["{config}", "--fits", "0GiB"], "--fits: must be a positive size like 24GiB"),
    ("--fits nonsense", ["{config}", "--fits", "nonsense"], "cannot read 'nonsense' as a size"),
    ("--fits no value", ["{config}", "--fits"], "--fits: expected one argument"),
    ("--fits both", ["{config}", "--fits", "24GiB", "--batch", "2", "--seq", "16"], "one of them, not both"),
    ("--batch 0", ["{config}", "--batch", "0", "--seq", "8"], "--batch: must be a positive integer"),
    ("--batch -2", ["{config}", "--batch", "-2", "--seq", "8"], "--batch: must be a positive integer"),
    ("--batch two", ["{config}", "--batch", "two", "--seq", "8"], "expected a positive integer"),
    ("--seq -1", ["{config}", "--batch", "1", "--seq", "-1"], "--seq: must be a positive integer"),
    ("--images -1", ["{config}", "--batch", "1", "--seq", "8", "--images", "-1"], "--images: must be a non-"),
    ("no --batch", ["{config}", "--seq", "8"], "required: --batch (or --fits)"),
    ("unknown dtype", ["{config}", "--batch", "1", "--seq", "8", "--dtype", "int8"], "unknown dtype 'int8'"),
    ("--step fp32", ["{config}", "--step", "--batch", "1", "--seq", "8", "--dtype", "fp32"], "leave --dtype"),
    ("--step without --seq", ["{config}", "--step", "--batch", "1"], "--explain, --gpus and --tp need"),
    ("--gpus without --fsdp", ["{config}", "--gpus", "8", "--fits", "80GiB"], "add --fsdp"),
    ("--fsdp without --gpus", ["{config}", "--fsdp", "--fits", "80GiB"], "give --gpus N"),
    ("--gpus 0", ["{config}", "--gpus", "0", "--fsdp", "--fits", "80GiB"], "--gpus"),
    ("--gpus without --seq", ["{config}", "--gpus", "2", "--fsdp", "--batch", "1"], "--gpus and --tp need"),
    ("--tp without --seq", ["{config}", "--tp", "2", "--batch", "1"], "--gpus and --tp need"),
    ("--tp 0", ["{config}", "--tp", "0", "--fits", "80GiB"], "--tp"),
    ("--tp with lora", ["{config}", "--tp", "2", "--fits", "8GiB", "--recipe", "lora"], "under tensor"),
    ("unknown recipe", ["{config}", "--fits", "1GiB", "--recipe", "dora"], "invalid choice: 'dora'"),
    ("unknown command", None, "invalid choice: 'fly'"),
    ("no command", None, "required: COMMAND"),
]


@pytest.mark.parametrize("case, args, names", BAD, ids=[case for case, _, _ in BAD])
def test_bad_input_is_one_line_and_status_2(tmp_path, config, case, args, names):
    (tmp_path / "text.json").write_text('{"model_type": "llama",')
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "untyped.json").write_text('{"hidden_size": 64}')
    (tmp_path / "empty").mkdir()
    if args is None:
        command = ["fly"] if case == "unknown command" else []
    else:
        command = ["plan", *(a.format(dir=tmp_path, config=config) for a in args)]
    done = _run(*command)
    assert done.returncode == 2 and done.stdout == "", done
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert re.match(r"invact( plan)?: error: \S", lines[0]) and names in lines[0], lines[0]


@pytest.mark.parametrize(
    "args",
    [["plan", "absent.json"], ["plan", "{config}", "--fits", "-5GiB"], ["plan", "{config}", "--batch", "1"]],
    ids=["missing file", "--fits -5GiB", "no --seq"],
)
def test_bad_input_is_refused_before_torch_loads(config, args):
    """The command parses its arguments and reads its config file first: neither torch nor transformers
    (seconds to import) is imported on the way to the refusal."""
    done = _run(*(a.format(config=config) for a in args), python=("-X", "importtime"))
    assert done.returncode == 2 and "error:" in done.stderr.splitlines()[-1], done.stderr
    imported = _imported(done.stderr)
    assert "invact.cli" in imported and not imported & set(HEAVY), sorted(imported & set(HEAVY))


def test_the_console_script_refuses_before_torch_loads(tmp_path):
    """The `invact` script ([project.scripts]) imports invact.cli under its own name: the same."""
    script = tmp_path / "invact"
    script.write_text("import sys\nfrom invact.cli import main\nsys.exit(main())\n")
    command = [sys.executable, "-X", "importtime", str(script), "plan", str(tmp_path / "absent.json")]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    assert done.returncode == 2 and "absent.json: no such file" in done.stderr.splitlines()[-1], done.stderr
    assert not _imported(done.stderr) & set(HEAVY)


def test_version_names_invact_torch_and_transformers_without_importing_them():
    done = _run("--version", python=("-X", "importtime"))
    assert done.returncode == 0, done.stderr
    line = r"invact \d+\.\d+\.\d+\S* \(torch \S+, transformers [^)]+\)\n"
    assert re.fullmatch(line, done.stdout), done.stdout
    assert not _imported(done.stderr) & set(HEAVY)


def test_the_top_level_help_lists_the_commands_and_what_fits_answers():
    done = _run("--help")
    assert done.returncode == 0, done.stderr
    for text in ("plan", "--fits", "how long a sequence", "how large a batch", "--version", "examples:"):
        assert text in done.stdout, text


def test_the_planners_names_are_the_commands():
    """invact.cli and the planner's rooms take the names `invact plan` accepts from one torch-free module
    (invact.planner.options): the planner's dtypes and recipes are those names."""
    from invact import cli
    from invact.planner import config, inputs, options, recipes, step

    assert set(config.DTYPES) == set(options.DTYPE_NAMES)
    assert all(str(config.DTYPES[k]) == f"torch.{v}" for k, v in options.DTYPE_NAMES.items())
    assert {name: r.label for name, r in recipes.RECIPES.items()} == options.RECIPE_LABELS
    assert inputs.DEFAULT_IMAGE_SIDE is options.DEFAULT_IMAGE_SIDE
    assert step.SEQ_MULTIPLE is cli.SEQ_MULTIPLE is options.SEQ_MULTIPLE


@pytest.mark.parametrize("text", ["24GiB", "24 GiB", "24G", "80GB", "1.5TiB", "512MiB", "100", "4kb", ".5g"])
def test_fits_reads_a_size_as_the_planner_does(text):
    from invact.cli import _size
    from invact.planner.options import parse_size

    assert _size(text) == parse_size(text)


def test_a_seq_past_the_configs_positions_warns_in_one_line(config, capsys):
    from invact.cli import main

    assert main(["plan", str(config), "--batch", "1", "--seq", "128", "--dtype", "float32", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["seq"] == 128  # planned as given
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("invact plan: warning: --seq 128"), err
    assert "max_position_embeddings (64)" in lines[0]
    assert main(["plan", str(config), "--batch", "1", "--seq", "64", "--dtype", "float32", "--json"]) == 0
    assert capsys.readouterr().err == ""  # at the positions: no warning


@pytest.mark.slow
def test_the_command_plans_once_its_input_is_checked(config):
    """`python -m invact` loads invact's runtime after its checks (invact/__init__.py defers it in the
    command's process): a whole run, with the warning, as in-process."""
    done = _run("plan", str(config), "--batch", "1", "--seq", "128", "--dtype", "float32", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["patched_saved_bytes"] > 0
    assert "invact plan: warning: --seq 128" in done.stderr and "Traceback" not in done.stderr
