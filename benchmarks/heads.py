"""A causal LM's loss head side by side, forward + backward (gradients of the hidden state and the head's
weight): time, peak memory, matmul FLOP/s against this machine's measured matmul peak, and each head's
loss and gradients against eager's.

Heads:
- eager: `F.cross_entropy(F.linear(h, W).float(), y)`, as transformers' causal-LM loss computes it (logits
  in the model's dtype, upcast to fp32, mean over the targets that are not -100);
- invact: `invact.loss.linear_cross_entropy` (what patch(loss=True) runs): chunks of rows, gradients
  computed in the forward, three matmuls in all (no recomputation);
- trl: `trl.kernels.chunked_logprob.ChunkedLogProbFunction` as TRL's SFTTrainer calls it by default
  (`add_fused_lm_head(outputs=("log_probs", "entropy", "is_top1"))`, vocabulary tiles of
  trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE, temperature 1, no softcap; off Triton devices every
  position is scored with its label clamped to 0 and masked after), loss = -sum(log p) / valid tokens.
  Its backward recomputes each logits tile: four matmuls in all; on CPU it upcasts 16-bit tiles to fp32
  for the gradient matmuls (_addmm_fp32);
- torch: `F.linear_cross_entropy` (torch >= 2.13) with `LinearCrossEntropyOptions(batch_chunk_size=1024,
  chunking_method=None)`; `options=None` is the reference path (the whole logits), and the default
  options' "auto" chunking took 10.8x eager's time here (2048 x 256 x 32768, fp32: 30.6 s against 2.8 s),
  too long for the full shapes. Its loss has the input's dtype (a bf16 loss for bf16 inputs);
- liger: Liger-Kernel's fused linear cross-entropy is Triton kernels only: not run on a CPU (recorded).

Every timed head runs once per round, in turn with a matmul reference (load on the shared machine hits
them alike); each time is the minimum over rounds after one warm-up step (which also gives the loss and
gradients compared with eager's). Peak memory: one more step under torch's profiler (profile_memory),
the largest running sum of the CPU allocator's allocations and frees during forward + backward, above
what was alive before (step_plan.profiled_peak; it sees kernel workspaces, which a dispatch mode does
not), gradients of h and W included.

Physics: each head's matmul FLOPs (forward 2 N H V, backward 4 N H V, plus 2 N H V where it recomputes the
logits: TRL), cross-checked against the matmuls counted on a small shape (MatmulFlops), divided by
its time, against the peak torch.mm reaches on this machine in the same run (the three matmul forms of a
head, N x H by H x C, N x C by C x H and C x N by N x H, C = REFERENCE_COLUMNS, the fastest block of each
over every round, each block timed REFERENCE_REPEATS times a round). For a 16-bit dtype the bound
is the larger of that dtype's and fp32's peak (TRL's CPU path runs its gradient matmuls in fp32). A
figure above the bound is a measurement bug: the run says so, and without --quick exits 1.

Writes benchmarks/results/heads_cpu.json (--out) and its markdown table to heads_cpu.md beside it.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import shlex
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from invact.loss import linear_cross_entropy

from timing import RESULTS, cpu_model, version, write_result

MIB = 2**20
# (label, tokens, hidden, vocab). Two released models' vocabularies at a batch's worth of tokens; the
# hidden sizes are narrower than the models with these vocabularies have (Qwen2.5-0.5B 896 with 151936,
# SmolLM2-135M 576 with 49152), so that one eager step takes seconds, not tens of seconds, on 2 shared
# cores: measured here 37 GFLOP/s for an eager fp32 step (2048 x 256 x 32768). The heads' difference is
# in what they do with the N x V logits, which these shapes keep (the logits are 4.8-6x the weight's).
SHAPES = [
    ("Qwen2/2.5/3 vocabulary", 2048, 256, 151936),
    ("SmolLM vocabulary", 4096, 512, 49152),
]
# bf16 is not in the full run: this AVX2 CPU has no bf16 arithmetic and torch's bf16 mm ran at 0.8-17
# GFLOP/s here against 100-180 for fp32, so one bf16 eager step of the first shape takes minutes
DTYPES = ("float32",)
QUICK_SHAPES = [("quick", 64, 32, 3000)]
QUICK_DTYPES = ("float32", "bfloat16")
REFERENCE_COLUMNS = 4096  # TRL's tiles are 32768 columns wide, invact's chunks whole rows: a middle width
REFERENCE_BLOCKS = 4  # blocks of each matmul form per round, each timed REFERENCE_REPEATS times
REFERENCE_REPEATS = 2
IGNORED = 0.1  # the fraction of targets that are -100
HEADS = ("eager", "invact", "trl", "torch", "liger")
LIGER_NOTE = "not run: needs CUDA/Triton (Liger-Kernel's fused linear cross-entropy is Triton kernels only)"
# matmul FLOPs per N H V: forward 2, backward 4 (d h and d W), and TRL's backward recomputes the logits (2)
EXPECTED_FLOPS = {"eager": 6, "invact": 6, "trl": 8, "torch": 6}


def _eager(h, w, y):
    return F.cross_entropy(F.linear(h, w).float(), y)


def _invact(h, w, y):
    return linear_cross_entropy(h, w, y)


def _trl_chunk() -> int:
    try:
        from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE
    except ImportError:
        return 32768
    return _CHUNKED_LOGPROB_CHUNK_SIZE


def _trl(h, w, y):
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction

    mask = y != -100
    per_token = ChunkedLogProbFunction.apply(
        h, w, None, y.clamp(min=0), 1.0, _trl_chunk(), None, 1.0, ("log_probs", "entropy", "is_top1")
    )
    log_probs = per_token[0].masked_fill(~mask, 0)
    return -log_probs.sum() / mask.sum().clamp(min=1)


def _torch(h, w, y):
    options = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=1024, chunking_method=None)
    return F.linear_cross_entropy(h, w, y, options=options)


def heads() -> dict:
    """{name: fn(h, w, y) -> loss} of the heads that run here, and {name: why not} of the others."""
    run, skipped = {"eager": _eager, "invact": _invact}, {}
    try:
        import trl.kernels.chunked_logprob  # noqa: F401

        run["trl"] = _trl
    except ImportError as e:
        skipped["trl"] = f"not run: {e}"
    if hasattr(F, "linear_cross_entropy") and hasattr(torch.nn, "LinearCrossEntropyOptions"):
        run["torch"] = _torch
    else:
        skipped["torch"] = f"not run: torch {torch.__version__} has no F.linear_cross_entropy"
    skipped["liger"] = LIGER_NOTE
    return run, skipped


def _inputs(tokens, hidden, vocab, dtype):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, hidden, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) * hidden**-0.5).to(dtype).requires_grad_()
    y = torch.randint(0, vocab, (tokens,), generator=g)
    y[torch.rand(tokens, generator=g) < IGNORED] = -100
    return h, w, y


def _step(fn, h, w, y) -> torch.Tensor:
    h.grad = w.grad = None
    loss = fn(h, w, y)
    loss.backward()
    return loss.detach()


class MatmulFlops(TorchDispatchMode):
    """Counts the FLOPs of every matmul (aten mm and addmm, out= and in-place forms included: TRL's
    `addmm_`, which FlopCounterMode leaves out) run while it is active. A Python custom op (torch's
    F.linear_cross_entropy is one: opaque to a dispatch mode) runs its Python function under the mode, so
    the matmuls inside it are counted too."""

    _MM = {"aten::mm", "aten::addmm", "aten::addmm_"}

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch._library.custom_ops import OPDEFS

        kwargs = kwargs or {}
        custom = OPDEFS.get(func._schema.name)
        if custom is not None:
            with self:
                return custom._init_fn(*args, **kwargs)
        if func._schema.name in self._MM:
            a, b = (args[0], args[1]) if func._schema.name == "aten::mm" else (args[1], args[2])
            self.flops += 2 * a.shape[0] * a.shape[1] * b.shape[1]
        return func(*args, **kwargs)


def counted_flops() -> dict:
    """{head: matmul FLOPs of a forward + backward per N H V}, counted (MatmulFlops) on a small fp32 shape."""
    tokens, hidden, vocab = 48, 16, 1000
    h, w, y = _inputs(tokens, hidden, vocab, torch.float32)
    out = {}
    for name, fn in heads()[0].items():
        with MatmulFlops() as counter:
            _step(fn, h, w, y)
        out[name] = counter.flops / (tokens * hidden * vocab)
    return out


def _errors(got: torch.Tensor, ref: torch.Tensor) -> dict:
    got, ref = got.double(), ref.double()
    abs_err = (got - ref).abs().max().item()
    scale = ref.abs().max().item()
    return {"max_abs": abs_err, "max_rel": abs_err / scale if scale else abs_err}


def _reference_forms(h, w):
    """The three matmul forms of a head, C = REFERENCE_COLUMNS: (flops, fn) per form."""
    n, hidden = h.shape
    c = min(REFERENCE_COLUMNS, w.shape[0])
    hd, wd = h.detach(), w.detach()
    d = torch.randn(n, c, dtype=h.dtype)
    out_f, out_h, out_w = (
        torch.empty(n, c, dtype=h.dtype),
        torch.empty_like(hd),
        torch.empty(c, hidden, dtype=h.dtype),
    )
    blocks = [wd[i * c : (i + 1) * c] for i in range(min(REFERENCE_BLOCKS, w.shape[0] // c))]
    flops = 2 * n * hidden * c
    return {
        "forward (N x H) x (H x C)": (flops, [lambda b=b: torch.mm(hd, b.t(), out=out_f) for b in blocks]),
        "d h (N x C) x (C x H)": (flops, [lambda b=b: torch.mm(d, b, out=out_h) for b in blocks]),
        "d W (C x N) x (N x H)": (flops, [lambda: torch.mm(d.t(), hd, out=out_w) for _ in blocks]),
    }


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def measure(label, tokens, hidden, vocab, dtype_name, rounds, flops_per) -> dict:
    dtype = getattr(torch, dtype_name)
    h, w, y = _inputs(tokens, hidden, vocab, dtype)
    run, skipped = heads()
    forms = _reference_forms(h, w)
    say = lambda text: print(f"  {label} {dtype_name}: {text}", file=sys.stderr, flush=True)  # noqa: E731

    # warm-up step of each head: its loss and gradients, compared with eager's
    results = {}
    for name, fn in run.items():
        t0 = time.perf_counter()
        loss = _step(fn, h, w, y)
        results[name] = {"loss": loss.float().item(), "grads": (h.grad.clone(), w.grad.clone())}
        say(f"warm-up {name} {time.perf_counter() - t0:.1f} s, loss {loss.item():.6f}")
    ref_loss, ref_dh, ref_dw = results["eager"]["loss"], *results["eager"]["grads"]
    for r in results.values():
        dh, dw = r.pop("grads")
        loss_err = abs(r["loss"] - ref_loss)
        r["errors"] = {
            "loss": {"max_abs": loss_err, "max_rel": loss_err / abs(ref_loss)},
            "grad_hidden": _errors(dh, ref_dh),
            "grad_weight": _errors(dw, ref_dw),
        }
    del ref_dh, ref_dw, dh, dw
    h.grad = w.grad = None

    times = {name: [] for name in run}
    block_ms = {form: [] for form in forms}
    for i in range(rounds):
        for name, fn in run.items():
            gc.collect()
            times[name].append(_time(lambda fn=fn: _step(fn, h, w, y)))
        for form, (_, fns) in forms.items():
            block_ms[form].extend(_time(f) for f in fns for _ in range(REFERENCE_REPEATS))
        say(f"round {i + 1}/{rounds}: " + ", ".join(f"{n} {t[-1]:.0f} ms" for n, t in times.items()))

    from step_plan import profiled_peak

    for name, fn in run.items():
        h.grad = w.grad = None
        peak = profiled_peak(lambda fn=fn: _step(fn, h, w, y))
        results[name]["peak_bytes"] = peak["peak"]
        results[name]["peak_mib"] = peak["peak"] / MIB
        say(f"peak {name} {peak['peak'] / MIB:.1f} MiB")
    h.grad = w.grad = None

    reference = {form: flops / min(block_ms[form]) / 1e6 for form, (flops, _) in forms.items()}
    nhv = tokens * hidden * vocab
    for name, r in results.items():
        ms = min(times[name])
        r["ms"] = ms
        r["times_ms"] = times[name]
        r["flops"] = EXPECTED_FLOPS[name] * nhv
        r["flops_counted_per_nhv"] = flops_per.get(name)
        r["gflops"] = r["flops"] / ms / 1e6
    for r in results.values():
        r["ratio_ms"] = r["ms"] / results["eager"]["ms"]
        r["ratio_mib"] = r["peak_bytes"] / results["eager"]["peak_bytes"]
    return {
        "label": label,
        "tokens": tokens,
        "hidden": hidden,
        "vocab": vocab,
        "dtype": dtype_name,
        "logits_mib": tokens * vocab * dtype.itemsize / MIB,
        "weight_mib": vocab * hidden * dtype.itemsize / MIB,
        "mm_gflops": reference,
        "heads": results,
        "skipped": skipped,
    }


def peak_bound(result: dict, dtype: str) -> float:
    """The GFLOP/s no head may pass in `dtype`: the fastest matmul form measured in that dtype, or in fp32
    where that is faster (a 16-bit head may run matmuls in fp32), over the rows of the run."""
    rates = [
        g for r in result["rows"] if r["dtype"] in (dtype, "float32") for g in r["mm_gflops"].values()
    ]  # fmt: skip
    return max(rates)


def violations(result: dict) -> list[str]:
    """One line per timed figure whose matmul FLOP/s passes the measured peak (a measurement bug), and per
    head whose counted matmul FLOPs fall below the ones its figure assumes (a head that skipped work)."""
    errors = []
    for r in result["rows"]:
        bound = peak_bound(result, r["dtype"])
        for name, v in r["heads"].items():
            where = f"{r['label']} {r['dtype']} {name}"
            if v["gflops"] > bound:
                errors.append(f"{where}: {v['ms']:.1f} ms is {v['gflops']:.1f} GFLOP/s of matmuls, above the "
                              f"measured peak {bound:.1f}: a measurement bug")  # fmt: skip
            counted = v.get("flops_counted_per_nhv")
            if counted is not None and not math.isclose(counted, EXPECTED_FLOPS[name], rel_tol=0.01):
                errors.append(f"{where}: MatmulFlops counts {counted:.2f} N H V of matmuls, the figure "
                              f"assumes {EXPECTED_FLOPS[name]}")  # fmt: skip
    return errors


def table(result: dict) -> str:
    """The markdown of a result: a header (machine, versions, command), one table per shape and dtype."""
    m = result["machine"]
    lines = [
        f"Loss heads, forward + backward (gradients of the hidden states and the weight), {m['cpu']}.",
        "",
        f"Machine: {m['cpu']} ({m['isa']}), {m['threads']} torch threads, load average {m['load']} as the "
        f"run started. torch {result['versions']['torch']}, trl {result['versions']['trl']}, transformers "
        f"{result['versions']['transformers']}. Command: `{result['command']}`.",
        "",
        f"Time: minimum of {result['rounds']} interleaved rounds after a warm-up (ms). Memory: peak of the "
        "CPU allocator's bytes above those alive before, forward + backward, gradients included (torch "
        "profiler). GFLOP/s: the head's matmul FLOPs (6 N H V; TRL 8: its backward recomputes the logits) "
        "over its time, against the fastest torch.mm measured in the same run (mm peak). Errors: against "
        "eager, loss |difference| / |eager's|, gradients max |difference| / max |eager's|.",
        "",
    ]
    for r in result["rows"]:
        bound = peak_bound(result, r["dtype"])
        lines += [
            f"**{r['label']}: {r['tokens']} tokens x hidden {r['hidden']} x vocabulary {r['vocab']}, "
            f"{r['dtype']} (logits {r['logits_mib']:.0f} MiB, weight {r['weight_mib']:.0f} MiB)**",
            "",
            "| head | ms | x eager | MiB | x eager | GFLOP/s | of mm peak | loss err | grad h err | "
            "grad W err |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for name, v in r["heads"].items():
            e = v["errors"]
            lines.append(
                f"| {name} | {v['ms']:.0f} | {v['ratio_ms']:.2f} | {v['peak_mib']:.1f} | "
                f"{v['ratio_mib']:.3f} | {v['gflops']:.1f} | {v['gflops'] / bound:.2f} | "
                f"{e['loss']['max_rel']:.1e} | {e['grad_hidden']['max_rel']:.1e} | "
                f"{e['grad_weight']['max_rel']:.1e} |"
            )
        for name, why in r["skipped"].items():
            lines.append(f"| {name} | {why} | | | | | | | | |")
        forms = ", ".join(f"{form} {g:.1f}" for form, g in r["mm_gflops"].items())
        lines += ["", f"mm peak bound {bound:.1f} GFLOP/s (this row's torch.mm, GFLOP/s: {forms}).", ""]
    bad = result["physics_violations"]
    lines.append(
        "Physics check: " + ("; ".join(bad) if bad else "every figure is below the measured mm peak.")
    )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds of every head (default 3)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--quick", action="store_true", help="small shapes, fp32 and bf16 (a test)")
    parser.add_argument("--out", type=Path, default=RESULTS / "heads_cpu.json", help="the JSON file")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes, dtypes = (QUICK_SHAPES, QUICK_DTYPES) if args.quick else (SHAPES, DTYPES)
    flops_per = counted_flops()
    print(f"matmul FLOPs per N H V, counted: {flops_per}", file=sys.stderr, flush=True)
    rows = []
    load = os.getloadavg()[0]  # the machine's 1-minute load average as the run starts
    for label, tokens, hidden, vocab in shapes:
        for dtype in dtypes:
            print(f"{label}: {tokens} x {hidden} x {vocab}, {dtype}", file=sys.stderr, flush=True)
            rows.append(measure(label, tokens, hidden, vocab, dtype, args.rounds, flops_per))
    argv_text = sys.argv[1:] if argv is None else argv
    result = {
        "machine": {
            "cpu": cpu_model(),
            "isa": torch.backends.cpu.get_cpu_capability(),
            "threads": torch.get_num_threads(),
            "load": round(load, 2),
        },
        "versions": {name: version(name) for name in ("torch", "trl", "transformers")},
        "command": shlex.join(["python", "benchmarks/heads.py", *argv_text]),
        "rounds": args.rounds,
        "quick": args.quick,
        "expected_flops_per_nhv": EXPECTED_FLOPS,
        "rows": rows,
    }
    result["physics_violations"] = violations(result)
    text = table(result)
    print(text)
    path = write_result(result, "heads", "cpu", out=args.out)
    path.with_suffix(".md").write_text(text + "\n")
    for line in result["physics_violations"]:
        print(f"PHYSICS: {line}", file=sys.stderr)
    return 1 if result["physics_violations"] and not args.quick else 0


if __name__ == "__main__":
    sys.exit(main())
