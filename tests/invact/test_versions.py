"""The supported torch and transformers range (invact._versions.SUPPORTED): pyproject.toml and the
README say the same, the running versions are inside it or said to be outside it, and a torch below it
is refused at import with one line."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from invact import _versions
from invact._versions import SUPPORTED, outside

ROOT = Path(__file__).resolve().parents[2]


def _project() -> dict:
    tomllib = pytest.importorskip("tomllib")  # the standard library's from Python 3.11
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _requirements() -> list[str]:
    project = _project()
    extras = project["optional-dependencies"]
    return [*project["dependencies"], *(r for group in extras.values() for r in group)]


@pytest.mark.parametrize("package", sorted(SUPPORTED))
def test_pyproject_requires_the_oldest_supported(package):
    # Every requirement line naming the package names the range's lower bound, nothing else.
    lines = [r for r in _requirements() if re.match(rf"{package}\b(?![-_])", r)]
    assert lines and set(lines) == {f"{package}>={SUPPORTED[package][0]}"}, lines


def test_torch_is_a_dependency():
    # Declared, so pip refuses a torch below the range; the README's set-up installs torch first, so an
    # installed torch inside it satisfies the line and pip pulls no other build.
    assert f"torch>={SUPPORTED['torch'][0]}" in _project()["dependencies"]


def test_the_readme_names_the_range():
    (torch_old, torch_new), (tf_old, tf_new) = SUPPORTED["torch"], SUPPORTED["transformers"]
    line = f"torch {torch_old} to {torch_new} and transformers {tf_old} to {tf_new}"
    assert line in (ROOT / "README.md").read_text().replace("\n", " ")


@pytest.mark.parametrize(
    "package, version, why",
    [
        ("torch", "2.10.1", "older"),
        ("torch", "2.11.0+cu130", None),
        ("torch", "2.13.0+cpu", None),
        ("torch", "2.15.3", None),  # a patch release of the newest tested minor is inside
        ("torch", "2.16.0.dev20261101", "newer"),
        ("torch", "3.0.0", "newer"),
        ("transformers", "4.56.2", "older"),
        ("transformers", "4.57.6", None),
        ("transformers", "5.0.0rc1", None),
        ("transformers", "5.24.1", None),
        ("transformers", "5.25.0", "newer"),
    ],
)
def test_outside(package, version, why):
    assert outside(package, version) == why


def test_the_running_torch_is_inside():
    # CI's torch is one the package supports: its tests would otherwise test nothing users are told to run.
    assert outside("torch", torch.__version__) is None


def test_an_older_torch_is_refused_in_one_line():
    with pytest.raises(
        ImportError, match=r"^invact supports torch >= 2\.\d+; this is torch 2\.9\.1: upgrade"
    ):
        _versions.check("2.9.1")


def test_a_newer_torch_warns_once_in_one_line():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _versions.check("2.99.0")
    torch_says = [str(w.message) for w in caught if "torch 2.99.0" in str(w.message)]
    assert len(torch_says) == 1 and "\n" not in torch_says[0] and "untested" in torch_says[0]


def test_importing_invact_is_silent_inside_the_range():
    # A fresh interpreter, warnings as errors: the supported torch (and transformers) say nothing.
    done = subprocess.run(
        [sys.executable, "-W", "error", "-c", "import invact"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr


def _compat():
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        import compat
    finally:
        sys.path.pop(0)
    return compat


def test_make_compat_runs_the_ranges_ends():
    # tests/compat.py's environments reach both ends of both ranges.
    pinned = _compat().ENVIRONMENTS.values()
    for i, package in enumerate(("torch", "transformers")):
        minors = {".".join(env[i].split(".")[:2]) for env in pinned}
        assert set(SUPPORTED[package]) <= minors, (package, minors)


@pytest.mark.skipif(bool(os.environ.get("INVACT_COMPAT")), reason="inside make compat: it rewrites the table")
def test_the_committed_compat_table_is_its_results_and_all_pass():
    compat = _compat()
    result = json.loads((ROOT / "benchmarks/results/compat_cpu.json").read_text())
    assert [r["name"] for r in result["rows"]] == list(compat.ENVIRONMENTS)
    assert (ROOT / "benchmarks/results/compat_cpu.md").read_text() == compat._markdown(result["rows"], False)
    for row in result["rows"]:
        assert row["failed"] == row["errors"] == 0 and row["passed"] > 0 and row["plan_fits"], row["name"]
        assert row["versions"].split()[0].startswith(compat.ENVIRONMENTS[row["name"]][0])
