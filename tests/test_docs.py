"""The documents cite no work log, and every decision-log entry the code cites exists.

Figures carry their date, GPU and commit; session, issue and note numbers belong to git
history. Code cites docs/tuning.md by entry name (`docs/tuning.md: entry-name`).
"""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
WORK_LOG = re.compile(r"\bsessions?\b|\bissues? [0-9]+|\bnotes? [0-9]+|\bround [0-9]+",
                      re.IGNORECASE)
# "docs/tuning.md: a-name" or "docs/tuning.md: a-name, another-name", maybe across a
# comment's line break
CITATION = re.compile(r"docs/tuning\.md:((?:[\s#]*[a-z0-9][a-z0-9-]*,)*[\s#]*[a-z0-9][a-z0-9-]*)")
DOCUMENTS = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in [
    *(ROOT / "docs").glob("*.md"), *(ROOT / "bench" / "results").glob("*.md")])]


@pytest.mark.parametrize("path", DOCUMENTS)
def test_documents_cite_no_work_log(path):
    hits = [line for line in (ROOT / path).read_text().splitlines() if WORK_LOG.search(line)]
    assert not hits, f"{path} cites the work log: {hits[:3]}"


def cited_entries(text: str) -> list[str]:
    """The decision-log entries `text` cites by name."""
    return [name.strip(" \n#") for match in CITATION.findall(text) for name in match.split(",")]


def test_every_cited_entry_exists():
    entries = set(re.findall(r"^### (\S+)$", (ROOT / "docs" / "tuning.md").read_text(),
                             re.MULTILINE))
    sources = [p for folder in ("xattn_jax", "xattn_torch_bridge", "bench", "tests")
               for p in (ROOT / folder).rglob("*.py") if p.name != "test_docs.py"]
    cited = {(str(p.relative_to(ROOT)), name) for p in sources
             for name in cited_entries(p.read_text())}
    assert len(cited) >= 20
    missing = sorted(c for c in cited if c[1] not in entries)
    assert not missing, f"cited entries missing from docs/tuning.md: {missing}"


def test_citations_are_read_across_comment_lines():
    text = "x  # (docs/tuning.md: triton-span,\n# triton-causal-span)\ny  # docs/tuning.md:\n#  a-b."
    assert cited_entries(text) == ["triton-span", "triton-causal-span", "a-b"]
