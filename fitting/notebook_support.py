"""What the notebooks in notebooks/ compute and draw, kept here so their cells stay short.

Settings: INVACT_NOTEBOOK_SMALL=1 shrinks grids and the largest k so that CI executes each notebook
in seconds; unset, the notebooks run with the full settings their committed outputs show.
Figures are matplotlib `Figure`s (no pyplot state) shown as inline PNGs by `show`.
"""

from __future__ import annotations

import io
import json
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from codegen.coeffs_json import SCHEMA, CoeffFile, load
from fitting import quantize
from fitting.activations import Activation, get_activation
from fitting.evaluate import X_RANGE, QFunction, compile_q, linf, metric_x_grid
from fitting.targets import target

REPO = Path(__file__).resolve().parents[1]
COEFFS = REPO / "coeffs"
NOTEBOOKS = REPO / "notebooks"
SMALL_ENV = "INVACT_NOTEBOOK_SMALL"
_FLOOR_STYLE = {"fp32": ":", "fp16": "--", "bf16": "-."}
_BRANCH_COLOR = {"left": "C0", "right": "C1"}


@dataclass(frozen=True)
class Settings:
    small: bool
    max_bits: int  # FewBit quantizers for k = 1..max_bits
    cells: int  # L2 DP grid (fitting.quantize.l2_optimal)
    samples: int  # L-inf samples (fitting.quantize.linf_optimal) and x-space L-inf evaluation
    metric_cells: int  # x-space L2 quadrature cells (fitting.quantize.x_errors)
    plot_stride: int  # plot every n-th point of the metric grid
    remeasure: bool  # re-measure linf from the expression next to the JSON's value


def settings() -> Settings:
    if os.environ.get(SMALL_ENV, "") not in ("", "0"):
        return Settings(True, 3, 300, 2**14, 2**11, 16, False)
    return Settings(False, 8, 4000, 2**20, 2**14, 1, True)


def coeff_files(root: Path = COEFFS) -> list[Path]:
    """Every coeffs/<activation>/<family>.json of schema invact-coeffs/1 (Pareto fronts, *_front.json,
    have another schema and are skipped), sorted by activation then family."""
    out = []
    for path in sorted(root.glob("*/*.json")):
        if path.stem.endswith("_front"):
            continue
        if json.loads(path.read_text(encoding="utf-8")).get("schema") == SCHEMA:
            out.append(path)
    return out


@dataclass(frozen=True)
class Approximation:
    path: Path
    act: Activation
    coeffs: CoeffFile
    q: dict[str, QFunction]  # branch -> q(y), float64 ("right" alone for a monotone activation)

    @property
    def label(self) -> str:
        return f"{self.coeffs.activation}/{self.coeffs.family}"

    def of_x(self) -> quantize.XFunction:
        return quantize.invact_of_x(self.act, self.q["left"], self.q["right"])


def load_approximation(path: Path) -> Approximation:
    coeffs = load(path)
    q = {b: compile_q(branch.sympy_expression()) for b, branch in coeffs.branches.items()}
    return Approximation(path, get_activation(coeffs.activation), coeffs, q)


def show(fig: Figure, dpi: int = 80) -> None:
    """Display a figure as an inline PNG (independent of the matplotlib backend)."""
    from IPython.display import Image, display

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    display(Image(data=buf.getvalue(), format="png"))


def markdown_table(rows: Iterable[dict], columns: list[str], digits: int = 3) -> str:
    """A Markdown table; floats to `digits` significant digits, everything else by str."""
    fmt = lambda v: f"{v:.{digits}g}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r[c]) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def show_table(rows: Iterable[dict], columns: list[str], digits: int = 3) -> None:
    from IPython.display import Markdown, display

    display(Markdown(markdown_table(rows, columns, digits)))


# --- notebook 01: approximation error -----------------------------------------------------------------
def floor_ratios(rows: list[dict]) -> list[dict]:
    """Per row of error_rows: linf_<dtype> / floor_<dtype>, how far a family is from its storage
    floor. A floor of 0 (leaky_relu: q is a constant per sign of y, which rounding keeps) gives 0
    where the error is 0 too, inf otherwise."""

    dtypes = ("fp32", "fp16", "bf16")

    def ratio(err: float, floor: float) -> float:
        return err / floor if floor else (0.0 if err == 0 else float("inf"))

    out = []
    for r in rows:
        ratios = {d: ratio(r[f"linf_{d}"], r[f"floor_{d}"]) for d in dtypes}
        out.append({"file": r["file"], "branch": r["branch"]} | ratios)
    return out


def error_rows(a: Approximation, remeasure: bool) -> list[dict]:
    """Per branch: the JSON's errors and storage floors, plus linf re-measured from the expression."""
    rows = []
    for b, br in a.coeffs.branches.items():
        row = {"file": a.label, "branch": b, "flops": br.flops, **br.errors}
        row |= {f"floor_{k}": v for k, v in br.storage_floor.items()}
        row["linf (re-measured)"] = linf(a.act, b, a.q[b]) if remeasure else "-"
        rows.append(row)
    return rows


ERROR_COLUMNS = ["file", "branch", "flops", "l2", "linf", "linf (re-measured)", "linf_fp32", "linf_fp16",
                 "linf_bf16", "floor_fp32", "floor_fp16", "floor_bf16"]  # fmt: skip


def approximation_figure(a: Approximation, stride: int = 1) -> Figure:
    """The paper's Fig. 2 for one file: exact and approximate f'(f_b^-1(y)) against y, |error| against
    y per branch (log, with the storage floors), and |q(f(x)) - f'(x)| against x (log). A monotone
    activation has one branch, "right", over all of x."""
    act = a.act
    fig = Figure(figsize=(16, 4.2), layout="constrained")
    ax_q, ax_ey, ax_ex, ax_sx = fig.subplots(1, 4)
    split = "monotone: one branch, no bit" if act.monotone else f"T = {act.threshold:.4f}"
    fig.suptitle(f"{a.label}: q(y) approximates f'(f_b^-1(y)); {split}")
    for b in a.q:
        color = _BRANCH_COLOR[b]
        x = metric_x_grid(act, b)[::stride]
        y = act.f(x)
        exact = target(act, y, b)
        err = a.q[b](y) - exact
        view = x > -8 if b == "left" else x < 6  # the shape; farther out both are flat
        ax_q.plot(y[view], exact[view], "k-", lw=2.5, alpha=0.35)
        ax_q.plot(y[view], a.q[b](y[view]), "--", color=color, lw=1, label=f"q, {b}")
        abs_err = np.where(err == 0, np.nan, np.abs(err))  # exact zeros (far tails) have no log
        ax_ey.loglog(y - act.y_min, abs_err, color=color, lw=0.7, label=b)
        ax_ex.semilogy(x, abs_err, color=color, lw=0.7, label=b)
        ax_sx.plot(x[np.abs(x) < 8], err[np.abs(x) < 8], color=color, lw=0.8, label=b)
        for dtype, floor in a.coeffs.branches[b].storage_floor.items():
            ax_ex.axhline(floor, color=color, ls=_FLOOR_STYLE[dtype], lw=0.7, alpha=0.6)
    for dtype, ls in _FLOOR_STYLE.items():
        ax_ex.plot([], [], color="gray", ls=ls, lw=0.7, label=f"{dtype} storage floor")
    ax_q.plot([], [], "k-", lw=2.5, alpha=0.35, label="exact")
    ax_q.set(title="exact and approximate", xlabel="y = f(x)", ylabel="f'(f_b^-1(y))")
    ax_ey.set(title="|error| against y", xlabel="y - y_min", ylabel="|q(y) - f'(f_b^-1(y))|")
    ax_ex.set(title="|error| against x (floors per branch)", xlabel="x", ylabel="|q(f(x)) - f'(x)|")
    ax_sx.set(title="signed error against x", xlabel="x", ylabel="q(f(x)) - f'(x)")
    smallest_linf = min(br.errors["linf"] for br in a.coeffs.branches.values())
    for ax in (ax_ey, ax_ex):
        ax.set_ylim(bottom=min(1e-12, 0.1 * smallest_linf))  # lower for the 'exact' family's rounding
    ax_ex.set_xlim(*X_RANGE)
    for ax in (ax_q, ax_ey, ax_ex, ax_sx):
        ax.legend(fontsize=7)
    return fig


# --- notebook 02: FewBit comparison ----------------------------------------------------------------------
def fewbit_rows(act: Activation, s: Settings) -> list[dict]:
    """fitting.quantize.fewbit_table with the notebook's settings: rows k, objective, l2, linf, l2_normal."""
    return quantize.fewbit_table(act, s.max_bits, s.cells, s.samples, s.metric_cells)


def invact_rows(approximations: list[Approximation], s: Settings) -> list[dict]:
    """The x-space metrics of each InvAct file, on the same quadrature as the quantizers."""
    return [
        {"file": a.label, **quantize.x_errors(a.act, a.of_x(), cells=s.metric_cells, samples=s.samples)}
        for a in approximations
    ]


METRICS = {
    "l2": "L2: sqrt(int (g - f')^2 dx), x in [-100, 100]",
    "linf": "L-inf: max |g - f'|, x in [-100, 100]",
    "l2_normal": "L2, x ~ N(0, 1) (the project's l2)",
}


def comparison_figure(act: Activation, fewbit: list[dict], invact: list[dict], facts: dict | None) -> Figure:
    """The paper's Fig. 5 (right): per metric, the optimal k-bit quantizer for that metric against k, and
    each InvAct file as a horizontal line; a published FewBit re-implementation as markers when given."""
    fig = Figure(figsize=(16, 4.5), layout="constrained")
    fig.suptitle(f"{act.name}: optimal k-bit FewBit quantizers against InvAct (log scale)")
    for ax, (metric, title) in zip(fig.subplots(1, 3), METRICS.items(), strict=True):
        rows = [r for r in fewbit if r["objective"] == metric]
        ax.semilogy(
            [r["k"] for r in rows], [r[metric] for r in rows], "ko-", label=f"FewBit, optimal for {metric}"
        )
        if facts and metric != "l2_normal":
            col = 0 if metric == "l2" else 1
            ax.semilogy(list(facts), [v[col] for v in facts.values()], "s", mfc="none", color="gray",
                        label="FewBit, gradient descent (published)")  # fmt: skip
        for i, r in enumerate(invact):
            ax.axhline(r[metric], color=f"C{i}", lw=1.2, label=f"InvAct {r['file']}")
        ax.set(title=title, xlabel="k (bits per element)", ylabel="error")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend(fontsize=7)
    return fig


def comparison_rows(fewbit: list[dict], invact: list[dict]) -> list[dict]:
    """Per InvAct file and metric: its error, and the fewest bits an optimal quantizer needs to match it
    ("> k_max" when none of the computed k does)."""
    out = []
    for r in invact:
        for metric in METRICS:
            best = {f["k"]: f[metric] for f in fewbit if f["objective"] == metric}
            k = next((k for k in sorted(best) if best[k] <= r[metric]), None)
            out.append({"file": r["file"], "metric": metric, "InvAct": r[metric],
                        f"FewBit k={max(best)}": best[max(best)],
                        "bits FewBit needs": str(k) if k else f"> {max(best)}"})  # fmt: skip
    return out


def facts_rows(fewbit: list[dict]) -> list[dict]:
    """A published FewBit table (GELU, gradient descent on the unweighted L2) beside the optimal quantizers:
    the L2-optimal one's L2 and L-inf (the same quantity as the table's columns) and the L-inf optimum."""
    by = {(r["k"], r["objective"]): r for r in fewbit}
    return [
        {
            "k": k,
            "FACTS l2": l2,
            "optimal l2": by[k, "l2"]["l2"],
            "FACTS linf": li,
            "linf of the l2-optimal": by[k, "l2"]["linf"],
            "optimal linf": by[k, "linf"]["linf"],
        }
        for k, (l2, li) in quantize.FACTS_FEWBIT_GELU.items()
        if (k, "l2") in by
    ]


# --- execution -------------------------------------------------------------------------------------------
def execute_notebook(src: Path, dst: Path, small: bool, timeout: int = 1800) -> object:
    """Execute the notebook `src` with this interpreter's ipykernel (whatever kernels are installed
    elsewhere), with the kernel's working directory set to dst's folder, and write it to `dst`
    (which may be `src`). Timing metadata is not recorded, so re-execution changes only outputs."""
    import nbformat
    from jupyter_client.kernelspec import KernelSpec, KernelSpecManager
    from jupyter_client.manager import AsyncKernelManager
    from nbclient import NotebookClient
    from traitlets import default

    class ThisPython(KernelSpecManager):
        def get_kernel_spec(self, kernel_name: str) -> KernelSpec:
            argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
            return KernelSpec(argv=argv, display_name="Python 3", language="python", name=kernel_name)

    class ThisPythonKernel(AsyncKernelManager):
        @default("kernel_spec_manager")
        def _kernel_spec_manager_default(self) -> KernelSpecManager:
            return ThisPython()

    nb = nbformat.read(src, as_version=4)
    env = dict(os.environ, PYDEVD_DISABLE_FILE_VALIDATION="1")
    env.pop(SMALL_ENV, None)
    if small:
        env[SMALL_ENV] = "1"
    resources = {"metadata": {"path": str(dst.parent)}}
    client = NotebookClient(nb, kernel_name="python3", kernel_manager_class=ThisPythonKernel, timeout=timeout,
                            record_timing=False, resources=resources)  # fmt: skip
    client.execute(env=env)
    nbformat.write(nb, dst)
    return nb
