"""The head + loss against its floor on CUDA: the time of its three (tokens x hidden x vocab) matrix
products alone, beside invact.loss.linear_cross_entropy (its gradients computed in the forward a chunk
of rows at a time: invact.loss.op) at several chunk sizes, eager's and torch.compile's own head + loss.

Per shape, bf16, forward + backward:
- `matmul logits / dh / dW`: the three products alone (logits = h W^T, dh = d W, dW = d^T h); their sum
  is the floor;
- `kernel B/w/lanes`: invact.loss._triton.rows over the whole (tokens x vocab) logits at each launch
  configuration (columns a step, warps, per-lane running sums or a reduction per step), GB/s counting
  two reads and one write of each element; the fastest becomes the configuration of the rest of the
  run (and is the one invact.loss._triton.CONFIG should hold);
- `invact N MiB`: linear_cross_entropy with chunks of N MiB of logits (BLOCK_BYTES["cuda"]);
- `eager` (F.linear, .float(), F.cross_entropy) and `eager compiled` (the same under torch.compile).

Each figure: median ms of interleaved rounds (events around one call), and the peak bytes above the
inputs. Writes benchmarks/results/loss_floor_<device>.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
import torch.nn.functional as F

from invact.loss import _triton as K
from invact.loss import linear_cross_entropy
from invact.loss import op as loss_op

from timing import device_name, peak_gbps, version, write_result

SHAPES = [(4096, 2048, 128256), (8192, 2048, 128256)]
CHUNK_MIB = (128, 256, 512)


def _ms(fn, rounds_out: list) -> None:
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    fn()
    e1.record()
    torch.cuda.synchronize()
    rounds_out.append(e0.elapsed_time(e1))


def _median_ms(fn, rounds: int) -> float:
    fn()
    times: list = []
    for _ in range(rounds):
        _ms(fn, times)
    return statistics.median(times)


def sweep(n: int, v: int, rounds: int) -> list[dict]:
    """The kernel alone at each of CONFIGS on (n x v) bf16 logits."""
    dev = "cuda"
    z = torch.randn(n, v, device=dev).bfloat16()
    t = torch.randint(0, v, (n,), device=dev)
    scale = torch.full((n,), 1.0 / n, device=dev)
    rows = []
    for config in K.SWEEP:
        ms = _median_ms(lambda c=config: K.rows(z, t, scale, 0.0, (), True, c), rounds)
        rows.append({**config, "ms": ms, "gbps": 3 * n * v * 2 / ms / 1e6})
        print(f"  kernel {config}: {ms:.3f} ms, {rows[-1]['gbps']:.0f} GB/s", flush=True)
    return rows


def _variants(h, w, t) -> dict:
    hd, wd = h.detach(), w.detach()
    d = torch.randn(h.shape[0], w.shape[0], device=h.device, dtype=h.dtype)
    variants = {
        "matmul logits": lambda: F.linear(hd, wd),
        "matmul dh": lambda: torch.mm(d, wd),
        "matmul dW": lambda: torch.mm(d.t(), hd),
    }

    def invact(mib):
        loss_op.BLOCK_BYTES["cuda"] = mib * 2**20
        linear_cross_entropy(h, w, t).backward()
        h.grad = w.grad = None

    for mib in CHUNK_MIB:
        variants[f"invact {mib} MiB"] = lambda mib=mib: invact(mib)

    def eager_loss(h, w, t):
        return F.cross_entropy(F.linear(h, w).float(), t)

    compiled = torch.compile(eager_loss)

    def run(fn):
        fn(h, w, t).backward()
        h.grad = w.grad = None

    variants["eager"] = lambda: run(eager_loss)
    variants["eager compiled"] = lambda: run(compiled)
    return variants


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    dev = "cuda"
    result = {"device": device_name(dev), "torch": torch.__version__, "triton": version("triton"),
              "peak_gbps": peak_gbps(), "shapes": []}  # fmt: skip
    n0, _, v0 = SHAPES[0]
    result["sweep"] = sweep(n0, v0, args.rounds)
    best = min(result["sweep"], key=lambda r: r["ms"])
    K.CONFIG = {k: best[k] for k in ("BLOCK", "num_warps", "LANES")}
    result["config"] = K.CONFIG
    print(f"kernel configuration for the rest of the run: {K.CONFIG}", flush=True)
    default_block = loss_op.BLOCK_BYTES["cuda"]
    for n, hid, v in SHAPES:
        g = torch.Generator(device=dev).manual_seed(0)
        h = torch.randn(n, hid, device=dev, generator=g).bfloat16().requires_grad_()
        w = (torch.randn(v, hid, device=dev, generator=g) * hid**-0.5).bfloat16().requires_grad_()
        t = torch.randint(0, v, (n,), device=dev, generator=g)
        t[::10] = -100
        variants = _variants(h, w, t)
        times = {k: [] for k in variants}
        peaks = {}
        for k, fn in variants.items():  # warm-up and peak bytes
            fn()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            fn()
            torch.cuda.synchronize()
            peaks[k] = torch.cuda.max_memory_allocated() - base
        for i in range(args.rounds):
            keys = list(variants)
            for k in keys[i % len(keys) :] + keys[: i % len(keys)]:
                _ms(variants[k], times[k])
        loss_op.BLOCK_BYTES["cuda"] = default_block
        row = {"tokens": n, "hidden": hid, "vocab": v, "variants": {}}
        flop = 2 * n * hid * v
        for k in variants:
            ms = statistics.median(times[k])
            flops = (1 if k.startswith("matmul") else 3) * flop
            row["variants"][k] = {"ms": ms, "peak_mib": peaks[k] / 2**20, "tflops": flops / ms / 1e9}
        floor = sum(row["variants"][f"matmul {m}"]["ms"] for m in ("logits", "dh", "dW"))
        row["floor_ms"] = floor
        print(f"\n{n} x {hid} x {v}: three matmuls {floor:.2f} ms")
        for k, r in row["variants"].items():
            print(f"  {k:24s} {r['ms']:7.2f} ms  {r['ms'] / floor:5.2f}x floor  "
                  f"peak {r['peak_mib']:8.1f} MiB  {r['tflops']:.0f} TFLOP/s")  # fmt: skip
        result["shapes"].append(row)
        del h, w, variants
    path = write_result(result, "loss_floor", dev)
    path.with_suffix(".md").write_text(table(result) + "\n")  # the table the docs include
    return 0


def table(result: dict) -> str:
    """The markdown of a result: the kernel's configurations, then per shape each variant's ms, its
    ratio to the three matmuls' sum, its peak above the inputs and its matmuls' TFLOP/s."""
    sweep = sorted(result["sweep"], key=lambda r: r["ms"])
    best, worst = sweep[0], sweep[-1]
    lines = [f"{result['device']}, torch {result['torch']}, triton {result['triton']}, bf16; the rows kernel "
             f"over 4096 x 128256 logits at {len(sweep)} launch configurations: {best['ms']:.3f} ms "
             f"({best['gbps']:.0f} GB/s counting two reads and a write; datasheet {result['peak_gbps']:.0f}) "
             f"to {worst['ms']:.3f} ms", "",
             "| tokens x hidden x vocab | variant | ms | x three matmuls | peak MiB above inputs | TFLOP/s |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for row in result["shapes"]:
        shape = f"{row['tokens']} x {row['hidden']} x {row['vocab']}"
        for k, r in row["variants"].items():
            lines.append(f"| {shape} | {k} | {r['ms']:.2f} | {r['ms'] / row['floor_ms']:.2f} | "
                         f"{r['peak_mib']:.0f} | {r['tflops']:.0f} |")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
