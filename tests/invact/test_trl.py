"""invact under TRL's trainers: SFTTrainer, DPOTrainer (with the reference model TRL builds itself, from
the model's path), KTOTrainer (the same) and GRPOTrainer (sampled generation, a Python reward), each
training a tiny Llama eager and after `invact.patch(model)`, from the same weights, on the same data, with
the same seed, with TRL's default gradient checkpointing and without it.

Why: since TRL 1.15 these trainers compute their log-probabilities with TRL's own chunked head
(trl.trainer.utils.add_fused_lm_head: `model(..., fused_lm_head=True)` runs the backbone and reads the
head's weight), so invact's loss path never runs there; what invact changes is the activations, the gated
products act(g) * u and the norms. Checked per trainer:

- the losses: step 0 bitwise equal (patch() leaves the forward bitwise: the same parameters give the same
  loss, and for GRPO the same sampled completions), the step-0 gradient within the bound of the inverted
  activations and norms, each later step's loss within what the gradients' difference moves the
  parameters by (plain SGD: derived below), GRPO's completions equal at every step (its loss depends on
  them: with other samples its losses would not be comparable, and its loss is often 0 here, ratio 1 and
  group-normalized advantages, so its gradients carry the comparison); the head's own forward never runs
  with autograd (TRL's fused head computes the loss, not invact's);
- the peak of one training step's live bytes (invact.planner.live_bytes.LiveBytes around
  trainer.training_step; GRPO's generation runs before it): the patched step's is below eager's by exactly
  what invact stops keeping, derived from the sizes and the tokens the step ran (_saving).

The runs (benchmarks/trl_trainers.py's `train`, which the benchmark uses at a larger size) are cached per
module: each (trainer, checkpointing) pair is trained once eager and once patched.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")

from tests.invact.test_norm_patch import FP32_GRADIENT_REL  # noqa: E402
from tests.invact.test_training_stacks import _family_bound  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import trl_trainers  # noqa: E402

sys.path.pop(0)

# Tiny, so that the 16 runs take a few seconds each on 2 cores, yet the MLPs' and norms' saved tensors
# are large enough that the peaks differ by hundreds of KiB without checkpointing
SIZES = dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=128)  # fmt: skip
STEPS, BATCH, SEQ, LR, COMPLETION = 3, 4, 32, 0.1, 4
U32 = 2.0**-24  # fp32's unit roundoff

# The step-0 gradient, both runs at the same parameters on the same batch: each of the L inverted SiLUs
# adds at most _family_bound("silu") |dy| to its input's gradient, relative (the whole-gradient bound of
# tests/invact/test_training_stacks.py::test_hf_trainer_trains_a_patched_model, L times), and the inverted
# norms FP32_GRADIENT_REL (tests/invact/test_norm_patch.py: (6 + d/2) fp32 roundings, there at d = 64,
# this model's hidden size). Measured here: 4.0e-7 to 4.3e-7 (derived bound 2.6e-4).
GRADIENT_REL = SIZES["num_hidden_layers"] * _family_bound("silu") + FP32_GRADIENT_REL
# The later steps (derived as in test_hf_trainer_trains_a_patched_model): plain SGD without clipping
# gives theta'_k - theta_k = -lr sum_{j<k} (g'_j - g_j) exactly, so to first order |L'_k - L_k| <=
# |grad L_k| lr sum_{j<k} |g'_j - g_j|; HIGHER_ORDER times that for the higher orders (|d theta| is ~1e-7
# relative), plus LOSS_ULPS ulps of L_k for the rounding of the loss's last ops at other parameters.
HIGHER_ORDER = 2
LOSS_ULPS = 4


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{(trainer, patched, checkpointing): trl_trainers.train's record}, each trained on first use."""
    done: dict = {}
    root = tmp_path_factory.mktemp("trl")

    def run(kind: str, patched: bool, checkpointing: bool) -> dict:
        key = (kind, patched, checkpointing)
        if key not in done:
            out = root / f"{kind}-{'ckpt' if checkpointing else 'nockpt'}"
            sizes = dict(steps=STEPS, batch=BATCH, seq=SEQ, lr=LR, completion=COMPLETION)
            done[key] = trl_trainers.train(kind, patched, SIZES, out, **sizes, checkpointing=checkpointing)
        return done[key]

    return run


CASES = [
    pytest.param(kind, checkpointing, id=f"{kind}-{'ckpt' if checkpointing else 'nockpt'}")
    for kind in trl_trainers.TRAINERS
    for checkpointing in (True, False)
]


@pytest.mark.parametrize(("kind", "checkpointing"), CASES)
def test_patched_losses_within_the_derived_bound(runs, kind, checkpointing):
    eager, patched = runs(kind, False, checkpointing), runs(kind, True, checkpointing)
    layers = SIZES["num_hidden_layers"]  # a SiLU and two RMSNorms a layer, the final norm, the head (unused)
    assert patched["replaced"] == {"activation": layers, "norm": 2 * layers + 1, "loss": 1}
    assert patched["head_calls"] == eager["head_calls"] == 0  # TRL's fused head: invact's loss never runs
    # and plan() says so, of the model the trainer holds (its forward wrapped by add_fused_lm_head)
    ((taken, reason),) = patched["plan_loss"]
    assert taken and reason.startswith("not in effect in calls with fused_lm_head=True (TRL's trainers)")
    want, got = eager["losses"], patched["losses"]
    assert len(want) == len(got) == STEPS and all(math.isfinite(x) for x in got)
    # GRPO: the same parameters and torch's forward at step 0, then ~1e-7 apart: a sampled token changes only
    # where the seeded uniform falls within that of a bin's edge (deterministic on a given machine)
    if kind == "grpo":
        assert patched["completions"] == eager["completions"] and len(eager["completions"]) == STEPS
    assert got[0] == want[0]  # the same parameters and torch's forward: bitwise the same loss
    g0, h0 = patched["grads"][0], eager["grads"][0]
    assert (g0 - h0).norm() <= GRADIENT_REL * h0.norm()
    for k in range(1, STEPS):
        drift = LR * sum((patched["grads"][j] - eager["grads"][j]).norm() for j in range(k))
        bound = HIGHER_ORDER * eager["grads"][k].norm().item() * drift + LOSS_ULPS * math.ulp(want[k])
        assert abs(got[k] - want[k]) <= bound, (k, got[k] - want[k], bound)


def _saving(checkpointing: bool, tokens: int) -> int:
    """The bytes invact stops keeping at the step's peak (TRL's head, forward or backward: every saved
    activation alive), fp32, for `tokens` tokens through the backbone with autograd.

    Each inverted SiLU keeps y (which the product act(g) * u keeps anyway) and 1 bit per element instead of
    its input g, and the gated hook drops the down projection's copy of act(g) * u: 2 x 4 bytes less 1/8
    per (token, intermediate) element, in each of the L layers. Each norm: Hugging Face's RMSNorm keeps its
    input x and x * rstd (2 x 4 bytes per (token, hidden) element) beside rstd; the inverted norm keeps rstd
    and its output, which the next projection keeps anyway in the layers (0 more), but not after the last
    norm, whose output TRL's head copies (its hidden_states[:, :-1] reshaped) so the norm's own y is one
    tensor more there: 2 per layer norm (2 a layer), 1 for the final norm. With gradient checkpointing
    the layers keep only their inputs until backward recomputes them one at a time: the final norm's one
    tensor is what is left."""
    hidden, inter, layers = SIZES["hidden_size"], SIZES["intermediate_size"], SIZES["num_hidden_layers"]
    final_norm = 4 * tokens * hidden
    if checkpointing:
        return final_norm
    mlp = layers * (2 * 4 * tokens * inter - tokens * inter // 8)
    return mlp + 2 * 2 * layers * 4 * tokens * hidden + final_norm


@pytest.mark.parametrize(("kind", "checkpointing"), CASES)
def test_patched_step_peak_is_lower_by_the_derived_saving(runs, kind, checkpointing):
    eager, patched = runs(kind, False, checkpointing), runs(kind, True, checkpointing)
    assert eager["tokens"] == patched["tokens"] > 0
    assert eager["peak"] - patched["peak"] == _saving(checkpointing, eager["tokens"])


def test_the_committed_table_is_the_committed_results():
    """docs/trl.md includes benchmarks/results/trl_trainers_cpu.md: the table of the committed JSON."""
    import json

    result = json.loads((ROOT / "benchmarks" / "results" / "trl_trainers_cpu.json").read_text())
    table = (ROOT / "benchmarks" / "results" / "trl_trainers_cpu.md").read_text()
    assert table == trl_trainers.table(result)
