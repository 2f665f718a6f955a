"""Time of a causal LM's head + loss, forward + backward: eager (Hugging Face's: logits = h W^T in the
model's dtype, upcast, F.cross_entropy), invact.loss.linear_cross_entropy (patch(loss=True)'s), and
torch's own F.linear_cross_entropy with LinearCrossEntropyOptions (chunked; not taken by invact: it has
no softcapping, its scalar reductions keep gradient buffers the head weight's size between forward and
backward, and its reduction="none" returns 16-bit per-row losses for 16-bit inputs).

Shapes (tokens, hidden, vocab): a tiny Llama's head with Llama 3's vocabulary, a wider one, and a
Gemma-2-style head (vocabulary 256000, final softcapping 30). Every variant runs once per round, in
turn (drift hits all), 10% of the targets ignored (-100); each figure is the median over rounds.
Also per variant, once: the bytes its forward leaves allocated for the backward. Beside each time:
GFLOP/s of its matmuls (eager and invact 6 N H V: three products each) against a
reference measured in the same run, the FLOPs of one (N x H) x (H x V) matmul in blocks of 2048
columns (REFERENCE_COLUMNS) in that dtype: a variant's matmul rate well above the reference would be
a measurement error. Writes benchmarks/results/loss_time_<device>.json, and its markdown table to
.md beside it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from invact.loss import linear_cross_entropy

from timing import device_name, wall_ms, write_result

SOFTCAP = (("div", 30.0), ("tanh",), ("mul", 30.0))
# The reference's block: (tokens x 2048) outputs stay in cache, so it measures the matmul, not the
# writing of a (tokens x vocab) result (one whole-logits matmul ran at 128 GFLOP/s where blocks of
# the same FLOPs ran faster: 2 cores of an AMD EPYC Zen 4, fp32, 2048 x 256 x 128256).
REFERENCE_COLUMNS = 2048
# (label, tokens, hidden, vocab, ops, whether torch's default options run: measured 17.1x (fp32) and
# 60.7x (bf16) eager's time on the first shape, 2 cores of an AMD EPYC Zen 4, they would take most of
# the run on the others: their aspect-ratio chunking gives 0-4 rows a chunk at these widths)
SHAPES = [
    ("Llama-3 vocabulary, hidden 128", 512, 128, 128256, (), True),
    ("Llama-3 vocabulary, hidden 256", 2048, 256, 128256, (), False),
    ("Gemma-2 vocabulary + softcap, hidden 128", 512, 128, 256000, SOFTCAP, False),
    ("SmolLM vocabulary, hidden 512", 2048, 512, 49152, (), False),
]
SMALL = [("small", 64, 32, 3000, (), True), ("small softcap", 64, 32, 3000, SOFTCAP, False)]


def _eager(h, w, t, ops):
    z = F.linear(h, w)
    for op in ops:  # in the model's dtype, as Gemma 2's forward does
        z = z * op[1] if op[0] == "mul" else z / op[1] if op[0] == "div" else torch.tanh(z)
    return F.cross_entropy(z.float(), t)


def _variants(ops, torch_default: bool) -> dict:
    variants = {
        "eager": lambda h, w, t: _eager(h, w, t, ops),
        "invact": lambda h, w, t: linear_cross_entropy(h, w, t, ops=ops),
    }
    options = getattr(torch.nn, "LinearCrossEntropyOptions", None)
    if not ops and options is not None and torch_default:  # torch's has no softcapping
        variants["torch chunked (default options)"] = lambda h, w, t: F.linear_cross_entropy(
            h, w, t, options=options()
        )
    if not ops and options is not None:
        variants["torch chunked (batch_chunk_size=128)"] = lambda h, w, t: F.linear_cross_entropy(
            h, w, t, options=options(batch_chunk_size=128, chunking_method=None)
        )
    return variants


def _inputs(tokens, hidden, vocab, dtype, device):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, hidden, generator=g).to(device, dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) * hidden**-0.5).to(device, dtype).requires_grad_()
    t = torch.randint(0, vocab, (tokens,), generator=g)
    t[torch.rand(tokens, generator=g) < 0.1] = -100
    return h, w, t.to(device)


def _held_after_forward(fn, h, w, t) -> int:
    """Bytes a forward allocates and has not freed when it returns (CPU: the profiler's net memory,
    self_cpu_memory_usage summed; CUDA: torch.cuda.memory_allocated after against before): what the
    variant holds for its backward, saved tensors or not (a gradient buffer kept on the autograd
    context counts too), plus the loss itself."""
    from torch.profiler import ProfilerActivity, profile

    if h.is_cuda:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        loss = fn(h, w, t)
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - before
        del loss
        return held

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss = fn(h, w, t)
    del loss
    return sum(e.self_cpu_memory_usage for e in prof.events())


def measure(label, tokens, hidden, vocab, ops, torch_default, dtype, device, rounds) -> dict:
    h, w, t = _inputs(tokens, hidden, vocab, dtype, device)
    variants = _variants(ops, torch_default)

    def step(fn):
        h.grad = w.grad = None
        fn(h, w, t).backward()

    def reference():  # the same FLOPs as one logits matmul, 2048 columns at a time into one buffer
        with torch.no_grad():
            out = torch.empty(tokens, REFERENCE_COLUMNS, dtype=dtype, device=device)
            for start in range(0, vocab - REFERENCE_COLUMNS + 1, REFERENCE_COLUMNS):
                torch.mm(h, w[start : start + REFERENCE_COLUMNS].t(), out=out)

    held = {name: _held_after_forward(fn, h, w, t) for name, fn in variants.items()}
    times = {name: [] for name in (*variants, "reference matmul")}
    losses = {name: fn(h, w, t).item() for name, fn in variants.items()}  # also a warm-up
    for _ in range(rounds):
        for name, fn in variants.items():
            times[name].append(wall_ms(lambda fn=fn: step(fn), 1, device))
        times["reference matmul"].append(wall_ms(reference, 1, device))
    ms = {k: statistics.median(v) for k, v in times.items()}
    matmul = 2 * tokens * hidden * vocab
    blocks = vocab // REFERENCE_COLUMNS
    flops = {"reference matmul": 2 * tokens * hidden * REFERENCE_COLUMNS * blocks, "eager": 3 * matmul,
             "invact": 3 * matmul}  # fmt: skip
    rows = {}
    for name, m in ms.items():
        f = flops.get(name, 3 * matmul)  # torch's chunked: at least eager's three matmuls
        rows[name] = {"ms": m, "gflops": f / m / 1e6, "ratio_to_eager": m / ms["eager"]}
        if name in losses:
            rows[name]["loss"] = losses[name]
            rows[name]["held_after_forward_bytes"] = held[name]
    return {"label": label, "tokens": tokens, "hidden": hidden, "vocab": vocab, "ops": [list(o) for o in ops],
            "dtype": str(dtype).removeprefix("torch."), "variants": rows}  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7, help="rounds of every variant (default 7)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--small", action="store_true", help="small shapes (a check that it runs)")
    parser.add_argument("--only", default=None, help="the shapes whose label contains this text")
    parser.add_argument("--out", type=Path, default=None, help="the JSON file (default: results/)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    shapes = [s for s in (SMALL if args.small else SHAPES) if args.only is None or args.only in s[0]]
    if not shapes:
        parser.error(f"--only {args.only!r}: no shape's label contains it")
    for shape in shapes:
        for dtype in (torch.float32, torch.bfloat16):
            rows.append(measure(*shape, dtype, device, args.rounds))
            r = rows[-1]
            print(f"{r['label']}, {r['dtype']}: " + ", ".join(
                f"{k} {v['ms']:.1f} ms ({v['ratio_to_eager']:.2f}x)" for k, v in r["variants"].items()
            ), flush=True)  # fmt: skip
    result = {
        "device": device_name(device),
        "torch": torch.__version__,
        "rounds": args.rounds,
        "rows": rows,
    }
    print()
    print(table(result))
    path = write_result(result, "loss_time", device, out=args.out)
    path.with_suffix(".md").write_text(table(result) + "\n")  # the table the docs include
    return 0


def table(result: dict) -> str:
    """The markdown table of a result: one row per shape and dtype, time and ratio to eager per variant."""
    names = list(dict.fromkeys(k for r in result["rows"] for k in r["variants"] if k != "reference matmul"))
    lines = [
        f"Head + loss, forward + backward, {result['device']}, torch {result['torch']}, median of "
        f"{result['rounds']} rounds (ms; x eager; GFLOP/s of the matmuls; reference: one logits matmul's "
        f"FLOPs in {REFERENCE_COLUMNS}-column blocks)",
        "",
        "| shape (tokens x hidden x vocab) | dtype | " + " | ".join(names) + " | reference matmul |",
        "|---" * (len(names) + 3) + "|",
    ]
    for r in result["rows"]:
        v = r["variants"]
        cells = [
            f"{v[n]['ms']:.0f} ({v[n]['ratio_to_eager']:.2f}x; {v[n]['gflops']:.0f})" if n in v else "n/a"
            for n in names
        ]
        ref = v["reference matmul"]
        shape = f"{r['label']}: {r['tokens']} x {r['hidden']} x {r['vocab']}"
        held = ", ".join(f"{n} {v[n]['held_after_forward_bytes'] / 2**20:.1f}" for n in names if n in v)
        shape += f" (held after forward, MiB: {held})"
        lines.append(
            f"| {shape} | {r['dtype']} | " + " | ".join(cells) + f" | {ref['ms']:.0f} ({ref['gflops']:.0f}) |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
