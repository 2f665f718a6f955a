"""benchmarks/heads.py --quick runs and writes what its doc says: per shape and dtype every head's time,
peak memory, matmul FLOP/s against the measured mm peak and errors against eager's, within bounds
derived from the dtypes' roundings; its physics check flags a figure above the peak; and the committed
results/heads_cpu.md is the table the script prints from the committed results/heads_cpu.json."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
RESULTS = BENCHMARKS / "results"
HEADS = ("eager", "invact", "trl", "torch")
SUMMED = ("loss", "grad_hidden", "grad_weight")

# fp32: unit roundoff u = 2^-24. Each head sums at most max(tokens, vocab) products or exponentials in
# any one result (the log-sum-exp and d h over the vocabulary, d W over the tokens), so each result's
# rounding error is at most n u of its terms' magnitude (Higham's gamma_n ~ n u), and two heads summing in
# different orders differ by at most twice that. Errors are max |difference| / max |eager's|. At the quick
# shape (64 tokens, vocabulary 3000): 2 x 3000 x 2^-24 = 3.6e-4; measured up to 5.8e-7 (torch's d h).
FP32_TERMS_FACTOR = 2
# bf16: eager rounds the logits to bf16 and its logits' gradient to bf16 (each 2^-8 relative), and every
# head rounds its gradients to bf16 (2^-8); TRL, torch and invact round their logits tiles (TRL: bf16
# tiles) or not (invact: fp32 sums, one bf16 rounding of the output), so two heads differ by at most these
# three roundings on eager's side plus one on the other's: 4 x 2^-8 = 0.0156, above the fp32 sums' error
# (3.6e-4). Measured up to 6.8e-3 (torch's d W, whose loss is also rounded to bf16: 7.8e-4).
BF16_ROUNDINGS = 4


def _bound(dtype: str, tokens: int, vocab: int) -> float:
    fp32 = FP32_TERMS_FACTOR * max(tokens, vocab) * 2**-24
    return fp32 if dtype == "float32" else fp32 + BF16_ROUNDINGS * 2**-8


def _heads_module():
    sys.path.insert(0, str(BENCHMARKS))
    import heads

    return heads


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    pytest.importorskip("trl")
    out = tmp_path_factory.mktemp("heads") / "heads.json"
    cmd = [sys.executable, str(BENCHMARKS / "heads.py"), "--quick", "--rounds", "1", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=BENCHMARKS)
    assert proc.returncode == 0, proc.stderr
    return out, proc


@pytest.mark.slow
def test_quick_run_structure(quick):
    out, proc = quick
    heads = _heads_module()
    result = json.loads(out.read_text())
    assert result["quick"] is True and result["rounds"] == 1
    assert set(result["machine"]) == {"cpu", "isa", "threads", "load"} and result["machine"]["threads"] >= 1
    assert result["versions"]["torch"] and result["versions"]["trl"]
    assert [(r["label"], r["dtype"]) for r in result["rows"]] == [
        (s[0], d) for s in heads.QUICK_SHAPES for d in heads.QUICK_DTYPES
    ]
    for r in result["rows"]:
        assert list(r["heads"]) == list(HEADS), r["heads"].keys()
        assert r["skipped"] == {"liger": heads.LIGER_NOTE}
        assert len(r["mm_gflops"]) == 3 and all(g > 0 for g in r["mm_gflops"].values())
        nhv = r["tokens"] * r["hidden"] * r["vocab"]
        for name, v in r["heads"].items():
            assert v["ms"] == min(v["times_ms"]) > 0 and v["peak_bytes"] > 0
            # the FLOPs the figure assumes are the ones counted on the head's own matmuls
            assert v["flops_counted_per_nhv"] == heads.EXPECTED_FLOPS[name]
            assert v["flops"] == heads.EXPECTED_FLOPS[name] * nhv
            assert v["gflops"] == pytest.approx(v["flops"] / v["ms"] / 1e6)
        assert r["heads"]["eager"]["ratio_ms"] == r["heads"]["eager"]["ratio_mib"] == 1.0
    assert "| liger | not run: needs CUDA/Triton" in proc.stdout
    assert out.with_suffix(".md").read_text() == heads.table(result) + "\n"


@pytest.mark.slow
def test_quick_heads_match_eager(quick):
    result = json.loads(quick[0].read_text())
    for r in result["rows"]:
        bound = _bound(r["dtype"], r["tokens"], r["vocab"])
        for name, v in r["heads"].items():
            for what in SUMMED:
                err = v["errors"][what]["max_rel"]
                assert err <= bound, f"{r['dtype']} {name} {what}: {err:.2e} > {bound:.2e}"


def test_bounds_catch_a_wrong_head():
    """A head that averages over the ignored targets too (10% of them: heads.IGNORED) is off by about
    10% in its loss and gradients: far outside both bounds."""
    heads = _heads_module()
    assert _bound("bfloat16", 64, 3000) < heads.IGNORED / 2
    import torch
    import torch.nn.functional as F

    h, w, y = heads._inputs(64, 32, 3000, torch.float32)
    right = F.cross_entropy(F.linear(h, w), y).item()
    wrong = F.cross_entropy(F.linear(h, w), y.clamp(min=0), reduction="none")[y != -100].sum() / len(y)
    assert abs(wrong.item() - right) / right > _bound("float32", 64, 3000)


def test_physics_check_flags_a_figure_above_the_peak():
    heads = _heads_module()
    row = {"label": "x", "dtype": "float32", "mm_gflops": {"mm": 100.0},
           "heads": {"eager": {"ms": 1.0, "gflops": 99.0, "flops_counted_per_nhv": 6.0}}}  # fmt: skip
    assert heads.violations({"rows": [row]}) == []
    row["heads"]["eager"]["gflops"] = 101.0
    assert len(heads.violations({"rows": [row]})) == 1
    row["heads"]["eager"]["gflops"], row["heads"]["eager"]["flops_counted_per_nhv"] = 99.0, 4.0
    assert len(heads.violations({"rows": [row]})) == 1


def test_committed_table_is_the_committed_data():
    heads = _heads_module()
    result = json.loads((RESULTS / "heads_cpu.json").read_text())
    assert (RESULTS / "heads_cpu.md").read_text() == heads.table(result) + "\n"
    assert result["quick"] is False and result["physics_violations"] == []
