"""The search report: each branch's Pareto front (flops against error), the chosen member marked."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from fitting.search.front import Measured


def print_fronts(activation: str, fronts: dict[str, list[Measured]], chosen: dict[str, Measured],
                 limits: dict[str, int] | None, console: Console) -> None:  # fmt: skip
    for branch, front in fronts.items():
        limit = (limits or {}).get(branch)
        title = f"{activation} / search, {branch} branch: Pareto front" + (
            f" (pick: <= {limit} flops)" if limit else ""
        )
        table = Table(title=title)
        for name in ("flops", "linf_fp32", "l2", "expression (coefficients fitted)"):
            table.add_column(name, justify="left" if name.startswith("expr") else "right")
        for m in front:
            mark = " *" if m is chosen[branch] else ""
            expr = str(m.form.substituted(m.coefficients))
            shown = expr if len(expr) < 110 else expr[:107] + "..."
            errs = f"{m.errors['linf_fp32']:.3e}", f"{m.errors['l2']:.3e}"
            table.add_row(f"{m.flops}{mark}", *errs, shown, style="bold" if mark else None)
        console.print(table)
