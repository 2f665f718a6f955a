"""Could an inverted q_norm / k_norm keep less than its output y? Qwen3's (and OLMo-2's, Gemma-3's)
query and key norms feed rotary embeddings, q_rot = q cos + rotate_half(q) sin, whose multiplies save
cos and sin, not q; attention then saves q_rot. So the inverted norm keeps y itself (today's
invact.norm). The alternative measured here: recover y from the q_rot attention keeps, by the inverse
rotation, and keep nothing of y (or 4 bits per element that correct the recovered value by up to
7 units in its last place).

For y = the Llama-style RMSNorm of random rows (Qwen3's q_norm: head_dim 128, RoPE theta 1e6), weights
1 + s * N(0, 1) for a few spreads s, per dtype: the share of y's elements the inverse rotation gives
back bitwise, and within 7 units; and the RMS error against float64 of the gradients (dx, dweight)
invact.norm's backward computes from each candidate y, as a multiple of the error of the replaced
module's own gradients (autograd through its ops). Writes benchmarks/results/rope_inversion_cpu.json
and prints a markdown table.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from timing import cpu_model, write_result

THETA, EPS = 1e6, 1e-6
# codes of the 4-bit correction: the difference of y and the recovered value in units in the last place
CODE_MAX = 7


def _ordered(t: torch.Tensor) -> torch.Tensor:
    """Each float's bit pattern as an int64 that orders like the values (sign-magnitude to integers)."""
    bits = t.element_size() * 8
    i = t.view({16: torch.int16, 32: torch.int32}[bits]).to(torch.int64)
    magnitude = i & ((1 << (bits - 1)) - 1)
    return torch.where(i < 0, -magnitude, magnitude)


def _from_ordered(o: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    bits = torch.finfo(dtype).bits
    i = torch.where(o < 0, (-o) | (1 << (bits - 1)), o)
    i = torch.where(i >= 1 << (bits - 1), i - (1 << bits), i)  # as the signed pattern
    return i.to({16: torch.int16, 32: torch.int32}[bits]).view(dtype)


def _rotary(seq: int, dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin as Hugging Face's rotary embedding gives them: (seq, dim), halves repeated, in the
    model's dtype."""
    inv_freq = 1.0 / THETA ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = torch.outer(torch.arange(seq, dtype=torch.float64), inv_freq).float()
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(q: torch.Tensor) -> torch.Tensor:
    half = q.shape[-1] // 2
    return torch.cat((-q[..., half:], q[..., :half]), dim=-1)


def _unrotate(q_rot: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """q from q_rot = q cos + rotate_half(q) sin, in fp32: per pair (j, j + d/2) the inverse of the
    2 x 2 matrix [[c1, -s1], [s2, c2]] of the rounded cos and sin (their squares need not sum to 1)."""
    half = q_rot.shape[-1] // 2
    (c1, c2), (s1, s2), (e1, e2) = (t.float().split(half, dim=-1) for t in (cos, sin, q_rot))
    det = c1 * c2 + s1 * s2
    return torch.cat(((c2 * e1 + s1 * e2) / det, (c1 * e2 - s2 * e1) / det), dim=-1)


def measure(dtype: torch.dtype, spread: float, heads: int, seq: int, dim: int) -> dict:
    from invact import norm

    v = norm.VARIANTS["rms"]  # Qwen3RMSNorm's formula (coeffs/norms.json)
    g = torch.Generator().manual_seed(0)
    w = (1 + spread * torch.randn(dim, generator=g)).to(dtype)
    x = (3 * torch.randn(1, heads, seq, dim, generator=g)).to(dtype)
    dy = torch.randn(1, heads, seq, dim, generator=g).to(dtype)
    # float64 truth
    x64, w64, dy64 = x.double(), w.double(), dy.double()
    rstd64 = torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + EPS)
    h64 = x64 * rstd64
    gw = dy64 * w64
    truth = (rstd64 * (gw - h64 * (gw * h64).mean(-1, keepdim=True)), (dy64 * h64).reshape(-1, dim).sum(0))

    def error(grads) -> tuple[float, float]:
        return tuple(float((a.double() - b).norm() / b.norm()) for a, b in zip(grads, truth, strict=True))

    xe, we = x.clone().requires_grad_(), w.clone().requires_grad_()
    y, _, rstd = norm.forward(xe, we, None, EPS, v)  # the module's own ops: autograd gives its gradients
    y.backward(dy)
    eager = error((xe.grad, we.grad))
    y = y.detach()
    cos, sin = _rotary(seq, dim, dtype)
    q_rot = y * cos + _rotate_half(y) * sin  # Hugging Face's apply_rotary_pos_emb, in y's dtype
    recovered = _unrotate(q_rot, cos, sin)
    rounded = recovered.to(dtype)
    code = _ordered(y) - _ordered(rounded)
    corrected = _from_ordered(_ordered(rounded) + code.clamp(-CODE_MAX, CODE_MAX), dtype)

    def ours(kept: torch.Tensor) -> tuple[float, float]:
        dx, dw, _ = norm.backward(dy, kept, None, rstd.detach(), w, None, v, False, (True, True, False))
        return error((dx.to(dtype), dw))

    row = {"dtype": str(dtype).removeprefix("torch."), "spread": spread,
           "eager_dx": eager[0], "eager_dw": eager[1],
           "exact_share": float((code == 0).float().mean()),
           "within_code_share": float((code.abs() <= CODE_MAX).float().mean())}  # fmt: skip
    for name, kept in (("y", y), ("recovered", recovered), ("corrected", corrected)):
        dx, dw = ours(kept)
        row[f"{name}_dx"], row[f"{name}_dw"] = dx / eager[0], dw / eager[1]
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--heads", type=int, default=8, help="heads (default 8)")
    parser.add_argument("--seq", type=int, default=2048, help="positions 0..seq-1 (default 2048)")
    parser.add_argument("--dim", type=int, default=128, help="head_dim, even (default 128, Qwen3's)")
    parser.add_argument("--spreads", type=float, nargs="+", default=[0.1, 0.3, 1.0],
                        help="weight spreads s: weights 1 + s N(0, 1) (default 0.1 0.3 1.0)")  # fmt: skip
    parser.add_argument("--small", action="store_true", help="a smoke run: 2 heads, 64 positions, dim 16")
    parser.add_argument("--out", default=None, help="JSON path (default results/rope_inversion_cpu.json)")
    args = parser.parse_args(argv)
    if args.small:
        args.heads, args.seq, args.dim = 2, 64, 16
    for name in ("heads", "seq", "dim"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be positive")
    if args.dim % 2:
        parser.error("--dim must be even (rotary embeddings pair j with j + dim/2)")
    rows = [
        measure(dtype, spread, args.heads, args.seq, args.dim)
        for dtype in (torch.bfloat16, torch.float16, torch.float32)
        for spread in args.spreads
    ]
    print(f"\n{cpu_model()}, torch {torch.__version__}: {args.heads} heads x {args.seq} positions x "
          f"{args.dim}; gradient RMS error against float64 as a multiple of the module's own\n")  # fmt: skip
    print("| dtype | weight spread | y bitwise from q_rot | within 7 units | dx, dweight: y kept | "
          "from q_rot | from q_rot + 4 bits |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['dtype']} | {r['spread']} | {100 * r['exact_share']:.1f}% | "
              f"{100 * r['within_code_share']:.1f}% | {r['y_dx']:.2f}, {r['y_dw']:.2f} | "
              f"{r['recovered_dx']:.2f}, {r['recovered_dw']:.2f} | "
              f"{r['corrected_dx']:.2f}, {r['corrected_dw']:.2f} |")  # fmt: skip
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    result = {"device": "cpu", "cpu": cpu_model(), "torch": torch.__version__, "settings": settings,
              "rows": rows}  # fmt: skip
    write_result(result, "rope_inversion", "cpu", out=Path(args.out) if args.out else None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
