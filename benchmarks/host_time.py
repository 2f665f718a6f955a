"""Host time per call of InvAct against torch: microseconds of the host's clock per forward + backward
on tensors so small (batch 4 by default) that the kernels cost next to nothing, so what is measured is
the Python and dispatch cost a small layer waits for (on a GPU the device never holds the host back).
Writes benchmarks/results/host_time_<device>.json and prints markdown tables.

Setups, each InvAct against torch, forward + backward(dy):
- a bare GELU (torch.nn.GELU against invact.InvActGELU) on a (batch, 16) leaf;
- a GELU MLP, Linear(16, 64), GELU, Linear(64, 16), patched with invact.patch, which runs it as one
  autograd Function (invact.mlp);
- a SwiGLU MLP (Llama-style gate/up/down, 16 -> 32 -> 16, SiLU), patched with invact.patch: one
  Function too, which saves no gated product act(g) * u (the gated path, on by default);
- the same SwiGLU MLP with a forward invact.mlp does not recognise (it takes a second, unused
  argument), so that the gated path runs as invact.gated's saved-tensor hooks: what an MLP with a
  LoRA-wrapped or quantized projection costs.
Torch and InvAct alternate round by round (interleaved, the first of each pair alternating too), so
drift in the machine's speed hits both; each figure is the median over rounds of the mean over
`--calls` calls, after warm-up, and the ratio is InvAct's median over torch's.

Layers (the original rows of this script, on `--elements` elements): the backend's bare forward and
backward (invact.ops' bodies, kernels included), InvAct's forward through the module (autograd
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

import torch
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


def interleaved(pairs: dict[str, tuple[Step, Step]], calls: int, rounds: int, sync) -> list[dict]:
    """Per setup (name -> (torch's step, InvAct's step)): the median per-call microseconds of each over
    `rounds` rounds, the two timed one after the other in every round, in alternating order."""
    for fns in pairs.values():
        for fn in fns:
            for _ in range(max(calls // 10, 2)):  # warm-up: numba's kernels, allocator, caches
                fn()
    sync()
    samples = {name: ([], []) for name in pairs}
    for r in range(rounds):
        for name, fns in pairs.items():
            for side in (0, 1) if r % 2 == 0 else (1, 0):
                samples[name][side].append(_mean_us(fns[side], calls, sync))
    rows = []
    for name, (theirs, ours) in samples.items():
        torch_us, invact_us = statistics.median(theirs), statistics.median(ours)
        rows.append({
            "setup": name,
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
    """SwiGLU whose forward takes a second argument: not invact.mlp's form, so invact.gated hooks it."""

    def forward(self, x: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def setups(device: str, batch: int) -> dict[str, tuple[Step, Step]]:
    """name -> (torch's forward + backward, InvAct's), each a fresh step per call on fixed inputs."""
    import invact
    import invact.mlp

    torch.manual_seed(0)
    x, dy = torch.randn(batch, 16, device=device), torch.randn(batch, 16, device=device)

    def leaf_step(module: nn.Module) -> Step:
        return lambda: module(x.detach().requires_grad_()).backward(dy)

    def model_step(model: nn.Module) -> Step:  # the parameters need grad, the input does not
        return lambda: model(x).backward(dy)

    gelu_mlp = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)).to(device)
    swiglu = SwiGLU(16, 32).to(device)
    hooked = HookedSwiGLU(16, 32).to(device)
    hooked.load_state_dict(swiglu.state_dict())
    patched = {name: copy.deepcopy(model) for name, model in
               (("gelu_mlp", gelu_mlp), ("swiglu", swiglu), ("hooked", hooked))}  # fmt: skip
    for name, model in patched.items():
        if not invact.patch(model):
            raise RuntimeError(f"invact.patch replaced nothing in the {name} setup")
    # Each setup measures the path it names: invact.mlp's Function, or invact.gated's hooks.
    fused = {name: isinstance(m.__dict__.get("forward"), invact.mlp.Forward) for name, m in patched.items()}
    hooks = bool(patched["hooked"]._forward_pre_hooks)
    if fused != {"gelu_mlp": True, "swiglu": True, "hooked": False} or not hooks:
        raise RuntimeError(f"invact.patch did not run the MLPs as expected: fused {fused}")
    mlp, gated = f"GELU MLP 16-64-16, batch {batch}", f"SwiGLU MLP 16-32-16, batch {batch}"
    return {
        f"GELU ({batch}, 16)": (leaf_step(nn.GELU()), leaf_step(invact.InvActGELU())),
        mlp: (model_step(gelu_mlp), model_step(patched["gelu_mlp"])),
        f"{gated}, gated path": (model_step(swiglu), model_step(patched["swiglu"])),
        f"{gated}, gated path by hooks": (model_step(swiglu), model_step(patched["hooked"])),
    }


def layers(device: str, n: int, calls: int, rounds: int, sync) -> list[dict]:
    import invact
    from invact import ops

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
    compared = interleaved(setups(args.device, args.batch), args.calls, args.rounds, sync)
    rows = layers(args.device, args.elements, args.calls, args.rounds, sync)
    name = device_name(args.device)
    print(f"\n{name}, torch {torch.__version__}: host microseconds per forward + backward, fp32, median of "
          f"{args.rounds} interleaved rounds of {args.calls} calls\n")  # fmt: skip
    print("| setup | torch us | InvAct us | InvAct / torch |\n|---|---|---|---|")
    for row in compared:
        print(f"| {row['setup']} | {row['torch_us']:.1f} | {row['invact_us']:.1f} | {row['ratio']:.2f} |")
    print(f"\nLayer by layer, GELU on {args.elements} fp32 elements, host microseconds per call\n")
    print("| layer | us per call |\n|---|---|")
    for row in rows:
        print(f"| {row['layer']} | {row['us']:.1f} |")
    # torch's thread count as set, and as read after the run: a parallel region of numba's OpenMP layer
    # can change it (measured: after torch.set_num_threads(1) and a parallel torch op, 2 after one)
    result = {"device": name, "cpu": cpu_model(), "torch": torch.__version__, "threads": args.threads,
              "torch_threads_after": torch.get_num_threads(), "batch": args.batch, "elements": args.elements,
              "calls": args.calls, "rounds": args.rounds, "setups": compared, "rows": rows}  # fmt: skip
    write_result(result, "host_time", args.device, out=Path(args.out) if args.out else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
