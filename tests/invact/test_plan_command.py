"""`invact plan` (invact/cli.py, invact/planner/): the bytes a training forward saves for backward,
planned on the meta device from a config alone, against what a real CPU forward holds (the profiler,
no saved-tensor hooks); the command's errors, help and output; and invact's counter, op and gated
hooks on meta tensors."""

import gc
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

import invact
from invact.memory import count_saved

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
LLAMA_8B = ROOT / "benchmarks" / "configs" / "llama-3.1-8b-shaped.json"
BATCH, SEQ = 2, 32
TINY_LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=128)  # fmt: skip
# GPT-2 keeps its default dropout (0.1): CPU's SDPA then takes the math kernel, and dropout saves masks
TINY_GPT2 = dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=64)

# How far the planned bytes may be from what a real CPU forward holds, relative. Measured (fp32, batch
# 2, seq 32, seeds 0-2): 0 bytes apart on the tiny Llama, eager and patched; 48 bytes of 1.26 MB
# (0.004%) on GPT-2 eager (a few scalar tensors its Python GELU holds), 0 patched. 0.2% is 50x the
# worst gap and below the smallest term the planner must get right here, the packed bits (0.5% of
# the patched Llama figure): well inside the 3% the command was asked to reach.
HELD_TOLERANCE = 0.002


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "invact", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)  # fmt: skip


def _plan_json(config: Path, *args: str) -> dict:
    done = _run("plan", str(config), "--json", *args)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _write(tmp_path: Path, config: dict, name: str = "config.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(config))
    return path


def _held_bytes(config: dict, patched: bool, labels: bool = False) -> tuple[int, int, int]:
    """(bytes allocated and not freed during one training forward of the model `config` describes,
    built on CPU in fp32 with random weights (seed 0), on input_ids (BATCH, SEQ) (seed 1): what
    autograd keeps plus the output, summed over the profiler's self_cpu_memory_usage, no saved-tensor
    hooks; the bytes of input_ids, allocated before the forward; the bytes of the head's parameters,
    whose gradients patch()'s loss computes in the forward). With `labels`, labels = input_ids (the
    loss computed, as the planner's default). Earlier garbage is collected first: freed inside the
    profile, it would count as negative."""
    torch.manual_seed(0)
    built = transformers.AutoConfig.for_model(**config)
    auto = transformers.AutoModelForCausalLM
    model = auto.from_config(built, dtype=torch.float32, attn_implementation="sdpa")
    if patched:
        invact.patch(model)
    model.train()
    seeded = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config["vocab_size"], (BATCH, SEQ), generator=seeded)
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = model(input_ids=ids, use_cache=False, **({"labels": ids} if labels else {}))
    held = sum(e.self_cpu_memory_usage for e in prof.events())
    del out
    head = sum(p.numel() * p.element_size() for p in model.get_output_embeddings().parameters())
    return held, ids.numel() * ids.element_size(), head


@pytest.mark.slow
@pytest.mark.parametrize("labels", [True, False], ids=["labels", "no labels"])
@pytest.mark.parametrize("config", [TINY_LLAMA, TINY_GPT2], ids=["llama", "gpt2"])
def test_planned_bytes_match_what_a_real_forward_holds(tmp_path, config, labels):
    shape = ("--batch", str(BATCH), "--seq", str(SEQ), "--dtype", "float32")
    plan = _plan_json(_write(tmp_path, config), *shape, *(() if labels else ("--no-labels",)))
    assert plan["attention"]["implementation"] == "sdpa" and plan["labels"] == labels
    for patched, key, output in (
        (False, "eager_saved_bytes", "output_bytes"),
        (True, "patched_saved_bytes", "patched_output_bytes"),
    ):
        held, input_bytes, head_bytes = _held_bytes(config, patched, labels)
        # What the forward holds when it returns, in the planner's terms:
        #   + the bytes saved for backward (plan[key]: each storage once, parameters excluded), which
        #     include input_ids: the embedding saves the indices for its backward;
        #   + the output's bytes not among them (plan[output]: the logits, (BATCH, SEQ, vocab) fp32,
        #     held by the returned ModelOutput, and the loss; patch()'s loss path returns no logits);
        #   - input_ids, saved but allocated before the profile started (the planner reports the same
        #     bytes as plan["input_bytes"]);
        #   + patch()'s loss (with labels): the head's parameter gradients, computed in the forward and
        #     saved for the backward to hand on (not counted as saved: the step holds them as .grad
        #     from the backward's first op; invact.memory.EARLY_GRADIENT).
        assert plan["input_bytes"] == input_bytes
        early = head_bytes if patched and labels else 0
        expected = plan[key] + plan[output] - input_bytes + early
        assert held == pytest.approx(expected, rel=HELD_TOLERANCE), (key, held, expected)


def _documented_plans() -> list[tuple[str, str, list[str]]]:
    """(file, command, the lines shown) for every `$ invact plan ...` text block in the README and docs."""
    found = []
    for path in (ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))):
        for command, shown in re.findall(
            r"```text\n\$ (invact plan [^\n]*)\n(.*?)```", path.read_text(), re.S
        ):
            found.append((str(path.relative_to(ROOT)), command, shown.splitlines()))
    return found


@pytest.mark.slow
@pytest.mark.parametrize(
    "where, command, shown", _documented_plans(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_documented_plan_output_is_the_commands(where, command, shown):
    # Each shown line is a line the command prints now, in the same order (a block may show a part).
    done = _run(*shlex.split(command)[1:])
    assert done.returncode == 0, done.stderr
    printed = iter(line.rstrip() for line in done.stdout.splitlines())
    for line in shown:
        assert any(line.rstrip() == p for p in printed), f"{where}: {line!r} is not what `{command}` prints"


def test_the_readme_and_docs_show_a_plan():
    assert {where for where, _, _ in _documented_plans()} >= {"README.md", "docs/patching.md"}


@pytest.mark.slow
def test_gpt2_plan_json(tmp_path):
    plan = _plan_json(_write(tmp_path, TINY_GPT2), "--batch", "2", "--seq", "16", "--dtype", "bf16")
    for key in ("eager_saved_bytes", "patched_saved_bytes", "kinds", "decisions", "config", "batch", "seq",
                "dtype", "output_bytes", "attention"):  # fmt: skip
        assert key in plan
    assert (plan["batch"], plan["seq"], plan["dtype"]) == (2, 16, "bfloat16")
    assert plan["config"].endswith("config.json")
    assert isinstance(plan["eager_saved_bytes"], int) and isinstance(plan["patched_saved_bytes"], int)
    assert 0 < plan["patched_saved_bytes"] < plan["eager_saved_bytes"]
    for which in ("eager", "patched"):  # the kinds split each total exactly
        assert sum(k[f"{which}_bytes"] for k in plan["kinds"]) == plan[f"{which}_saved_bytes"]
    kinds = {k["kind"]: k for k in plan["kinds"]}
    # gelu_new is a Python composition whose intermediates torch saves: InvAct keeps y and bits only
    assert kinds["mlp_activations"]["patched_bytes"] < kinds["mlp_activations"]["eager_bytes"]
    # the inverted norms keep y (which c_attn and c_fc save: eager counts it under attention and MLP,
    # the first to save it) and rstd, not x: less in the two rows together, attention no more
    assert kinds["attention"]["patched_bytes"] <= kinds["attention"]["eager_bytes"]
    norms_and_attention = [
        sum(kinds[k][f"{w}_bytes"] for k in ("norms", "attention")) for w in ("patched", "eager")
    ]
    assert norms_and_attention[0] < norms_and_attention[1]
    replaced = [d for d in plan["decisions"] if d["replace"] and d["kind"] == "activation"]
    assert len(replaced) == TINY_GPT2["n_layer"]
    assert all(d["class"].endswith("NewGELUActivation") for d in replaced)
    norms = [d for d in plan["decisions"] if d["kind"] == "norm"]
    assert len(norms) == 2 * TINY_GPT2["n_layer"] + 1 and all(d["replace"] for d in norms)  # ln_1, ln_2, ln_f


@pytest.mark.slow
def test_llama_8b_shaped_config(tmp_path):
    """The benchmark config at batch 1, seq 4096, bf16: the rows the gated path changes, computed by
    hand from the config, and the logits."""
    cfg = json.loads(LLAMA_8B.read_text())
    layers, inter, vocab = cfg["num_hidden_layers"], cfg["intermediate_size"], cfg["vocab_size"]
    tokens, bf16 = 4096, 2
    plan = _plan_json(LLAMA_8B, "--batch", "1", "--seq", str(tokens), "--no-norms", "--no-labels")  # MLPs
    kinds = {k["kind"]: k for k in plan["kinds"]}
    per_mlp = tokens * inter * bf16  # one (1, seq, intermediate) bf16 tensor
    bits = tokens * inter // 8
    assert kinds["gated_products"]["eager_bytes"] == layers * per_mlp  # h = act(g) * u, each layer
    assert kinds["gated_products"]["patched_bytes"] == 0  # recomputed in backward
    assert kinds["mlp_activations"]["eager_bytes"] == layers * 2 * per_mlp  # g, and y the multiply saves
    assert kinds["mlp_activations"]["patched_bytes"] == layers * (per_mlp + bits)  # y and its bits
    assert plan["output_bytes"] == tokens * vocab * bf16
    assert plan["attention"] == {"implementation": "sdpa", "kernels": ["flash"]}
    assert plan["eager_saved_bytes"] - plan["patched_saved_bytes"] == layers * (2 * per_mlp - bits)


@pytest.mark.slow
def test_table_for_a_person(tmp_path):
    config = _write(tmp_path, TINY_LLAMA)
    done = _run("plan", str(config), "--batch", "2", "--seq", "32", "--dtype", "float32")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    head = "\n".join(lines[:4])
    assert "sdpa" in head and "batch 2 x seq 32" in head and "float32" in head
    totals = next(line for line in lines if line.startswith("saved for backward"))
    assert lines.index(totals) < 5 and "eager" in totals and "%" in totals
    table = [line for line in lines if line.startswith(("attention", "MLP", "gated", "norms", "total"))]
    assert len(table) >= 5
    assert len({len(line) for line in table}) == 1  # aligned: right-aligned columns, one width
    assert any(line.startswith("  replaced: model.layers.*.mlp.act_fn (x2)") for line in lines)


@pytest.mark.slow
@pytest.mark.parametrize(
    "case",
    ["missing file", "bad json", "not an object", "no model_type", "unknown model_type", "unbuildable",
     "batch 0", "batch -1", "seq 0", "batch not a number", "unknown dtype"],
)  # fmt: skip
def test_bad_input_is_one_line_and_status_2(tmp_path, case):
    config = _write(tmp_path, TINY_LLAMA)
    args = {"batch": "1", "seq": "8", "dtype": "float32"}
    if case == "missing file":
        config = tmp_path / "absent.json"
    elif case == "bad json":
        config.write_text('{"model_type": "llama",')
    elif case == "not an object":
        config.write_text("[1, 2]")
    elif case == "no model_type":
        config.write_text('{"hidden_size": 64}')
    elif case == "unknown model_type":
        config.write_text('{"model_type": "no_such_model"}')
    elif case == "unbuildable":  # 64 is not a multiple of 5 heads
        config.write_text(json.dumps(TINY_LLAMA | {"num_attention_heads": 5}))
    elif case.startswith(("batch", "seq")):
        name, value = case.split(" ", 1)
        args[name] = {"not a number": "two"}.get(value, value)
    elif case == "unknown dtype":
        args["dtype"] = "int8"
    done = _run("plan", str(config), *(f"--{k}={v}" for k, v in args.items()))
    assert done.returncode == 2
    assert done.stdout == ""
    # The error's one line, after any warning's (a version outside the tested range: one line each).
    *warned, error = done.stderr.splitlines()
    assert error.startswith("invact plan: error:"), done.stderr
    assert all(line.startswith("invact plan: warning:") for line in warned), done.stderr


# The command in a fresh interpreter that reads transformers' version as 99.0.0 (outside the tested range).
_WITH_A_NEWER_TRANSFORMERS = """
import sys
from importlib import metadata
real = metadata.version
metadata.version = lambda name: "99.0.0" if name == "transformers" else real(name)
sys.argv = ["invact", *sys.argv[1:]]  # the console script's name: the runtime loads once input is checked
from invact.cli import main
sys.exit(main())
"""


def test_a_version_warning_and_a_bad_input_are_one_line_each(tmp_path):
    config = _write(tmp_path, {"model_type": "no_such_model"})
    done = subprocess.run(
        [sys.executable, "-c", _WITH_A_NEWER_TRANSFORMERS, "plan", str(config), "--batch=1", "--seq=8"],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert done.returncode == 2 and done.stdout == ""
    warning, error = done.stderr.splitlines()
    assert (
        warning.startswith("invact plan: warning: invact is tested with transformers") and "99.0.0" in warning
    )
    assert error.startswith("invact plan: error: transformers cannot build"), done.stderr


def test_help_explains_every_option():
    done = _run("plan", "--help")
    assert done.returncode == 0
    for text in ("--batch", "--seq", "--dtype", "--json", "--no-gated", "CONFIG.json", "saves for backward",
                 "parameters", "sdpa", "logits", "Exit status"):  # fmt: skip
        assert text in done.stdout, text


def test_main_in_process_returns_status(tmp_path, capsys):
    from invact.cli import main

    assert main(["plan", str(tmp_path / "absent.json"), "--batch", "1", "--seq", "4"]) == 2
    assert capsys.readouterr().err.startswith("invact plan: error:")


class _ActThenLinear(nn.Module):
    """A Linear, an activation, a Linear: the activation's output is what the second Linear saves."""

    def __init__(self, act: nn.Module) -> None:
        super().__init__()
        self.up, self.act, self.down = nn.Linear(24, 40), act, nn.Linear(40, 24)

    def forward(self, x):
        return self.down(self.act(self.up(x)))


@pytest.mark.parametrize("act", [nn.GELU(), invact.InvAct("gelu")], ids=["torch", "invact"])
def test_count_saved_on_meta_is_count_saved_on_cpu(act):
    """On meta every data pointer is 0: the counter tells storages (and parameters) apart by identity
    and counts a tensor saved twice (by the activation and the next Linear) once, as on CPU."""
    reports = {}
    for device in ("cpu", "meta"):
        torch.manual_seed(0)
        model = _ActThenLinear(act).to(device)
        x = torch.randn(3, 24).to(device).requires_grad_()
        with count_saved(model) as counter:
            model(x)
        reports[device] = counter.report
    assert reports["meta"].saved_bytes == reports["cpu"].saved_bytes > 0
    assert reports["meta"].saved_tensors == reports["cpu"].saved_tensors
    assert reports["meta"].by_dtype == reports["cpu"].by_dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("mode", ["bits", "precision_bit"])
def test_invact_forward_and_backward_on_meta(dtype, mode):
    """The eager op on meta tensors: forward and backward give shapes (float64's backward, Newton
    iterations on values, goes through the op's fake kernel there)."""
    x = torch.empty(5, 7, device="meta", dtype=dtype, requires_grad=True)
    y = invact.InvAct("silu", mode)(x)
    y.backward(torch.empty_like(y))
    assert y.shape == x.shape and x.grad.shape == x.shape and x.grad.dtype == dtype


@pytest.mark.slow
def test_llama_1b_shaped_head_and_loss():
    """Llama-3.2-1B-shaped, batch 1, seq 4096, bf16, with labels: eager's head and loss save the head's
    input, the fp32 log-softmax, the targets (a view of the labels padded by one, int64) and
    nll_loss's fp32 total weight; patch()'s loss computes its gradients in the forward and saves the
    hidden states' alone (tokens x hidden, bf16): the head weight's, held as the parameter's gradient
    from the backward's first op, is not counted (invact.memory.EARLY_GRADIENT)."""
    from invact.planner.forward import forward_saved

    config = ROOT / "benchmarks" / "configs" / "llama-3.2-1b-shaped.json"
    cfg = json.loads(config.read_text())
    tokens, bf16 = 4096, 2
    plan = forward_saved(config, 1, tokens, "bfloat16")
    kinds = {k["kind"]: k for k in plan["kinds"]}
    targets = (tokens + 1) * 8
    logits = tokens * (cfg["hidden_size"] * bf16 + cfg["vocab_size"] * 4)
    assert kinds["head_loss"]["eager_bytes"] == logits + targets + 4
    assert kinds["head_loss"]["patched_bytes"] == tokens * cfg["hidden_size"] * bf16
    assert plan["patched_output_bytes"] == 4  # the fp32 loss alone: no logits
    assert plan["output_bytes"] == tokens * cfg["vocab_size"] * bf16 + 4


def _assert_a_real_forward_saves(plan: dict, config: dict) -> None:
    """A real CPU forward (no labels) of the causal LM `config` describes saves the plan's bytes,
    eager and patched."""
    for patched, key in ((False, "eager_saved_bytes"), (True, "patched_saved_bytes")):
        torch.manual_seed(0)
        built = transformers.AutoConfig.for_model(**config)
        model = transformers.AutoModelForCausalLM.from_config(built, attn_implementation="sdpa")
        if patched:
            invact.patch(model)
        model.train()
        with count_saved(model) as counter:
            model(input_ids=torch.randint(0, 128, (BATCH, SEQ)), use_cache=False)
        assert plan[key] == counter.report.saved_bytes, key


@pytest.mark.slow
def test_fused_gate_up_on_meta_matches_cpu():
    """Phi-3's fused gate_up: the gated path moves u and y into the fused output when the MLP returns,
    telling storages apart by identity on meta: the planned bytes are a real forward's."""
    from invact.planner.forward import forward_saved

    config = TINY_LLAMA | {"model_type": "phi3", "pad_token_id": 0}
    plan = forward_saved(config, BATCH, SEQ, "float32", labels=False)
    _assert_a_real_forward_saves(plan, config)


@pytest.mark.slow
def test_masked_attention_on_meta_takes_the_kernel_cpu_takes():
    """Mistral with a sliding window shorter than the sequence passes SDPA a mask: torch's kernel choice
    on stand-ins broadcasts it (its last two dimensions 1), so the meta forward takes CPU's fused kernel
    with the mask as a real one does (the mask's key length against the stand-ins' one key sent it to
    the math path, which also keeps the attention probabilities)."""
    from invact.planner.forward import forward_saved

    config = TINY_LLAMA | {"model_type": "mistral", "sliding_window": SEQ // 4}
    plan = forward_saved(config, BATCH, SEQ, "float32", labels=False)
    assert plan["attention"]["kernels"] == ["flash"]
    _assert_a_real_forward_saves(plan, config)
