"""benchmarks/native_models.py: models written as plain PyTorch get the saving Hugging Face's get."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULT = ROOT / "benchmarks" / "results" / "native_models_cpu.json"
# The loss's relative error bound in fp32 for these shapes: gamma of the longest sum it goes through (the
# vocabulary's log-sum-exp, the hidden size's dot product, the 1024 tokens' mean: Higham, 3.1), 32000 +
# 256 + 1024 terms of u = 2^-24, against eager's the same bound again.
LOSS_RTOL = 2 * (32000 + 256 + 1024) * 2.0**-24


def _markdown():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from native_models import markdown
    finally:
        sys.path.pop(0)
    return markdown


def test_small_run_patches_every_kind_in_native_models(tmp_path):
    out = tmp_path / "native.json"
    script = str(ROOT / "benchmarks" / "native_models.py")
    proc = subprocess.run([sys.executable, script, "--small", "--out", str(out)], capture_output=True,
                          text=True, timeout=600, cwd=ROOT / "benchmarks")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rows = {r["model"]: r for r in json.loads(out.read_text())["rows"]}
    assert sorted(rows) == ["Hugging Face gpt", "Hugging Face llama", "native gpt", "native llama"]
    for name, r in rows.items():
        assert r["patched_bytes"] < r["eager_bytes"], name
    for name in ("native gpt", "native llama"):  # the functional MLPs and the norm modules
        assert {"mlp", "norm"} <= set(rows[name]["kinds"]), rows[name]["kinds"]


def test_the_committed_table_is_its_result_and_native_llamas_save_what_hugging_faces_save():
    result = json.loads(RESULT.read_text())
    assert RESULT.with_suffix(".md").read_text() == _markdown()(
        result["rows"], result["batch"], result["seq"]
    )
    # the Llamas by shape (heads aside: torchtitan's debug model has 16): every native one, torchtitan's own
    # included, saves at least the bytes patch() saves in Hugging Face's
    by_shape: dict = {}
    for r in result["rows"]:
        if r["model"].endswith("llama"):
            key = tuple(r["shape"][k] for k in ("hidden", "layers", "intermediate", "vocab"))
            by_shape.setdefault(key, {})[r["model"]] = r["eager_bytes"] - r["patched_bytes"]
    assert len(by_shape) == 2 and "torchtitan llama" in by_shape[(256, 6, 768, 2048)]
    for saved in by_shape.values():
        hf = saved.pop("Hugging Face llama")
        assert saved and all(native >= hf for native in saved.values()), (saved, hf)
    for r in result["rows"]:  # the same loss, eager and patched: fp32's rounding of a mean over the tokens
        eager, patched = r["losses"]
        assert abs(patched - eager) <= LOSS_RTOL * abs(eager), r["model"]


def test_the_docs_figures_are_the_committed_result():
    rows = json.loads(RESULT.read_text())["rows"]
    docs = (ROOT / "docs" / "patching.md").read_text().replace("\n", " ")

    def mib(r, key):
        return f"{r[key] / 2**20:.1f}"

    llamas = [(rows[i], rows[i + 1]) for i in range(0, len(rows), 2) if rows[i]["model"] == "native llama"]
    for native, hf in llamas:
        saved = [f"{(r['eager_bytes'] - r['patched_bytes']) / 2**20:.1f}" for r in (native, hf)]
        assert f"{saved[0]} against {saved[1]} MiB" in docs, saved
    native, hf = (next(r for r in rows if r["model"] == name) for name in ("native gpt", "Hugging Face gpt"))
    assert f"{mib(native, 'eager_bytes')} against {mib(hf, 'eager_bytes')} MiB eager" in docs
    assert f"{mib(native, 'patched_bytes')} against {mib(hf, 'patched_bytes')} MiB" in docs
