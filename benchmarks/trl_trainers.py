"""invact under TRL's trainers (SFTTrainer, DPOTrainer, KTOTrainer, GRPOTrainer) on CPU: a Llama-shaped
causal LM built from a config (random weights, nothing downloaded), trained eager and after
`invact.patch(model)` from the same weights on the same data with the same seed.

Since TRL 1.15 these trainers compute their log-probabilities with TRL's own chunked head
(trl.trainer.utils.add_fused_lm_head, called as `model(..., fused_lm_head=True)`): it runs the backbone
and projects the last hidden state through the head's weight itself, so invact's loss path (which wraps
the model's forward and the head) never runs there; what invact changes under TRL is the activations, the
gated products act(g) * u of the MLPs and the norms.

Per trainer, with TRL's default gradient checkpointing and without it, and per side: the peak of the
live bytes one training step allocates (the step MEASURED_STEP, trainer.training_step under
invact.planner.live_bytes.LiveBytes: forward and backward; the weights and the data alive before are not
counted, and GRPO's generation runs before it), the time per step (the minimum over the other steps, from
the trainer's step begin to its end, generation included), the loss of each step (the trainer's log
history), GRPO's sampled completions (equal or not), and the modules invact replaced (patch()'s names,
counted by plan()'s kinds) with plan()'s word on the loss once the trainer is built.

Writes benchmarks/results/trl_trainers_cpu.json (with the machine: the CPU's model, torch's thread count,
the torch, transformers and trl versions) and its markdown table trl_trainers_cpu.md beside it.
tests/invact/test_trl.py trains with the helpers here at a tiny size.
"""

from __future__ import annotations

import argparse
import collections
import json
import platform
import time
from pathlib import Path

import torch

from timing import RESULTS, cpu_model

MIB = 2**20
SEED = 0
TRAINERS = ("sft", "dpo", "kto", "grpo")
# The benchmark's model: Llama-shaped, small enough that the whole script runs in a few minutes on 2 cores
BENCH_SIZES = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=2000)  # fmt: skip
BENCH_SEQ = 64  # words of each text (prompt plus completion)
MEASURED_STEP = 1  # the step whose peak is measured (step 0 warms up; it is left out of the times)


# -- Model, tokenizer, data ----------------------------------------------------------------------------


def tokenizer(vocab_size: int):
    """A word-level tokenizer built in code: <pad> (0), <eos> (1), <unk> (2) and words w3 .. w{vocab-1},
    split on whitespace."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>")  # fmt: skip


def model(sizes: dict, path: Path):
    """A LlamaForCausalLM of `sizes` in fp32, loaded from `path` (a directory): the first call draws its
    weights (torch.manual_seed(SEED)) and saves them there, so every call gives the same weights, and
    DPO and KTO build their reference model from the same path, as they do from a model's name."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if not (Path(path) / "config.json").exists():
        config = LlamaConfig(**sizes, pad_token_id=0, eos_token_id=1, bos_token_id=None,
                             max_position_embeddings=1024, tie_word_embeddings=False)  # fmt: skip
        torch.manual_seed(SEED)
        LlamaForCausalLM(config).save_pretrained(path)
    return LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)


def _words(rng: torch.Generator, vocab_size: int, n: int) -> str:
    return " ".join(f"w{i}" for i in torch.randint(3, vocab_size, (n,), generator=rng).tolist())


def dataset(kind: str, rows: int, seq: int, vocab_size: int):
    """`rows` examples for trainer `kind`, random words (seeded): SFT a text of `seq` words; DPO a prompt of
    seq/2 and a chosen and a rejected completion of seq/2; KTO a prompt and a completion, labelled
    desirable and undesirable in turn; GRPO a prompt of seq/2 (its completions are generated). A
    completion starts with a space: TRL tokenizes prompt + completion, whose words must not merge."""
    from datasets import Dataset

    rng = torch.Generator().manual_seed(SEED)
    half = seq // 2
    w = lambda n, lead="": [lead + _words(rng, vocab_size, n) for _ in range(rows)]  # noqa: E731
    if kind == "sft":
        return Dataset.from_dict({"text": w(seq)})
    if kind == "dpo":
        return Dataset.from_dict({"prompt": w(half), "chosen": w(half, " "), "rejected": w(half, " ")})
    if kind == "kto":
        return Dataset.from_dict({"prompt": w(half), "completion": w(half, " "),
                                  "label": [i % 2 == 0 for i in range(rows)]})  # fmt: skip
    if kind == "grpo":
        return Dataset.from_dict({"prompt": w(half)})
    raise ValueError(kind)


def reward_low_words(completions, **kwargs) -> list[float]:
    """GRPO's reward: the share of a completion's words among the lower half of the vocabulary's ids."""
    return [sum(int(t[1:]) < 100 for t in c.split() if t[1:].isdigit()) / max(1, len(c.split()))
            for c in completions]  # fmt: skip


# -- One training run -------------------------------------------------------------------------------------


def _args(kind: str, out: str, steps: int, batch: int, seq: int, lr: float, completion: int,
          checkpointing: bool):  # fmt: skip
    """The trainer's config: plain SGD at a constant rate without clipping (the update is -lr * grad, so a
    loss difference between two runs follows from their gradients'), one step a log, fp32 on CPU,
    gradient checkpointing as `checkpointing` (TRL's default: on)."""
    import trl

    common = dict(output_dir=out, max_steps=steps, per_device_train_batch_size=batch, learning_rate=lr,
                  optim="sgd", lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=0.0,
                  logging_steps=1, seed=SEED, data_seed=SEED, report_to=[], save_strategy="no",
                  use_cpu=True, bf16=False, fp16=False, dataloader_num_workers=0, disable_tqdm=True,
                  gradient_checkpointing=checkpointing)  # fmt: skip
    if kind == "sft":
        return trl.SFTConfig(**common, max_length=seq + 1)
    if kind == "dpo":
        return trl.DPOConfig(**common, max_length=seq + 1)
    if kind == "kto":
        return trl.KTOConfig(**common, max_length=seq + 1)
    return trl.GRPOConfig(**common, num_generations=2, max_completion_length=completion,
                          steps_per_generation=1, num_iterations=1, log_completions=False)  # fmt: skip


def _trainer(kind: str, net, tok, data, args):
    import trl

    if kind == "sft":
        return trl.SFTTrainer(model=net, args=args, train_dataset=data, processing_class=tok)
    if kind == "dpo":  # ref_model None: TRL loads the reference model (unpatched) from `net`'s path
        return trl.DPOTrainer(model=net, args=args, train_dataset=data, processing_class=tok)
    if kind == "kto":
        return trl.KTOTrainer(model=net, args=args, train_dataset=data, processing_class=tok)
    return trl.GRPOTrainer(model=net, reward_funcs=reward_low_words, args=args, train_dataset=data,
                           processing_class=tok)  # fmt: skip


def train(kind: str, patched: bool, sizes: dict, out: Path, steps: int = 3, batch: int = 2, seq: int = 16,
          lr: float = 0.1, completion: int = 4, checkpointing: bool = True,
          measure: bool = True) -> dict:  # fmt: skip
    """One run of trainer `kind` on the model of `sizes` (saved under `out`/model; the trainer's output in
    `out`/<patched or eager>) (patched with invact.patch(model) before the
    trainer is built, as the docs say, where `patched`). {losses: each step's loss (log history),
    grads: each step's flattened gradient before the optimizer's step (float64), peak: the live bytes
    the training_step of MEASURED_STEP allocated at most (None without `measure`), step_ms: each step's
    milliseconds, completions: GRPO's generated completion ids of each step (token lists), tokens: the
    tokens (padding included) of the backbone's forwards with autograd in MEASURED_STEP, head_calls: the
    calls of the head's own forward with autograd (TRL's fused head reads its weight instead), replaced:
    {kind: modules}, plan_loss: plan()'s loss Decision under the built trainer (its replace, reason)}."""
    from transformers import TrainerCallback

    import invact
    from invact.planner.live_bytes import LiveBytes

    net = model(sizes, Path(out) / "model")
    tok = tokenizer(sizes["vocab_size"])
    counts: dict[str, int] = {}
    if patched:
        kinds = {d.name: d.kind for d in invact.plan(net) if d.replace}
        counts = dict(collections.Counter(kinds[n] for n in invact.patch(net)))
    where = str(Path(out) / ("patched" if patched else "eager"))
    args = _args(kind, where, steps, batch, seq, lr, completion, checkpointing)
    trainer = _trainer(kind, net, tok, dataset(kind, batch * steps, seq, sizes["vocab_size"]), args)
    plan_loss = [(d.replace, d.reason) for d in invact.plan(trainer.model) if d.kind == "loss"]

    record: dict = {"grads": [], "step_ms": [], "completions": [], "peak": None, "tokens": 0, "head_calls": 0}

    def count_tokens(module, args, kwargs):  # the backbone's forwards with autograd in the measured step
        ids = kwargs.get("input_ids", args[0] if args else None)
        if torch.is_grad_enabled() and len(record["step_ms"]) == MEASURED_STEP and ids is not None:
            record["tokens"] += ids.numel()

    def count_head_calls(module, args):  # the head's own forward with autograd: invact's loss path would run
        record["head_calls"] += torch.is_grad_enabled()

    net.model.register_forward_pre_hook(count_tokens, with_kwargs=True)
    net.lm_head.register_forward_pre_hook(count_head_calls)

    class Record(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            record["t0"] = time.perf_counter()

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            g = [p.grad.flatten() for p in model.parameters() if p.grad is not None]
            record["grads"].append(torch.cat(g).double())

        def on_step_end(self, args, state, control, **kwargs):
            record["step_ms"].append((time.perf_counter() - record["t0"]) * 1e3)

    trainer.add_callback(Record())
    step = trainer.training_step

    def training_step(model, inputs, *rest, **kw):
        if kind == "grpo":  # GRPO generates inside _prepare_inputs, called here: keep the completions
            inputs = trainer._prepare_inputs(inputs)
            record["completions"].append(inputs["completion_ids"].tolist())
            trainer_prepare, trainer._prepare_inputs = trainer._prepare_inputs, lambda x: x
        try:
            if measure and len(record["step_ms"]) == MEASURED_STEP:
                live = LiveBytes()
                try:
                    with live:
                        loss = step(model, inputs, *rest, **kw)
                finally:
                    live.close()
                record["peak"] = live.peak
                return loss
            return step(model, inputs, *rest, **kw)
        finally:
            if kind == "grpo":
                trainer._prepare_inputs = trainer_prepare

    trainer.training_step = training_step
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {"losses": losses, "grads": record["grads"], "peak": record["peak"], "step_ms": record["step_ms"],
            "completions": record["completions"], "tokens": record["tokens"],
            "head_calls": record["head_calls"], "replaced": counts, "plan_loss": plan_loss}  # fmt: skip


# -- The benchmark ----------------------------------------------------------------------------------------


def main() -> None:
    import transformers
    import trl

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS / "trl_trainers_cpu.json")
    parser.add_argument("--steps", type=int, default=5, help="training steps a run (default 5)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=BENCH_SEQ)
    parser.add_argument("--only", nargs="*", choices=TRAINERS, default=list(TRAINERS))
    a = parser.parse_args()
    transformers.utils.logging.set_verbosity_error()
    rows = []
    for kind in a.only:
        for checkpointing in (True, False):
            rows.append(_row(kind, checkpointing, a))
            print(json.dumps({k: v for k, v in rows[-1].items() if "losses" not in k}), flush=True)
    result = {
        "machine": {
            "cpu": cpu_model(),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "trl": trl.__version__,
            "python": platform.python_version(),
        },
        "model": {"class": "LlamaForCausalLM", **BENCH_SIZES, "dtype": "float32"},
        "setup": {
            "steps": a.steps,
            "batch": a.batch,
            "seq_words": a.seq,
            "measured_step": MEASURED_STEP,
            "optimizer": "sgd, lr 0.01, constant, no clipping",
            "grpo": {"num_generations": 2, "max_completion_length": a.seq // 4},
        },
        "rows": rows,
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    a.out.with_suffix(".md").write_text(table(result))
    print(table(result))


def _row(kind: str, checkpointing: bool, a) -> dict:
    """One trainer's eager and patched runs at the benchmark's size, compared."""
    import tempfile

    runs = {}
    with tempfile.TemporaryDirectory() as out:
        for patched in (False, True):
            t0 = time.perf_counter()
            runs[patched] = train(kind, patched, BENCH_SIZES, Path(out), steps=a.steps, batch=a.batch,
                                  seq=a.seq, lr=0.01, completion=a.seq // 4,
                                  checkpointing=checkpointing)  # fmt: skip
            runs[patched]["wall_s"] = time.perf_counter() - t0
    eager, inv = runs[False], runs[True]
    timed = lambda r: min(ms for i, ms in enumerate(r["step_ms"]) if i not in (0, MEASURED_STEP))  # noqa: E731
    return {
        "trainer": kind,
        "checkpointing": checkpointing,
        "tokens": eager["tokens"],
        "eager_peak_mib": eager["peak"] / MIB,
        "patched_peak_mib": inv["peak"] / MIB,
        "peak_ratio": inv["peak"] / eager["peak"],
        "eager_step_ms": timed(eager),
        "patched_step_ms": timed(inv),
        "eager_losses": eager["losses"],
        "patched_losses": inv["losses"],
        "max_abs_loss_diff": max(abs(x - y) for x, y in zip(eager["losses"], inv["losses"], strict=True)),
        "same_completions": eager["completions"] == inv["completions"] if kind == "grpo" else None,
        "head_calls_with_grad": inv["head_calls"],
        "replaced": inv["replaced"],
        "plan_loss_under_trl": inv["plan_loss"],
        "wall_s": eager["wall_s"] + inv["wall_s"],
    }


def table(result: dict) -> str:
    m = result["machine"]
    lines = [
        f"CPU: {m['cpu']}, {m['threads']} threads; torch {m['torch']}, transformers {m['transformers']}, "
        f"trl {m['trl']}. Model: {_model_line(result['model'])}.",
        "",
        "| trainer | checkpointing | tokens | peak eager (MiB) | peak patched (MiB) | ratio "
        "| step eager (ms) | step patched (ms) | max abs loss diff | replaced |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in result["rows"]:
        rep = ", ".join(f"{k} {v}" for k, v in sorted(r["replaced"].items()))
        lines.append(f"| {r['trainer'].upper()} | {'on' if r['checkpointing'] else 'off'} | {r['tokens']} | "
                     f"{r['eager_peak_mib']:.1f} | {r['patched_peak_mib']:.1f} | "
                     f"{r['peak_ratio']:.3f} | {r['eager_step_ms']:.0f} | {r['patched_step_ms']:.0f} | "
                     f"{r['max_abs_loss_diff']:.2e} | {rep} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def _model_line(model: dict) -> str:
    return (f"Llama, {model['num_hidden_layers']} layers, hidden {model['hidden_size']}, intermediate "
            f"{model['intermediate_size']}, vocabulary {model['vocab_size']}, {model['dtype']}")  # fmt: skip


if __name__ == "__main__":
    main()
