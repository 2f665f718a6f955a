"""The whole training step's peak that invact.planner.step predicts on the meta device, against a real CPU
step's: does `Step(config, recipe, device="cpu").peak(batch, seq)` give the live bytes a real step
reaches, for architectures other than the Llama it was built on?

The models (transformers, random weights from a config, nothing downloaded; ARCHITECTURES): Llama,
Qwen2, Gemma 2, GPT-2 and Qwen2-MoE, 2 layers of hidden 128, 4 heads (2 key-value heads), vocabulary
16000: small enough that a real step takes a few tenths of a second here, with the activations most of
the peak at the longest sequence (the eager loss's logits: 125 MiB at 1024 tokens). Gemma 2 has no SDPA
path in transformers (eager attention, on both sides) and a sliding window of 256 on its first layer,
so that seq 512 takes its masked path. The predictor was built on those five; four more check it
beyond them: llama_tied, a Llama of hidden 32 with a tied head over a vocabulary of 32000 (1000 times
its width: the head is most of the model, and its weight gradient meets the embedding's), Phi-3 (fused
qkv and gate_up projections), OLMo 2 (norms after attention and the MLP, RMSNorm on queries and keys)
and Granite (muP multipliers: the logits divided by logits_scaling, the loss's transform), the last
three at the five's sizes. Each at batch 2 and seq 128, 256 and 512, for every recipe
(invact.planner.recipes.RECIPES: bf16, mixed, lora), without and with Hugging Face's gradient checkpointing,
eager and then after invact.patch() (applied to the same two Steps after the eager rows, as
invact.planner.step.step_peaks does).

Predicted: `Step(config, recipe, device="cpu")` on the meta device, its `peak()`. Measured: a real model
built from the same config in the recipe's dtype (bf16; fp32 for "mixed"), seeded, with the attention
implementation the meta Step chose (invact.planner.config.build_model: SDPA, else eager), wrapped in
`Step(None, recipe, model=..., device="cpu")` so that LoRA, AdamW (foreach) and its state are set up as
the prediction's; input_ids = labels, random tokens of a seeded generator. One warm-up step, then
gc.collect() (no garbage of an earlier row is freed inside the measured step), then one step under
torch's profiler (profile_memory=True): the "[memory]" events (every allocation and free of the CPU
allocator, with its bytes, whatever the allocator then does with the memory) in time order, the
largest running sum, plus the bytes alive before the step (parameters, buffers, AdamW's state, the
inputs). `end_bytes`, the running sum after the step, is 0 where the step leaves nothing behind.

Two more columns for diagnosis: `dispatch_bytes`, the peak invact.planner.live_bytes.LiveBytes (the
predictor's own counting, a dispatch mode) follows on a third, real step, without the kernel workspaces a
plan for a CPU adds (invact.planner.live_bytes.cpu_matmul_workspace): where it equals predicted_bytes and
measured_bytes is
higher, the difference is allocated inside a kernel without an op (a workspace, which a dispatch mode
cannot see), not a fault of the meta emulation; where predicted_bytes is above it, the plan counted
such a workspace at its peak; `measured_at`, the op stack around the measured peak (outermost first).

Writes benchmarks/results/step_plan_cpu.json (machine: `device`, the CPU's model, its vector ISA and
torch's thread count) and its markdown table to step_plan_cpu.md beside it; with --only and no --out,
step_plan_cpu_<names>.json. Prints each row as it is measured and the worst ratios.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

from timing import RESULTS, device_name, version, write_result

MIB = 2**20
BATCH = 2
SEQS = (128, 256, 512)
SEED = 0
_DECODER = dict(hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=16000, tie_word_embeddings=False)  # fmt: skip
# name -> config dict (its model_type picks the transformers class)
ARCHITECTURES: dict[str, dict] = {
    "llama": {"model_type": "llama", **_DECODER},
    "qwen2": {"model_type": "qwen2", **_DECODER},
    # Gemma 2's default head_dim is 256; it ties its embeddings; layer 0 slides over 256 tokens
    "gemma2": {
        "model_type": "gemma2",
        **_DECODER,
        "head_dim": 32,
        "tie_word_embeddings": True,
        "sliding_window": 256,
    },
    "gpt2": {
        "model_type": "gpt2",
        "n_embd": 128,
        "n_layer": 2,
        "n_head": 4,
        "vocab_size": 16000,
        "n_positions": 1024,
    },
    # 8 experts of 64, 2 per token, and a shared expert of 128, in both layers
    "qwen2_moe": {
        "model_type": "qwen2_moe",
        **_DECODER,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 128,
        "num_experts": 8,
        "num_experts_per_tok": 2,
    },
    # A vocabulary 1000 times the hidden size, the head tied to the embedding: the loss's weight gradient
    # (vocab x hidden) meets the embedding's in backward, and the head is most of the model
    "llama_tied": {
        "model_type": "llama",
        **_DECODER,
        "hidden_size": 32,
        "intermediate_size": 96,
        "vocab_size": 32000,
        "tie_word_embeddings": True,
    },
    # fused projections: one qkv_proj and one gate_up_proj a layer (its default pad_token_id, 32000, is
    # past this vocabulary)
    "phi3": {"model_type": "phi3", **_DECODER, "pad_token_id": 0},
    # norms after attention and the MLP (not before), and RMSNorm on the queries and keys
    "olmo2": {"model_type": "olmo2", **_DECODER},
    # muP multipliers: the logits divided by logits_scaling (the loss's transform), the embeddings, the
    # residuals and the attention scores scaled
    "granite": {
        "model_type": "granite",
        **_DECODER,
        "logits_scaling": 8.0,
        "embedding_multiplier": 12.0,
        "residual_multiplier": 0.22,
        "attention_multiplier": 0.0625,
    },
}
# The acceptance: predicted within 5% of measured, and never more than 2% below it.
ABOVE, BELOW = 1.05, 0.98


def steps(config: dict, recipe: str, device: str = "cpu"):
    """(the meta Step of `config` for `recipe`, planned as on `device`; the real one: the causal LM of
    the same config (the class the meta Step built, invact.planner.config.build_model's choice) on `device`
    in the recipe's dtype, seeded, with the attention implementation the meta Step chose)."""
    import transformers

    from invact.planner.config import build_config
    from invact.planner.recipes import RECIPES
    from invact.planner.step import Step

    transformers.utils.logging.set_verbosity_error()
    meta = Step(dict(config), recipe, device=device)
    torch.manual_seed(SEED)
    model = transformers.AutoModelForCausalLM.from_config(
        build_config(dict(config)), dtype=RECIPES[recipe].dtype, attn_implementation=meta.attention
    ).to(device)
    real = Step(None, recipe, model=model, device=device)
    assert type(real.base) is type(meta.base) and real.attention == meta.attention, (
        real.base,
        real.attention,
    )
    return meta, real


def inputs(step, batch: int, seq: int) -> dict:
    """A training step's inputs for the real `step`: seeded random input_ids on its model's device,
    labels the same tensor."""
    vocab = step.base.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(SEED))
    ids = ids.to(next(step.base.parameters()).device)
    return {"input_ids": ids, "labels": ids, "use_cache": False}


def _alive(step, given: dict) -> int:
    """Bytes of the distinct storages alive before a step: parameters, buffers (and a 4-bit base's
    constants), AdamW's state, inputs."""
    from invact.planner.quantized import quant_state_tensors

    tensors = [
        *step.model.parameters(),
        *step.model.buffers(),
        *step._state(),
        *quant_state_tensors(step.model),
    ]
    tensors += [t for t in given.values() if isinstance(t, torch.Tensor)]
    return sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}.values())


def profiled_peak(fn, ranges: str | None = None) -> dict:
    """fn() under torch's profiler (profile_memory=True): {peak: the largest running sum of the CPU
    allocator's allocations and frees in time order (bytes above what was alive before), end: the sum
    after fn, at: the names of the ops running at the peak, outermost first}; with `ranges` (a prefix of
    record_function names fn opens, such as "fsdp_peaks::"), also peaks: {name less the prefix: the
    largest running sum inside that range (from the sum as it starts)}, and `at` without those names."""
    from torch.profiler import ProfilerActivity, profile

    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = list(prof.profiler.kineto_results.events())
    memory = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    running = peak = 0
    when = None
    for ns, nbytes in memory:
        running += nbytes
        if running > peak:
            peak, when = running, ns
    at = []
    if when is not None:
        around = [e for e in events if e.name() != "[memory]" and e.start_ns() <= when <= e.end_ns()]
        at = [e.name() for e in sorted(around, key=lambda e: (e.start_ns(), -e.end_ns()))]
    result = {"peak": peak, "end": running, "at": at}
    if ranges is None:
        return result
    result["at"] = [name for name in at if not name.startswith(ranges)]
    result["peaks"] = {}
    for e in events:
        if e.name().startswith(ranges):
            start, end = e.start_ns(), e.end_ns()
            total, best = 0, None
            for ns, nbytes in memory:
                if ns > end:
                    break
                if ns >= start and best is None:
                    best = total
                total += nbytes
                if ns >= start:
                    best = max(best, total)
            result["peaks"][e.name().removeprefix(ranges)] = total if best is None else best
    return result


def _dispatch_peak(step, given: dict) -> int:
    """The peak invact.planner.live_bytes.LiveBytes follows on one real step of `step` (the predictor's own
    counting on real tensors: Step.follow)."""
    gc.collect()
    return step.follow(given).peak


def measure(step, batch: int, seq: int, checkpointing: bool, dispatch: bool = True) -> dict:
    """The real `step`'s peak live bytes in one training step at (batch, seq), after a warm-up step:
    {measured_bytes, end_bytes, measured_at (the ops at the peak), dispatch_bytes (LiveBytes' peak of
    another step; None without `dispatch`)}."""
    from invact.planner.recipes import disable_checkpointing, enable_checkpointing

    (enable_checkpointing if checkpointing else disable_checkpointing)(step.base)
    given = inputs(step, batch, seq)
    step.run(given)  # the warm-up
    alive = _alive(step, given)
    profiled = profiled_peak(lambda: step.run(given))
    return {
        "measured_bytes": alive + profiled["peak"],
        "end_bytes": profiled["end"],
        "measured_at": profiled["at"],
        "dispatch_bytes": _dispatch_peak(step, given) if dispatch else None,
    }


def compare(name: str, recipe: str, seqs=SEQS, batch: int = BATCH, report=print):
    """The rows of one architecture and recipe: eager, then patched, each without and with checkpointing,
    at each of `seqs`; `report(row)` as each is done."""
    meta, real = steps(ARCHITECTURES[name], recipe)
    for patched in (False, True):
        if patched:
            meta.patch()
            real.patch()
        for checkpointing in (False, True):
            for seq in seqs:
                t0 = time.perf_counter()
                gc.collect()
                try:
                    predicted, error = meta.peak(batch, seq, checkpointing=checkpointing), None
                except Exception as e:  # the meta step cannot run: the row says why, the real step still runs
                    predicted = {"peak_bytes": None, "phase": None, "op": None, "terms": None}
                    error = f"{type(e).__name__}: {str(e).splitlines()[0]}"
                t1 = time.perf_counter()
                measured = measure(real, batch, seq, checkpointing)
                t2 = time.perf_counter()
                ratio = None if error else predicted["peak_bytes"] / measured["measured_bytes"]
                row = {
                    "architecture": name,
                    "model_type": ARCHITECTURES[name]["model_type"],
                    "model_class": type(real.base).__name__,
                    "attention": real.attention,
                    "seq": seq,
                    "batch": batch,
                    "recipe": recipe,
                    "checkpointing": checkpointing,
                    "patched": patched,
                    "predicted_bytes": predicted["peak_bytes"],
                    **measured,
                    "ratio": ratio,
                    "phase": predicted["phase"],
                    "op": predicted["op"],
                    "terms": predicted["terms"],
                    "predict_s": round(t1 - t0, 3),
                    "measure_s": round(t2 - t1, 3),
                    "error": error,
                }
                report(row)
                yield row


def _variant(row: dict) -> str:
    return ("patch()" if row["patched"] else "eager") + (", checkpointing" if row["checkpointing"] else "")


def _mib(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / MIB:.2f}"


def progress(row: dict) -> None:
    if row["error"]:
        tail = f"prediction failed: {row['error'][:120]}"
    else:
        flag = "" if BELOW <= row["ratio"] <= ABOVE else "  OUTSIDE"
        took = f"{row['predict_s']:.2f} s + {row['measure_s']:.2f} s"
        tail = f"ratio {row['ratio']:.4f} ({row['phase']}; {took}){flag}"
    print(f"{row['architecture']:9} {row['recipe']:5} seq {row['seq']:4} {_variant(row):25} predicted "
          f"{_mib(row['predicted_bytes']):>7} MiB measured {_mib(row['measured_bytes']):>7} MiB {tail}",
          flush=True)  # fmt: skip


def summary(rows: list[dict]) -> dict:
    """The worst ratios above and below 1 (None where no row is), how many rows are exact, the rows
    outside the acceptance and those whose prediction failed."""

    def which(row: dict | None) -> dict | None:
        keys = ("architecture", "seq", "recipe", "checkpointing", "patched", "ratio", "phase", "error")
        return None if row is None else {k: row[k] for k in keys}

    done = [r for r in rows if r["ratio"] is not None]
    above = max((r for r in done if r["ratio"] > 1), key=lambda r: r["ratio"], default=None)
    below = min((r for r in done if r["ratio"] < 1), key=lambda r: r["ratio"], default=None)
    return {
        "rows": len(rows),
        "worst_above": which(above),
        "worst_below": which(below),
        "exact": sum(r["predicted_bytes"] == r["measured_bytes"] for r in done),
        "outside": [which(r) for r in done if not BELOW <= r["ratio"] <= ABOVE],
        "failed": [which(r) for r in rows if r["ratio"] is None],
    }


def _worst(row: dict | None) -> str:
    if row is None:
        return "none"
    return f"{row['ratio']:.4f} ({row['architecture']}, {row['recipe']}, seq {row['seq']}, {_variant(row)})"


def header(result: dict) -> str:
    """The table's title and the summary: the worst ratios, how many rows are exact, outside or failed."""
    s = result["summary"]
    failed = sorted({f"{r['architecture']} {r['recipe']}" for r in s["failed"]})
    return "\n".join([
        f"Predicted (invact.planner, meta device) against measured (torch profiler) peak of one training "
        f"step, MiB; batch {result['batch']}; {result['device']}, torch {result['torch']}, transformers "
        f"{result['transformers']}",
        "",
        f"Worst ratio above 1: {_worst(s['worst_above'])}. Worst below 1: {_worst(s['worst_below'])}. "
        f"{s['exact']} of {s['rows']} rows exact; {len(s['outside'])} outside [{BELOW}, {ABOVE}]; "
        f"{len(s['failed'])} not predicted ({', '.join(failed) or 'none'}). {result['wall_s']:.0f} s in all.",
    ])  # fmt: skip


def table(result: dict) -> str:
    lines = [
        header(result),
        "",
        "Ratio: predicted / measured. Phase: where the predicted peak is. LiveBytes on the real step: the "
        "predictor's own counting (a dispatch mode) on a real step: equal to predicted where the meta step "
        "allocates as the real one, less the kernel workspace the plan counts at its peak (a bf16 mm's copy "
        "of a B at most 32 columns wide: invact.planner.live_bytes.cpu_matmul_workspace); below measured by "
        "what "
        "kernels allocate inside themselves (a bf16 mm's oneDNN buffers), above it where autograd sums two "
        "gradients of one tensor (in place in a plain step, out of place under a dispatch mode and on "
        "meta).",
        "",
        "| architecture | seq | recipe | checkpointing | patched | predicted | measured | ratio | phase | "
        "LiveBytes on the real step |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        ratio = "failed" if r["ratio"] is None else f"{r['ratio']:.4f}"
        lines.append(
            f"| {r['architecture']} | {r['seq']} | {r['recipe']} | {'yes' if r['checkpointing'] else 'no'} | "
            f"{'yes' if r['patched'] else 'no'} | {_mib(r['predicted_bytes'])} | "
            f"{_mib(r['measured_bytes'])} | {ratio} | {r['phase'] or '-'} | {_mib(r['dispatch_bytes'])} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    from invact.planner.recipes import RECIPES

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", choices=list(ARCHITECTURES), metavar="NAME",
                        help=f"only these ({', '.join(ARCHITECTURES)}; default all)")  # fmt: skip
    parser.add_argument("--recipes", nargs="+", choices=list(RECIPES), metavar="RECIPE",
                        help=f"only these recipes ({', '.join(RECIPES)}; default all)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=None,
                        help="the JSON file (default results/step_plan_cpu.json; .md beside it)")  # fmt: skip
    args = parser.parse_args(argv)
    names = args.only or list(ARCHITECTURES)
    recipes = args.recipes or list(RECIPES)
    start = time.perf_counter()
    rows = [row for name in names for recipe in recipes for row in compare(name, recipe, report=progress)]
    result = {
        "device": device_name("cpu"),
        "torch": torch.__version__,
        "transformers": version("transformers"),
        "peft": version("peft"),
        "bitsandbytes": version("bitsandbytes"),
        "batch": BATCH,
        "seqs": list(SEQS),
        "architectures": {name: ARCHITECTURES[name] for name in names},
        "acceptance": {"above": ABOVE, "below": BELOW},
        "wall_s": round(time.perf_counter() - start, 1),
        "summary": summary(rows),
        "rows": rows,
    }
    print()
    print(header(result))
    suffix = "" if args.only is None else "_" + "-".join(names)
    suffix += "" if args.recipes is None else "_" + "-".join(recipes)
    path = write_result(result, "step_plan", "cpu", out=args.out or RESULTS / f"step_plan_cpu{suffix}.json")
    path.with_suffix(".md").write_text(table(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
