"""`bench.quality_time` (the real-model settings timed at their densities) on the CPU, and
`bench.plot_quality_time`'s table, equal-time comparison and plot from records."""

from __future__ import annotations

import json
import math

import jax.numpy as jnp
import numpy as np
import pytest

from bench import plot_quality_time, quality_time
from bench.attention import structured_qkv
from bench.common import MODEL_QUALITY, QUALITY_TIME, rows_of
from xattn_jax import xattention

# the fields of every timing row, as bench.common.record writes them
TIMING_FIELDS = {"case", "impl", "gpu", "ms", "floor_ms", "extra_mib", "date", "versions"}
NOT_WIDENED = ("estimate 0.95", "sampled-rows 0.95")


def committed_quality() -> list[dict]:
    """bench.model_quality's rows of the committed record (which holds quality_time's too)."""
    return rows_of(json.loads(quality_time.QUALITY.read_text()), MODEL_QUALITY)


# --- settings from model_quality.json --------------------------------------------------

def test_settings_are_the_licenses_records_with_an_estimate():
    records = committed_quality()
    settings, length = quality_time.read_settings(quality_time.QUALITY)
    expected = [r for r in records if r["text"] == "licenses"
                and r["rule"] in ("estimate", "sampled-rows")]
    assert [s.name for s in settings] == [r["setting"] for r in expected]
    assert length == expected[0]["length"]
    for s, r in zip(settings, expected):
        assert s.density == r["density"] and s.quality["top1"] == r["top1"]
        assert s.quality["kl_mean"] == r["kl_mean"]
        assert s.estimate == {"estimate": "antidiagonal", "sampled-rows": "sampled-rows"}[
            r["rule"]]
        assert s.threshold_rule == ("calibrated" if r["setting"].startswith("calibrated")
                                    else "uniform")
        assert (s.min_blocks, s.dense_last, s.stride) == (r["min_blocks"], r["dense_last"],
                                                          r["stride"])
        assert "licenses" in s.quality["source"] and r["gpu"] in s.quality["source"]
    assert {s.estimate for s in settings} == {"antidiagonal", "sampled-rows"}
    assert {s.threshold_rule for s in settings} == {"uniform", "calibrated"}


def test_densities_follow_the_records_file(tmp_path):
    records = committed_quality()
    changed = [dict(r, density=0.5) if r["setting"] == "estimate 0.9" else r for r in records]
    # another benchmark's row of the same setting, in the same record, is not read
    timed = dict(changed[0], benchmark=QUALITY_TIME, setting="estimate 0.9", rule="estimate",
                 text="python-docs", density=0.7)
    path = tmp_path / "quality.json"
    path.write_text(json.dumps(changed + [timed]))
    settings, _ = quality_time.read_settings(path, "python-docs")
    by_name = {s.name: s for s in settings}
    assert by_name["estimate 0.9"].density == 0.5
    docs = {r["setting"]: r["density"] for r in records if r["text"] == "python-docs"}
    assert by_name["xattention defaults"].density == docs["xattention defaults"]
    assert "oracle 0.95" not in by_name and "dense" not in by_name


def test_records_without_the_text_are_refused():
    with pytest.raises(ValueError, match="text: no estimate's record scored on 'novels'"):
        quality_time.quality_settings(committed_quality(), "novels")
    # the same from the committed record, whose timed rows name no text
    with pytest.raises(ValueError, match=r"texts: \['licenses', 'python-docs'\]"):
        quality_time.read_settings(quality_time.QUALITY, "novels")


# --- the timed calls -------------------------------------------------------------------

def test_threshold_for_finds_the_nearest_density():
    def steps(t):  # density in steps of 0.01, not decreasing
        return math.floor(t * 100) / 100

    t, density = quality_time.threshold_for(steps, 0.337)
    assert density == pytest.approx(0.34) and steps(t) == density
    assert quality_time.threshold_for(steps, 2.0) == (1.0, 1.0)


@pytest.mark.parametrize("estimate", ["antidiagonal", "sampled-rows"])
def test_the_whole_call_is_xattentions(estimate):
    sizes = quality_time.SMOKE_LLAMA
    q, k, v = structured_qkv(512, sizes, jnp.float32)
    sc = quality_time.Scale("test", "test", sizes, 512, 1)
    setting = quality_time.Setting("test", estimate, "uniform", sizes.block, 8, 4, 1, {})
    calls = quality_time.Calls(sc, q, k, v)
    t = 0.9
    threshold = jnp.full((sizes.q_heads,), t, jnp.float32)
    out, mask = xattention(q, k, v, threshold=t, block_size=sizes.block, stride=8,
                           min_blocks=4, dense_last=1, estimate=estimate, return_mask=True)
    ours = calls.estimate(setting, threshold)[0](q, k, threshold)
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(mask))
    assert 0 < float(quality_time.block_density(mask)) < 1
    whole = calls.whole(setting, threshold)[0](q, k, v, threshold)
    np.testing.assert_allclose(np.asarray(whole), np.asarray(out), rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_smoke_run_writes_a_row_per_part(tmp_path):
    out = tmp_path / "quality_time.json"
    scales = ("smollm2-135m-256", "llama-3.1-8b-1k")
    quality_time.main(["--smoke", "--settings", ",".join(NOT_WIDENED), "--scales",
                       ",".join(scales), "--json", str(out)])
    rows = json.loads(out.read_text())
    model = {r["setting"]: r["density"] for r in committed_quality()
             if r["text"] == "licenses"}
    assert [r["scale"] for r in rows if r["part"] == "dense"] == list(scales)
    for r in rows:
        assert TIMING_FIELDS <= set(r) and r["ms"] > 0 and r["command"].endswith(str(out))
    timed = [r for r in rows if r["part"] != "dense"]
    assert sorted((r["scale"], r["setting"], r["part"]) for r in timed) == sorted(
        (sc, name, part) for sc in scales for name in NOT_WIDENED
        for part in plot_quality_time.PARTS)
    for r in timed:
        assert r["model_density"] == model[r["setting"]] and 0 < r["density"] <= 1
        if r["scale"] == "llama-3.1-8b-1k":  # enough blocks to hit the model's density
            assert r["density"] == pytest.approx(r["model_density"], abs=0.005)
    keys = [(r["case"], r["impl"], r["gpu"]) for r in rows]
    assert len(keys) == len(set(keys))
    md, png = tmp_path / "quality_time.md", tmp_path / "quality_time.png"
    plot_quality_time.main([str(out), "--md", str(md), "--png", str(png)])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for sc in scales:
        assert f"## {sc}:" in md.read_text()


def test_unknown_settings_are_refused():
    with pytest.raises(ValueError, match="--settings: \\['estimate 0.5'\\]"):
        quality_time.main(["--smoke", "--settings", "estimate 0.5"])


# --- the table and plot from fabricated records ---------------------------------------

# (setting, estimate, rule, whole-call ms, top1, kl) of one fabricated scale
FABRICATED = [("a 1", "antidiagonal", "uniform", 1.0, 0.80, 0.10),
              ("a 2", "antidiagonal", "uniform", 3.0, 0.90, 0.01),
              ("s 1", "sampled-rows", "calibrated", 2.0, 0.95, 0.02),
              ("s 2", "sampled-rows", "calibrated", 4.0, 0.97, 0.004)]


def fabricated_rows(scale: str = "llama-3.1-8b-32k", gpu: str = "GPU A",
                    impl: str = "jax") -> list[dict]:
    stamp = {"benchmark": QUALITY_TIME, "gpu": gpu, "date": "2026-01-01", "versions": "v",
             "commit": "c", "floor_ms": 0.1, "extra_mib": 1.0, "scale": scale, "model": "M",
             "length": 32768, "command": "python -m bench.quality_time"}
    rows = [dict(stamp, case=f"{scale} dense", impl="cudnn", part="dense", ms=10.0)]
    for name, estimate, rule, ms, top1, kl in FABRICATED:
        for part, part_ms in (("estimate", ms / 4), ("attention", 3 * ms / 4),
                              ("xattention", ms)):
            rows.append(dict(stamp, case=f"{scale} {name}: {part}", impl=f"x/{impl}",
                             part=part, ms=part_ms, setting=name, estimate=estimate,
                             threshold_rule=rule, estimate_impl=impl, density=0.3,
                             model_density=0.3, top1=top1, kl_mean=kl, ppl_change_pct=1.0,
                             quality_length=8192, quality_source="model_quality.json: q"))
    return rows


def test_table_rows_match_the_settings():
    rows = fabricated_rows() + fabricated_rows("smollm2-135m-8k")
    md = plot_quality_time.markdown(rows, "quality_time.png", "python -m x")
    assert "quality_time.png" in md and "GPU GPU A" in md
    for scale in ("llama-3.1-8b-32k", "smollm2-135m-8k"):
        section = md.split(f"## {scale}:")[1].split("At equal time:")[0]
        table = [[cell.strip() for cell in line.strip("|").split("|")]
                 for line in section.splitlines() if line.startswith("| ")]
        assert [cells[1] for cells in table[1:]] == ["a 1", "a 2", "s 1", "s 2", ""]
        assert table[-1][0] == "dense (cudnn)"
        assert "| antidiagonal, uniform | a 2 | 0.300 / 0.300 | 0.9000 | 0.0100 |" in section
        assert "| +1.00% | 0.750 | 2.250 | 3.000 | 0.300 |" in section


def test_quality_at_interpolates_top1_linearly_and_kl_in_log():
    by_scale, _ = plot_quality_time.points(fabricated_rows())
    named = plot_quality_time.curves(by_scale["llama-3.1-8b-32k"], set())
    uniform = named["antidiagonal, uniform"]
    assert plot_quality_time.quality_at(uniform, 2.0, "top1") == pytest.approx(0.85)
    assert plot_quality_time.quality_at(uniform, 2.0, "kl_mean") == pytest.approx(
        math.sqrt(0.10 * 0.01))
    assert plot_quality_time.quality_at(uniform, 3.0, "top1") == pytest.approx(0.90)
    assert plot_quality_time.quality_at(uniform, 3.5, "top1") is None


def test_equal_time_names_the_curve_ahead():
    by_scale, _ = plot_quality_time.points(fabricated_rows())
    named = plot_quality_time.curves(by_scale["llama-3.1-8b-32k"], set())
    rows = plot_quality_time.equal_time(named)
    assert [r["ms"] for r in rows] == [2.0, 3.0]  # where both curves are defined
    sampled = "sampled-rows, calibrated"
    assert all(r["top1"] == sampled for r in rows)
    # KL: at 2 ms 0.02 against sqrt(0.1 * 0.01) = 0.032; at 3 ms sqrt(0.02 * 0.004) =
    # 0.0089 against 0.01
    assert [r["kl"] for r in rows] == [sampled, sampled]
    assert rows[1]["quality"]["antidiagonal, uniform"] == pytest.approx((0.90, 0.01))
    assert plot_quality_time.ahead_summary(rows, "top1") == f"{sampled} (2-3 ms)"


def test_several_estimate_implementations_are_curves_of_their_own():
    rows = fabricated_rows() + [dict(r, impl="x/mosaic", estimate_impl="mosaic")
                                for r in fabricated_rows() if r["part"] != "dense"
                                and r["estimate"] == "sampled-rows"]
    by_scale, _ = plot_quality_time.points(rows)
    several = plot_quality_time.impls_of_estimates(rows)
    assert list(plot_quality_time.curves(by_scale["llama-3.1-8b-32k"], several)) == [
        "antidiagonal, uniform", "sampled-rows (jax), calibrated",
        "sampled-rows (mosaic), calibrated"]


def test_incomplete_or_mixed_records_are_refused():
    rows = fabricated_rows()
    with pytest.raises(ValueError, match="a 1 \\(jax\\) lacks \\['attention'\\]"):
        plot_quality_time.points([r for r in rows if r["case"] != "llama-3.1-8b-32k a 1: "
                                  "attention"])
    with pytest.raises(ValueError, match="recorded twice"):
        plot_quality_time.points(rows + rows[1:2])
    with pytest.raises(ValueError, match="gpu: the records hold \\['GPU A', 'GPU B'\\]"):
        plot_quality_time.one_gpu(rows + fabricated_rows(gpu="GPU B"), None)
    assert plot_quality_time.one_gpu(rows + fabricated_rows(gpu="GPU B"), "GPU B") == \
        fabricated_rows(gpu="GPU B")


def test_plot_has_a_column_per_scale_and_a_curve_per_estimate_and_rule(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    rows = fabricated_rows() + fabricated_rows("smollm2-135m-8k")
    fig = plot_quality_time.figure(rows)
    assert len(fig.axes) == 4
    labels = {line.get_label() for line in fig.axes[0].get_lines()}
    assert {"antidiagonal, uniform", "sampled-rows, calibrated", "dense (cudnn)"} <= labels
    path = tmp_path / "records.json"
    path.write_text(json.dumps(rows))
    plot_quality_time.main([str(path), "--md", str(tmp_path / "t.md"), "--png",
                            str(tmp_path / "t.png")])
    assert "![top-1 and KL" in (tmp_path / "t.md").read_text()
