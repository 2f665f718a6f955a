"""The per-row arithmetic the loss's torch row passes share, on one device (invact.loss.op's _rows_pass)
and over a vocabulary's shards (invact.loss.parallel.rows): what a model applies between its head and its
loss on a chunk of logits (`transformed`: scalar multiplications and divisions, Cohere's logit_scale and
Granite's logits_scaling, and tanh, Gemma 2/3's final softcapping, in fp32 with the factors of its
derivative), each row's loss from its log-sum-exp (`row_losses`), and its gradient from its softmax
(`gradient_into`)."""

from __future__ import annotations

import torch


def transformed(pre: torch.Tensor, ops: tuple, keep: bool):
    """z = ops applied to pre, in fp32 (pre itself where it is fp32: a chunk's fresh logits, which the
    callers change in place), and the derivative's factors: the product of the scalars and, when
    keep, each tanh's output (each contributes 1 - t^2)."""
    z = pre.float() if pre.dtype != torch.float32 else pre
    scale, tanhs = 1.0, []
    for op in ops:
        if op[0] == "mul":
            z.mul_(op[1])
            scale *= op[1]
        elif op[0] == "div":  # divided, not multiplied by the reciprocal: the model's own rounding
            z.div_(op[1])
            scale /= op[1]
        else:  # "tanh"
            z.tanh_()
            if keep:
                tanhs.append(z.clone())
    return z, scale, tanhs


def row_losses(lse, picked, total, t, cw, smoothing: float, classes: int):
    """(each row's loss, fp32 (rows,); cw[t] and cw's sum, None without class weights) from its log-sum-exp
    `lse`, its target's logit `picked` and (label smoothing) its logits' sum `total` (weighted by cw),
    over `classes` classes: F.cross_entropy's (1 - eps) w[t] nll + eps / C sum_c w_c (-log p_c)."""
    losses = lse - picked
    picked_w = whole = None
    if cw is not None:
        picked_w, whole = cw[t], cw.sum()
        losses = losses * picked_w
    if smoothing:  # F.cross_entropy's (1 - eps) nll + eps * mean over classes of -log p (weighted)
        smooth = lse - total.div(classes) if cw is None else (whole * lse - total).div(classes)
        losses = (1 - smoothing) * losses + smoothing * smooth
    return losses, picked_w, whole


def gradient_into(
    z, p, at, mine, cw_cols, picked_w, whole, smoothing: float, classes: int, tanhs, factor, scale
):
    """d loss / d z times `scale` (rows,), written over z (its dtype): `p` the softmax over z's columns (fp32,
    changed in place; z itself where fp32), `at` (rows, 1) each target's column, `mine` (rows,) whether it
    is among these columns (None: always), `cw_cols` the class weights of these columns (None without),
    picked_w and whole as row_losses gives them; each tanh's output of `tanhs` contributes 1 - t^2, and
    the scalars' product `factor`. Row r's gradient: (1 - eps) w[t_r] (p_r - e_t) + eps/C (W p_r - w)."""
    if cw_cols is None:
        hit = (
            p.new_full(at.shape, -(1 - smoothing))
            if mine is None
            else torch.where(mine, -(1 - smoothing), 0.0).unsqueeze(1)
        )
        p.scatter_add_(1, at, hit)
        if smoothing:
            p.sub_(smoothing / classes)
    else:
        p.mul_(((1 - smoothing) * picked_w + smoothing / classes * whole).unsqueeze(1))
        hit = -(1 - smoothing) * picked_w
        p.scatter_add_(1, at, (hit if mine is None else torch.where(mine, hit, 0.0)).unsqueeze(1))
        if smoothing:
            p.sub_(cw_cols * (smoothing / classes))
    for th in tanhs:  # d tanh(u) / du = 1 - tanh(u)^2
        p.mul_(th.square_().neg_().add_(1))
    p.mul_((scale * factor if factor != 1.0 else scale).unsqueeze(1))
    if p is not z:
        z.copy_(p)
