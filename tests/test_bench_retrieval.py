"""`bench.retrieval --smoke` on the real model (CPU, 512 tokens, one item per task):
every (setting, task) recorded with the run's stamp, dense the reference, and its plot.
Skips without the `models` extra and the weights."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from bench import plot_retrieval, retrieval, retrieval_tasks, smollm2  # noqa: E402


@pytest.mark.slow
def test_smoke_run_records_every_setting_and_task(tmp_path):
    reason = smollm2.missing()
    if reason:
        pytest.skip(reason)
    out, md = tmp_path / "retrieval.json", tmp_path / "retrieval.md"
    retrieval.main(["--smoke", "--items", "1", "--settings", "dense,xattention defaults",
                    "--device", "cpu", "--json", str(out), "--md", str(md)])
    records = json.loads(out.read_text())
    tasks = list(retrieval_tasks.TASKS)
    assert [(r["setting"], r["task"]) for r in records] == [
        (s, t) for s in ("dense", "xattention defaults") for t in tasks]
    for r in records:
        assert r["length"] == 512 and r["items"] == len(r["per_item"]) == 1
        assert r["gpu"] == "cpu" and r["dtype"] == "float32" and r["date"]
        assert r["command"].startswith("python -m bench.retrieval --smoke")
        assert "jax" in r["versions"] and "commit" in r
        item = r["per_item"][0]
        assert item["logprob"] < 0 and r["accuracy"] == item["solved"]
        assert 0 < r["density"] <= 1
    dense = {r["task"]: r for r in records if r["setting"] == "dense"}
    for r in records:
        d = dense[r["task"]]
        assert r["logprob_change"] == pytest.approx(r["logprob"] - d["logprob"])
        assert r["accuracy_change_points"] == pytest.approx(
            100 * (r["accuracy"] - d["accuracy"]))
        assert r["per_item"][0]["seed"] == d["per_item"][0]["seed"]
    assert all(r["density"] == 1 for r in dense.values())
    assert any(r["density"] < 1 for r in records if r["setting"] != "dense")
    text = md.read_text()
    assert "| xattention defaults |" in text and "variable-tracking accuracy" in text
    assert "The defaults within 2 points of dense's accuracy on every task:" in text
    png = tmp_path / "retrieval.png"
    plot_retrieval.main([str(out), str(png)])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv", [["--tasks", "passkey"], ["--items", "0"],
                                  ["--settings", "nonsense"], ["--device", "tpu"],
                                  ["--calibrate-rules", "exact"], ["--targets", "a"]])
def test_bad_arguments_are_refused_by_name(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        retrieval.main(["--smoke", *argv])
    assert exit_.value.code == 2 and argv[0] in capsys.readouterr().err
