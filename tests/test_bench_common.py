"""bench.common's records name the commit they ran on and merge into shared records (CPU
only: no kernel runs)."""

import json
import re
import shutil
import subprocess

import pytest

from bench import common


def test_commit_is_the_checkouts_head():
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    head = subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], cwd=common.__file__
                          .rsplit("/", 1)[0], capture_output=True, text=True)
    if head.returncode:
        assert common.commit() is None  # not a git checkout
        return
    got = common.commit()
    assert re.fullmatch(r"[0-9a-f]{7,}(-dirty)?", got), got
    assert got.split("-")[0] == head.stdout.strip()


def test_commit_outside_a_checkout_is_none(monkeypatch):
    def no_git(*args, **kwargs):
        return subprocess.CompletedProcess(args, 128, "", "fatal: not a git repository")

    monkeypatch.setattr(common.subprocess, "run", no_git)
    assert common.commit() is None


def _row(case, impl, gpu, ms):
    return {"case": case, "impl": impl, "gpu": gpu, "ms": ms}


def test_merge_json_replaces_rows_by_case_impl_and_gpu(tmp_path):
    """A run replaces its own rows where they stood and appends new ones; another
    benchmark's rows, and the same case's rows of another GPU, stay."""
    path = tmp_path / "estimate.json"
    common.merge_json(path, [_row("causal-32k", "mosaic", "NVIDIA H200", 1.0),
                             _row("chunk4096-ctx64k", "mosaic", "NVIDIA H200", 0.5)])
    common.merge_json(path, [_row("causal-32k", "mosaic", "NVIDIA H100 80GB HBM3", 1.2)])
    common.merge_json(path, [_row("causal-32k", "mosaic", "NVIDIA H200", 0.9),
                             _row("causal-64k", "mosaic", "NVIDIA H200", 3.9)])
    assert json.loads(path.read_text()) == [
        _row("causal-32k", "mosaic", "NVIDIA H200", 0.9),
        _row("chunk4096-ctx64k", "mosaic", "NVIDIA H200", 0.5),
        _row("causal-32k", "mosaic", "NVIDIA H100 80GB HBM3", 1.2),
        _row("causal-64k", "mosaic", "NVIDIA H200", 3.9)]


def test_merge_json_takes_another_key_and_refuses_rows_without_their_gpu(tmp_path):
    path = tmp_path / "quality.json"
    quality = [{"setting": "dense", "text": "licenses", "gpu": "cpu", "top1": 1.0}]
    common.merge_json(path, quality, key=("setting", "text", "gpu"))
    common.merge_json(path, [dict(quality[0], top1=0.5)], key=("setting", "text", "gpu"))
    assert json.loads(path.read_text()) == [dict(quality[0], top1=0.5)]
    with pytest.raises(ValueError, match=r"lacks \['gpu'\]"):
        common.merge_json(path, [{"case": "causal-32k", "impl": "mosaic", "ms": 1.0}])
    assert json.loads(path.read_text()) == [dict(quality[0], top1=0.5)]  # not written


def test_benchmarks_sharing_a_record_keep_each_others_rows(tmp_path):
    """model_quality.json holds three benchmarks' rows: a row of one never replaces a row
    of another, even where their other key fields agree."""
    from bench.model_quality import QUALITY_KEY
    from bench.quality_time import QUALITY_TIME_KEY
    from bench.retrieval import RETRIEVAL_KEY

    path = tmp_path / "shared.json"
    same = {"setting": "s", "text": "t", "gpu": "G", "case": "c", "impl": "i", "task": "k"}
    writes = ((common.MODEL_QUALITY, QUALITY_KEY), (common.RETRIEVAL, RETRIEVAL_KEY),
              (common.QUALITY_TIME, QUALITY_TIME_KEY))
    for run in (1, 2):
        for benchmark, key in writes:
            common.merge_json(path, [dict(same, benchmark=benchmark, run=run)], key)
    rows = json.loads(path.read_text())
    assert [(r["benchmark"], r["run"]) for r in rows] == [(b, 2) for b, _ in writes]
    assert common.rows_of(rows, common.RETRIEVAL) == [rows[1]]
