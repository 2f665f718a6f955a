"""invact.patch() on bitsandbytes-quantized models under PEFT's LoRA, as users run QLoRA: a tiny random Llama
(gated MLP, RMSNorm) saved with save_pretrained and loaded back by transformers with a BitsAndBytesConfig
(4-bit nf4, 4-bit fp4, 4-bit nf4 with double quantization, 8-bit), prepared by PEFT's
prepare_model_for_kbit_training with and without gradient checkpointing, with LoRA adapters on every
projection (and, in one case, on the head too). For each: what plan() says is what patch() does (the
activations, norms and head replaced; bitsandbytes' layers and PEFT's adapters left as they are), three
AdamW steps of the patched model follow eager's losses, and the step's peak live bytes
(invact.planner.live_bytes.LiveBytes, the planner's own counting, on a step after AdamW's state exists) is
below eager's. The planned peaks of such steps against measured ones are tests/invact/test_qlora_plan.py's.

Why: a QLoRA base is not the nn.Linear model the rest of the suite patches. Its projections are
bitsandbytes' Linear4bit / Linear8bitLt inside PEFT's LoRA layers (invact must not fuse such an MLP into
its one op, and hooks it instead), prepare_model_for_kbit_training casts the norms and the head to float32
while the quantized layers compute in bfloat16, and an adapter on the head makes it PEFT's lora.Linear,
whose loss invact cannot compute from the hidden state (it leaves that head alone and says so).
The figures docs/qlora.md quotes: `python tests/invact/test_qlora_runtime.py`.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import invact
from invact.activation.modules import InvAct
from invact.identity import original_class
from invact.loss import LossHead
from invact.norm import InvNorm
from invact.planner.live_bytes import LiveBytes

bnb = pytest.importorskip("bitsandbytes")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

# torch's checkpoint asks for use_reentrant, which prepare_model_for_kbit_training does not pass by default
pytestmark = pytest.mark.filterwarnings(
    "ignore:torch.utils.checkpoint. the use_reentrant parameter:UserWarning"
)

# A Llama of 2 layers, hidden 64, MLP 256, vocabulary 512 (the head not tied, as Llama 3's): small enough
# that a step takes about a tenth of a second on one thread, with BATCH x SEQ = 512 tokens so that the step's
# activations and the loss's logits (512 x 512 fp32: 1 MiB a copy), not the weights, make the peak
LLAMA = dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False)  # fmt: skip
BATCH, SEQ = 2, 256
STEPS = 3  # the last one under LiveBytes: AdamW's state exists from the first on, as in a training run
LR = 1e-2  # large enough that each step moves the loss (about 0.06 a step here) far above rounding
RANK = 8
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# The bases, each as transformers loads it for a user (compute in bfloat16, QLoRA's setting)
QUANTIZED = {
    "nf4": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16),
    "fp4": dict(load_in_4bit=True, bnb_4bit_quant_type="fp4", bnb_4bit_compute_dtype=torch.bfloat16),
    "nf4-dq": dict(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    ),  # fmt: skip
    "int8": dict(load_in_8bit=True),
}
QUANTIZED_LAYERS = {"nf4": "Linear4bit", "fp4": "Linear4bit", "nf4-dq": "Linear4bit", "int8": "Linear8bitLt"}

# Every step's loss as computed: the forward is eager's function (the activation's output is torch's, the
# norm's matches its formula bitwise, the loss computes the same per-token terms); only the order in which
# the n = BATCH x SEQ per-token losses are summed may differ (the patched loss goes a chunk of rows at a
# time). Derived: each is a torch sum of n positive fp32 terms (pairwise/cascade summation, relative error
# at most about ceil(log2 n) x eps), so they differ by at most twice that: 2.1e-6 of the loss here.
# Measured: 0 at the first step in every case.
SUM_ORDER_RTOL = 2 * math.ceil(math.log2(BATCH * SEQ)) * torch.finfo(torch.float32).eps
# The later steps' losses, as a share of how far eager's loss moved since the first step. Derived (an
# estimate, not a proof): the patched backward's gradients differ from eager's by the inverted activation's
# and norm's rounding (about 1e-5 relative in fp32: the same steps on the unquantized fp32 model stay
# within 6e-6 of the move), but the quantized layers compute in bfloat16 (8-bit: float16) and round every
# gradient they pass back, so a difference can move a gradient by one bfloat16 spacing, 2^-8 of it, and
# AdamW's update, invariant to the gradients' scale, moves the loss by about that share differently.
# Measured on these cases (1 thread of a 2-core AMD EPYC): at most 2.0e-4 of the move without autocast
# (fp4, step 3), 2.7e-4 with bf16 autocast (nf4-dq, step 3); a gradient invact got wrong (a dropped or
# doubled path through the MLP or a norm) moves the loss by a large share of the move instead (measured
# on nf4: the activation's input gradient zeroed 0.30, halved 1.7e-2, times 1 + 10% noise 4.8e-3). Beyond
# these cases: a 4-bit Gemma 2 of the same size (GELU-tanh, not tested here) reached 5.7e-3 at step 2,
# from its activation alone (patch(norms=False, loss=False) the same; unquantized fp32: 5.6e-6).
LATER_STEPS_SHARE = 2.0**-8


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The tiny random Llama, saved as a user's checkpoint would be (nothing downloaded)."""
    path = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).save_pretrained(path)
    return path


def _model(path, quantization: str, checkpointing: str | None, head: bool):
    """The QLoRA model as a user builds it: loaded quantized, prepared for k-bit training, LoRA adapters on
    every projection (and on the head with `head`), the adapters' initialization seeded."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers.utils.logging.disable_progress_bar()
        transformers.utils.logging.set_verbosity_error()
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path, quantization_config=transformers.BitsAndBytesConfig(**QUANTIZED[quantization]),
            dtype=torch.bfloat16,
        )  # fmt: skip
        # checkpointing: None (off), "reentrant" (prepare_model_for_kbit_training's default: torch's
        # checkpoint called without use_reentrant) or "non-reentrant" (what transformers recommends)
        kwargs = {"use_reentrant": False} if checkpointing == "non-reentrant" else None
        model = peft.prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=checkpointing is not None, gradient_checkpointing_kwargs=kwargs
        )
        torch.manual_seed(1)
        targets = PROJECTIONS + (["lm_head"] if head else [])
        config = peft.LoraConfig(r=RANK, lora_alpha=2 * RANK, lora_dropout=0.0, target_modules=targets)
        return peft.get_peft_model(model, config)


def _step(model, optimizer, ids, autocast: bool) -> float:
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    value = loss.item()
    del loss
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return value


def _run(
    path, quantization: str, checkpointing: str | None, head: bool, autocast: bool, patched: bool
) -> dict:
    """STEPS AdamW steps of the model on one seeded batch (labels = input_ids), the last under LiveBytes:
    {losses, peak (bytes), plan (patch()'s Decisions, before it ran), replaced (what patch() returned),
    model}."""
    model = _model(path, quantization, checkpointing, head)
    model.train()
    plan = invact.plan(model) if patched else None
    replaced = invact.patch(model) if patched else None
    ids = torch.randint(0, LLAMA["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(2))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses = [_step(model, optimizer, ids, autocast) for _ in range(STEPS - 1)]
    state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    known = {"weights": [*model.parameters(), *model.buffers()], "optimizer": state, "inputs": [ids]}
    with LiveBytes(known) as live:
        losses.append(_step(model, optimizer, ids, autocast))
    live.close()
    return {"losses": losses, "peak": live.peak, "plan": plan, "replaced": replaced, "model": model}


# (quantization, checkpointing, head adapter, bf16 autocast): every base without and with checkpointing
# as prepare_model_for_kbit_training turns it on by default (no autocast: the norms and the adapters in
# float32, the quantized layers computing in bfloat16); the QLoRA paper's base (nf4, double quantization)
# with non-reentrant checkpointing and under a Trainer's bf16=True (autocast); the head adapted too
CASES = [(q, ckpt, False, False) for q in QUANTIZED for ckpt in (None, "reentrant")] + [
    ("nf4-dq", "non-reentrant", False, False),
    ("nf4-dq", None, False, True),
    ("nf4", None, True, False),
]


def _id(case) -> str:
    q, ckpt, head, autocast = case
    return "-".join([q, ckpt or "nockpt", *(["head"] if head else []), *(["autocast"] if autocast else [])])


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """One thread: these models' matmuls are a few hundred KiB, and two threads on a busy 2-core machine
    spin-wait for each other (measured here, a 2-core AMD EPYC shared with other jobs: a step 0.1 s at one
    thread, 0.4 to 2.6 s at two). Nothing checked depends on it: LiveBytes counts the ops' outputs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# module-scoped and parametrized: pytest runs a case's three tests together, on one eager and one
# patched run
@pytest.fixture(scope="module", params=[pytest.param(case, id=_id(case)) for case in CASES])
def case(request, saved) -> dict:
    quantization, checkpointing, head, autocast = request.param
    runs = {patched: _run(saved, *request.param, patched) for patched in (False, True)}
    return {"quantization": quantization, "head": head, "eager": runs[False], "patched": runs[True]}


def test_plan_says_what_patch_replaces(case):
    run = case["patched"]
    plan, model = run["plan"], run["model"]
    assert sorted(run["replaced"]) == sorted(d.name for d in plan if d.replace)
    # what the model holds: an activation per MLP, two norms per layer and the final one, the head
    modules = dict(model.named_modules())
    acts = [n for n, m in modules.items() if original_class(m).__name__ == "SiLUActivation"]
    norms = [n for n, m in modules.items() if original_class(m).__name__ == "LlamaRMSNorm"]
    assert len(acts) == LLAMA["num_hidden_layers"] and len(norms) == 2 * LLAMA["num_hidden_layers"] + 1
    replaced = {k: sorted(d.name for d in plan if d.replace and d.kind == k) for k in ("activation", "norm")}
    assert replaced == {"activation": sorted(acts), "norm": sorted(norms)}
    assert all(isinstance(modules[n], InvAct) for n in acts)
    # each activation's MLP hooked for its gated product (bitsandbytes' layers under PEFT's: not fused),
    # the hook still there after the steps or taken off where the call saved no product (under autocast)
    gated = {d.name: d.gated for d in plan if d.kind == "activation"}
    assert gated == {n: n.rpartition(".")[0] for n in acts}
    assert all(vars(modules[g]).get("_invact_recompute_products") is not None for g in gated.values())
    assert not [g for g in gated.values() if "forward" in vars(modules[g])]  # not run as invact's one op
    assert all(isinstance(modules[n], InvNorm) for n in norms)
    (loss,) = [d for d in plan if d.kind == "loss"]
    assert loss.name == "base_model.model.lm_head"
    if case["head"]:  # PEFT's lora.Linear over the head: left alone, the loss computes full logits as eager's
        head = type(modules[loss.name])  # named by its module, as PEFT's class is also called Linear
        said = f"a {head.__module__}.{head.__qualname__}, not an nn.Linear"
        assert not loss.replace and said in loss.reason, loss
        assert loss.name not in run["replaced"] and not isinstance(modules[loss.name], LossHead)
    else:
        assert loss.replace and isinstance(modules[loss.name], LossHead)
    # nothing else changed: bitsandbytes' layers and PEFT's adapters are their own classes
    layer = QUANTIZED_LAYERS[case["quantization"]]
    quantized = [m for m in modules.values() if type(m) is getattr(bnb.nn, layer)]
    assert len(quantized) == len(PROJECTIONS) * LLAMA["num_hidden_layers"]
    adapters = [m for m in modules.values() if isinstance(m, peft.tuners.lora.LoraLayer)]
    assert len(adapters) == len(quantized) + case["head"]
    ours = [n for n, m in modules.items() if isinstance(m, (InvAct, InvNorm, LossHead))]
    assert sorted(ours) == sorted(run["replaced"])
    # a second patch() finds nothing left to do
    assert invact.patch(model) == []


def test_patched_losses_follow_eager(case):
    eager, patched = case["eager"]["losses"], case["patched"]["losses"]
    assert abs(patched[0] - eager[0]) <= SUM_ORDER_RTOL * abs(eager[0]), (eager, patched)
    for k in range(1, STEPS):
        moved = abs(eager[k] - eager[0])
        assert moved > 0, eager  # the steps train: a bound on a share of nothing would check nothing
        bound = SUM_ORDER_RTOL * abs(eager[k]) + LATER_STEPS_SHARE * moved
        assert abs(patched[k] - eager[k]) <= bound, (k, eager, patched)


def test_patched_step_peak_is_below_eager(case):
    eager, patched = case["eager"]["peak"], case["patched"]["peak"]
    assert patched < eager, (eager / 2**20, patched / 2**20)


def _figures() -> None:
    """The figures docs/qlora.md quotes: per case, the losses' differences and the peaks (MiB), from the
    runs the tests check (python tests/invact/test_qlora_runtime.py)."""
    import tempfile

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as path:
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).save_pretrained(path)
        for params in CASES:
            runs = [_run(path, *params, p) for p in (False, True)]
            eager, patched = (r["losses"] for r in runs)
            peaks = [r["peak"] / 2**20 for r in runs]
            diffs = [abs(a - b) for a, b in zip(eager, patched, strict=True)]
            shares = [diffs[k] / abs(eager[k] - eager[0]) for k in range(1, STEPS)]
            print(f"{_id(params)}: losses {eager[0]:.4f} ... {eager[-1]:.4f}, diffs "
                  f"{' / '.join(f'{d:.1e}' for d in diffs)} (largest share of the move {max(shares):.1e}); "
                  f"peak eager {peaks[0]:.2f} MiB, patched {peaks[1]:.2f} MiB", flush=True)  # fmt: skip


if __name__ == "__main__":
    _figures()
