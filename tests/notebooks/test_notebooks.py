"""The analysis notebooks: each executes cleanly under the small settings (on a copy; the committed
files are never touched), and the committed files carry outputs of a full-settings execution."""

import shutil

import nbformat
import pytest

from fitting.notebook_support import NOTEBOOKS, execute_notebook

pytestmark = pytest.mark.notebooks
PATHS = sorted(NOTEBOOKS.glob("*.ipynb"))
IDS = [p.stem for p in PATHS]


def _code_cells(nb):
    return [c for c in nb.cells if c.cell_type == "code"]


def _images(nb) -> int:
    return sum("image/png" in o.get("data", {}) for c in _code_cells(nb) for o in c.outputs)


def _settings_line(nb) -> str:
    """The first cell prints the Settings it ran with."""
    text = "".join(o.get("text", "") for o in _code_cells(nb)[0].outputs if o.output_type == "stream")
    return next(line for line in text.splitlines() if line.startswith("Settings("))


def test_the_notebooks_exist():
    assert IDS == ["01_approximation_error", "02_fewbit_comparison", "03_training_equivalence"]


@pytest.mark.parametrize("path", PATHS, ids=IDS)
def test_executes_with_small_settings(path, tmp_path):
    copy = tmp_path / path.name
    shutil.copy(path, copy)
    nb = execute_notebook(copy, copy, small=True, timeout=300)  # raises CellExecutionError on any error
    assert all(c.execution_count is not None for c in _code_cells(nb))
    assert not [o for c in _code_cells(nb) for o in c.outputs if o.output_type == "error"]
    assert _images(nb) >= 1
    assert "small=True" in _settings_line(nb)


@pytest.mark.parametrize("path", PATHS, ids=IDS)
def test_committed_with_full_outputs(path):
    nb = nbformat.read(path, as_version=4)
    cells = _code_cells(nb)
    assert [c.execution_count for c in cells] == list(range(1, len(cells) + 1)), "re-run notebooks/execute.py"
    assert not [o for c in cells for o in c.outputs if o.output_type == "error"]
    assert _images(nb) >= 1
    assert "small=False" in _settings_line(nb)
