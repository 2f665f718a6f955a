"""Peak memory of a whole CPU training step (forward with labels, the loss, backward, AdamW) of a
causal LM with a real vocabulary, torch eager against invact.patch(loss=False) and invact.patch()
(the loss computed from hidden states, invact.loss): does the loss's fp32 (tokens x vocab) tensor
leave the step's peak, not only the saved bytes?

The models (transformers, random weights from a config, nothing downloaded; --model): "llama", a
Llama-style decoder, 2 layers, hidden 128, SwiGLU 352, vocabulary 128256 (Llama 3's), untied head;
"gpt2", GPT-2's head and loss (its loss_type is None), 2 layers of 128, vocabulary 50257; "qwen2-vl",
a Qwen2-VL with one 56 x 56 image (2 vision layers of 64, 4 image tokens) and 2 text layers of 128,
vocabulary 151936; "wide", the Llama-style decoder at hidden 512 (SwiGLU 1408) and vocabulary 49152,
the width at which the loss's CPU time is judged, at seq 1024. Each step is also timed (median ms).
Batch 2 x seq 256
(Qwen2-VL: 1 x 512, the image among the tokens), in
fp32 and bf16. Each variant runs in a process of its own, so that nothing one leaves behind counts
against another, with glibc's mmap threshold at 64 KiB (MALLOC_MMAP_THRESHOLD_): every tensor above it
is mapped and unmapped on free, so the resident set follows what torch holds instead of what the heap
kept. That threshold makes every such allocation fresh pages (a page fault per 4 KiB on first touch),
which taxes code that allocates many mid-size tensors (the patched loss's passes: 1.03x compile alone's
bf16 wide step under it, 0.87x under glibc's default, measured one after the other on a 2-core Xeon);
`--allocator default` runs the children with glibc's own thresholds, for step times as users see
them (the peaks then read the heap's resident set, less exactly). A first step creates the gradients
and AdamW's state; then, per measured step, the gradients are
set to None, the kernel's peak resident set (VmHWM) is reset (writing 5 to /proc/self/clear_refs),
the step runs, and its peak above the resident set before it is the figure (median of the steps).
With --compile both sides run under torch.compile (inductor), the first step compiling. Linux only.
Writes benchmarks/results/step_peak_<device>[_<model>][_compiled].json (Llama eager: no suffix), and
its markdown table to .md beside it.
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
import time
from pathlib import Path

import torch

from timing import RESULTS, device_name, write_result

VARIANTS = {"eager": None, "patch(loss=False)": {"loss": False}, "patch()": {}}
# --kinds: patch() of one op kind at a time (the others left out), for what each does under --compile
KIND_VARIANTS = {"eager": None, "activation + gated MLP": dict(gated=True, norms=False, loss=False),
                 "norm": dict(exclude="*", gated=False, norms=True, loss=False),
                 "loss": dict(exclude="*", gated=False, norms=False, loss=True),
                 "patch(norms=False)": dict(norms=False), "patch()": {}}  # fmt: skip
MODEL = dict(hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=128256, tie_word_embeddings=False)  # fmt: skip
SMALL = MODEL | dict(hidden_size=32, intermediate_size=64, vocab_size=8000)
# "wide": hidden 512, vocabulary 49152 (SmolLM's), the width at which the loss's time is judged on a CPU
WIDE = MODEL | dict(hidden_size=512, intermediate_size=1408, num_attention_heads=8, num_key_value_heads=4,
                    vocab_size=49152)  # fmt: skip
BATCH, SEQ = 2, 256
WIDE_SEQ = 1024  # "wide": 2048 tokens a step, where the loss's tensors, not the gradients, make the peak
MMAP_THRESHOLD = 64 * 1024


def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1)) * 1024


def _vocab(name: str, small: bool) -> int:
    if small and name in ("llama", "wide"):
        return SMALL["vocab_size"]
    return {"llama": MODEL["vocab_size"], "wide": WIDE["vocab_size"], "gpt2": 50257, "qwen2-vl": 151936}[name]


def _model(name: str, small: bool):
    """(the model, its training inputs with labels) of --model `name`, fp32."""
    import transformers as T

    g = torch.Generator().manual_seed(1)
    vocab = _vocab(name, small)
    if name in ("llama", "wide"):
        model = T.LlamaForCausalLM(T.LlamaConfig(**(SMALL if small else WIDE if name == "wide" else MODEL)))
    elif name == "gpt2":
        width = 32 if small else 128
        model = T.GPT2LMHeadModel(
            T.GPT2Config(n_embd=width, n_layer=2, n_head=4, n_positions=SEQ, vocab_size=vocab)
        )
    else:  # one 56 x 56 image: 4 x 4 patches of 14, merged 2 x 2 into 4 tokens
        width = 32 if small else 128
        sections = [1, 1, 2] if small else [4, 6, 6]  # temporal, height, width: half the head size of 8 or 32
        config = T.Qwen2VLConfig(
            text_config=dict(hidden_size=width, intermediate_size=2 * width, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
                             rope_scaling={"type": "mrope", "mrope_section": sections}),
            vision_config=dict(depth=2, embed_dim=32, hidden_size=width, num_heads=4, mlp_ratio=2,
                               patch_size=14, spatial_merge_size=2, temporal_patch_size=2),
            image_token_id=151655, vision_start_token_id=151652, video_token_id=151656,
        )  # fmt: skip
        model = T.Qwen2VLForConditionalGeneration(config)
        ids = torch.randint(0, 1000, (1, BATCH * SEQ), generator=g)
        ids[0, 0], ids[0, 1:5] = config.vision_start_token_id, config.image_token_id
        pixels = torch.randn(16, 3 * 2 * 14 * 14, generator=g)
        grid, types = torch.tensor([[1, 4, 4]]), (ids == config.image_token_id).long()
        return model, dict(
            input_ids=ids, labels=ids, pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=types
        )
    ids = torch.randint(0, vocab, (BATCH, WIDE_SEQ if name == "wide" and not small else SEQ), generator=g)
    return model, dict(input_ids=ids, labels=ids)


def _child(
    variant: str, dtype: str, small: bool, steps: int, name: str = "llama", compiled: bool = False
) -> dict:
    import transformers

    import invact

    transformers.utils.logging.set_verbosity_error()
    torch.manual_seed(0)
    model, inputs = _model(name, small)
    model = model.to(getattr(torch, dtype)).train()
    if "pixel_values" in inputs:
        inputs["pixel_values"] = inputs["pixel_values"].to(getattr(torch, dtype))
    options = (VARIANTS | KIND_VARIANTS)[variant]
    if options is not None:
        invact.patch(model, **options)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    run = torch.compile(model) if compiled else model

    def step() -> float:
        loss = run(**inputs).loss
        loss.backward()
        optimizer.step()
        return loss.item()

    losses = [step()]  # creates the gradients and AdamW's state
    peaks, times = [], []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        gc.collect()
        before = _kib("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current resident set
        start = time.perf_counter()
        losses.append(step())
        times.append((time.perf_counter() - start) * 1e3)
        peaks.append(_kib("VmHWM") - before)
    with invact.memory.count_saved(model) as counter:
        model(**inputs)
    return {"peak_bytes": statistics.median(peaks), "peaks": peaks, "losses": losses,
            "saved_bytes": counter.report.saved_bytes, "ms": statistics.median(times), "step_ms": times,
            "threads": torch.get_num_threads()}  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="measured steps per variant (default 5)")
    parser.add_argument("--small", action="store_true", help="a small model (a check that it runs)")
    parser.add_argument("--out", type=Path, default=None, help="the JSON file (default: results/)")
    parser.add_argument("--model", choices=("llama", "wide", "gpt2", "qwen2-vl"), default="llama",
                        help="the model (default llama; see above)")  # fmt: skip
    parser.add_argument("--compile", action="store_true", help="both sides under torch.compile")
    what = "patch() of one op kind at a time (activation + gated MLP; norm; loss) and of all"
    parser.add_argument("--kinds", action="store_true", help=what)
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS | KIND_VARIANTS), metavar="VARIANT",
                        help="these variants only (of --kinds' and the default's; written without the "
                        "markdown table where eager or patch() is not among them)")  # fmt: skip
    parser.add_argument("--allocator", choices=("peak", "default"), default="peak",
                        help="peak: glibc's mmap threshold at 64 KiB, the resident set follows "
                        "torch (the default); default: glibc's own, times as users see them")  # fmt: skip
    dtypes = ["float32", "bfloat16"]
    parser.add_argument("--dtypes", nargs="+", choices=dtypes, default=dtypes, help="dtypes (default both)")
    parser.add_argument("--child", nargs=2, metavar=("VARIANT", "DTYPE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_child(*args.child, args.small, args.steps, args.model, args.compile)))
        return 0
    config = SMALL if args.small else WIDE if args.model == "wide" else MODEL
    threshold = MMAP_THRESHOLD if args.allocator == "peak" else None
    env = os.environ | ({"MALLOC_MMAP_THRESHOLD_": str(threshold)} if threshold else {})
    rows = []
    flags = (
        ["--model", args.model]
        + (["--small"] if args.small else [])
        + (["--compile"] if args.compile else [])
    )
    for dtype in args.dtypes:
        row = {"dtype": dtype, "variants": {}}
        for variant in args.variants or (KIND_VARIANTS if args.kinds else VARIANTS):
            command = [sys.executable, __file__, "--child", variant, dtype, "--steps", str(args.steps)]
            done = subprocess.run(command + flags, env=env, capture_output=True, text=True, check=True)
            row["variants"][variant] = json.loads(done.stdout.strip().splitlines()[-1])
            print(dtype, variant, row["variants"][variant]["peak_bytes"] / 2**20, "MiB", flush=True)
        rows.append(row)
    seq = WIDE_SEQ if args.model == "wide" and not args.small else SEQ
    tokens = BATCH * seq
    result = {
        "device": device_name("cpu"),
        "torch": torch.__version__,
        "model": config if args.model in ("llama", "wide") else args.model,
        "name": args.model,
        "compiled": args.compile,
        "batch": BATCH,
        "seq": seq,
        "fp32_logits_bytes": tokens * _vocab(args.model, args.small) * 4,
        "mmap_threshold": threshold,
        "rows": rows,
    }
    if {"eager", "patch()"} <= set(rows[0]["variants"]):
        print()
        print(table(result))
    suffix = ("" if args.model == "llama" else f"_{args.model}") + ("_compiled" if args.compile else "")
    suffix += "_kinds" if args.kinds else ""
    path = write_result(result, "step_peak", "cpu", out=args.out or RESULTS / f"step_peak_cpu{suffix}.json")
    if {"eager", "patch()"} <= set(rows[0]["variants"]):
        path.with_suffix(".md").write_text(table(result) + "\n")  # the table the docs include
    return 0


def _which(result: dict) -> str:
    """The model and mode where they are not the original run's (Llama, eager): "gpt2 compiled, "."""
    name = result.get("name") or (result["model"] if isinstance(result["model"], str) else "llama")
    compiled = result.get("compiled", False)
    return "" if name == "llama" and not compiled else f"{name}{' compiled' if compiled else ''}, "


def table(result: dict) -> str:
    mib = 2**20
    names = list(result["rows"][0]["variants"])
    lines = [
        "Peak of a whole training step above the resident set before it (MiB; median of steps), "
        + _which(result)
        + f"{result['device']}, torch {result['torch']}; one fp32 (tokens x vocab) tensor = "
        f"{result['fp32_logits_bytes'] / mib:.1f} MiB",
        "",
        "| dtype | " + " | ".join(names) + " | eager - patch() | saved for backward: eager -> patch() |",
        "|---" * (len(names) + 3) + "|",
    ]
    for r in result["rows"]:
        v = r["variants"]
        drop = (v["eager"]["peak_bytes"] - v["patch()"]["peak_bytes"]) / mib
        saved = f"{v['eager']['saved_bytes'] / mib:.1f} -> {v['patch()']['saved_bytes'] / mib:.1f}"
        cells = " | ".join(f"{v[n]['peak_bytes'] / mib:.1f}" for n in names)
        lines.append(f"| {r['dtype']} | {cells} | {drop:.1f} | {saved} |")
    if all("ms" in v for r in result["rows"] for v in r["variants"].values()):  # runs that timed steps
        threads = result["rows"][0]["variants"]["eager"].get("threads")
        lines += ["", f"Median step ms ({threads} threads)", "",
                  "| dtype | " + " | ".join(names) + " | patch() / eager |",
                  "|---" * (len(names) + 2) + "|"]  # fmt: skip
        for r in result["rows"]:
            v = r["variants"]
            cells = " | ".join(f"{v[n]['ms']:.1f}" for n in names)
            lines.append(f"| {r['dtype']} | {cells} | {v['patch()']['ms'] / v['eager']['ms']:.3f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
