"""The short GPU check (`make gpu-quick`): what decides whether a GPU user keeps
patch() on, in bf16, each figure side by side with torch in one process.

1. A Llama-3.1-8B-shaped decoder (hidden 4096, intermediate 14336, 32 heads, 8 KV heads, 2 layers,
   batch 1, seq 512, no head: forward + backward(dy) of the last hidden state): torch eager,
   patch(), torch.compile, torch.compile + patch(). Per variant: the synchronized wall clock per step
   (median of interleaved rounds) and the GPU's busy time per step (the profiler's device time: what
   the step costs when the host keeps up), with the TFLOP/s each implies against the datasheet.
2. A causal LM's head + loss at Llama-3.2-1B's shape (4096 tokens x hidden 2048 x vocabulary 128256):
   eager (Hugging Face's: bf16 logits, their fp32 copy, F.cross_entropy) against
   invact.loss.linear_cross_entropy (patch()'s), each also under torch.compile, forward + backward,
   beside its floor, the three (tokens x hidden x vocab) matmuls alone timed in the same rounds, with
   the bytes each forward leaves held.
3. Host microseconds per op kind (benchmarks/host_time.py's setups: activation, gated MLP, norm, loss,
   and a tiny Llama step), eager and compiled, fewer rounds than host_time.py's own.
4. The top host costs of the compiled patched 8B-shaped step (profiler, self CPU time per step), and
   the calls of invact's own ops in it.
5. Whole training steps at real shapes (STEP_MODELS: the Llama-3.2-1B- and Qwen2.5-0.5B-shaped configs
   of benchmarks/configs, 8 layers, real vocabularies, batch 4 x seq 2048, bf16, AdamW): eager,
   patch(), torch.compile, torch.compile + patch(), ms and the allocator's peak, under "steps".

The parts run in the order of what they decide (2, 5, 1, 3, 4) within a time budget (--budget, default
BUDGET_S): a part or a whole-step row is started only while the budget has room for it, judged by the
longest row of its kind measured so far (a compiled row by the compiled rows); what it leaves out is
listed under "skipped" with the seconds it had left. A part started is run to its end (a compilation
cannot be stopped half way), so the budget is a bound on when the last one starts, not a hard limit.

--parts runs some of them. Writes benchmarks/results/gpu_quick_<device>.json (after the loss and after
each whole step too: a run stopped at its time limit keeps what it measured) and prints one markdown
report. --small runs every part at tiny shapes (on a CPU too: a check that the script runs).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import host_time
import torch
import torch.nn.functional as F
from physics import device_peak
from torch import nn

from timing import cpu_model, device_busy_ms, device_name, version, write_result

LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                num_hidden_layers=2, vocab_size=32000, attn_implementation="sdpa")  # fmt: skip
LLAMA_SMALL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                   num_hidden_layers=2, vocab_size=512, attn_implementation="sdpa")  # fmt: skip
LOSS_1B = (4096, 2048, 128256)  # tokens, hidden, vocabulary: Llama-3.2-1B's head at 4096 tokens
LOSS_SMALL = (64, 32, 3000)
VARIANTS = ("eager", "patch", "compile", "compile_patch")
PARTS = ("step", "loss", "host", "profile", "steps")
TITLES = {"step": "Llama-shaped step", "loss": "head + loss", "host": "host time per op kind",
          "profile": "profile", "steps": "whole training steps at real shapes"}  # fmt: skip
# The order parts run in: what decides whether a GPU user keeps patch() on first (the head + loss, then
# the whole steps at real shapes), the 8B-shaped decoder, host microseconds and the profile after.
ORDER = ("loss", "steps", "step", "host", "profile")
# `make gpu-quick`'s default budget in seconds: the check is to take at most 4 minutes on an H100/H200,
# and the process spends about 15 s before its first part there (interpreter, torch, CUDA context,
# the model configs; the H200 runs' logs put part 2's start at 2-13 s after the imports), after the
# gated MLP kernels' tests that gpu_suite.sh runs first (about 48 kernel compiles at 0.3 s each here).
BUDGET_S = 200.0
# Each part's seconds before this run has measured it: the longest in the H200 runs' logs (torch 2.11;
# benchmarks/results/gpu_logs/quick_*.log and run3_quick.log, from each part's start to the next's).
# The whole-step rows have none: the first of each kind (eager, compiled) starts whenever time is left.
PART_SECONDS = {"part loss": 11.0, "part step": 67.0, "part host": 49.0, "part profile": 8.0}


class Budget:
    """The seconds a run may spend: `allows(kind, what)` says whether a unit of work of `kind` may start
    now, from the longest unit of that kind done so far (`done(kind, seconds)`; `known`: seconds per kind
    before any is done); where it may not, the unit is recorded in `skipped` with the seconds left."""

    def __init__(self, seconds: float, clock=time.perf_counter, known: dict | None = None) -> None:
        self.seconds, self.clock, self.start = seconds, clock, clock()
        self.longest: dict[str, float] = dict(known or {})  # seconds per kind, before any is measured
        self.skipped: list[dict] = []

    def left(self) -> float:
        return self.seconds - (self.clock() - self.start)

    def allows(self, kind: str, what: str) -> bool:
        left = self.left()
        if left > self.longest.get(kind, 0.0):
            return True
        self.skipped.append({"what": what, "seconds_left": round(left, 1)})
        print(f"  skipped {what}: {left:.0f} s of the budget left", flush=True)
        return False

    def done(self, kind: str, seconds: float) -> None:
        self.longest[kind] = max(self.longest.get(kind, 0.0), seconds)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _wall_ms(step, calls: int, device: str) -> float:
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        step()
    _sync(device)
    return (time.perf_counter() - t0) * 1e3 / calls


def _llama_flops(model: nn.Module, tokens: int, seq: int, config: dict) -> int:
    """Forward + backward FLOPs, an upper bound: 6 per token per weight of the layers (embedding
    excluded: a lookup), and attention's two (seq x seq) products, 4 s^2 hidden per sequence and layer
    forward, twice that backward (FlopCounterMode counts 5% fewer on the small config: a bound that is
    higher makes the physics check stricter)."""
    weights = sum(p.numel() for n, p in model.named_parameters() if "embed" not in n and p.dim() == 2)
    attention = 12 * tokens * seq * config["hidden_size"] * config["num_hidden_layers"]
    return 6 * tokens * weights + attention


def llama_step(config: dict, batch: int, seq: int, device: str, dtype, rounds: int, calls: int) -> dict:
    """Part 1: the decoder's four variants, interleaved; wall ms, GPU busy ms and TFLOP/s per variant."""
    import transformers

    import invact

    torch.manual_seed(0)
    model = transformers.LlamaModel(transformers.LlamaConfig(**config)).to(device, dtype).train()
    ids = torch.randint(0, config["vocab_size"], (batch, seq), device=device)
    dy = torch.randn(batch, seq, config["hidden_size"], device=device, dtype=dtype)
    patched = copy.deepcopy(model)
    invact.patch(patched)
    dynamo_config = __import__("torch._dynamo", fromlist=["config"]).config
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, host_time.RECOMPILE_LIMIT)
    models = {"eager": model, "patch": patched, "compile": torch.compile(copy.deepcopy(model)),
              "compile_patch": torch.compile(patched)}  # fmt: skip

    def step_of(m: nn.Module):
        def step():
            m(input_ids=ids).last_hidden_state.backward(dy)
            for p in m.parameters():
                p.grad = None

        return step

    steps = {k: step_of(m) for k, m in models.items()}
    compile_s = {}
    for k, step in steps.items():  # warm-up: compilation, autotuning, allocator
        t0 = time.perf_counter()
        step()
        _sync(device)
        compile_s[k] = time.perf_counter() - t0
        step()
    from torch.utils.flop_counter import FlopCounterMode

    try:
        with FlopCounterMode(display=False) as counter:
            steps["eager"]()
        flops = counter.get_total_flops()
    except AssertionError:  # torch 2.11's counter refuses grouped-query sdpa: counted by formula instead
        flops = _llama_flops(model, batch * seq, seq, config)
    wall = {k: [] for k in steps}
    for r in range(rounds):
        order = VARIANTS[r % 4 :] + VARIANTS[: r % 4]
        for k in order:
            wall[k].append(_wall_ms(steps[k], calls, device))
    row = {"flops": flops, "first_call_s": compile_s}
    for k in steps:
        row[f"{k}_wall_ms"] = statistics.median(wall[k])
        row[f"{k}_wall_rounds_ms"] = wall[k]
        row[f"{k}_busy_ms"] = device_busy_ms(steps[k], calls, device)
        row[f"{k}_tflops"] = flops / row[f"{k}_wall_ms"] / 1e9
    for k, base in (("patch", "eager"), ("compile_patch", "compile"), ("compile", "eager")):
        row[f"{k}_wall_ratio"] = row[f"{k}_wall_ms"] / row[f"{base}_wall_ms"]
        row[f"{k}_busy_ratio"] = row[f"{k}_busy_ms"] / row[f"{base}_busy_ms"]
    row["steps"] = steps  # for the profile part; popped before writing
    return row


def _matmuls(h, w) -> dict:
    """The head + loss's three (tokens x hidden x vocab) products alone, on a made-up logit gradient:
    the logits h W^T, d h = d W and d W = d^T h (the floor a head + loss's time is held against)."""
    d = torch.randn(h.shape[0], w.shape[0], device=h.device, dtype=h.dtype)
    hd, wd = h.detach(), w.detach()
    return {"matmul logits": lambda: F.linear(hd, wd), "matmul dh": lambda: torch.mm(d, wd),
            "matmul dW": lambda: torch.mm(d.t(), hd)}  # fmt: skip


def loss_row(tokens: int, hidden: int, vocab: int, device: str, dtype, rounds: int) -> dict:
    """Part 2: head + loss, eager against invact, each also under torch.compile (and torch's chunked
    F.linear_cross_entropy where the installed torch has it), forward + backward ms (median of
    interleaved rounds) against the three matmuls' floor measured in the same rounds, held MiB after the
    forward, TFLOP/s of the three matmuls each does."""
    from loss_time import _held_after_forward, _inputs

    from invact.loss import linear_cross_entropy

    h, w, t = _inputs(tokens, hidden, vocab, dtype, device)

    def eager_loss(h, w, t):
        return F.cross_entropy(F.linear(h, w).float(), t)

    variants = {"eager": eager_loss, "invact": linear_cross_entropy,
                "eager compiled": torch.compile(eager_loss),
                "invact compiled": torch.compile(linear_cross_entropy)}  # fmt: skip
    if hasattr(F, "linear_cross_entropy"):
        variants["torch chunked"] = F.linear_cross_entropy

    def step(fn):
        h.grad = w.grad = None
        fn(h, w, t).backward()

    held = {k: _held_after_forward(fn, h, w, t) for k, fn in variants.items()}
    calls = {k: (lambda fn=fn: step(fn)) for k, fn in variants.items()} | _matmuls(h, w)
    for fn in calls.values():
        fn()
    times = {k: [] for k in calls}
    for r in range(rounds):
        order = list(calls)
        for k in order[r % len(order) :] + order[: r % len(order)]:
            times[k].append(_wall_ms(calls[k], 1, device))
    ms = {k: statistics.median(v) for k, v in times.items()}
    floor = ms["matmul logits"] + ms["matmul dh"] + ms["matmul dW"]
    matmul = 2 * tokens * hidden * vocab
    out = {"tokens": tokens, "hidden": hidden, "vocab": vocab, "floor_ms": floor, "variants": {},
           "matmuls": {k: {"ms": ms[k], "tflops": matmul / ms[k] / 1e9} for k in _matmuls(h, w)}}  # fmt: skip
    out["kernels"] = top_kernels(calls["invact"], device)
    for k in variants:
        out["variants"][k] = {"ms": ms[k], "ratio_to_eager": ms[k] / ms["eager"],
                              "ratio_to_floor": ms[k] / floor, "tflops": 3 * matmul / ms[k] / 1e9,
                              "held_after_forward_mib": held[k] / 2**20}  # fmt: skip
    return out


# The real-shape steps (part 5): configs in benchmarks/configs, the layers kept, the batch.
STEP_MODELS = {"Llama-3.2-1B-shaped, 8 layers": ("llama-3.2-1b-shaped.json", 8),
               "Qwen2.5-0.5B-shaped, 8 layers": ("qwen2.5-0.5b-shaped.json", 8)}  # fmt: skip
STEP_SHAPE = (4, 2048)  # 8192 tokens a step
STEP_SMALL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, vocab_size=3000)  # fmt: skip
STEP_VARIANTS = ("eager", "patch", "compile", "compile+patch")


def _step_model(name: str, small: bool, device: str, dtype, layers: int | None = None):
    import transformers

    from invact.planner.config import load_config

    file, default = STEP_MODELS[name]
    config, _ = load_config(str(Path(__file__).parent / "configs" / file))
    config.num_hidden_layers = 2 if small else layers or default
    if small:
        for k, v in STEP_SMALL.items():
            setattr(config, k, v)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).to(device, dtype).train()


def _step_row(name: str, variant: str, small: bool, device: str, dtype, steps: int, layers: int | None = None,
              options: dict | None = None) -> dict:  # fmt: skip
    """One model in one variant (step_rows); `options`: patch()'s keywords where the variant patches."""
    import invact

    batch, seq = (2, 32) if small else STEP_SHAPE
    model = _step_model(name, small, device, dtype, layers)
    if "patch" in variant:
        invact.patch(model, **(options or {}))
    run = torch.compile(model) if "compile" in variant else model
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))
    ids = ids.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def step():
        run(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    t0 = time.perf_counter()
    for _ in range(3):
        step()
    _sync(device)
    first = time.perf_counter() - t0
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = [_wall_ms(step, 1, device) for _ in range(steps)]
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
    with torch.no_grad():
        loss = run(input_ids=ids, labels=ids).loss.item()
    return {"model": name, "variant": variant, "ms": statistics.median(times), "peak_bytes": peak,
            "warmup_s": first, "loss": loss, "tokens": batch * seq}  # fmt: skip


def step_rows(small: bool, device: str, dtype, steps: int, progress=None, budget: Budget | None = None
              ) -> list[dict]:  # fmt: skip
    """Part 5: whole training steps (forward with labels, loss, backward, AdamW, grads to None) of each
    STEP_MODELS model in each variant, one variant at a time: median ms of `steps` synchronized steps
    after 3 warm-up steps (compilation among them), and the allocator's peak bytes over those steps
    (weights, gradients and AdamW's state included). `progress(rows)` after each row (a partial
    result written: a run stopped at its time limit keeps the rows it measured). `budget`: a row starts
    only where it allows one of its kind (compiled or eager)."""
    rows = []
    for name in STEP_MODELS:
        for variant in STEP_VARIANTS:
            kind = "compiled step" if "compile" in variant else "eager step"
            if budget is not None and not budget.allows(kind, f"{name} {variant}"):
                continue
            t0 = time.perf_counter()
            rows.append(_step_row(name, variant, small, device, dtype, steps))
            rows[-1]["seconds"] = time.perf_counter() - t0
            if budget is not None:
                budget.done(kind, rows[-1]["seconds"])
            if progress is not None:
                progress(rows)
            gib = (rows[-1]["peak_bytes"] or 0) / 2**30
            print(f"  {name} {variant}: {rows[-1]['ms']:.1f} ms, peak {gib:.2f} GiB "
                  f"({rows[-1]['seconds']:.0f} s)", flush=True)  # fmt: skip
            torch._dynamo.reset()
            if device == "cuda":
                torch.cuda.empty_cache()
    return rows


def steps_report(rows: list[dict]) -> str:
    """Part 5's markdown: per model, each variant's ms and peak, with the ratios the issue's bars name."""
    lines = ["| model | variant | ms | x base | peak GiB | x base peak |", "|---|---|---|---|---|---|"]
    by = {(r["model"], r["variant"]): r for r in rows}
    bases = {"patch": "eager", "compile+patch": "compile"}
    for r in rows:
        base = by.get((r["model"], bases.get(r["variant"], "")))
        peak = r["peak_bytes"] or 0
        ratio = f"{r['ms'] / base['ms']:.2f}x {bases[r['variant']]}" if base else ""
        pratio = f"{peak / base['peak_bytes']:.2f}x" if base and base["peak_bytes"] else ""
        lines.append(
            f"| {r['model']} | {r['variant']} | {r['ms']:.1f} | {ratio} | {peak / 2**30:.2f} | {pratio} |"
        )
    return "\n".join(lines)


def top_kernels(step, device: str, top: int = 10) -> list[dict]:
    """The profiler's top device-time events of one call of `step` (its kernels on CUDA; its ops on a
    CPU): what a slow op spends its time on."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device == "cuda"
    step()
    _sync(device)
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        step()
        _sync(device)
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)[:top]
    return [{"name": e.key[:90], "ms": getattr(e, key) / 1e3, "calls": e.count} for e in events]


def report(result: dict) -> str:
    """The whole check's markdown: the parts the result holds."""
    lines = [f"gpu-quick on {result['device']} (torch {result['torch']}, triton {result['triton']}, host "
             f"{result['cpu']}), {result['dtype']}"]  # fmt: skip
    if "llama" in result:
        lines += ["", llama_report(result)]
    if "loss" in result:
        lines += ["", loss_report(result["loss"])]
    if "host" in result:
        lines += ["", "Host microseconds per forward + backward (host_time.py's setups)", "",
                  host_time.table(result["host"])]  # fmt: skip
    if "profile" in result:
        lines += ["", "Compiled + patch() 8B-shaped step: top host costs (profiler)", "",
                  host_time.profile_table(result["profile"])]  # fmt: skip
    if "steps" in result:
        b, s = STEP_SHAPE
        lines += ["", f"Whole training steps, batch {b} x seq {s}, bf16, AdamW (median ms; allocator peak)",
                  "", steps_report(result["steps"])]  # fmt: skip
    if result.get("skipped"):
        lines += ["", "Left out by the time budget: " + "; ".join(
            f"{x['what']} ({x['seconds_left']:.0f} s left)" for x in result["skipped"])]  # fmt: skip
    return "\n".join(lines)


def llama_report(result: dict) -> str:
    """Part 1's markdown: the four variants' wall clock and GPU busy time, with their ratios."""
    r, peak = result["llama"], result.get("peak_tflops")
    lines = [f"Llama-3.1-8B-shaped decoder, {result['llama_shape']}: ms per forward + backward "
             f"({r['flops'] / 1e12:.2f} TFLOP a step; datasheet peak {peak or 'unknown'} TFLOP/s)", "",
             "| variant | wall ms | GPU busy ms | TFLOP/s (wall) | wall ratio | busy ratio |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    bases = {"patch": "eager", "compile_patch": "compile", "compile": "eager"}
    for k in VARIANTS:
        ratio = f"{r[f'{k}_wall_ratio']:.2f}x {bases[k]}" if k in bases else ""
        busy = f"{r[f'{k}_busy_ratio']:.2f}x" if k in bases else ""
        lines.append(f"| {k.replace('_', ' + ')} | {r[f'{k}_wall_ms']:.2f} | {r[f'{k}_busy_ms']:.2f} | "
                     f"{r[f'{k}_tflops']:.0f} | {ratio} | {busy} |")  # fmt: skip
    return "\n".join(lines)


def loss_report(loss: dict) -> str:
    """Part 2's markdown: the variants' table (against the three matmuls' floor where the result has
    it), invact's block-size sweep (results written before the loss went chunked) and top device
    events."""
    lines = []
    shape = f"{loss['tokens']} x {loss['hidden']} x {loss['vocab']}"
    if "floor_ms" in loss:
        lines += ["", f"Head + loss, {shape}, forward + backward; its three matmuls alone "
                  f"{loss['floor_ms']:.2f} ms", "",
                  "| variant | ms | x eager | x three matmuls | TFLOP/s | held after forward MiB |",
                  "|---|---|---|---|---|---|"]  # fmt: skip
        for k, v in loss["variants"].items():
            lines.append(f"| {k} | {v['ms']:.2f} | {v['ratio_to_eager']:.2f} | {v['ratio_to_floor']:.2f} | "
                         f"{v['tflops']:.0f} | {v['held_after_forward_mib']:.1f} |")  # fmt: skip
    else:
        lines += ["", f"Head + loss, {shape}, forward + backward", "",
                  "| variant | ms | x eager | TFLOP/s | held after forward MiB |",
                  "|---|---|---|---|---|"]  # fmt: skip
        for k, v in loss["variants"].items():
            lines.append(f"| {k} | {v['ms']:.2f} | {v['ratio_to_eager']:.2f} | {v['tflops']:.0f} | "
                         f"{v['held_after_forward_mib']:.1f} |")  # fmt: skip
    if "blocks" in loss:
        lines += [
            "",
            "invact's head + loss by block size: "
            + ", ".join(
                f"{b['block_bytes'] >> 20} MiB ({b['columns']} columns) {b['ms']:.2f} ms"
                for b in loss["blocks"]
            ),
        ]
    if "kernels" not in loss:
        return "\n".join(lines)
    lines += [
        "",
        "invact's head + loss, top device events: "
        + "; ".join(f"{k['name']} {k['ms']:.2f} ms x{k['calls']}" for k in loss["kernels"]),
    ]
    return "\n".join(lines)


def check(result: dict) -> list[str]:
    """Figures above the datasheet's bf16 peak: a measurement bug, not a result (the Llama-shaped step
    where the result has it: --loss-only's has the loss alone)."""
    peak = result.get("peak_tflops")
    errors = []
    if peak:
        for k in VARIANTS if "llama" in result else ():
            for what in ("wall", "busy"):
                tflops = result["llama"]["flops"] / result["llama"][f"{k}_{what}_ms"] / 1e9
                if tflops > peak:
                    errors.append(f"{k}: {tflops:.0f} TFLOP/s from its {what} time, above the {peak} peak")
        for k, v in result.get("loss", {}).get("variants", {}).items():
            if v["tflops"] > peak:
                errors.append(f"loss {k}: {v['tflops']:.0f} TFLOP/s, above the {peak} peak")
    return errors


def _header(device: str, rounds: int) -> dict:
    """What every result states first: the machine, the versions, the dtype, the rounds, the peak."""
    peak = device_peak(torch.cuda.get_device_name()) if device == "cuda" else None
    return {"device": device_name(device), "cpu": cpu_model(), "torch": torch.__version__,
            "triton": version("triton"), "transformers": version("transformers"), "dtype": "bfloat16",
            "peak_tflops": getattr(peak, "bf16_tflops", None), "rounds": rounds}  # fmt: skip


def _write_checked(result: dict, stem: str, device: str, out: Path | None) -> int:
    """Write the result unless check() finds a figure above the peak (then say which and return 1)."""
    errors = check(result)
    for error in errors:
        print(f"gpu_quick.py: refusing to write the results: {error}", file=sys.stderr)
    if errors:
        return 1
    write_result(result, stem, device, out=out)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--small", action="store_true", help="tiny shapes and few rounds (runs on a CPU)")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds per part (default 7)")
    parser.add_argument(
        "--out", type=Path, default=None, help="the JSON (default results/gpu_quick_<device>.json)"
    )
    parser.add_argument("--loss-only", action="store_true",
                        help="part 2 alone (head + loss): results/gpu_quick_loss_<device>.json")  # fmt: skip
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS),
                        help="the parts to run (default all): " + ", ".join(PARTS))  # fmt: skip
    parser.add_argument("--budget", type=float, default=BUDGET_S,
                        help=f"seconds the parts may take (default {BUDGET_S:.0f}): a part or whole-step "
                        "row starts only where the longest of its kind so far still fits; what is left "
                        "out is listed under 'skipped'")  # fmt: skip
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be positive")
    if not args.budget > 0:
        parser.error("--budget must be a positive number of seconds")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.small:
        parser.error("no CUDA device is visible: gpu-quick needs one (or --small, a check that it runs)")
    dtype = torch.bfloat16
    config, shape = (LLAMA_SMALL, (1, 16)) if args.small else (LLAMA_8B, (1, 512))
    calls = 2 if args.small else 5
    t0 = time.perf_counter()
    if args.loss_only:
        loss = loss_row(*(LOSS_SMALL if args.small else LOSS_1B), device, dtype, args.rounds)
        result = {**_header(device, args.rounds), "loss": loss}
        print(loss_report(loss))
        return _write_checked(result, "gpu_quick_loss", device, args.out)
    parts, result = set(args.parts), _header(device, args.rounds)
    budget = Budget(args.budget, known=PART_SECONDS)
    step_fns = None

    def write(partial: dict) -> None:  # after each part: a run stopped at its time limit keeps them
        partial["skipped"] = budget.skipped
        write_result(partial, "gpu_quick", device, out=args.out)

    def progress(rows: list[dict]) -> None:  # after each whole-step row of part 5
        result["steps"] = rows
        write(result)

    for part in (p for p in ORDER if p in parts):
        if part == "profile" and step_fns is None:
            continue  # the profile is of part 1's compiled patched step
        if not budget.allows(f"part {part}", f"part {part}"):
            continue
        t1 = time.perf_counter()
        print(f"  {t1 - t0:.0f} s; part {PARTS.index(part) + 1}: {TITLES[part]}", flush=True)
        if part == "loss":
            result["loss"] = loss_row(*(LOSS_SMALL if args.small else LOSS_1B), device, dtype, args.rounds)
        elif part == "steps":
            steps = 3 if args.small else 8
            result["steps"] = step_rows(args.small, device, dtype, steps, progress, budget)
        elif part == "step":
            llama = llama_step(config, *shape, device, dtype, args.rounds, calls)
            step_fns = llama.pop("steps")  # for the profile part; not written
            layers = config["num_hidden_layers"]
            result |= {"llama_shape": f"batch {shape[0]}, seq {shape[1]}, {layers} layers",
                       "llama_config": config, "llama": llama}  # fmt: skip
        elif part == "host":
            sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
            host_calls = 20 if args.small else 100
            pairs = host_time.setups(device, 4)
            if not args.small:  # --small: eager only (host_time.py's own check compiles every setup)
                pairs += host_time.setups(device, 4, compiled=True)
            result["host"] = host_time.interleaved(pairs, host_calls, max(args.rounds, 3), sync)
        else:
            result["profile"] = host_time.top_host_costs(step_fns["compile_patch"], calls)
            step_fns = None
        budget.done(f"part {part}", time.perf_counter() - t1)
        if part != "steps":  # part 5 wrote after each of its rows
            write(result)
    del step_fns
    result["skipped"] = budget.skipped
    result["seconds"] = time.perf_counter() - t0
    print()
    print(report(result))
    return _write_checked(result, "gpu_quick", device, args.out)


if __name__ == "__main__":
    sys.exit(main())
