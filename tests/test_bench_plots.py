"""The benchmark plots from records (CPU only: no kernel runs)."""

import pathlib

import pytest

pytest.importorskip("matplotlib")

from bench.plot_side_by_side import side_by_side_figure  # noqa: E402
from bench.plotting import records_and_output  # noqa: E402


def _record(case, impl, ms, floor_ms, same_run=None):
    record = {"case": case, "impl": impl, "ms": ms, "floor_ms": floor_ms,
              "gpu": "NVIDIA H200", "date": "2026-12-03"}
    if same_run is not None:
        record["same_run_floor_ms"] = same_run
    return record


def test_side_by_side_bars_are_time_over_floor_grouped_by_implementation():
    records = [
        _record("causal-32k", "xattn-jax-mosaic (call 2)", 1.0, 0.5, 0.55),
        _record("causal-32k", "original", 4.0, 0.5),
        _record("causal-32k", "xattn-jax-triton", 1.5, 0.5, 0.55),
        _record("causal-1m", "xattn-jax-mosaic (call 4)", 900.0, 750.0, 820.0),
    ]
    ax = side_by_side_figure(records).axes[0]
    bars = {c.get_label(): [b.get_height() for b in c] for c in ax.containers}
    assert list(bars) == ["original", "xattn-jax-triton", "xattn-jax-mosaic"]
    assert bars["original"] == pytest.approx([8.0])
    assert bars["xattn-jax-triton"] == pytest.approx([3.0])
    assert bars["xattn-jax-mosaic"] == pytest.approx([2.0, 1.2])  # both calls, one series
    assert [t.get_text() for t in ax.get_xticklabels()] == ["causal-32k", "causal-1m"]
    ticks = sorted(y for collection in ax.collections for _, y in collection.get_offsets())
    assert ticks == pytest.approx(sorted([1.1, 1.1, 820 / 750]))


def test_side_by_side_refuses_two_records_of_one_bar():
    records = [_record("causal-32k", "xattn-jax-mosaic (call 2)", 1.0, 0.5),
               _record("causal-32k", "xattn-jax-mosaic (call 3)", 1.1, 0.5)]
    with pytest.raises(ValueError, match="causal-32k.*xattn-jax-mosaic"):
        side_by_side_figure(records)


def test_records_of_several_files_plot_together(tmp_path):
    import json

    first, second = tmp_path / "estimate.json", tmp_path / "chunked.json"
    first.write_text(json.dumps([_record("causal-32k", "original", 4.0, 0.5)]))
    chunk = _record("chunk4096-ctx64k", "original", 17.5, 0.4)
    second.write_text(json.dumps([dict(chunk, date="2026-11-30")]))
    records, source, out = records_and_output([str(first), str(second), "out.png"], "usage")
    assert [r["case"] for r in records] == ["causal-32k", "chunk4096-ctx64k"]
    assert (source, out) == (str(first), "out.png")
    title = side_by_side_figure(records).axes[0].get_title()
    assert "2026-11-30, 2026-12-03" in title
    with pytest.raises(SystemExit):
        records_and_output([str(first)], "usage")


def test_the_estimate_record_plots_its_chunk_rows_in_one_file(tmp_path):
    """bench/results/estimate.json holds `bench.estimate`'s and `bench.chunked`'s
    records: one bar a case and an implementation, the chunk cases among them."""
    path = pathlib.Path(__file__).resolve().parent.parent / "bench/results/estimate.json"
    records, _, _ = records_and_output([str(path), str(tmp_path / "out.png")], "usage")
    cases = [t.get_text() for t in side_by_side_figure(records).axes[0].get_xticklabels()]
    assert "causal-32k" in cases and "chunk4096-ctx64k" in cases


def test_the_model_quality_record_plots_quality_over_density_and_over_time(tmp_path):
    """bench/results/model_quality.json holds `bench.model_quality`'s rows and
    `bench.quality_time`'s: one image, quality against density above, against time below
    (two axes per timed scale); without timed rows, the upper part alone."""
    import json

    from bench import plot_model_quality
    from bench.common import MODEL_QUALITY, rows_of

    path = pathlib.Path(__file__).resolve().parent.parent / "bench/results/model_quality.json"
    records = json.loads(path.read_text())
    scales = {r["scale"] for r in records if r.get("benchmark") == "quality_time"}
    fig = plot_model_quality.figure(records)
    top, bottom = fig.subfigs
    assert len(top.axes) == 2 and len(bottom.axes) == 2 * len(scales) >= 2
    alone = plot_model_quality.figure(rows_of(records, MODEL_QUALITY))
    assert not alone.subfigs and len(alone.axes) == 2
    with pytest.raises(ValueError, match="no sparse setting"):
        plot_model_quality.figure([r for r in records if r.get("rule") == "dense"])
    out = tmp_path / "quality.png"
    plot_model_quality.main([str(path), str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_side_by_side_names_the_gpu_of_bars_from_another_gpu():
    records = [_record("causal-32k", "original", 4.0, 0.5),
               _record("causal-64k", "original", 9.0, 2.0),
               dict(_record("causal-32k", "xattn-jax", 1.1, 0.5), gpu="NVIDIA H100")]
    ax = side_by_side_figure(records).axes[0]
    assert "NVIDIA H200" in ax.get_title()
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["original", "xattn-jax, NVIDIA H100"]
