"""16-bit gradient accuracy: InvAct's input gradient against torch's own, for x ~ N(0, 1) stored in bf16
or fp16 and dy = 1, both measured against f'(x) in float64 at the stored x.

Per activation and dtype: the RMS error of torch's gradient, of InvAct's with the q its 16-bit kernels
evaluate (`q16`: the 'half' family where coeffs/defaults_16bit.json names one, else the fp32 family's q)
and, for comparison, with the fp32 family's q at the same stored y (`fp32 q`); the ratio to torch's;
and per branch the largest error against that branch's storage floor in the dtype (the error of the
exact estimator once y is stored: docs/fitting.md, "Error metrics"). Runs the CPU backend, which
evaluates the q the GPU kernels print for 16-bit y (invact.activation._portable). Prints a markdown table and
writes results/accuracy_16bit_cpu.json.
"""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

import torch

from timing import version, write_result

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
FLOOR_KEY = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def _rms(err: torch.Tensor) -> float:
    return err.square().mean().sqrt().item()


def measure(name: str, dtype: torch.dtype, n: int, seed: int = 0) -> dict:
    """One row: RMS errors (torch, InvAct with q16, InvAct with the fp32 q), their ratios to torch's,
    and per branch max error / storage floor, over n inputs x ~ N(0, 1) rounded to `dtype` (those at
    a flat region's edge aside)."""
    from invact.activation.activations import ACTIVATIONS
    from invact.activation.ops import invact as invact_op

    act = ACTIVATIONS[name]
    gen = act.generated
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(dtype)
    # Not at the edge of a flat region (hardswish's x = -3): f'(x) there is one-sided, where torch and
    # InvAct both give the flat side's 0 (y cannot tell the two apart).
    xd, step = x.double(), 1e-9 * (1 + x.double().abs())
    x = x[(act.f(xd - step) != act.f(xd)) & (act.f(xd + step) != act.f(xd)) | (act.df(xd) == 0)]
    reference = act.df(x.double())
    xt = x.clone().requires_grad_()
    act.torch_forward(xt).backward(torch.ones_like(xt))
    torch_err = xt.grad.double() - reference
    xi = x.clone().requires_grad_()
    y = invact_op(xi, name, "bits")
    y.backward(torch.ones_like(y))
    err = xi.grad.double() - reference
    # The fp32 family's q at the same stored y: what the 16-bit kernels evaluated before their own family.
    left = None if act.monotone else x < act.threshold
    q32 = gen.q_right(y.detach().float()) if left is None else torch.where(
        left, gen.q_left(y.detach().float()), gen.q_right(y.detach().float()))  # fmt: skip
    err32 = q32.to(dtype).double() - reference
    row = {
        "activation": name, "dtype": str(dtype).removeprefix("torch."), "n": n,
        "family_16bit": gen.FAMILY_16BIT, "rms_torch": _rms(torch_err), "rms_q16": _rms(err),
        "rms_fp32_q": _rms(err32),
    }  # fmt: skip
    # None where torch's gradient is exact (a piecewise-linear f: leaky_relu, relu6)
    row["ratio_q16"] = row["rms_q16"] / row["rms_torch"] if row["rms_torch"] else None
    row["ratio_fp32_q"] = row["rms_fp32_q"] / row["rms_torch"] if row["rms_torch"] else None
    everywhere = torch.ones_like(x, dtype=torch.bool)
    masks = {"right": everywhere} if left is None else {"left": left, "right": ~left}
    row["max_error"] = {b: err[m].abs().max().item() for b, m in masks.items() if m.any()}
    floors = {b: gen.STORAGE_FLOOR[b][FLOOR_KEY[dtype]] for b in row["max_error"]}
    row["storage_floor"] = floors
    # None where the floor is 0 (q constant on the branch: leaky_relu, relu6): dx's rounding alone
    row["max_over_floor"] = {b: e / floors[b] if floors[b] else None for b, e in row["max_error"].items()}
    return row


def main(argv: list[str] | None = None) -> int:
    from invact.activation.activations import ACTIVATIONS

    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--only", nargs="*", help="activations (default: all)")
    parser.add_argument("--n", type=int, default=2**20, help="inputs per row (default 2^20)")
    parser.add_argument("--out", type=Path, help="JSON path (default results/accuracy_16bit_cpu.json)")
    args = parser.parse_args(argv)
    names = args.only or sorted(ACTIVATIONS)
    unknown = sorted(set(names) - set(ACTIVATIONS))
    if unknown:
        parser.error(f"unknown activation(s) {', '.join(unknown)}; known: {', '.join(sorted(ACTIVATIONS))}")
    if args.n < 1:
        parser.error("--n must be positive")
    rows = []
    for i, name in enumerate(names):
        for dtype in DTYPES.values():
            print(f"[{i + 1}/{len(names)}] {name} {dtype}", file=sys.stderr)
            rows.append(measure(name, dtype, args.n))
    print("\n| activation | dtype | 16-bit family | RMS torch | RMS InvAct (q16) | x torch | RMS with fp32 q "
          "| x torch | max / storage floor |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        floor = ", ".join(f"{b} {v:.2f}" for b, v in r["max_over_floor"].items() if v is not None) or "-"
        ratios = [f"{r[k]:.2f}" if r[k] is not None else "-" for k in ("ratio_q16", "ratio_fp32_q")]
        rms = f"{r['rms_torch']:.3g} | {r['rms_q16']:.3g} | {ratios[0]} | {r['rms_fp32_q']:.3g} | {ratios[1]}"
        print(f"| {r['activation']} | {r['dtype']} | {r['family_16bit']} | {rms} | {floor} |")
    result = {
        "device": f"cpu: {platform.processor() or platform.machine()}", "torch": version("torch"),
        "n": args.n, "rows": rows,
    }  # fmt: skip
    write_result(result, "accuracy_16bit", "cpu", out=args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
