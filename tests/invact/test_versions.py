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
from importlib import metadata
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


def _minor(version: str, step: int) -> str:
    """ "5.24" -> "5.25" (step 1) or "5.23" (step -1)."""
    major, minor = version.split(".")
    return f"{major}.{int(minor) + step}"


# Each end of each range, with the release forms that compare by their leading release alone.
_OUTSIDE_CASES = [
    case
    for package, (oldest, newest) in sorted(SUPPORTED.items())
    for case in [
        (package, f"{_minor(oldest, -1)}.1", "older"),
        (package, f"{oldest}.0", None),
        (package, f"{newest}.3", None),  # a patch release of the newest tested minor is inside
        (package, f"{_minor(newest, 1)}.0", "newer"),
        (package, f"{_minor(newest, 1)}.0.dev20261101", "newer"),
    ]
] + [
    ("torch", f"{SUPPORTED['torch'][0]}.0+cu130", None),  # local build labels
    ("torch", f"{SUPPORTED['torch'][1]}.0+cpu", None),
    ("torch", "3.0.0", "newer"),
    ("transformers", "5.0.0rc1", None),  # a release candidate counts as its release
]


@pytest.mark.parametrize("package, version, why", _OUTSIDE_CASES)
def test_outside(package, version, why):
    assert outside(package, version) == why


def test_the_running_torch_is_inside():
    # CI's torch is one the package supports: its tests would otherwise test nothing users are told to run.
    assert outside("torch", torch.__version__) is None


def test_an_older_torch_is_refused_in_one_line():
    with pytest.raises(
        ImportError, match=r"^invact supports torch >= 2\.\d+; this is torch 2\.9\.1: upgrade"
    ):
        _versions.check("2.9.1", None)


def test_a_newer_torch_warns_once_in_one_line():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _versions.check("2.99.0", None)
    torch_says = [str(w.message) for w in caught if "torch 2.99.0" in str(w.message)]
    assert len(torch_says) == 1 and "\n" not in torch_says[0] and "untested" in torch_says[0]
    assert all(issubclass(w.category, _versions.VersionWarning) for w in caught)


def _ends(package: str) -> list[str]:
    return [f"{v}.0" for v in SUPPORTED[package]]


@pytest.mark.parametrize("transformers_version", [*_ends("transformers"), None])
@pytest.mark.parametrize("torch_version", _ends("torch"))
def test_check_is_silent_inside_the_range(torch_version, transformers_version):
    # The versions it checks are the ones given (None: transformers not installed), not the installed ones.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _versions.check(torch_version, transformers_version)


# A user's script, run in a fresh interpreter told which versions it has: torch's __version__ set and
# transformers' metadata read as given before invact's first import.
_SCRIPT = """import sys
from importlib import metadata

import torch

torch.__version__, transformers = sys.argv[1], sys.argv[2]
real = metadata.version
metadata.version = lambda name: transformers if name == "transformers" else real(name)
import invact
"""


def _import_with(
    tmp_path: Path, torch_version: str, transformers_version: str
) -> subprocess.CompletedProcess:
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    return subprocess.run(
        [sys.executable, str(script), torch_version, transformers_version], capture_output=True, text=True
    )


@pytest.mark.parametrize("outside_the_range", [(), ("transformers",), ("torch", "transformers")])
def test_importing_invact_warns_at_the_users_import_for_each_version_outside(tmp_path, outside_the_range):
    given = {p: f"{_minor(SUPPORTED[p][1], 1 if p in outside_the_range else 0)}.0" for p in SUPPORTED}
    done = _import_with(tmp_path, given["torch"], given["transformers"])
    assert done.returncode == 0, done.stderr
    # Python's format: the user's file and line, the one-line message, then that line's source.
    where = f"{tmp_path / 'train.py'}:{_SCRIPT.splitlines().index('import invact') + 1}"
    want = [f"{where}: VersionWarning: {_versions.message(p, given[p], 'newer')}" for p in outside_the_range]
    assert done.stderr.splitlines() == [line for w in want for line in (w, "  import invact")]


def test_importing_invact_from_python_c_warns_in_one_line():
    # `python -c`: no file to show a line of (and a loader that has no sources: never asked for one).
    newer = f"{_minor(SUPPORTED['transformers'][1], 1)}.0"
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT, f"{SUPPORTED['torch'][1]}.0", newer], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    line = _SCRIPT.splitlines().index("import invact") + 1
    message = _versions.message("transformers", newer, "newer")
    assert done.stderr.splitlines() == [f"<string>:{line}: VersionWarning: {message}"]


def test_importing_invact_refuses_an_older_torch_in_one_line(tmp_path):
    old = f"{_minor(SUPPORTED['torch'][0], -1)}.0"
    done = _import_with(tmp_path, old, f"{SUPPORTED['transformers'][1]}.0")
    assert done.returncode == 1
    assert done.stderr.splitlines()[-1] == f"ImportError: {_versions.message('torch', old, 'older')}"


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


# -- the test environment's pins (tests/constraints.txt): what `make test`, and so CI, installs -------------

PINS = ROOT / "tests" / "constraints.txt"


def _name(requirement: str) -> str:
    """A requirement's project name, normalized as pip compares them: "Jinja2" -> "jinja2",
    "typing_extensions" -> "typing-extensions"."""
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement).group(0)).lower()


def _pins(path: Path = PINS) -> dict[str, str]:
    lines = [line for line in path.read_text().splitlines() if line and not line.startswith("#")]
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+==[^=\s]+", line) for line in lines), "a line that is not a pin"
    return {_name(line): line.split("==")[1] for line in lines}


def _tested_requirements() -> set[str]:
    """The names `pip install -e '.[dev]'` asks for: the dependencies and the dev extra, its invact[...]
    references expanded."""
    project = _project()
    extras, names, todo = project["optional-dependencies"], set(), [*project["dependencies"], "invact[dev]"]
    while todo:
        requirement = todo.pop()
        if _name(requirement) == "invact":
            todo += [
                r for extra in re.search(r"\[(.*)\]", requirement).group(1).split(",") for r in extras[extra]
            ]
        else:
            names.add(_name(requirement))
    return names


def test_every_requirement_of_the_tests_is_pinned():
    assert _tested_requirements() - _pins().keys() == set()


@pytest.mark.parametrize("package", sorted(SUPPORTED))
def test_the_pins_are_inside_the_supported_range(package):
    # CI tests what users are told is supported: a bump past the newest end moves the end in the same commit.
    assert outside(package, _pins()[package]) is None, _pins()[package]


@pytest.mark.skipif(
    Path(sys.prefix).resolve() != (ROOT / ".venv").resolve(), reason="not the Makefile's venv"
)
def test_the_makefiles_venv_has_the_pinned_versions():
    # .venv/constraints.txt: the pins with TORCH's line for torch's (the Makefile's recipe); everything it
    # names is installed at its version (torch up to its local label, "+cpu").
    venv = _pins(ROOT / ".venv" / "constraints.txt")
    assert {k: v for k, v in venv.items() if k != "torch"} == {
        k: v for k, v in _pins().items() if k != "torch"
    }
    found = {name: metadata.version(name).split("+")[0] for name in venv}
    assert found == venv
