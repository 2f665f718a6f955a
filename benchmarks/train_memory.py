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
"""

from __future__ import annotations

import argparse
import gc
import sys
from collections.abc import Callable
from pathlib import Path

import torch
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


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def training_step(model: nn.Module, inputs: dict, optimizer: torch.optim.Optimizer, device: str) -> dict:
    """One step; bytes saved by its forward and, on CUDA, the allocator's peak over it and the memory
    held before it (parameters, optimizer state, inputs)."""
    _sync(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    resting = torch.cuda.memory_allocated() if device == "cuda" else None
    with count_saved(model) as counter:
        loss = model(**inputs).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    _sync(device)
    return {
        "loss": loss.item(),
        "saved_bytes": counter.report.saved_bytes,
        "peak_bytes": torch.cuda.max_memory_allocated() if device == "cuda" else None,
        "resting_bytes": resting,
    }


def measure(name: str, small: bool, device: str, dtype: torch.dtype, mode: str) -> dict:
    what, build = MODELS[name]
    torch.manual_seed(0)
    with torch.device(device):  # parameters initialized where they live (fast on a GPU)
        model, (batch, seq) = build(small)
    if small:
        batch, seq, what = 2, 32, f"tiny {what}"
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
    return "\n".join(lines)


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

    result = {"device": device_name(args.device), "torch": torch.__version__,
              "transformers": transformers.__version__, "dtype": args.dtype, "mode": args.mode,
              "small": args.small, "rows": rows}  # fmt: skip
    print(markdown(result))
    write_result(result, "train_memory", args.device, args.dtype, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
