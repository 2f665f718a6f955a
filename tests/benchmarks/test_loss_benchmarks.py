"""benchmarks/loss_time.py and benchmarks/step_peak.py --small run and write what their docs say: the
head + loss time of every variant per shape and dtype, and a training step's peak per variant."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"


def _run(script: str, out: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(BENCHMARKS / script), "--small", "--out", str(out), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=BENCHMARKS)
    assert proc.returncode == 0, proc.stderr
    return proc


def test_loss_time_small_run(tmp_path):
    out = tmp_path / "loss_time.json"
    proc = _run("loss_time.py", out, "--rounds", "2")
    sys.path.insert(0, str(BENCHMARKS))
    from loss_time import SMALL

    rows = json.loads(out.read_text())["rows"]
    assert [(r["label"], r["dtype"]) for r in rows] == [
        (s[0], d) for s in SMALL for d in ("float32", "bfloat16")
    ]
    for r in rows:
        v = r["variants"]
        assert {"eager", "invact", "reference matmul"} <= set(v) and v["eager"]["ratio_to_eager"] == 1.0
        assert all(x["ms"] > 0 for x in v.values())
        # the same loss as eager, to the bf16 logits' rounding (a relative 2^-8 per logit at most)
        assert abs(v["invact"]["loss"] - v["eager"]["loss"]) <= 2**-8 * abs(v["eager"]["loss"])
    assert "| small: 64 x 32 x 3000 (held after forward, MiB: eager " in proc.stdout


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="Linux's /proc/self/clear_refs")
def test_step_peak_small_run(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "step_peak.json"
    proc = _run("step_peak.py", out, "--steps", "2")
    result = json.loads(out.read_text())
    assert [r["dtype"] for r in result["rows"]] == ["float32", "bfloat16"]
    for r in result["rows"]:
        v = r["variants"]
        assert list(v) == ["eager", "patch(loss=False)", "patch()"]
        assert all(x["peak_bytes"] > 0 and len(x["peaks"]) == 2 for x in v.values())
        assert v["patch()"]["saved_bytes"] < v["patch(loss=False)"]["saved_bytes"] < v["eager"]["saved_bytes"]
    assert "| float32 |" in proc.stdout


RESULTS = BENCHMARKS / "results"


def _module(name: str):
    import importlib

    sys.path.insert(0, str(BENCHMARKS))
    return importlib.import_module(name)


@pytest.mark.parametrize(
    "script, stem, render",
    [
        ("loss_time", "loss_time_cpu", lambda m, r: m.table(r)),
        ("step_peak", "step_peak_cpu", lambda m, r: m.table(r)),
        ("step_peak", "step_peak_cpu_compiled", lambda m, r: m.table(r)),
        ("step_peak", "step_peak_cpu_gpt2", lambda m, r: m.table(r)),
        ("step_peak", "step_peak_cpu_gpt2_compiled", lambda m, r: m.table(r)),
        ("step_peak", "step_peak_cpu_qwen2-vl", lambda m, r: m.table(r)),
        ("step_peak", "step_peak_cpu_qwen2-vl_compiled", lambda m, r: m.table(r)),
        ("step_peak", "step_peak_cpu_wide_compiled_kinds", lambda m, r: m.table(r)),
        ("plan_lm", "plan_lm", lambda m, r: m.table(r)),
        ("memory", "memory_lm_cpu", lambda m, r: m.markdown_lm(r["rows"])),
        ("memory", "memory_lm_cpu_bfloat16", lambda m, r: m.markdown_lm(r["rows"])),
        ("training", "training_cpu_loss", lambda m, r: m.markdown(r["summary"])),
    ],
)
def test_committed_tables_are_their_results(script, stem, render):
    # docs/results/loss.md includes these tables as written: each is its JSON's rendering
    result = json.loads((RESULTS / f"{stem}.json").read_text())
    assert (RESULTS / f"{stem}.md").read_text() == render(_module(script), result) + "\n"


def test_the_loss_figures_in_the_readme_and_docs_are_the_results():
    plan = json.loads((RESULTS / "plan_lm.json").read_text())
    step = json.loads((RESULTS / "step_peak_cpu.json").read_text())
    times = json.loads((RESULTS / "loss_time_cpu.json").read_text())
    (llama,) = [r for r in plan["rows"] if r["model"] == "Llama-3.2-1B"]
    e = llama["eager_bytes"]
    (fp32,) = [r["variants"] for r in step["rows"] if r["dtype"] == "float32"]
    ratios = [r["variants"]["invact"]["ratio_to_eager"] for r in times["rows"]]
    head = llama["head_loss_eager_bytes"] / 2**30, llama["head_loss_patched_bytes"] / 2**20
    figures = [
        f"{llama['patched_bytes'] / e - 1:+.1%} ({llama['no_loss_bytes'] / e - 1:+.1%} without the loss "
        "path)",
        f"{head[0]:.2f} GiB -> {head[1]:.0f} MiB",
        f"{fp32['eager']['peak_bytes'] / 2**20:.0f} -> {fp32['patch()']['peak_bytes'] / 2**20:.0f} MiB",
        f"{min(ratios):.2f}-{max(ratios):.2f}x eager's",
    ]
    text = " ".join((ROOT / "docs" / "results" / "index.md").read_text().split())
    missing = [f for f in figures if f not in text]
    assert not missing, f"docs/results/index.md does not show {missing}"


def test_torch_default_options_figures_in_the_docs_are_the_results():
    times = json.loads((RESULTS / "loss_time_cpu.json").read_text())
    default = "torch chunked (default options)"
    ratios = {
        r["dtype"]: r["variants"][default]["ratio_to_eager"]
        for r in times["rows"]
        if default in r["variants"]
    }
    chunked, unfused = "torch chunked (batch_chunk_size=128)", [r for r in times["rows"] if not r["ops"]]

    def span(variant, dtype):
        got = [r["variants"][variant]["ratio_to_eager"] for r in unfused if r["dtype"] == dtype]
        return f"{min(got):.2f}-{max(got):.2f}x"

    (held,) = [r["variants"][chunked]["held_after_forward_bytes"] for r in unfused[:1]]
    figures = [
        f"{ratios['float32']:.1f}x and {ratios['bfloat16']:.1f}x eager's time",
        f"{span(chunked, 'float32')} eager's time in fp32 and {span(chunked, 'bfloat16')} in bf16, invact's "
        f"{span('invact', 'float32')} and {span('invact', 'bfloat16')}",
        f"measured {held / 2**20:.1f} MiB held after the forward",
    ]
    text = " ".join((ROOT / "docs" / "patching.md").read_text().split())
    assert not [f for f in figures if f not in text]


def test_the_compiled_step_peaks_in_the_docs_are_the_results():
    text = " ".join((ROOT / "docs" / "results" / "loss.md").read_text().split())
    mib = 2**20

    def drop(stem: str, dtype: str) -> float:
        step = json.loads((RESULTS / f"{stem}.json").read_text())
        (v,) = [r["variants"] for r in step["rows"] if r["dtype"] == dtype]
        return (v["eager"]["peak_bytes"] - v["patch()"]["peak_bytes"]) / mib

    gpt2, qwen, llama = (drop(f"step_peak_cpu_{m}compiled", "float32") for m in ("gpt2_", "qwen2-vl_", ""))
    assert f"fp32 GPT-2 by {gpt2:.0f} MiB" in text and f"Qwen2-VL by {qwen:.0f} MiB" in text
    assert f"the Llama-style decoder of the first table by {llama:.0f} MiB" in text
    gpt2, qwen, llama = (drop(f"step_peak_cpu_{m}compiled", "bfloat16") for m in ("gpt2_", "qwen2-vl_", ""))
    assert f"bf16 Qwen2-VL by {qwen:.0f} MiB" in text
    assert f"the Llama-style decoder by {llama:.0f} MiB" in text
    assert f"GPT-2 by {gpt2:.0f} MiB: there compile alone's whole step peaks at" in text


def test_the_kinds_under_compile_figures_in_the_docs_are_the_results():
    """docs/patching.md's per-kind paragraph quotes step_peak.py --model wide --compile --kinds."""
    result = json.loads((RESULTS / "step_peak_cpu_wide_compiled_kinds.json").read_text())
    rows = {r["dtype"]: r["variants"] for r in result["rows"]}

    def peak(kind, base="eager"):
        change = [
            rows[d][kind]["peak_bytes"] / rows[d][base]["peak_bytes"] - 1 for d in ("float32", "bfloat16")
        ]
        return [f"{abs(c):.1%}" if abs(c) < 5e-4 else f"{c:+.1%}".replace("+", "") for c in change]

    times = [
        rows[d][k]["ms"] / rows[d]["eager"]["ms"] - 1
        for d in rows
        for k in rows[d]
        if k not in ("eager", "patch()")
    ]
    text = " ".join((ROOT / "docs" / "patching.md").read_text().split())
    loss, act, norm = peak("loss"), peak("activation + gated MLP"), peak("norm")
    whole, rest = peak("patch()"), peak("patch()", "loss")
    figures = [
        f"the loss {loss[0]} (fp32) and {loss[1]} (bf16), the activation with the gated MLP {act[0]} and "
        f"{act[1]}, the norm {norm[0]} and {norm[1]}",
        f"all of `patch()` is {whole[0]} and {whole[1]} against compile alone ({rest[0]} and {rest[1]} "
        "against the loss alone), in "
        + " and ".join(
            f"{rows[d]['patch()']['ms'] / rows[d]['eager']['ms']:.2f}x" for d in ("float32", "bfloat16")
        ),
        f"The kinds' own times ({min(times):+.1%} to {max(times):+.1%} of compile alone's)".replace(
            "(+", "("
        ),
    ]
    missing = [f for f in figures if f not in text]
    assert not missing, missing


def test_the_norm_beside_the_loss_under_compile_is_the_result():
    """docs/patching.md: compiled patch() against compiled patch(norms=False), from the kinds run and
    the no-norms run (step_peak.py --variants), per dtype."""
    kinds = json.loads((RESULTS / "step_peak_cpu_wide_compiled_kinds.json").read_text())["rows"]
    alone = json.loads((RESULTS / "step_peak_cpu_wide_compiled_no_norms.json").read_text())["rows"]
    changes = []
    for k, n in zip(kinds, alone, strict=True):
        assert k["dtype"] == n["dtype"]
        without = n["variants"]["patch(norms=False)"]["peak_bytes"]
        change = k["variants"]["patch()"]["peak_bytes"] / without - 1
        changes.append(f"{abs(change):.1%}" if abs(change) < 5e-4 else f"{change:+.1%}".replace("+", ""))
    text = " ".join((ROOT / "docs" / "patching.md").read_text().split())
    assert f"both compiled, is {changes[0]} (fp32) and {changes[1]} (bf16)" in text


def test_the_compiled_reruns_quoted_are_the_results():
    """docs/patching.md quotes step_peak.py's compiled wide reruns: bf16 under the benchmark's mmap
    threshold, and both dtypes under glibc's default allocator (time and peak against compile alone)."""
    text = " ".join((ROOT / "docs" / "patching.md").read_text().split())
    (row,) = json.loads((RESULTS / "step_peak_cpu_wide_compiled_bf16_timed.json").read_text())["rows"]
    v = row["variants"]
    assert f"read {v['patch()']['ms'] / v['eager']['ms']:.3f}x)" in text
    result = json.loads((RESULTS / "step_peak_cpu_wide_compiled_timed_default_allocator.json").read_text())
    assert result["mmap_threshold"] is None  # glibc's own thresholds
    rows = {r["dtype"]: r["variants"] for r in result["rows"]}
    ratio = {d: {k: rows[d]["patch()"][k] / rows[d]["eager"][k] for k in ("ms", "peak_bytes")} for d in rows}
    assert (
        f"compile + `patch()` takes {ratio['float32']['ms']:.3f}x (fp32) and {ratio['bfloat16']['ms']:.3f}x "
        f"(bf16) compile alone's step time, at {ratio['float32']['peak_bytes']:.3f}x and "
        f"{ratio['bfloat16']['peak_bytes']:.3f}x its peak"
    ) in text
