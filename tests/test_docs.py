"""The documentation stands alone: every Markdown file it names is in the repository."""

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
