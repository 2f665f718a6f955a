"""benchmarks/tensor_parallel.py's committed result: its table is printed from its JSON, and every row
shows what tests/invact/test_tensor_parallel.py checks on each run (no logits saved patched, less saved and
a lower peak on every rank)."""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULT = ROOT / "benchmarks" / "results" / "tensor_parallel_cpu.json"


def _markdown():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from tensor_parallel import markdown
    finally:
        sys.path.pop(0)
    return markdown


def test_the_committed_table_is_its_result():
    result = json.loads(RESULT.read_text())
    assert RESULT.with_suffix(".md").read_text() == _markdown()(result["rows"])
    cases = {(r["case"], r["ranks"]) for r in result["rows"]}
    assert cases == {(c, n) for c in ("hf", "native", "native_sp") for n in (2, 4)} | {
        ("fsdp_tp", 4),
        ("hf_fsdp_tp", 4),
    }
    for r in result["rows"]:
        e, p = r["eager"], r["patched"]
        assert e["vocab_wide_saved"] > 0 and p["vocab_wide_saved"] == 0, r
        assert p["saved_mib"] < e["saved_mib"] and p["peak_mib"] < e["peak_mib"], r
