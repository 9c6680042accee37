"""`bench.model_quality --smoke` on the real model (512 tokens, CPU) with a table calibrated
on the other text, and its plot. Skips without the `models` extra and the weights."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("transformers")

from bench import model_quality, plot_model_quality, smollm2  # noqa: E402
from xattn_jax.calibrate import THRESHOLDS  # noqa: E402


@pytest.mark.slow
def test_smoke_run_records_every_setting(tmp_path):
    reason = smollm2.missing()
    if reason:
        pytest.skip(reason)
    out = tmp_path / "quality.json"
    model_quality.main(["--smoke", "--calibrate-on", "licenses", "--targets", "0.5",
                        "--calibrate-rules", "sampled-rows,oracle",
                        "--json", str(out), "--md", str(tmp_path / "quality.md")])
    records = {r["setting"]: r for r in json.loads(out.read_text())}
    calibrated = "calibrated sampled-rows 0.5 on licenses"
    oracle = "calibrated oracle 0.5 on licenses"
    assert list(records) == [s.name for s in model_quality.SMOKE] + [calibrated, oracle]
    dense = records["dense"]
    assert (dense["density"], dense["top1"], dense["kl_mean"]) == (1.0, 1.0, 0.0)
    for r in records.values():
        assert r["text"] == "python-docs" and r["length"] == 512 and 0 < r["density"] <= 1
    # the defaults keep a higher threshold and widen: at least the blocks of 0.9
    assert records["xattention defaults"]["density"] >= records["estimate 0.9"]["density"]
    assert records["estimate 0.9"]["kl_mean"] > 0
    for name in (calibrated, oracle):
        table = np.asarray(records[name]["threshold"], np.float32)
        assert table.shape == (30, 9) and set(np.unique(table)) <= set(np.float32(THRESHOLDS))
        assert records[name]["rule"] == name.split()[1]
    assert calibrated in (tmp_path / "quality.md").read_text()
    png = tmp_path / "quality.png"
    plot_model_quality.main([str(out), str(png)])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
