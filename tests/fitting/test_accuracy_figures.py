"""The accuracy figures shown on two pages, the README's "Accuracy of q" table (one row per activation,
left / right branch) and docs/results/accuracy.md's (one row per branch), are the committed fits':
each branch's `linf_fp32` of coeffs/<activation>/paper.json (the paper's forms, our refit) and
floor.json (the runtime's default family), and the fp32 storage floor floor.json records (the README
gives the larger branch's, accuracy.md each branch's, both to two digits; recomputed here by
fitting.evaluate.storage_floor, it is what the file says). The paper's published
figures, where both pages give numbers, are the same on both. docs/fitting.md's table of the paper
family gives each branch's refit and its storage floors in fp32, fp16 and bf16, from the same files."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from codegen.coeffs_json import load
from fitting.activations import get_activation
from fitting.evaluate import FORMATS, storage_floor

ROOT = Path(__file__).resolve().parents[2]
ACTIVATIONS = ["gelu", "gelu_tanh", "silu", "quick_gelu"]  # the README's rows, in its order
BRANCHES = ("left", "right")


def _e(x: float, digits: int) -> str:
    """Printed as the pages print: 9.33e-4 (no exponent padding)."""
    return re.sub(r"e([+-])0*(\d)", lambda m: f"e{'-' if m[1] == '-' else ''}{m[2]}", f"{x:.{digits - 1}e}")


def _rows(page: str, header: str) -> dict[tuple[str, ...], list[str]]:
    """The cells of the table under `header` in `page`, keyed by the leading cells that name a row."""
    lines = (ROOT / page).read_text().splitlines()
    start = lines.index(header) + 2
    rows = {}
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[tuple(cells[:2]) if cells[1] in BRANCHES else (cells[0],)] = cells
    return rows


def _linf(activation: str, family: str) -> dict[str, str]:
    coeffs = load(ROOT / "coeffs" / activation / f"{family}.json")
    return {b: _e(coeffs.branches[b].errors["linf_fp32"], 3) for b in BRANCHES}


# The recorded storage floor against a recomputation (the same grid and formula): float64 sums of
# another order on another CPU differ in the last digits; 1e-9 relative is far below the 2 digits shown
RECOMPUTED_RTOL = 1e-9


def _floors(activation: str, dtype: str = "fp32") -> dict[str, float]:
    coeffs = load(ROOT / "coeffs" / activation / "floor.json")
    return {b: coeffs.branches[b].storage_floor[dtype] for b in BRANCHES}


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_the_recorded_storage_floors_are_fitting_evaluates(activation):
    act = get_activation(activation)
    for branch, recorded in _floors(activation).items():
        assert storage_floor(act, branch, FORMATS["fp32"]) == pytest.approx(recorded, rel=RECOMPUTED_RTOL)


README = _rows("README.md", "| activation | paper, published | paper, our refit | invact `floor` (default) | "
               "fp32 storage floor |")  # fmt: skip
DOCS = _rows("docs/results/accuracy.md", "| activation | branch | paper, published | paper, refit | "
             "floor (runtime default) | fp32 storage floor |")  # fmt: skip


def test_the_pages_show_the_same_activations():
    assert [key[0] for key in README] == ACTIVATIONS
    assert sorted(DOCS) == sorted((a, b) for a in ACTIVATIONS for b in BRANCHES)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_the_readmes_row_is_the_committed_fits(activation):
    _, published, refit, floor, storage = README[(activation,)]
    paper, runtime = _linf(activation, "paper"), _linf(activation, "floor")
    assert refit == f"{paper['left']} / {paper['right']}"
    assert floor == f"{runtime['left']} / {runtime['right']}"
    assert storage == _e(max(_floors(activation).values()), 2)
    left, right = (DOCS[activation, b][2] for b in BRANCHES)
    if re.fullmatch(r"[\d.e-]+", left) and re.fullmatch(r"[\d.e-]+", right):
        assert published == f"{left} / {right}"


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("branch", BRANCHES)
def test_the_docs_row_is_the_committed_fits(activation, branch):
    _, _, _, refit, floor, storage = DOCS[activation, branch]
    assert refit == _linf(activation, "paper")[branch]
    assert floor == _linf(activation, "floor")[branch]
    assert storage == _e(_floors(activation)[branch], 2)


def _fitting_rows() -> dict[tuple[str, str], list[str]]:
    """docs/fitting.md's paper-family table, keyed by (activation, branch): "left (x < T)" is left."""
    rows = _rows("docs/fitting.md", "| activation | branch | published | refit (written to `coeffs/`) | "
                 "better by | storage floor fp32 / fp16 / bf16 |")  # fmt: skip
    return {(a, cells[1].split()[0]): cells for (a, *_), cells in rows.items()}


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("branch", BRANCHES)
def test_the_fitting_pages_row_is_the_committed_fits(activation, branch):
    _, _, _, refit, _, floors = _fitting_rows()[activation, branch]
    assert refit == _linf(activation, "paper")[branch]
    assert floors == " / ".join(_e(_floors(activation, d)[branch], 2) for d in ("fp32", "fp16", "bf16"))
