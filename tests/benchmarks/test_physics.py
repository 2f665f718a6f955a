"""benchmarks/physics.py and the checks speed.py and train_memory.py build on it: a row whose times imply
more FLOP/s or GB/s than the device's datasheet peak is refused, with made-up peaks on CPU; the
committed H100 rows are held to the real peak (the BERT-base rows, which timed another setup, are the
ones flagged); and each row's inputs must be what its name states."""

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT / "benchmarks"))
import physics  # noqa: E402
import speed  # noqa: E402
import train_memory  # noqa: E402
from physics import DevicePeak  # noqa: E402

import timing  # noqa: E402

sys.path.pop(0)

# A made-up device: 1 TFLOP/s in fp32, 2 with TF32, 3 in bf16, 4 in fp16, 100 GB/s, no L2 credit.
FAKE = DevicePeak("fake", 1.0, 2.0, 3.0, 4.0, 100.0, 0)
BERT_PAPER = "BERT-base (batch 64, seq 1024, 12 layers)"


@pytest.mark.parametrize(
    ("name", "expected"),
    [("NVIDIA H100 80GB HBM3", physics.H100_SXM), ("NVIDIA H100 PCIe", physics.H100_PCIE),
     ("NVIDIA H100 NVL", physics.H100_NVL), ("NVIDIA H200", physics.H200_SXM),
     ("NVIDIA H200 NVL", physics.H200_NVL), ("NVIDIA GH200 480GB", physics.GH200),
     ("NVIDIA A100-SXM4-80GB", physics.A100_80GB_SXM),
     ("NVIDIA A100-SXM4-40GB", physics.A100_40GB), ("NVIDIA A100 80GB PCIe", physics.A100_80GB_PCIE),
     ("NVIDIA A100-PCIE-40GB", physics.A100_40GB), ("NVIDIA GeForce RTX 4090", None), ("", None)],
)  # fmt: skip
def test_device_peak_matches_torch_device_names(name, expected):
    """The most specific entry wins (an H200 NVL is not held to the H200 SXM's figures); an unknown
    device has no peak."""
    assert physics.device_peak(name) == expected


def test_h100_sxm_figures_are_the_datasheet_dense_ones():
    """The figures the BERT row is held to: 67 TFLOP/s fp32, half the datasheet's with-sparsity 989
    (TF32) and 1,979 (bf16/fp16) TFLOP/s, 3.35 TB/s."""
    peak = physics.device_peak("NVIDIA H100 80GB HBM3")
    assert (peak.fp32_tflops, peak.hbm_gbps) == (67.0, 3350.0)
    assert (peak.tf32_tflops, peak.bf16_tflops, peak.fp16_tflops) == (989 / 2, 1979 / 2, 1979 / 2)


def test_an_unnamed_family_member_gets_the_family_maximum():
    """'H100' alone: no member's figure above it, so no valid row is ever flagged."""
    peak = physics.device_peak("NVIDIA H100 some new board")
    for member in (physics.H100_SXM, physics.H100_NVL, physics.H100_PCIE):
        assert peak.fp32_tflops >= member.fp32_tflops and peak.hbm_gbps >= member.hbm_gbps
    assert peak.hbm_gbps == physics.H100_NVL.hbm_gbps and peak.bf16_tflops == physics.H100_SXM.bf16_tflops


@pytest.mark.parametrize(
    ("dtype", "matmul", "expected"),
    [("float32", "ieee", 1.0), ("float32", "tf32", 2.0), ("float32", "bf16", 3.0), ("bfloat16", "ieee", 3.0),
     ("bfloat16", "tf32", 3.0), ("float16", "ieee", 4.0)],
)  # fmt: skip
def test_peak_tflops_follows_the_dtype_and_tf32(dtype, matmul, expected):
    assert physics.peak_tflops(FAKE, dtype, matmul) == expected


@pytest.mark.parametrize(
    ("setting", "expected"),
    [("", "ieee"), ("torch.set_float32_matmul_precision('high')", "tf32"),
     ("torch.backends.cuda.matmul.allow_tf32 = True", "tf32"),
     ("torch.backends.cuda.matmul.fp32_precision = 'tf32'", "tf32"),  # the new API: allow_tf32 then raises
     ("torch.backends.fp32_precision = 'tf32'", "tf32"),
     ("torch.set_float32_matmul_precision('medium')", "bf16")],
)  # fmt: skip
def test_fp32_matmul_mode_follows_torch_settings(setting, expected):
    """In a fresh interpreter each: torch's TF32 settings are process-wide, and mixing its legacy and
    new APIs in one process makes reading the legacy one raise."""
    code = f"import sys, torch; sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); import physics\n{setting}\n"
    code += "print(physics.fp32_matmul_mode())"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == expected


def test_a_row_above_a_made_up_peak_is_flagged_in_one_line():
    """2e9 FLOPs in 1 ms is 2 TFLOP/s: above the fake fp32 peak of 1, not above its TF32 peak of 2;
    the error names the row, the figure and the peak."""
    figures = {"torch_ms": (1.0, 2e9, 0.0)}
    (error,) = physics.row_violations("a fake row", figures, FAKE, "float32", "ieee")
    assert "\n" not in error and error.startswith("a fake row: torch_ms")
    assert "2.0 TFLOP/s" in error and "fake datasheet peak of 1.0 TFLOP/s" in error
    assert physics.row_violations("a fake row", figures, FAKE, "float32", "tf32") == []
    assert physics.row_violations("a fake row", {"torch_ms": (1.0, 0.9e9, 0.0)}, FAKE, "float32") == []


def test_bytes_above_the_bandwidth_peak_are_flagged_after_the_l2_credit():
    """200 MB in 1 ms is 200 GB/s, above 100; with a 150 MB L2 credited, 50 GB/s is not."""
    figures = {"invact_ms": (1.0, 0.0, 200e6)}
    (error,) = physics.row_violations("bare", figures, FAKE, "bfloat16")
    assert "200 GB/s" in error and "peak of 100 GB/s" in error
    cached = DevicePeak("fake", 1.0, 2.0, 3.0, 4.0, 100.0, 150 * 10**6)
    assert physics.row_violations("bare", figures, cached, "bfloat16") == []


def test_a_time_that_is_not_positive_is_an_error():
    assert physics.row_violations("r", {"torch_ms": (0.0, 1.0, 1.0)}, FAKE, "float32")


def test_event_times_far_below_an_independent_measure_are_flagged():
    """A median of CUDA events 30x below the synchronized wall clock missed work; one within the
    tolerance did not."""
    (error,) = physics.timing_violations("r", {"torch_ms": 1.0}, {"torch_ms": 30.0}, "the wall clock")
    assert "torch_ms 1.000 ms by CUDA events, but 30.000 ms by the wall clock" in error
    assert physics.timing_violations("r", {"torch_ms": 1.0}, {"torch_ms": 1.5}, "the wall clock") == []


def _fake_result(ms: float, **extra) -> dict:
    row = {"name": "a fake row", "torch_ms": ms, "invact_ms": ms, "flops": 2e9,
           "min_bytes": {"torch": 1e6, "invact": 1e6}, **extra}  # fmt: skip
    return {"device": "fake", "dtype": "float32", "physics": {"fp32_matmul": "ieee"}, "rows": [row]}


def test_speed_refuses_to_write_a_row_above_the_peak(tmp_path, capsys):
    """speed.finish, the end of main: a row above the (made-up) peak exits 1 with one line per
    error and leaves the previous result file as it was; a row below is written."""
    out = tmp_path / "speed.json"
    out.write_text("previous\n")
    assert speed.finish(_fake_result(1.0), FAKE, "cpu", out) == 1
    assert out.read_text() == "previous\n" and list(tmp_path.iterdir()) == [out]
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 2 and all("a fake row" in e and "peak of 1.0 TFLOP/s" in e for e in errors)
    assert speed.finish(_fake_result(4.0), FAKE, "cpu", out) == 0
    assert json.loads(out.read_text())["rows"][0]["torch_ms"] == 4.0
    assert list(tmp_path.iterdir()) == [out]  # written through a temporary file, renamed over it


def test_speed_refuses_event_times_the_wall_clock_contradicts(tmp_path):
    """Without any peak (an unknown device), events far below the synchronized wall clock or the
    profiler's busy time of the same step still refuse the write."""
    out = tmp_path / "speed.json"
    assert speed.finish(_fake_result(1.0, torch_wall_ms=30.0), None, "cpu", out) == 1
    assert speed.finish(_fake_result(1.0, invact_gpu_ms=30.0), None, "cpu", out) == 1
    assert not out.exists()
    assert speed.finish(_fake_result(1.0, torch_wall_ms=1.2, invact_gpu_ms=0.9), None, "cpu", out) == 0


def test_train_memory_refuses_a_step_above_the_peak():
    row = {"model": "fake model", "flops": 2e9, "min_bytes": {"torch": 0, "invact": 0},
           "torch": {"step_ms": 1.0}, "invact": {"step_ms": 4.0}}  # fmt: skip
    result = {"dtype": "float32", "physics": {"fp32_matmul": "ieee"}, "rows": [row]}
    (error,) = train_memory.check_result(result, FAKE)
    assert error.startswith("fake model: torch step 1.000 ms") and "peak of 1.0 TFLOP/s" in error
    assert train_memory.check_result(result, None) == []


def _name_shapes(name: str) -> dict[str, tuple[int, ...]]:
    """The input shapes a row's name states: '(N elements)', '(T x W)', '(T, W -> ...)', 'batch B, seq S'."""
    patterns = [(r"\((\d+) elements\)", "input"), (r"\((\d+) x (\d+)\)", "input"),
                (r"\((\d+), (\d+) ->", "input"), (r"batch (\d+), seq (\d+)", "input_ids")]  # fmt: skip
    for pattern, key in patterns:
        if match := re.search(pattern, name):
            return {key: tuple(int(g) for g in match.groups())}
    raise AssertionError(f"no shape in {name!r}")


@pytest.mark.parametrize("preset", ["paper", "cpu", "small"])
def test_every_setup_makes_the_inputs_and_model_its_name_states(preset):
    """The first H100 run's bug: BERT's input factory was a lambda over setups()'s b and s, rebound to
    the Llama row's before it ran, so 'batch 64, seq 1024' timed batch 1, seq 512 (and the cpu
    preset's 'seq 256' ran seq 128). Built on the meta device: shapes only."""
    pytest.importorskip("transformers")
    for setup in speed.setups(speed.PRESETS[preset], preset == "small"):
        name, make_model, make_inputs = setup[:3]
        with torch.device("meta"):
            inputs = make_inputs()
            layers = re.search(r"(\d+) layers", name)
            if layers:
                assert make_model().config.num_hidden_layers == int(layers.group(1)), name
        assert {k: tuple(v.shape) for k, v in inputs.items()} == _name_shapes(name), name


def test_a_row_whose_inputs_disagree_with_its_name_is_refused_before_timing(tmp_path, monkeypatch, capsys):
    """measure_row checks the factory's inputs against the shapes the row declares; main then exits 1
    with one line and writes nothing."""
    bad = speed.Setup("Linear (batch 64, seq 16)", lambda: nn.Linear(16, 16),
                      lambda: {"input": torch.randn(1, 16)}, {"input": (64, 16)})  # fmt: skip
    with pytest.raises(speed.BenchmarkError, match=r"makes \{'input': \(1, 16\)\}"):
        speed.measure_row(bad, "cpu", torch.float32, 1, False)
    monkeypatch.setattr(speed, "setups", lambda preset, small: [bad])
    out = tmp_path / "speed.json"
    assert speed.main(["--device", "cpu", "--small", "--out", str(out)]) == 1
    assert not out.exists() and "its name states" in capsys.readouterr().err


class _Unreached(nn.Module):
    """A first parameter the output never depends on: a backward that stops short of it."""

    def __init__(self):
        super().__init__()
        self.unused, self.used = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, input):
        return self.used(input)


def test_a_step_whose_backward_misses_the_first_parameter_is_refused():
    step = speed._step(_Unreached(), {"input": torch.randn(2, 4)})
    step.probe = speed._backward_probe("row", "torch_ms", step.model)
    with pytest.raises(speed.BenchmarkError, match="first parameter without a gradient"):
        step()
    ok = speed._step(nn.Sequential(nn.Linear(4, 4), nn.GELU()), {"input": torch.randn(2, 4)})
    ok()
    ok.probe = speed._backward_probe("row", "torch_ms", ok.model)
    ok()  # the gradients zeroed by the first call are written again


def test_a_variant_in_eval_mode_is_refused():
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1)).train()
    speed._check_training("row", "torch_ms", model)
    model[1].eval()
    with pytest.raises(speed.BenchmarkError, match="runs 1 in eval mode"):
        speed._check_training("row", "torch_ms", model)


def test_attention_is_counted_as_a_fused_kernel_saves_it():
    """On the meta device SDPA runs its math path, which saves (b, h, s, s) scores a flash or
    memory-efficient kernel never writes; StepCount counts q, k and v read twice and the output
    written once and read once, as those kernels do (so the bytes stay a lower bound on a GPU), and
    the two batched products forward (2 b h s^2 d each), twice that backward."""
    b, h, s, d = 2, 4, 64, 16
    q, k, v = (torch.empty(b, h, s, d, device="meta", requires_grad=True) for _ in range(3))
    with physics.StepCount() as count:
        out = nn.functional.scaled_dot_product_attention(q, k, v)
        dy = torch.empty_like(out)
        out.backward(dy)
    x = q.numel() * q.element_size()
    # reads q, k, v, dy; writes out, dq, dk, dv; the backward reads q, k, v and out again
    assert count.minimum_bytes([q, k, v, dy], [out, q.grad, k.grad, v.grad]) == 12 * x
    assert count.flops == 3 * 2 * (2 * b * h * s * s * d)


def test_wall_ms_times_the_calls_between_synchronizations():
    assert timing.wall_ms(lambda: time.sleep(0.01), 3, "cpu") >= 10


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bare_activation_bytes_are_the_kernels(dtype):
    """torch's gelu moves 5 element sizes per element (forward: read x, write y; backward: read x and
    dy, write dx); InvAct bits the same 5 plus the packed bit written and read (n/8 bytes each way);
    precision-bit 5; the compile bound 4 (nothing saved). No matmul: no FLOPs."""
    n, size = 4096, torch.finfo(dtype).bits // 8
    costs = speed.step_costs(speed.setups(speed.PRESETS["small"], True)[0], dtype)
    assert costs["flops"] == 0
    assert costs["min_bytes"] == {"torch": 5 * n * size, "invact": 5 * n * size + 2 * (n // 8),
                                  "precision_bit": 5 * n * size, "compile": 4 * n * size}  # fmt: skip


def test_linear_flops_are_forward_and_both_backward_products():
    """Linear+GELU on (t, w): 2 t w^2 forward, twice that backward (dx and dW)."""
    setup = next(s for s in speed.setups(speed.PRESETS["small"], True) if s.name.startswith("Linear"))
    t, w = speed.PRESETS["small"]["tokens"], speed.PRESETS["small"]["width"]
    assert speed.step_costs(setup)["flops"] == 3 * 2 * t * w * w


@pytest.fixture(scope="module")
def paper_costs() -> dict[str, dict[str, dict]]:
    """{dtype: {row name: step_costs}} of the paper preset, the committed H100 runs' sizes."""
    pytest.importorskip("transformers")
    setups = speed.setups(speed.PRESETS["paper"], False)
    return {
        d: {s.name: speed.step_costs(s, getattr(torch, d)) for s in setups} for d in ("float32", "bfloat16")
    }


def test_bert_paper_flops_are_the_analytic_count(paper_costs):
    """12 layers of 65,536 tokens: per layer 2 T (4 h^2 + 2 h i) for the Linear layers and 4 b s^2 h
    for attention's two batched products, forward; twice that backward; plus the pooler's forward
    (2 b h^2). 4.08e13: the figure the row's 30.7 ms is held to."""
    b, s, h, i, layers = 64, 1024, 768, 3072, 12
    per_layer = 2 * b * s * (4 * h * h + 2 * h * i) + 4 * b * s * s * h
    assert paper_costs["float32"][BERT_PAPER]["flops"] == 3 * layers * per_layer + 2 * b * h * h


# The committed H100 rows that break the datasheet peak: the first run's BERT-base rows. TF32 was off
# in both runs: gpu_logs/speed-fp32.log carries inductor's warning that TF32 is "available but not
# enabled". The second run's bf16 table (the fixed script) breaks it nowhere: its BERT-base row at the
# paper's size ran out of memory.
COMMITTED_FLAGGED = {
    "speed_h100-80gb-hbm3.json": {BERT_PAPER},
    "speed_h100-80gb-hbm3_bfloat16_first_run.json": {BERT_PAPER},
    "speed_h100-80gb-hbm3_bfloat16.json": set(),
}


@pytest.mark.parametrize("file", sorted(COMMITTED_FLAGGED))
def test_committed_h100_rows_break_the_peak_exactly_at_bert(file, paper_costs):
    """Each committed CUDA row's times held to the H100's datasheet peak with this module's FLOP and
    byte counts: the check flags the BERT-base row (1.3 PFLOP/s in fp32 against 67 TFLOP/s, 1.9 in
    bf16 against 989.5) and no other, under the fp32 peak and the TF32 one alike."""
    data = json.loads((RESULTS / file).read_text())
    assert (
        "TensorFloat32 tensor cores for float32 matrix multiplication available but not enabled"
        in (RESULTS / "gpu_logs" / "speed-fp32.log").read_text()
    )
    peak = physics.device_peak(data["device"])
    assert peak == physics.H100_SXM
    for matmul in ("ieee", "tf32"):
        flagged = set()
        for row in data["rows"]:
            costed = {**row, **paper_costs[data["dtype"]][row["name"]]}
            if physics.row_violations(row["name"], speed.figures(costed), peak, data["dtype"], matmul):
                flagged.add(row["name"])
        assert flagged == COMMITTED_FLAGGED[file], (matmul, flagged)
