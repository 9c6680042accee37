"""bench.xattention_overhead --smoke: every row runs on the CPU and is reported."""

from __future__ import annotations

import importlib.util
import json

import pytest

pytest.importorskip("torch")

from bench import xattention_overhead  # noqa: E402


def test_smoke_run_reports_every_row(tmp_path, capsys):
    path = tmp_path / "rows.json"
    assert xattention_overhead.main(["--smoke", "--json", str(path)]) == 0
    rows = {row["impl"]: row for row in json.loads(path.read_text())}
    calls = {"plain", "plain-jitted", "bridged", "sdpa"}
    if importlib.util.find_spec("transformers") is not None:
        calls.add("hf-layer")
    assert set(rows) == calls
    for row in rows.values():
        assert row["case"] == "causal-256" and row["ms"] > 0 and row["host_ms"] > 0
    for name in ("bridged", "hf-layer") if "hf-layer" in calls else ("bridged",):
        assert rows[name]["target_ms"] == pytest.approx(
            rows["plain"]["ms"] + xattention_overhead.TARGET_MS, abs=1e-3)
    table = capsys.readouterr().out
    for name in calls:
        assert f"| causal-256 | {name} |" in table
