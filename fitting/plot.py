"""The paper's Fig. 2 analogue for one family fit.

Top row: f'(f^-1(y)) against y for each branch (exact, start/published, written fit; one column for a
monotone activation), and f'(x) against x. Bottom row: |q(y) - target| against y per branch and
against x, on a log scale, with the fp32/fp16/bf16 storage floors as horizontal lines.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.backend_bases import FigureCanvasBase  # noqa: E402

from codegen.coeffs_json import write_atomic  # noqa: E402
from fitting.activations import get_activation  # noqa: E402
from fitting.evaluate import compile_q, metric_x_grid  # noqa: E402
from fitting.pipeline import FamilyFit  # noqa: E402
from fitting.targets import target  # noqa: E402

_FLOOR_STYLE = {"fp32": ":", "fp16": "--", "bf16": "-."}


def figure(fit: FamilyFit) -> plt.Figure:
    act = get_activation(fit.activation)
    n = len(fit.branches)
    fig, axes = plt.subplots(2, n + 1, figsize=(5 * (n + 1), 8), constrained_layout=True)
    fig.suptitle(f"{fit.activation} / {fit.family.name}: q(y) approximates f'(f^-1(y)) on each branch")
    in_x, err_x = axes[0, n], axes[1, n]
    # Log axes from 1e-10, or lower for a fit below that (the 'exact' family: float64 rounding).
    err_low = max(1e-17, min(1e-10, 0.1 * min(r.chosen.errors["linf"] for r in fit.branches.values())))
    for col, (branch, result) in enumerate(fit.branches.items()):
        x = metric_x_grid(act, branch)
        y = act.f(x)
        exact = target(act, y, branch)
        top, bottom = axes[0, col], axes[1, col]
        top.plot(y, exact, "k-", lw=2, label="exact")
        shown = {result.candidates[0].label: result.candidates[0]} if len(result.candidates) > 1 else {}
        shown["written"] = result.chosen
        for label, cand in shown.items():
            q = compile_q(fit.family.branches[branch].substituted(cand.coefficients))(y)
            err = np.abs(q - exact)
            style = "-" if label == "written" else "--"
            name = f"{label} (linf {cand.errors['linf']:.2e})"
            top.plot(y, q, style, lw=1, label=name)
            bottom.semilogy(y, np.maximum(err, 1e-17), style, lw=0.8, label=name)
            err_x.semilogy(x, np.maximum(err, 1e-17), style, lw=0.8, label=f"{branch}: {label}")
        for dtype, floor in result.storage_floor.items():
            bottom.axhline(
                floor, color="gray", ls=_FLOOR_STYLE[dtype], lw=0.8, label=f"{dtype} storage floor"
            )
        where = f"x {'<' if branch == 'left' else '>='} T = {act.threshold:.4f}"
        if act.monotone:
            where = "monotone: every x, no bit"
        top.set(title=f"{branch} branch ({where})", xlabel="y", ylabel="f'(f^-1(y))")
        bottom.set(xlabel="y", ylabel="|q(y) - f'(f^-1(y))|", ylim=(err_low, 1))
        if branch == "right":  # past y ~ 5 the target is 1 to float64 precision: show the shape
            for ax in (top, bottom):
                ax.set_xlim(act.y_min - 0.1, 5.0)
        top.legend(fontsize=8)
        bottom.legend(fontsize=7)
    x = np.linspace(-6, 6, 2001)
    in_x.plot(x, act.df(x), "k-", lw=2, label="f'(x)")
    if not act.monotone:
        in_x.axvline(act.threshold, color="gray", ls=":", label="T")
    in_x.set(title="in x", xlabel="x", ylabel="f'(x)")
    in_x.legend(fontsize=8)
    err_x.set(xlabel="x", ylabel="|gradient error|", ylim=(err_low, 1), xlim=(-20, 20))
    err_x.legend(fontsize=7)
    return fig


def plot_format(path: str | os.PathLike) -> str:
    """The image format `path`'s suffix names (no suffix: png); ValueError, one line, if matplotlib
    cannot write it. Cheap: call it before any work."""
    fmt = Path(path).suffix.lstrip(".").lower() or "png"
    supported = FigureCanvasBase.get_supported_filetypes()
    if fmt not in supported:
        raise ValueError(
            f"cannot write plot {path}: format {fmt!r} (from its suffix) is not one matplotlib writes; "
            f"use one of {', '.join(sorted(supported))}"
        )
    return fmt


def figure_bytes(fit: FamilyFit, fmt: str) -> bytes:
    """The figure rendered in `fmt` (see plot_format), in memory: nothing is written."""
    fig = figure(fit)
    try:
        buffer = io.BytesIO()
        fig.savefig(buffer, dpi=110, format=fmt)
        return buffer.getvalue()
    finally:
        plt.close(fig)


def save_figure(fit: FamilyFit, path: str | os.PathLike) -> None:
    """Render, then write atomically; the format follows the suffix (.png, .pdf, .svg; plot_format)."""
    write_atomic(path, figure_bytes(fit, plot_format(path)))
