"""The documentation stands alone: every Markdown file it names is in the repository, and the docs site
(mkdocs.yml, docs/) builds with `mkdocs build --strict`."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted(
    p for p in ROOT.rglob("*.md") if not any(part.startswith(".") for part in p.relative_to(ROOT).parts)
)
NAMED = re.compile(r"[\w./-]*[\w-]+\.md\b")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_named_markdown_files_exist(doc):
    missing = [name for name in NAMED.findall(doc.read_text())
               if not ((doc.parent / name).exists() or (ROOT / name).exists())]  # fmt: skip
    assert not missing, f"{doc.relative_to(ROOT)} names files that are not in the repository: {missing}"


def test_the_docs_spec_example_is_the_spec():
    """docs/how-it-works.md, "The activation spec", quotes mish's entry of coeffs/activations.json (notes
    left out)."""
    page = (ROOT / "docs" / "how-it-works.md").read_text()
    quoted = re.search(r"```json\n(\"mish\": \{.*?\n\})\n```", page, re.DOTALL)
    assert quoted, "docs/how-it-works.md no longer quotes mish's spec entry"
    entry = json.loads("{" + quoted.group(1) + "}")["mish"]
    spec = json.loads((ROOT / "coeffs" / "activations.json").read_text())["activations"]["mish"]
    assert entry == {k: v for k, v in spec.items() if k != "notes"}


def test_the_docs_site_builds_strict(tmp_path):
    """mkdocs.yml with docs/ and the API reference from invact's docstrings: any warning (a broken link
    or anchor, a page left out of the nav, a docstring mkdocstrings cannot render) fails the build."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # mkdocs-material's banner about its successor
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{output}"
    assert (tmp_path / "site" / "index.html").exists(), output
    for png in sorted((ROOT / "benchmarks" / "results").glob("*.png")):  # the training plots, as published
        assert (tmp_path / "site" / "results" / "plots" / png.name).exists(), f"{png.name} not in the site"


def test_the_faq_exactness_claim_is_the_coverage_runs():
    """The FAQ's "does it change my outputs" answer quotes the model-coverage run
    (benchmarks/results/architectures_cpu.json): the model types compared, those bitwise, and the
    largest relative difference of the rest, as docs/results/architectures.md prints it."""
    rows = [r for r in json.loads((ROOT / "benchmarks/results/architectures_cpu.json").read_text())["rows"]
            if r["status"] == "ok"]  # fmt: skip
    bitwise = sum(r["output_rel"] == 0 for r in rows)
    worst = re.sub(r"e-0*", "e-", f"{max(r['output_rel'] for r in rows):.1e}")  # 1.9e-07 printed 1.9e-7
    faq = " ".join((ROOT / "docs/faq.md").read_text().split())
    coverage = " ".join((ROOT / "docs/results/architectures.md").read_text().split())
    said = f"of {len(rows)} model types patched small on CPU, outputs were bitwise on {bitwise} and the other"
    assert f"{said} {len(rows) - bitwise} within {worst}" in faq
    assert f"outputs bitwise on {bitwise}**, the other {len(rows) - bitwise} within {worst}" in coverage


def _readme_python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


@pytest.mark.slow
def test_the_readmes_first_example_prints_what_it_says(capsys):
    """The README's first snippet runs as shown (a small Llama from a config, seq 1024, labels): the
    saved bytes its comment gives are what it prints, and the loss keeps no logits (an
    invact.loss.PendingLogits, computed when read, as the snippet's last line reads them)."""
    from invact.loss import PendingLogits

    (first,) = _readme_python_blocks()[:1]
    scope: dict = {}
    exec(compile(first, "README.md", "exec"), scope)  # noqa: S102 - the repository's own README
    before, after = scope["before"], scope["after"]
    mib = [f"{r.saved_bytes / 2**20:.1f} MiB" for r in (before, after)]
    assert f"# saved for backward: {mib[0]} -> {mib[1]}" in first
    assert capsys.readouterr().out.splitlines()[-2:] == [str(before), str(after)]
    assert isinstance(scope["out"].logits, PendingLogits)
    assert 0 <= float(scope["accuracy"]) <= 1
