"""The documentation stands alone: every Markdown file it names is in the repository."""

import json
import re
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


def test_the_readmes_spec_example_is_the_spec():
    """README, "Adding an activation", quotes mish's entry of coeffs/activations.json (notes left out)."""
    readme = (ROOT / "README.md").read_text()
    quoted = re.search(r"```json\n(\"mish\": \{.*?\n\})\n```", readme, re.DOTALL)
    assert quoted, "the README no longer quotes mish's spec entry"
    entry = json.loads("{" + quoted.group(1) + "}")["mish"]
    spec = json.loads((ROOT / "coeffs" / "activations.json").read_text())["activations"]["mish"]
    assert entry == {k: v for k, v in spec.items() if k != "notes"}
