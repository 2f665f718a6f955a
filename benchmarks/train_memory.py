"""Peak memory of a full training step (forward, loss, backward, AdamW step) with and without
invact.patch, next to the bytes autograd saves: does the drop in saved bytes reach the allocator's peak?

Models (transformers, random weights from configs, nothing downloaded, default dropout, SDPA
attention): BERT-base with its masked-LM head, GPT-2 (124M) with its LM head, and a Llama-shaped
decoder (hidden 2048, SwiGLU 8192, 8 layers, 16 heads / 8 KV heads). One model and one AdamW serve both
variants: a first step creates the optimizer state, the torch step is measured, the model is patched
in place (same parameters, same state) and the InvAct step is measured. Peak is
torch.cuda.max_memory_allocated() over the step; saved bytes are invact.memory.count_saved around the
forward. On CPU (--small) only saved bytes are measured. Writes
benchmarks/results/train_memory_<device>[_bfloat16].json and prints a markdown table.

Each measured step is also timed (wall clock between two torch.cuda.synchronize calls, so nothing the
step queues can finish outside it) and reported with the TFLOP/s and GB/s it implies: FLOPs of forward,
loss and backward by torch.utils.flop_counter on the meta device, bytes a lower bound (physics.StepCount
plus AdamW's update). On CUDA a step above the device's datasheet peak (physics.DATASHEET_PEAKS) makes
the script exit 1 with a one-line error and write nothing; an unknown device is not checked, and the
output says so.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from physics import (
    StepCount,
    device_peak,
    forward_read_parameters,
    fp32_matmul_mode,
    peak_note,
    rates,
    row_violations,
)
from torch import nn

import invact
from invact.memory import count_saved

from timing import device_name, write_result

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}


def _bert(small: bool) -> tuple[nn.Module, tuple[int, int]]:
    from transformers import BertConfig, BertForMaskedLM

    return BertForMaskedLM(BertConfig(attn_implementation="sdpa", **(TINY if small else {}))), (8, 512)


def _gpt2(small: bool) -> tuple[nn.Module, tuple[int, int]]:
    from transformers import GPT2Config, GPT2LMHeadModel

    shape = {"n_embd": 64, "n_layer": 2, "n_head": 4} if small else {}
    return GPT2LMHeadModel(GPT2Config(attn_implementation="sdpa", **shape)), (8, 1024)


def _llama(small: bool) -> tuple[nn.Module, tuple[int, int]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = (dict(TINY, num_key_value_heads=2) if small else
             dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=8, num_attention_heads=16,
                  num_key_value_heads=8))  # fmt: skip
    return LlamaForCausalLM(LlamaConfig(vocab_size=32000, attn_implementation="sdpa", **shape)), (4, 1024)


MODELS: dict[str, tuple[str, Callable[[bool], tuple[nn.Module, tuple[int, int]]]]] = {
    "BERT-base": ("masked LM", _bert),
    "GPT-2": ("causal LM, gelu_new", _gpt2),
    "Llama-shaped (8 x 2048, SwiGLU)": ("causal LM", _llama),
}


SMALL_SHAPE = (2, 32)  # batch, seq of --small

# Bytes per parameter element torch.optim.AdamW's update moves at least (torch/optim/adamw.py, every
# implementation: for-loop, foreach, fused): it reads the parameter, its gradient, exp_avg and
# exp_avg_sq and writes the parameter, exp_avg and exp_avg_sq, 7 element sizes (the state has the
# parameter's dtype).
ADAMW_ELEMENT_SIZES = 7


def step_costs(name: str, small: bool, dtype: torch.dtype, mode: str) -> dict:
    """FLOPs of one training step of MODELS[name] (forward, loss, backward; AdamW's update is
    elementwise, which FlopCounterMode counts as nothing) and a lower bound of its bytes per variant,
    torch and InvAct (`mode`): counted once per model on the meta device, at the measured shapes
    and dtype, by the same forward and loss as training_step (physics.StepCount; embedding tables
    count no forward read), plus ADAMW_ELEMENT_SIZES per parameter with a gradient. The InvAct
    count runs the model patched as measure() patches it, and must find the same FLOPs."""
    _, build = MODELS[name]
    with torch.device("meta"):
        model, (batch, seq) = build(small)
        ids = torch.randint(0, 1000, SMALL_SHAPE if small else (batch, seq))
    model = model.to(dtype).train()
    flops, min_bytes = {}, {}
    for variant in ("torch", "invact"):
        if variant == "invact":
            invact.patch(model, mode=mode)
        model.zero_grad(set_to_none=True)
        with StepCount() as count:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        adamw = ADAMW_ELEMENT_SIZES * sum(g.numel() * g.element_size() for g in grads)
        flops[variant] = count.flops
        reads = [ids, *forward_read_parameters(model)]
        min_bytes[variant] = count.minimum_bytes(reads, [loss, *grads]) + adamw
    # invact's loss computes the logits again in backward (invact.loss): one (tokens x hidden x vocab)
    # matmul more than eager's three, and nothing else differs
    head = model.get_output_embeddings()
    recompute = 2 * ids.numel() * head.in_features * head.out_features if head is not None else 0
    if flops["invact"] - flops["torch"] not in (0, recompute):
        raise RuntimeError(f"{name}: FLOPs differ between torch and InvAct by more than the loss's "
                           f"recomputed logits ({recompute}): {flops}")  # fmt: skip
    return {"flops": flops["torch"], "flops_invact": flops["invact"], "min_bytes": min_bytes}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def training_step(model: nn.Module, inputs: dict, optimizer: torch.optim.Optimizer, device: str) -> dict:
    """One step; bytes saved by its forward and, on CUDA, the allocator's peak over it and the memory
    held before it (parameters, optimizer state, inputs), and its wall-clock time between two
    synchronizations (count_saved's hooks included: a few us of host time per saved tensor, which can
    only make the step look slower, never faster than the device allows)."""
    _sync(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    resting = torch.cuda.memory_allocated() if device == "cuda" else None
    start = time.perf_counter()
    with count_saved(model) as counter:
        loss = model(**inputs).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    _sync(device)
    step_ms = (time.perf_counter() - start) * 1e3
    return {
        "loss": loss.item(),
        "saved_bytes": counter.report.saved_bytes,
        "peak_bytes": torch.cuda.max_memory_allocated() if device == "cuda" else None,
        "resting_bytes": resting,
        "step_ms": step_ms,
    }


def measure(name: str, small: bool, device: str, dtype: torch.dtype, mode: str) -> dict:
    what, build = MODELS[name]
    costs = step_costs(name, small, dtype, mode)  # on the meta device, before anything is measured
    torch.manual_seed(0)
    with torch.device(device):  # parameters initialized where they live (fast on a GPU)
        model, (batch, seq) = build(small)
    if small:
        (batch, seq), what = SMALL_SHAPE, f"tiny {what}"
    model = model.to(dtype).train()
    ids = torch.randint(0, 1000, (batch, seq), device=device)
    inputs = {"input_ids": ids, "labels": ids}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    training_step(model, inputs, optimizer, device)  # creates the optimizer state both variants share
    row = {"model": name, "setup": f"{what}, batch {batch}, seq {seq}", "torch": {}, "invact": {}}
    row["torch"] = training_step(model, inputs, optimizer, device)
    row["replaced"] = len(invact.patch(model, mode=mode))
    training_step(model, inputs, optimizer, device)  # Triton compilation outside the measured step
    row["invact"] = training_step(model, inputs, optimizer, device)
    row.update(costs)
    for variant in ("torch", "invact"):
        step = row[variant]
        flops = costs["flops_invact"] if variant == "invact" else costs["flops"]
        step["tflops"], step["gbps"] = rates(flops, costs["min_bytes"][variant], step["step_ms"])
    row["saved_drop"] = row["torch"]["saved_bytes"] - row["invact"]["saved_bytes"]
    if device == "cuda":
        row["peak_drop"] = row["torch"]["peak_bytes"] - row["invact"]["peak_bytes"]
        row["peak_drop_share"] = row["peak_drop"] / row["saved_drop"] if row["saved_drop"] else None
    del model, optimizer
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return row


def markdown(result: dict) -> str:
    cuda = result["rows"][0]["invact"]["peak_bytes"] is not None
    head = ["model", "setup", "saved, torch", "saved, InvAct", "saved drop"]
    head += ["peak, torch", "peak, InvAct", "peak drop", "peak drop / saved drop"] if cuda else []
    lines = [f"\n{result['device']}, {result['dtype']}, one training step (AdamW), mode {result['mode']}\n",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]  # fmt: skip
    mib = lambda b: f"{b / 2**20:,.1f} MiB"  # noqa: E731
    for r in result["rows"]:
        t, i = r["torch"], r["invact"]
        cells = [r["model"], r["setup"], mib(t["saved_bytes"]), mib(i["saved_bytes"]), mib(r["saved_drop"])]
        if cuda:
            cells += [mib(t["peak_bytes"]), mib(i["peak_bytes"]), mib(r["peak_drop"]),
                      f"{100 * r['peak_drop_share']:.0f}%"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    head = ["model", "GFLOP per step"] + [
        f"step, {who} (ms) | TFLOP/s | GB/s (at least)" for who in ("torch", "InvAct")
    ]
    lines += ["", "| " + " | ".join(head) + " |", "|" + "---|" * 8]
    for r in result["rows"]:
        cells = [r["model"], f"{r['flops'] / 1e9:.4g}"]
        for v in ("torch", "invact"):
            cells += [f"{r[v]['step_ms']:.3g}", f"{r[v]['tflops']:.3g}", f"{r[v]['gbps']:.3g}"]
        lines.append("| " + " | ".join(cells) + " |")
    if "physics" in result:
        lines.append(f"\n{result['physics']['note']}")
    return "\n".join(lines)


def check_result(result: dict, peak) -> list[str]:
    """One-line errors for each step of `result` above `peak` (a physics.DevicePeak; None: no check),
    held to the run's dtype and fp32 matmul mode. Pure: reads only `result`."""
    if peak is None:
        return []
    fp32_matmul = result.get("physics", {}).get("fp32_matmul", "ieee")
    errors = []
    for r in result["rows"]:
        flops = {"torch": r["flops"], "invact": r.get("flops_invact", r["flops"])}  # older results: one count
        figures = {f"{v} step": (r[v]["step_ms"], flops[v], r["min_bytes"][v]) for v in ("torch", "invact")}
        errors += row_violations(r["model"], figures, peak, result["dtype"], fp32_matmul)
    return errors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--mode", choices=["bits", "precision_bit"], default="bits")
    parser.add_argument("--small", action="store_true", help="tiny configs, batch 2, seq 32 (a smoke run)")
    parser.add_argument("--only", nargs="*", help="run only models whose name contains one of these words")
    parser.add_argument(
        "--out", type=Path, help="JSON path (default results/train_memory_<device>[_bfloat16].json)"
    )
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    if args.device == "cpu" and not args.small:
        parser.error("--device cpu needs --small (full-size models are for the GPU; peak memory is CUDA's)")
    names = [n for n in MODELS if not args.only or any(w.lower() in n.lower() for w in args.only)]
    if not names:
        parser.error(f"--only {args.only} matches none of: {', '.join(MODELS)}")
    dtype = getattr(torch, args.dtype)
    rows = []
    for name in names:
        rows.append(measure(name, args.small, args.device, dtype, args.mode))
        print(f"measured {name}", flush=True)
    import transformers

    peak = device_peak(torch.cuda.get_device_name()) if args.device == "cuda" else None
    fp32_matmul = fp32_matmul_mode()
    note = (peak_note(device_name(args.device), peak, args.dtype, fp32_matmul) if args.device == "cuda" else
            "CPU: steps not checked against a peak (no datasheet table for CPUs)")  # fmt: skip
    result = {"device": device_name(args.device), "torch": torch.__version__,
              "transformers": transformers.__version__, "dtype": args.dtype, "mode": args.mode,
              "small": args.small, "physics": {"peak": dataclasses.asdict(peak) if peak else None,
                                               "fp32_matmul": fp32_matmul, "note": note},
              "rows": rows}  # fmt: skip
    print(markdown(result))
    errors = check_result(result, peak)
    for error in errors:
        print(f"train_memory.py: refusing to write the results: {error}", file=sys.stderr)
    if errors:
        return 1
    write_result(result, "train_memory", args.device, args.dtype, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
