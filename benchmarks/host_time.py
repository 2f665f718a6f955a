"""Host time per call of InvAct against torch: microseconds of the host's clock per forward + backward
on tensors so small (batch 4 by default) that the kernels cost next to nothing, so what is measured is
the Python and dispatch cost a small layer waits for (on a GPU the device never holds the host back).
Writes benchmarks/results/host_time_<device>.json and prints markdown tables.

Setups, one or more per op kind, each InvAct against torch, forward + backward, eager and (unless
--no-compile) both sides under torch.compile:
- activation: a bare GELU (torch.nn.GELU against invact.InvActGELU) on a (batch, 16) leaf;
- mlp: a GELU MLP, Linear(16, 64), GELU, Linear(64, 16), patched with invact.patch, which runs it as
  one autograd Function (invact.mlp); a SwiGLU MLP (Llama-style gate/up/down, 16 -> 32 -> 16, SiLU),
  patched: one Function too, which saves no gated product act(g) * u; the same SwiGLU MLP with a
  forward invact.mlp does not recognise (it takes a second, unused argument), so that the gated path
  runs as invact.mlp.gated's saved-tensor hooks: what an MLP with a LoRA-wrapped or quantized projection
  costs (eager only: under compile it is the plain SwiGLU's graph);
- norm: Hugging Face's LlamaRMSNorm and torch's LayerNorm over 16 channels, patched (invact.norm);
- loss: a causal LM's head + loss, (batch x 4) rows of 16 into a 512-word vocabulary: eager's
  F.cross_entropy(F.linear(h, W).float(), t) against invact.loss.linear_cross_entropy;
- step: a tiny Llama (hidden 64, 2 layers, 4 heads, vocabulary 512) with labels, one sequence of 16
  tokens, eager against patch() (every kind at once: norms, MLPs, loss).
Torch and InvAct alternate round by round (interleaved, the first of each pair alternating too), so
drift in the machine's speed hits both; each figure is the median over rounds of the mean over
`--calls` calls (a tenth of them for the step), after warm-up, and the ratio is InvAct's median over
torch's.

--profile: the profiler's top host costs (self CPU time per call) of the compiled patched step, and
the calls of invact's own ops among them: a compiled step should call none.

Layers (the original rows of this script, on `--elements` elements): the backend's bare forward and
backward (invact.activation.ops' bodies, kernels included), InvAct's forward through the module (autograd
recording), and forward + backward(dy) with autograd's device threads on and off (on CUDA the engine
runs backward on a per-device thread, and a Python backward must be handed to it).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from timing import cpu_model, device_name, write_result

Step = Callable[[], object]


def _mean_us(fn: Step, calls: int, sync: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - t0) / calls * 1e6


def _per_call_us(fn: Step, calls: int, rounds: int, sync: Callable[[], None]) -> float:
    for _ in range(max(calls // 10, 2)):  # warm-up: compilation, allocator, caches
        fn()
    sync()
    return statistics.median(_mean_us(fn, calls, sync) for _ in range(rounds))


class Pair(NamedTuple):
    """One setup: torch's step and InvAct's, each a fresh forward + backward per call on fixed inputs."""

    name: str
    kind: str  # the op kind it exercises: activation, mlp, norm, loss, or step (a whole model)
    compiled: bool
    torch_step: Step
    invact_step: Step
    calls_divisor: int = 1  # a step of a whole model takes `calls // calls_divisor` calls a round


def _compiles() -> int:
    """Frames Dynamo has compiled in this process so far."""
    from torch._dynamo.utils import counters

    return sum(counters["frames"].values())


# Every compiled setup is a torch.compile of a module or function whose frames share code objects
# (nn.Module's call wrapper, Sequential.forward): past Dynamo's recompile limit (8 per code object in
# torch 2.13) the later setups would run eager and be timed as "compiled". 64 holds all of them.
RECOMPILE_LIMIT = 64


def interleaved(pairs: list[Pair], calls: int, rounds: int, sync) -> list[dict]:
    """Per setup: the median per-call microseconds of torch's step and InvAct's over `rounds` rounds,
    the two timed one after the other in every round, in alternating order."""
    for pair in pairs:
        for fn in (pair.torch_step, pair.invact_step):
            for _ in range(max(calls // pair.calls_divisor // 10, 2)):  # warm-up: compiles, caches
                fn()
    sync()
    compiles = _compiles()
    samples = [([], []) for _ in pairs]
    for r in range(rounds):
        for pair, sample in zip(pairs, samples, strict=True):
            n = max(calls // pair.calls_divisor, 1)
            for side in (0, 1) if r % 2 == 0 else (1, 0):
                sample[side].append(_mean_us(pair[3 + side], n, sync))
    if _compiles() != compiles:  # a timed call traced again: its rounds timed Dynamo, not the step
        raise RuntimeError(
            f"torch.compile compiled {_compiles() - compiles} frame(s) during the timed rounds"
        )
    rows = []
    for pair, (theirs, ours) in zip(pairs, samples, strict=True):
        torch_us, invact_us = statistics.median(theirs), statistics.median(ours)
        rows.append({
            "setup": pair.name,
            "kind": pair.kind,
            "compiled": pair.compiled,
            "torch_us": torch_us,
            "invact_us": invact_us,
            "ratio": invact_us / torch_us,
            # the same ratio per round, then its median: robust to drift within the run too
            "paired_ratio": statistics.median(o / t for t, o in zip(theirs, ours, strict=True)),
            "torch_rounds_us": theirs,
            "invact_rounds_us": ours,
        })  # fmt: skip
    return rows


class SwiGLU(nn.Module):
    """Llama's MLP: down(act(gate(x)) * up(x)), no biases."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class HookedSwiGLU(SwiGLU):
    """SwiGLU whose forward takes a second argument: not invact.mlp's form, so invact.mlp.gated hooks it."""

    def forward(self, x: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


# The step's tiny Llama: small enough that its kernels take next to nothing, so its time is the host's
# (the shape at which a compiled patched step showed 2.3x compiled torch's on a Zen 4).
TINY_LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=512, attn_implementation="sdpa")  # fmt: skip
TINY_SEQ = 16
LOSS_VOCAB = 512  # the loss setup's vocabulary: one block of invact.loss at (batch x 4) rows


def tiny_llama(device: str, dtype: torch.dtype = torch.float32) -> nn.Module:
    """TINY_LLAMA with random weights (seeded), in training mode."""
    import transformers

    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_LLAMA)).to(device, dtype).train()


def _patched(model: nn.Module, what: str, expect=None) -> nn.Module:
    """A patched copy of `model`, checked to take the path `what` names (expect(copy) is True)."""
    import invact

    copied = copy.deepcopy(model)
    if not invact.patch(copied) or (expect is not None and not expect(copied)):
        raise RuntimeError(f"invact.patch did not run the {what} setup as expected")
    return copied


def _eager_loss(h, w, t):
    return F.cross_entropy(F.linear(h, w).float(), t)


def setups(device: str, batch: int, compiled: bool = False) -> list[Pair]:
    """Every op kind's setups, torch's side against InvAct's; `compiled`: both sides under
    torch.compile (the gated hooks' setup is eager only)."""
    import invact
    import invact.mlp
    from invact.loss import linear_cross_entropy

    torch.manual_seed(0)
    x, dy = torch.randn(batch, 16, device=device), torch.randn(batch, 16, device=device)
    wrap = torch.compile if compiled else (lambda f: f)
    if compiled:
        dynamo_config = __import__("torch._dynamo", fromlist=["config"]).config
        dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, RECOMPILE_LIMIT)

    def leaf_step(module: nn.Module) -> Step:
        f = wrap(module)
        return lambda: f(x.detach().requires_grad_()).backward(dy)

    def model_step(model: nn.Module) -> Step:  # the parameters need grad, the input does not
        f = wrap(model)
        return lambda: f(x).backward(dy)

    def fused(m: nn.Module) -> bool:
        return isinstance(m.__dict__.get("forward"), invact.mlp.Forward)

    gelu_mlp = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)).to(device)
    swiglu = SwiGLU(16, 32).to(device)
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    rms, layer = LlamaRMSNorm(16).to(device), nn.LayerNorm(16).to(device)
    inverted = lambda m: getattr(m, "_invact_variant", None) is not None  # noqa: E731
    mlp, gated = f"GELU MLP 16-64-16, batch {batch}", f"SwiGLU MLP 16-32-16, batch {batch}"
    pairs = [
        Pair(f"GELU ({batch}, 16)", "activation", compiled, leaf_step(nn.GELU()),
             leaf_step(invact.InvActGELU())),
        Pair(mlp, "mlp", compiled, model_step(gelu_mlp), model_step(_patched(gelu_mlp, mlp, fused))),
        Pair(f"{gated}, gated path", "mlp", compiled, model_step(swiglu),
             model_step(_patched(swiglu, gated, fused))),
    ]  # fmt: skip
    if not compiled:
        hooked = HookedSwiGLU(16, 32).to(device)
        hooked.load_state_dict(swiglu.state_dict())
        by_hooks = _patched(hooked, gated, lambda m: not fused(m) and bool(m._forward_pre_hooks))
        pairs.append(
            Pair(f"{gated}, gated path by hooks", "mlp", compiled, model_step(hooked), model_step(by_hooks))
        )
    for name, norm in ((f"LlamaRMSNorm ({batch}, 16)", rms), (f"LayerNorm ({batch}, 16)", layer)):
        patched = _patched(nn.Sequential(norm), name, lambda m: inverted(m[0]))
        pairs.append(Pair(name, "norm", compiled, leaf_step(norm), leaf_step(patched)))
    rows = batch * 4
    h = torch.randn(rows, 16, device=device)
    w = (torch.randn(LOSS_VOCAB, 16, device=device) * 0.25).requires_grad_()
    t = torch.randint(0, LOSS_VOCAB, (rows,), device=device)
    eager_loss, invact_loss = wrap(_eager_loss), wrap(linear_cross_entropy)

    def loss_step(f) -> Step:
        return lambda: f(h.detach().requires_grad_(), w, t).backward()

    name = f"head + loss ({rows} x 16 x {LOSS_VOCAB})"
    pairs.append(Pair(name, "loss", compiled, loss_step(eager_loss), loss_step(invact_loss)))
    model = tiny_llama(device)
    ids = torch.randint(0, TINY_LLAMA["vocab_size"], (1, TINY_SEQ), device=device)
    patched = _patched(model, "tiny Llama")

    def llama_step(m: nn.Module) -> Step:
        f = wrap(m)
        return lambda: f(input_ids=ids, labels=ids).loss.backward()

    name = f"tiny Llama step (hidden 64, 2 layers, seq {TINY_SEQ}, vocab {TINY_LLAMA['vocab_size']}, labels)"
    pairs.append(Pair(name, "step", compiled, llama_step(model), llama_step(patched), calls_divisor=10))
    return pairs


def top_host_costs(step: Step, calls: int, top: int = 15) -> dict:
    """The profiler's view of `calls` calls of `step` (warm): the `top` events by self CPU time (us per
    step), and every invact op's calls per step and self CPU us per call."""
    from torch.profiler import ProfilerActivity, profile, schedule

    compiles = _compiles()
    # one call before recording: the profiler's first call may trace again (a grad-mode or dispatch
    # guard), which is Dynamo's time, not the step's
    with profile(
        activities=[ProfilerActivity.CPU], schedule=schedule(wait=0, warmup=1, active=calls), acc_events=True
    ) as prof:
        for _ in range(calls + 1):
            step()
            prof.step()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    rows = [{"name": e.key, "self_us_per_step": e.self_cpu_time_total / calls,
             "calls_per_step": e.count / calls}
            for e in events[:top]]  # fmt: skip
    ops = [{"name": e.key, "calls_per_step": e.count / calls,
            "self_us_per_call": e.self_cpu_time_total / e.count,
            "total_us_per_call": e.cpu_time_total / e.count}
           for e in events if e.key.startswith("invact::")]  # fmt: skip
    # frames Dynamo compiled during the warm-up call and the recorded ones: 0 where the step was warm
    return {"top": rows, "invact_ops": ops, "frames_compiled": _compiles() - compiles}


def layers(device: str, n: int, calls: int, rounds: int, sync) -> list[dict]:
    import invact
    from invact.activation import ops

    x = torch.randn(n, device=device)
    dy = torch.randn_like(x)
    leaf = x.clone().requires_grad_()
    y, bits = ops._forward_impl(x, "gelu", False)
    ours, theirs = invact.InvActGELU(), nn.GELU()

    def step(module: nn.Module) -> Step:
        return lambda: module(x.detach().requires_grad_()).backward(dy)

    timed = [
        ("torch GELU forward, recording autograd", lambda: theirs(leaf)),
        ("InvAct GELU forward, recording autograd", lambda: ours(leaf)),
        ("InvAct backend forward alone", lambda: ops._forward_impl(x, "gelu", False)),
        ("InvAct backend backward alone", lambda: ops._backward_impl(dy, y, bits, "gelu", False)),
        ("torch GELU forward + backward", step(theirs)),
        ("InvAct GELU forward + backward", step(ours)),
    ]
    rows = [{"layer": name, "us": _per_call_us(fn, calls, rounds, sync)} for name, fn in timed]
    threaded = torch.autograd.is_multithreading_enabled()
    try:
        torch.autograd.set_multithreading_enabled(False)
        for name, module in (("torch", theirs), ("InvAct", ours)):
            us = _per_call_us(step(module), calls, rounds, sync)
            rows.append({"layer": f"{name} GELU forward + backward, autograd on one thread", "us": us})
    finally:
        torch.autograd.set_multithreading_enabled(threaded)
    return rows


def main(argv: list[str] | None = None) -> int:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    parser.add_argument("--device", choices=["cpu", "cuda"], default=default_device)
    parser.add_argument("--batch", type=int, default=4, help="rows of the setups' inputs (default 4)")
    parser.add_argument("--elements", type=int, default=None,
                        help="elements of the layer rows (default 2^16 on CUDA, 64 on CPU)")  # fmt: skip
    parser.add_argument("--calls", type=int, default=300, help="calls per round (default 300)")
    parser.add_argument("--rounds", type=int, default=21, help="rounds; the median is reported (default 21)")
    parser.add_argument("--threads", type=int, default=1, help="torch's CPU threads (default 1)")
    parser.add_argument("--no-compile", action="store_true", help="eager setups only (no torch.compile)")
    parser.add_argument("--profile", action="store_true",
                        help="the profiler's top host costs of the compiled patched step")  # fmt: skip
    parser.add_argument("--small", action="store_true", help="a smoke run: 20 calls, 3 rounds")
    parser.add_argument("--out", default=None, help="JSON path (default results/host_time_<device>.json)")
    args = parser.parse_args(argv)
    if args.small:
        args.calls, args.rounds = 20, 3
    if args.elements is None:
        args.elements = 2**16 if args.device == "cuda" else 64
    for name in ("batch", "elements", "calls", "rounds", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be positive")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible")
    torch.set_num_threads(args.threads)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    pairs = setups(args.device, args.batch)
    if not args.no_compile:
        pairs += setups(args.device, args.batch, compiled=True)
    compared = interleaved(pairs, args.calls, args.rounds, sync)
    profiled = None
    if args.profile:
        step = next(p for p in pairs if p.kind == "step" and p.compiled == (not args.no_compile))
        profiled = top_host_costs(step.invact_step, max(args.calls // 10, 5))
    rows = layers(args.device, args.elements, args.calls, args.rounds, sync)
    name = device_name(args.device)
    print(f"\n{name}, torch {torch.__version__}: host microseconds per forward + backward, fp32, median of "
          f"{args.rounds} interleaved rounds of {args.calls} calls (the step: a tenth)\n")  # fmt: skip
    print(table(compared))
    if profiled is not None:
        print("\nThe compiled patched step's top host costs (profiler, self CPU us per step)\n")
        print(profile_table(profiled))
    print(f"\nLayer by layer, GELU on {args.elements} fp32 elements, host microseconds per call\n")
    print("| layer | us per call |\n|---|---|")
    for row in rows:
        print(f"| {row['layer']} | {row['us']:.1f} |")
    # torch's thread count as set, and as read after the run: a parallel region of numba's OpenMP layer
    # can change it (measured: after torch.set_num_threads(1) and a parallel torch op, 2 after one)
    result = {"device": name, "cpu": cpu_model(), "torch": torch.__version__, "threads": args.threads,
              "torch_threads_after": torch.get_num_threads(), "batch": args.batch, "elements": args.elements,
              "calls": args.calls, "rounds": args.rounds, "setups": compared, "rows": rows}  # fmt: skip
    if profiled is not None:
        result["profile"] = profiled
    write_result(result, "host_time", args.device, out=Path(args.out) if args.out else None)
    return 0


def table(compared: list[dict]) -> str:
    """The setups' markdown table: one row per setup, eager and compiled (torch.compile on both sides)."""
    lines = [
        "| op kind | setup | mode | torch us | InvAct us | InvAct / torch |",
        "|---|---|---|---|---|---|",
    ]
    for row in compared:
        mode = "compiled" if row["compiled"] else "eager"
        lines.append(f"| {row['kind']} | {row['setup']} | {mode} | {row['torch_us']:.1f} | "
                     f"{row['invact_us']:.1f} "
                     f"| {row['ratio']:.2f} |")  # fmt: skip
    return "\n".join(lines)


def profile_table(profiled: dict) -> str:
    lines = ["| event | self us per step | calls per step |", "|---|---|---|"]
    lines += [
        f"| {r['name']} | {r['self_us_per_step']:.1f} | {r['calls_per_step']:g} |" for r in profiled["top"]
    ]
    ops = profiled["invact_ops"]
    calls = sum(r["calls_per_step"] for r in ops)
    lines.append(f"\nframes compiled while profiling: {profiled['frames_compiled']}; "
                 f"invact op calls per compiled step: {calls:g}" + "".join(
        f"; {r['name']} {r['calls_per_step']:g} x {r['self_us_per_call']:.1f} us" for r in ops))  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
