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


def test_smoke_run_records_both_rows(tmp_path, capsys):
    reason = smollm2.missing()
    if reason:
        pytest.skip(reason)
    path, md = tmp_path / "prefill.json", tmp_path / "prefill.md"
    assert hf_prefill.main(["--smoke", "--json", str(path), "--md", str(md)]) == 0
    sdpa, xattn = json.loads(path.read_text())
    assert (sdpa["impl"], xattn["impl"]) == ("sdpa", "xattention")
    for row in (sdpa, xattn):
        assert row["case"] == "smollm2-135m-prefill-512" and row["ms"] > 0
        assert (row["length"], row["dtype"], row["text"]) == (512, "float32", "licenses")
    assert xattn["layers"] == 30 and xattn["bridged_calls"] == 30
    assert xattn["fallbacks"] == 0 and not any(xattn["fallback_counts"].values())
    assert xattn["settings"]["block_size"] == 64
    assert 0 < xattn["density"] <= 1
    # a close forward: most top-1 tokens kept, a small KL (dense would give 1 and 0)
    assert 0.5 < xattn["top1"] <= 1 and 0 <= xattn["kl_mean"] < 0.5
    table = md.read_text()
    assert table in capsys.readouterr().out and "| xattention |" in table
