"""The CLI's error report: one table per family fit, candidates per branch next to the storage floor."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from fitting.pipeline import SELECTION_METRIC, FamilyFit

COLUMNS = ("linf", "linf_fp32", "linf_fp16", "linf_bf16", "l2")  # every key of ERROR_KEYS


def error_table(fit: FamilyFit, written_to: str | None) -> Table:
    caption = (
        "linf: max |q(y) - f'(f^-1(y))|, x in [-20, 20]; linf_<dtype>: y stored in that dtype; "
        "l2: RMS with x ~ N(0, 1). Storage floor: the exact estimator's error once y is stored."
    )
    table = Table(title=f"{fit.activation} / {fit.family.name}", caption=caption, caption_justify="left")
    table.add_column("branch")
    table.add_column("coefficients")
    for name in COLUMNS:
        table.add_column(name, justify="right")
    table.add_column("flops", justify="right")
    for branch, result in fit.branches.items():
        for cand in result.candidates:
            mark = " *" if cand is result.chosen else ""
            row = [f"{cand.errors[k]:.3e}" for k in COLUMNS]
            style = "bold" if mark else None
            table.add_row(branch, cand.label + mark, *row, str(result.flops), style=style)
        floors = [
            f"{result.storage_floor[k.removeprefix('linf_')]:.1e}" if k.startswith("linf_") else ""
            for k in COLUMNS
        ]
        table.add_row(branch, "storage floor", *floors, "", style="dim", end_section=True)
    if written_to:
        table.caption += f"\n* written to {written_to} (smallest {SELECTION_METRIC})."
    return table


def improvement_line(fit: FamilyFit) -> str | None:
    """'linf_fp32 vs published: left 1.34x better, right 6.49x better' (start for unpublished); None
    when nothing was fitted (a form without coefficients, e.g. the 'exact' family)."""
    parts = []
    for branch, result in fit.branches.items():
        if len(result.candidates) == 1:
            return None
        base = result.candidates[0]
        ratio = base.errors[SELECTION_METRIC] / result.chosen.errors[SELECTION_METRIC]
        parts.append(f"{branch} {ratio:.2f}x better")
    first = next(iter(fit.branches.values())).candidates[0].label
    return f"{SELECTION_METRIC} of the written fit vs {first}: " + ", ".join(parts)


def print_report(fit: FamilyFit, written_to: str | None, console: Console | None = None) -> None:
    console = console or Console()
    console.print(error_table(fit, written_to))
    line = improvement_line(fit)
    if line:
        console.print(line)
