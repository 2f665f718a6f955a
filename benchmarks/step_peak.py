"""Peak memory of a whole CPU training step (forward with labels, the loss, backward, AdamW) of a
causal LM with a real vocabulary, torch eager against invact.patch(loss=False) and invact.patch()
(the loss computed from hidden states, invact.loss): does the loss's fp32 (tokens x vocab) tensor
leave the step's peak, not only the saved bytes?

The model: a Llama-style decoder (transformers, random weights from a config, nothing downloaded),
2 layers, hidden 128, SwiGLU 352, vocabulary 128256 (Llama 3's), untied head, batch 2 x seq 256, in
fp32 and bf16. Each variant runs in a process of its own, so that nothing one leaves behind counts
against another, with glibc's mmap threshold at 64 KiB (MALLOC_MMAP_THRESHOLD_): every tensor above it
is mapped and unmapped on free, so the resident set follows what torch holds instead of what the heap
kept. A first step creates the gradients and AdamW's state; then, per measured step, the gradients are
set to None, the kernel's peak resident set (VmHWM) is reset (writing 5 to /proc/self/clear_refs),
the step runs, and its peak above the resident set before it is the figure (median of the steps).
Linux only. Writes benchmarks/results/step_peak_<device>.json, and its markdown table to .md beside
it.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from timing import device_name, write_result

VARIANTS = {"eager": None, "patch(loss=False)": {"loss": False}, "patch()": {}}
MODEL = dict(hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=128256, tie_word_embeddings=False)  # fmt: skip
SMALL = MODEL | dict(hidden_size=32, intermediate_size=64, vocab_size=8000)
BATCH, SEQ = 2, 256
MMAP_THRESHOLD = 64 * 1024


def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1)) * 1024


def _child(variant: str, dtype: str, small: bool, steps: int) -> dict:
    import transformers

    import invact

    transformers.utils.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**(SMALL if small else MODEL))
    model = transformers.LlamaForCausalLM(config).to(getattr(torch, dtype)).train()
    if VARIANTS[variant] is not None:
        invact.patch(model, **VARIANTS[variant])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=g)

    def step() -> float:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        return loss.item()

    losses = [step()]  # creates the gradients and AdamW's state
    peaks = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        gc.collect()
        before = _kib("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current resident set
        losses.append(step())
        peaks.append(_kib("VmHWM") - before)
    with invact.memory.count_saved(model) as counter:
        model(input_ids=ids, labels=ids)
    return {"peak_bytes": statistics.median(peaks), "peaks": peaks, "losses": losses,
            "saved_bytes": counter.report.saved_bytes}  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="measured steps per variant (default 5)")
    parser.add_argument("--small", action="store_true", help="a small model (a check that it runs)")
    parser.add_argument("--out", type=Path, default=None, help="the JSON file (default: results/)")
    parser.add_argument("--child", nargs=2, metavar=("VARIANT", "DTYPE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_child(*args.child, args.small, args.steps)))
        return 0
    config = SMALL if args.small else MODEL
    env = os.environ | {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)}
    rows = []
    for dtype in ("float32", "bfloat16"):
        row = {"dtype": dtype, "variants": {}}
        for variant in VARIANTS:
            command = [sys.executable, __file__, "--child", variant, dtype, "--steps", str(args.steps)]
            done = subprocess.run(command + (["--small"] if args.small else []), env=env, capture_output=True,
                                  text=True, check=True)  # fmt: skip
            row["variants"][variant] = json.loads(done.stdout.strip().splitlines()[-1])
            print(dtype, variant, row["variants"][variant]["peak_bytes"] / 2**20, "MiB", flush=True)
        rows.append(row)
    tokens = BATCH * SEQ
    result = {
        "device": device_name("cpu"),
        "torch": torch.__version__,
        "model": config,
        "batch": BATCH,
        "seq": SEQ,
        "fp32_logits_bytes": tokens * config["vocab_size"] * 4,
        "mmap_threshold": MMAP_THRESHOLD,
        "rows": rows,
    }
    print()
    print(table(result))
    path = write_result(result, "step_peak", "cpu", out=args.out)
    path.with_suffix(".md").write_text(table(result) + "\n")  # the table the docs include
    return 0


def table(result: dict) -> str:
    mib = 2**20
    lines = [
        f"Peak of a whole training step above the resident set before it (MiB; median of steps), "
        f"{result['device']}, torch {result['torch']}; one fp32 (tokens x vocab) tensor = "
        f"{result['fp32_logits_bytes'] / mib:.1f} MiB",
        "",
        "| dtype | " + " | ".join(VARIANTS) + " | eager - patch() | saved for backward: eager -> patch() |",
        "|---" * (len(VARIANTS) + 3) + "|",
    ]
    for r in result["rows"]:
        v = r["variants"]
        drop = (v["eager"]["peak_bytes"] - v["patch()"]["peak_bytes"]) / mib
        saved = f"{v['eager']['saved_bytes'] / mib:.1f} -> {v['patch()']['saved_bytes'] / mib:.1f}"
        cells = " | ".join(f"{v[n]['peak_bytes'] / mib:.1f}" for n in VARIANTS)
        lines.append(f"| {r['dtype']} | {cells} | {drop:.1f} | {saved} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
