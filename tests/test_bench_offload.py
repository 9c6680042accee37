"""bench.offload --smoke: the three ways run on the CPU and are reported; the shadow's
way copies fewer bytes than the others and attends the pages the seed's way does, or
nearly."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from bench import offload  # noqa: E402


def test_smoke_run_reports_every_way(tmp_path, capsys):
    rows_path, table_path = tmp_path / "rows.json", tmp_path / "table.md"
    assert offload.main(["--smoke", "--json", str(rows_path), "--md", str(table_path)]) == 0
    rows = {row["impl"]: row for row in json.loads(rows_path.read_text())}
    assert set(rows) == set(offload.WAYS)
    for row in rows.values():
        assert row["case"] == "prefill-2k" and row["ms"] > 0 and row["floor_ms"] > 0
        for key in ("gpu", "extra_mib", "date", "versions", "h2d_mib", "density"):
            assert key in row
    load_all, seed, shadow = (rows[w] for w in offload.WAYS)
    assert load_all["density"] == 1 and 0 < shadow["density"] < 1
    # the seed copies every offloaded page's keys, then the pages it keeps
    assert shadow["h2d_mib"] < load_all["h2d_mib"] < seed["h2d_mib"] + load_all["h2d_mib"]
    assert seed["h2d_mib"] > shadow["h2d_mib"] + load_all["h2d_mib"] / 4
    assert shadow["same_as_seed"] >= 0.9
    table = table_path.read_text()
    assert table in capsys.readouterr().out
    for way in offload.WAYS:
        assert f"| prefill-2k | {way} |" in table
