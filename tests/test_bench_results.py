"""bench/results/: records named by their benchmark, each JSON row naming its GPU, every
plot shown by its benchmark's markdown, every markdown record listed in
docs/performance.md."""

from __future__ import annotations

import json
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
MAX_FILES = 20
# the fields of every timing row (one with "ms"), as bench.common.record writes them
TIMING_FIELDS = {"case", "impl", "gpu", "ms", "floor_ms", "extra_mib", "date", "versions"}
JSON_FILES = sorted(RESULTS.glob("*.json"))


def test_few_files_named_by_their_benchmark():
    names = sorted(p.name for p in RESULTS.iterdir())
    assert len(names) <= MAX_FILES, names
    named_by_device = [n for n in names if re.search(r"_(h100|h200|cpu)", n, re.IGNORECASE)]
    assert not named_by_device, f"name these by the benchmark alone: {named_by_device}"


@pytest.mark.parametrize("path", JSON_FILES, ids=[p.name for p in JSON_FILES])
def test_every_json_row_names_its_gpu_and_timing_rows_their_common_fields(path):
    rows = json.loads(path.read_text())
    assert isinstance(rows, list) and rows
    for row in rows:
        assert isinstance(row.get("gpu"), str) and row["gpu"], row
        if "ms" in row:
            assert TIMING_FIELDS <= set(row), (path.name, TIMING_FIELDS - set(row))
    if "case" in rows[0]:
        keys = [(r["case"], r["impl"], r["gpu"], r.get("run")) for r in rows]
        assert len(keys) == len(set(keys)), f"{path.name}: a row repeated"


def test_every_plot_is_shown_by_a_markdown_record():
    markdown = "".join(p.read_text() for p in RESULTS.glob("*.md"))
    unshown = [p.name for p in RESULTS.glob("*.png") if p.name not in markdown]
    assert not unshown, unshown


def test_every_markdown_record_is_listed_in_performance_md():
    listed = (ROOT / "docs" / "performance.md").read_text()
    unlisted = [p.name for p in RESULTS.glob("*.md") if f"bench/results/{p.name}" not in listed]
    assert not unlisted, unlisted


def test_every_path_the_repository_names_in_bench_results_exists():
    """README, docs, bench scripts and tests name only records that are there."""
    sources = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "bench").glob("*.py"),
               *RESULTS.glob("*.md"), *(ROOT / "tests").glob("*.py"),
               *(ROOT / "xattn_jax").rglob("*.py")]
    named = {m for source in sources
             for m in re.findall(r"bench/results/([\w.-]+\.(?:json|md|png))", source.read_text())}
    missing = sorted(n for n in named if not (RESULTS / n).exists())
    assert not missing, missing
