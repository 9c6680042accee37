"""bench.sampled_rows --small: both estimates of a case run on the CPU, recorded and
reported side by side with their ratio."""

from __future__ import annotations

import json

import pytest

from bench import sampled_rows


def test_small_run_records_both_estimates(tmp_path, capsys):
    path = tmp_path / "rows.json"
    sampled_rows.main(["--small", "--rounds", "1", "--cases", "chunk4096-ctx128k",
                       "--json", str(path)])
    rows = json.loads(path.read_text())
    assert [r["impl"] for r in rows] == [f"xattn-jax {e}" for e in sampled_rows.ESTIMATES]
    for row in rows:
        assert row["case"] == "chunk4096-ctx128k" and row["ms"] > 0
        assert len(row["rounds_ms"]) == 1 and row["ms"] == row["rounds_ms"][0]
    out = capsys.readouterr().out
    ratio = rows[1]["ms"] / rows[0]["ms"]
    assert f"chunk4096-ctx128k: sampled-rows / antidiagonal = {ratio:.2f}" in out


def test_unknown_cases_are_refused():
    with pytest.raises(SystemExit):
        sampled_rows.main(["--cases", "causal-32k"])
