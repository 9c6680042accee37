"""`bench.hf_prefill --smoke` on the real model (CPU, float32, 512 tokens, block 64): both
rows are recorded, every layer goes through the bridge, and the xattention row's density
and agreement with sdpa are those of a sparse but close forward. Skips without the
`models` extra and the weights."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from bench import hf_prefill, smollm2  # noqa: E402


@pytest.mark.slow
def test_smoke_run_records_every_row(tmp_path, capsys):
    reason = smollm2.missing()
    if reason:
        pytest.skip(reason)
    path, md = tmp_path / "prefill.json", tmp_path / "prefill.md"
    assert hf_prefill.main(["--smoke", "--json", str(path), "--md", str(md)]) == 0
    sdpa, xattn, sampled = json.loads(path.read_text())
    assert [r["impl"] for r in (sdpa, xattn, sampled)] == ["sdpa", "xattention",
                                                           "xattention-sampled-rows"]
    for row in (sdpa, xattn, sampled):
        assert row["case"] == "smollm2-135m-prefill-512" and row["ms"] > 0
        assert (row["length"], row["dtype"], row["text"]) == (512, "float32", "licenses")
    for row, estimate in ((xattn, "antidiagonal"), (sampled, "sampled-rows")):
        assert row["layers"] == 30 and row["bridged_calls"] == 30
        assert row["fallbacks"] == 0 and not any(row["fallback_counts"].values())
        assert row["settings"]["block_size"] == 64
        assert row["settings"]["estimate"] == estimate
        assert 0 < row["density"] <= 1
        # a close forward: most top-1 tokens kept, a small KL (dense would give 1 and 0)
        assert 0.5 < row["top1"] <= 1 and 0 <= row["kl_mean"] < 0.5
    table = md.read_text()
    assert table in capsys.readouterr().out and "| xattention |" in table
