"""The demo (`xattn_jax.demo`), its synthetic example and its exact recall."""

from __future__ import annotations

import math
import re
import sys

import jax.numpy as jnp
import numpy as np
import pytest

import xattn_jax
from xattn_jax import demo
from xattn_jax.demo import cli
from xattn_jax.demo.recall import coverage
from xattn_jax.demo.synthetic import structured_qk

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TINY = ["--length", "512", "--heads", "2", "--head-dim", "16", "--block-size", "64",
        "--repeats", "1"]


# --- the command line ------------------------------------------------------------------

def test_main_writes_png_and_reports_recall_and_density(tmp_path, capsys):
    out = tmp_path / "demo.png"
    demo.main(TINY + ["--head", "1", "--out", str(out)])
    report = capsys.readouterr().out
    assert out.read_bytes()[:8] == PNG_SIGNATURE
    import matplotlib.image
    assert matplotlib.image.imread(out).ndim == 3
    for name in ("density", "recall"):
        value = float(re.search(rf"^\s*{name}\s+([0-9.]+)", report, re.M).group(1))
        assert 0.0 <= value <= 1.0, report
    assert "8 x 8 blocks" in report and str(out) in report


@pytest.mark.parametrize("flags, message", [
    (["--threshold", "1.5"], "threshold"),
    (["--block-size", "100"], "block_size"),
    (["--stride", "0"], "stride"),
    (["--head-dim", "2"], "head_dim"),
    (["--head", "2"], "--head"),
    (["--length", "0"], "--length"),
    (["--impl", "cuda"], "--impl"),
    (["--threshold", "high"], "--threshold"),
])
def test_bad_flags_exit_with_a_clear_message(tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit) as exit_info:
        demo.main(TINY + ["--out", str(tmp_path / "demo.png")] + flags)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "demo.png").exists()


def test_without_matplotlib_the_demo_stops_before_computing(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
    monkeypatch.setattr(cli, "structured_qk", _no_work)
    with pytest.raises(SystemExit) as exit_info:
        demo.main(TINY + ["--out", str(tmp_path / "demo.png")])
    assert exit_info.value.code == 2
    assert "needs matplotlib: pip install 'xattn-jax[demo]'" in capsys.readouterr().err
    assert not (tmp_path / "demo.png").exists()


def _no_work(*args, **kwargs):
    raise AssertionError("the demo computed before finding matplotlib missing")


def test_missing_output_directory_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        demo.main(TINY + ["--out", str(tmp_path / "missing" / "demo.png")])
    assert exit_info.value.code == 2
    assert "does not exist" in capsys.readouterr().err


def test_plot_labels_every_mask_state_and_greys_blocks_after_the_diagonal():
    from xattn_jax.demo.cli import AFTER_DIAGONAL_COLOR, MASK_STATES, plot_figure
    import matplotlib.colors

    qb, kb = 3, 5  # a chunk: query block I lines up with key block I + 2
    allowed = np.arange(kb)[None, :] <= np.arange(qb)[:, None] + 2
    sums = np.where(allowed, 0.5, 0.0)
    mask = allowed & (np.arange(kb)[None, :] % 2 == 0)
    left, right = plot_figure(sums, mask, "title").axes[:2]
    labels = [text.get_text() for text in right.get_legend().get_texts()]
    assert sorted(labels) == sorted(label for label, _ in MASK_STATES)
    assert any("after the diagonal" in label for label in labels)
    states = np.asarray(right.images[0].get_array())
    np.testing.assert_array_equal(states, np.where(mask, 2, np.where(allowed, 1, 0)))
    grey = matplotlib.colors.to_rgba(AFTER_DIAGONAL_COLOR)
    assert right.images[0].cmap(right.images[0].norm(0)) == grey
    blank = np.ma.getmaskarray(np.ma.masked_invalid(left.images[0].get_array()))
    np.testing.assert_array_equal(blank, ~allowed)
    assert tuple(left.images[0].cmap.get_bad()) == grey


def test_plot_colors_shares_of_each_row_not_block_sums():
    """Block sums of a full block row add up to block_size / stride (16 here), yet the color
    bar shows each block's share of its row: at most 1, each row summing to 1, and its
    label says so."""
    from xattn_jax.demo.cli import SHARE_LABEL, plot_figure

    sums = np.tril(np.arange(1.0, 17.0)[None, :].repeat(4, axis=0)[:, :4])
    sums *= 16 / sums.sum(axis=1, keepdims=True)  # each row's 16 reshaped rows of mass
    left = plot_figure(sums, sums > 4, "title").axes[0]
    shown = np.ma.masked_invalid(left.images[0].get_array())
    np.testing.assert_allclose(shown.sum(axis=1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(shown.filled(0), sums / 16, rtol=1e-6)
    assert left.images[0].norm.vmax <= 1.0
    assert left.images[0].colorbar.ax.get_ylabel() == SHARE_LABEL
    assert "share" in SHARE_LABEL and "sums to 1" in SHARE_LABEL


# --- exact recall ----------------------------------------------------------------------

def brute_force_recall(q, k, mask, block_size, causal):
    """Per query head: the mean over batch and query tokens of the selected softmax mass."""
    q, k, mask = (np.asarray(x, np.float64) for x in (q, k, mask))
    b, hq, lq, d = q.shape
    lk, group = k.shape[2], hq // k.shape[1]
    recall = np.zeros(hq)
    for h in range(hq):
        for bi in range(b):
            for i in range(lq):
                visible = i + lk - lq + 1 if causal else lk
                logits = k[bi, h // group, :visible] @ q[bi, h, i] / math.sqrt(d)
                p = np.exp(logits - logits.max())
                p /= p.sum()
                keep = mask[bi, h, i // block_size, np.arange(visible) // block_size] > 0
                recall[h] += p[keep].sum() / (b * lq)
    return recall


@pytest.mark.parametrize("causal", [True, False])
def test_recall_matches_brute_force(causal):
    rng = np.random.default_rng(7)
    block_size, lq, lk = 16, 37, 69  # Lk - Lq = 32: query blocks line up with key blocks
    q = jnp.asarray(2 * rng.standard_normal((2, 4, lq, 8)), jnp.float32)
    k = jnp.asarray(2 * rng.standard_normal((2, 2, lk, 8)), jnp.float32)  # GQA, group 2
    mask = jnp.asarray(rng.random((2, 4, 3, 5)) < 0.5)
    # 10 query rows per chunk: 4 chunks, the last one partly padding.
    got = coverage(q, k, mask, block_size=block_size, causal=causal,
                   chunk_bytes=10 * 4 * 2 * 4 * 80)
    np.testing.assert_allclose(got.recall, brute_force_recall(q, k, mask, block_size, causal),
                               rtol=1e-5, atol=1e-6)
    allowed = np.arange(5)[None, :] <= np.arange(3)[:, None] + 2 if causal else np.ones((3, 5))
    expected = (np.asarray(mask) & (allowed > 0)).sum(axis=(0, 2, 3)) / (2 * allowed.sum())
    np.testing.assert_allclose(got.density, expected)


def test_recall_refuses_a_mask_of_the_wrong_shape():
    q = jnp.zeros((1, 2, 64, 8))
    with pytest.raises(ValueError, match="mask must have shape"):
        coverage(q, q, jnp.ones((1, 2, 4, 4), bool), block_size=32)


def test_recall_is_one_at_threshold_one_and_grows_with_threshold():
    example = structured_qk(1, heads=2, length=1024, head_dim=32)
    recalls, densities = [], []
    for threshold in (0.3, 0.6, 0.9, 0.99, 1.0):
        _, mask = xattn_jax.xattn_estimate(example.q, example.k, block_size=64,
                                           threshold=threshold)
        result = coverage(example.q, example.k, mask, block_size=64)
        recalls.append(result.recall)
        densities.append(result.density)
    recalls, densities = np.array(recalls), np.array(densities)
    np.testing.assert_allclose(recalls[-1], 1.0, atol=1e-5)
    assert np.all(np.diff(recalls, axis=0) >= -1e-6), recalls
    assert np.all(np.diff(densities, axis=0) >= 0), densities
    assert recalls[0].max() < 0.99 and densities[0].max() < 0.5  # the threshold matters


# --- the synthetic example -------------------------------------------------------------

def test_synthetic_is_deterministic_with_the_documented_shapes():
    a, b, c = (structured_qk(s, heads=2, length=300, head_dim=24) for s in (3, 3, 4))
    assert a.q.shape == a.k.shape == (1, 2, 300, 24)
    assert a.q.dtype == a.k.dtype == jnp.float32
    np.testing.assert_array_equal(a.q, b.q)
    np.testing.assert_array_equal(a.k, b.k)
    np.testing.assert_array_equal(a.diagonals, b.diagonals)
    assert not np.array_equal(a.q, c.q)


@pytest.fixture(scope="module")
def attention():
    """Exact causal attention of a synthetic example on every 4th query of its last three
    quarters (where the diagonal stripes are):
    (example, query rows int `[n]`, probabilities float64 `[H, n, L]`)."""
    example = structured_qk(0, heads=3, length=2048, head_dim=64)
    q, k = np.asarray(example.q[0], np.float64), np.asarray(example.k[0], np.float64)
    rows = np.arange(512, 2048, 4)
    logits = q[:, rows] @ k.transpose(0, 2, 1) / 8.0
    logits = np.where(np.arange(2048)[None, None, :] <= rows[None, :, None], logits, -np.inf)
    p = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return example, rows, p / p.sum(axis=-1, keepdims=True)


def _share(p, rows, where):
    """Mean over heads and rows of the mass in the key tokens `where(rows, keys)` selects,
    and the share that uniform attention over the visible keys would give them."""
    keys = np.arange(p.shape[-1])[None, :]
    selected = where(rows[:, None], keys) & (keys <= rows[:, None])
    uniform = (selected.sum(axis=1) / (rows + 1)).mean()
    return (p * selected).sum(axis=-1).mean(), uniform


def test_synthetic_attention_has_sinks_and_a_local_window(attention):
    example, rows, p = attention
    sink, uniform = _share(p, rows, lambda i, j: j < len(example.sinks))
    assert sink > 0.15 and sink > 50 * uniform
    local, uniform = _share(p, rows, lambda i, j: (i - j < 16) & (j >= len(example.sinks)))
    assert local > 0.08 and local > 5 * uniform


def test_synthetic_attention_has_vertical_stripes(attention):
    example, rows, p = attention
    stripe = np.isin(np.arange(p.shape[-1]), example.vertical)
    far = lambda i, j: stripe[j] & (i - j >= 64)  # noqa: E731
    share, uniform = _share(p, rows, far)
    assert share > 0.01 and share > 4 * uniform


def test_synthetic_attention_has_diagonal_stripes(attention):
    example, rows, p = attention
    shares = []
    for start, stop, offset in example.diagonals:
        inside = (rows >= start) & (rows < stop)
        near = lambda i, j, offset=offset: np.abs(i - offset - j) < 16  # noqa: E731
        shares.append(_share(p[:, inside], rows[inside], near))
        assert shares[-1][0] > 0.05 and shares[-1][0] > 1.5 * shares[-1][1], (start, offset)
    share, uniform = np.mean(shares, axis=0)
    assert share > 0.1 and share > 3 * uniform


def test_synthetic_attention_has_noise(attention):
    example, rows, p = attention
    structured = lambda i, j: ((j < len(example.sinks)) | (i - j < 64)  # noqa: E731
                               | np.isin(j, example.vertical))
    rest, _ = _share(p, rows, lambda i, j: ~structured(i, j))
    assert 0.02 < rest < 0.8
