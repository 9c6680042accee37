"""bench.serving_step's smoke run: every row group of both steps runs on the CPU and is
merged into the record, naming its device."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from bench import serving_step  # noqa: E402


@pytest.mark.slow
def test_smoke_run_records_every_row(tmp_path):
    out = tmp_path / "serving_step.json"
    serving_step.main(["--smoke", "--json", str(out)])
    rows = json.loads(out.read_text())
    cases = {r["case"] for r in rows}
    for step in ("long-prefill", "short-chunks"):
        for row in ("ragged-estimate", "loop-estimate", "ragged", "ragged-attention",
                    "loop", "dense", "dense-causal-512", "flex", "bridged"):
            assert f"{step}-page128-{row}" in cases, (step, row, sorted(cases))
    assert all(r["gpu"] == "cpu" and r["ms"] > 0 for r in rows)
    estimates = [r for r in rows if r["case"].endswith("ragged-estimate")]
    assert all(r["mask_diff"] == 0 for r in estimates)  # each chunk as its own xattention
    assert all(0 < r["density"] <= 1 for r in rows if "density" in r)
    bridged = [r for r in rows if r["case"].endswith("-bridged")]
    assert all(r["padded_host_ms"] > 0 and r["plain_host_ms"] > 0 for r in bridged)
    flex_rows = [r for r in rows if r["impl"] == "flexattention"]
    assert len(flex_rows) == 2 and all(r["agrees"] and r["wrong_blocks"] == 0
                                       for r in flex_rows)


@pytest.mark.slow
def test_smoke_run_on_sampled_rows(tmp_path):
    out = tmp_path / "serving_step.json"
    serving_step.main(["--smoke", "--steps", "short-chunks", "--rows", "estimate,step,loop",
                       "--estimate", "sampled-rows", "--json", str(out)])
    cases = {r["case"] for r in json.loads(out.read_text())}
    assert cases == {f"short-chunks-page128-sampled-rows-{row}"
                     for row in ("ragged-estimate", "ragged", "ragged-attention", "loop")}
