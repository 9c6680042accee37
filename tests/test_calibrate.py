"""`xattn_jax.calibrate`: per-head thresholds from sample activations."""

from __future__ import annotations

import importlib
import warnings

import jax.numpy as jnp
import numpy as np
import pytest

import xattn_jax
from xattn_jax.calibrate import THRESHOLDS, DensityNotReachedWarning, allocate, head_curves
from xattn_jax.demo.synthetic import structured_qk

calibrate_module = importlib.import_module("xattn_jax.calibrate")  # the package's
# attribute `calibrate` is the function

SETTINGS = dict(block_size=16, stride=4, min_blocks=0, dense_last=0, impl="reference")


def test_allocate_spends_blocks_where_they_buy_most_error():
    """Head 0's error falls steeply with density, head 1's barely: at a shared budget,
    head 0 gets the denser threshold; the mean density meets the target."""
    t = (0.5, 0.9, 1.0)
    density = np.array([[[0.2, 0.2], [0.5, 0.5], [1.0, 1.0]]])  # [layers, T, Hq]
    error = np.array([[[0.8, 0.05], [0.1, 0.04], [0.0, 0.0]]])
    table = allocate(density, error, target_density=0.35, thresholds=t)
    assert table.shape == (1, 2) and table.dtype == np.float32
    np.testing.assert_array_equal(table, np.float32([[0.9, 0.5]]))
    np.testing.assert_array_equal(allocate(density, error, target_density=1.0, thresholds=t),
                                  [[1.0, 1.0]])
    with pytest.warns(DensityNotReachedWarning, match="0.1 cannot be reached: .* 0.200"):
        sparsest = allocate(density, error, target_density=0.1, thresholds=t)
    np.testing.assert_array_equal(sparsest, [[0.5, 0.5]])  # nothing meets it: the sparsest


def test_head_curves_fall_with_density(rand):
    q, k = rand.qk(1, 2, 1, 96, 96, 16, stride=4)
    v = rand.normal(k.shape)
    density, error = head_curves(q, k, v, thresholds=(0.3, 0.8, 1.0), **SETTINGS)
    assert density.shape == error.shape == (3, 2)
    assert np.all(np.diff(density, axis=0) >= 0) and np.all(density[-1] == 1)
    np.testing.assert_allclose(error[-1], 0, atol=1e-6)
    assert np.all(error[0] > error[-1]), f"{rand}"


def test_calibrate_meets_its_density_and_changes_the_selection(rand):
    layers = []
    sharpness = np.array([0.3, 1.0, 2.0, 3.0], np.float32)[None, :, None, None]
    for seed in range(3):  # structured attention, from near-uniform heads to peaked ones
        qk = structured_qk(int(rand.rng.integers(1 << 30)) + seed, heads=4, length=256,
                           head_dim=16)
        layers.append((qk.q * sharpness, qk.k, rand.normal(qk.k.shape)))
    with warnings.catch_warnings():
        warnings.simplefilter("error", DensityNotReachedWarning)  # a target it reaches
        table = xattn_jax.calibrate(layers, target_density=0.6, **SETTINGS)
    assert table.shape == (3, 4) and set(np.unique(table)) <= set(np.float32(THRESHOLDS))
    assert len(np.unique(table)) > 1, f"one threshold for every head calibrates nothing {rand}"
    assert mean_density(layers, table) <= 0.6 + 1e-6
    everything = xattn_jax.calibrate(layers, target_density=1.0, **SETTINGS)
    assert mean_density(layers, everything) == 1.0


def mean_density(layers, table) -> float:
    """The share of causally visible blocks xattention keeps with `table`'s rows."""
    kept, visible = 0, 0
    options = {s: SETTINGS[s] for s in ("block_size", "stride", "min_blocks", "dense_last",
                                        "impl")}
    for (q, k, v), row in zip(layers, table):
        _, mask = xattn_jax.xattention(q, k, v, threshold=row, return_mask=True, **options)
        qb = mask.shape[-1]
        kept += int(np.asarray(mask).sum())
        visible += qb * (qb + 1) // 2 * mask.shape[1]  # Lq = Lk: causal
    return kept / visible


@pytest.mark.parametrize("target", [0.0, -0.5, 1.5, float("nan")])
def test_bad_target_density_is_refused(target, rand):
    q, k = rand.qk(1, 2, 1, 32, 32, 16, stride=4)
    with pytest.raises(ValueError, match="target_density"):
        xattn_jax.calibrate([(q, k, k)], target_density=target, **SETTINGS)


def test_curves_of_other_shapes_are_refused():
    with pytest.raises(ValueError, match="density and error"):
        allocate(np.zeros((2, 3, 4)), np.zeros((2, 3, 5)), target_density=0.5,
                 thresholds=(0.5, 0.9, 1.0))
    with pytest.raises(ValueError, match="layers must hold"):
        xattn_jax.calibrate([], **SETTINGS)


def test_an_unreachable_target_warns_with_the_density_kept(rand):
    """Two blocks per head, each row keeping at least 4 blocks: every threshold keeps all
    of them, so a target of 0.3 gets the sparsest table and a warning saying 1.000."""
    q, k = rand.qk(1, 2, 1, 32, 32, 16, stride=4)
    settings = dict(SETTINGS, min_blocks=4)
    with pytest.warns(DensityNotReachedWarning, match="0.3 cannot be reached: .* 1.000"):
        table = xattn_jax.calibrate([(q, k, k)], target_density=0.3, **settings)
    np.testing.assert_array_equal(table, np.float32([[min(THRESHOLDS)] * 2]))


def _layer(heads=2, length=32, kv_heads=1, dtype=jnp.float32):
    q = jnp.zeros((1, heads, length, 16), dtype)
    k = jnp.zeros((1, kv_heads, length, 16), dtype)
    return q, k, k


@pytest.mark.parametrize("layers, error, message", [
    ([_layer()[:2]], TypeError, r"layers\[0\] must be a \(q, k, v\) tuple of three arrays, "
                               r"got a tuple of 2"),
    ([_layer(), _layer()[0]], TypeError, r"layers\[1\] must be a \(q, k, v\)"),
    ("qkv", TypeError, "layers must be an iterable"),
    (_layer()[0], TypeError, r"layers\[0\] must be a \(q, k, v\)"),
    ([(_layer()[0], _layer()[1], None)], ValueError, r"layers\[0\]: v must have rank 4"),
    ([(_layer()[1], _layer()[0], _layer()[0])], ValueError,
     r"layers\[0\]: the query heads of q \(1\) must be a multiple"),
    ([_layer(), _layer(heads=4)], ValueError,
     r"layers\[1\]: q must have the query heads of layers\[0\]'s q \(2\)"),
    ([_layer(dtype=jnp.int32)], ValueError, r"layers\[0\]: q must be float32"),
])
def test_bad_layers_are_refused_before_any_work(layers, error, message, monkeypatch):
    monkeypatch.setattr(calibrate_module, "head_curves", _no_work)
    with pytest.raises(error, match=message):
        xattn_jax.calibrate(layers, **SETTINGS)


@pytest.mark.parametrize("arguments, error, message", [
    (dict(thresholds=[]), ValueError,
     r"thresholds must be a non-empty sequence of floats in \(0, 1\], got shape \(0,\)"),
    (dict(thresholds=0.9), ValueError, r"thresholds must be a non-empty sequence"),
    (dict(thresholds=["high"]), TypeError, r"thresholds must be a non-empty sequence"),
    (dict(thresholds=[0.5, 1.5]), ValueError, r"thresholds must lie in \(0, 1\]"),
    (dict(target_density="0.3"), TypeError, "target_density must be a finite number"),
    (dict(treshold=0.9), TypeError, r"calibrate takes the settings .* unknown \['treshold'\]"),
    (dict(block_size=18), ValueError, r"block_size must be a positive multiple of stride"),
    (dict(min_blocks=-1), ValueError, "min_blocks must be an integer >= 0"),
    (dict(impl="cuda"), ValueError, "impl must be one of"),
    (dict(estimate="exact"), ValueError, "estimate must be one of"),
])
def test_bad_arguments_are_refused_before_any_work(arguments, error, message, monkeypatch):
    monkeypatch.setattr(calibrate_module, "head_curves", _no_work)
    with pytest.raises(error, match=message):
        xattn_jax.calibrate([_layer()], **{**SETTINGS, **arguments})


def _no_work(*args, **kwargs):
    raise AssertionError("calibrate computed a curve before refusing its arguments")
