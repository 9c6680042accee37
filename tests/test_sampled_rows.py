"""Block scores from sampled query rows (`xattn_jax.sampled_rows`) against a float64 model,
and `xattention(estimate="sampled-rows")` and the calibration on them."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import xattn_jax
from xattn_jax.reference import sampled_rows
from xattn_jax.calibrate import head_curves
from xattn_jax.defaults import DENSE_LAST, MIN_BLOCKS


def model_mass(q, k, *, block_size: int, rows: int, causal: bool, scale=None):
    """float64: each sampled row's exact softmax over the keys it sees, summed per block."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    b, hq, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    scale = d ** -0.5 if scale is None else scale
    qb, kb = -(-lq // block_size), -(-lk // block_size)
    out = np.zeros((b, hq, qb, kb))
    for i, h, block in np.ndindex(b, hq, qb):
        start = block * block_size
        length = min(block_size, lq - start)
        for part in range(1, rows + 1):
            row = start + max(part * length // rows - 1, 0)
            s = k[i, h // (hq // hkv)] @ q[i, h, row] * scale
            if causal:
                s[np.arange(lk) > row + lk - lq] = -np.inf
            p = np.exp(s - s.max())
            p /= p.sum()
            out[i, h, block] += np.pad(p, (0, kb * block_size - lk)).reshape(kb, -1).sum(-1)
    return out


@pytest.mark.parametrize("lq,lk,causal,rows", [(96, 96, True, 4), (80, 112, True, 16),
                                               (70, 70, True, 3), (64, 100, False, 5),
                                               (96, 96, True, 1)])
def test_mass_matches_the_model(lq, lk, causal, rows, rand):
    q, k = rand.qk(2, 4, 2, lq, lk, 8, stride=1)
    if causal and (lk - lq) % 16:
        pytest.skip("causal needs whole blocks of context")
    got = xattn_jax.sampled_block_mass(q, k, block_size=16, rows=rows, causal=causal)
    want = model_mass(q, k, block_size=16, rows=rows, causal=causal)
    assert got.shape == want.shape and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6,
                               err_msg=str(rand))
    np.testing.assert_allclose(np.asarray(got).sum(-1), rows, rtol=1e-5)
    if causal:
        qb, kb = got.shape[-2:]
        past_diagonal = np.arange(kb)[None, :] > np.arange(qb)[:, None] + kb - qb
        assert not np.asarray(got)[..., past_diagonal].any()


def test_every_row_sampled_is_the_exact_block_mass(rand):
    q, k = rand.qk(1, 2, 1, 64, 64, 8, stride=1)
    got = xattn_jax.sampled_block_mass(q, k, block_size=16, rows=16, scale=0.3)
    s = np.einsum("hid,jd->hij", np.asarray(q[0], np.float64), np.asarray(k[0, 0])) * 0.3
    s[:, np.triu_indices(64, 1)[0], np.triu_indices(64, 1)[1]] = -np.inf
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    want = p.reshape(2, 4, 16, 4, 16).sum(axis=(2, 4))
    np.testing.assert_allclose(np.asarray(got[0]), want, rtol=1e-5, atol=1e-6)


def test_steps_of_query_blocks_change_nothing(rand, monkeypatch):
    q, k = rand.qk(1, 3, 1, 128, 128, 8, stride=1)
    whole = xattn_jax.sampled_block_mass(q, k, block_size=16, rows=4, impl="reference")
    monkeypatch.setattr(sampled_rows, "SCORE_STEP_BYTES", 3 * 4 * 3 * 4 * 128)  # 3 blocks
    sampled_rows.block_mass.clear_cache()
    stepped = xattn_jax.sampled_block_mass(q, k, block_size=16, rows=4, impl="reference")
    sampled_rows.block_mass.clear_cache()
    np.testing.assert_allclose(np.asarray(stepped), np.asarray(whole), rtol=1e-6, atol=1e-7)


def test_bf16_inputs(rand):
    q, k = rand.qk(1, 2, 2, 64, 64, 16, stride=1, dtype=jnp.bfloat16)
    got = xattn_jax.sampled_block_mass(q, k, block_size=32, rows=8)
    want = model_mass(q, k, block_size=32, rows=8, causal=True)
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("kwargs,error,words", [
    (dict(rows=0), ValueError, "rows"), (dict(rows=17), ValueError, "rows must be at most"),
    (dict(rows=2.0), TypeError, "rows"), (dict(scale=-1.0), ValueError, "scale"),
    (dict(causal=1), TypeError, "causal"), (dict(block_size=0), ValueError, "block_size")])
def test_bad_arguments_are_refused(kwargs, error, words, rand):
    q, k = rand.qk(1, 2, 1, 32, 32, 8, stride=1)
    with pytest.raises(error, match=words):
        xattn_jax.sampled_block_mass(q, k, **{"block_size": 16, **kwargs})


def test_xattention_selects_on_sampled_rows(rand):
    q, k = rand.qk(1, 4, 2, 128, 128, 16, stride=1)
    v = rand.normal((1, 2, 128, 16))
    t = jnp.asarray([0.5, 0.7, 0.9, 0.95])
    out, mask = xattn_jax.xattention(q, k, v, threshold=t, block_size=16, return_mask=True,
                                     estimate="sampled-rows")
    sums = xattn_jax.sampled_block_mass(q, k, block_size=16)
    want_mask = xattn_jax.select_blocks(sums, t, min_blocks=MIN_BLOCKS, dense_last=DENSE_LAST)
    np.testing.assert_array_equal(np.asarray(mask), np.asarray(want_mask))
    want = xattn_jax.block_sparse_attention(q, k, v, want_mask, block_size=16)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-5, atol=1e-6)
    _, antidiagonal = xattn_jax.xattention(q, k, v, threshold=t, block_size=16, stride=4,
                                           return_mask=True)
    assert not np.array_equal(np.asarray(mask), np.asarray(antidiagonal)), \
        "the case must tell the two estimates apart"


@pytest.mark.parametrize("estimate,error", [("rows", ValueError), (1, TypeError)])
def test_xattention_refuses_an_unknown_estimate(estimate, error, rand):
    q, k = rand.qk(1, 2, 1, 32, 32, 8, stride=1)
    with pytest.raises(error, match="estimate must be one of"):
        xattn_jax.xattention(q, k, k, block_size=16, estimate=estimate)


def test_calibration_curves_follow_the_scores_selected_on(rand):
    q, k = rand.qk(1, 2, 1, 128, 128, 16, stride=1)
    v = rand.normal((1, 1, 128, 16))
    options = dict(thresholds=(0.5, 1.0), block_size=16, stride=4, min_blocks=0,
                   dense_last=0)
    diagonal_only = jnp.broadcast_to(jnp.eye(8, dtype=jnp.float32), (1, 2, 8, 8))
    density, error = head_curves(q, k, v, block_scores=diagonal_only, **options)
    np.testing.assert_allclose(density[0], 15 / 36)  # the forced sink and diagonal
    np.testing.assert_allclose(density[1], 1.0)
    np.testing.assert_allclose(error[1], 0.0, atol=1e-6)
    sampled = head_curves(q, k, v, estimate="sampled-rows", **options)
    antidiagonal = head_curves(q, k, v, **options)
    assert not np.array_equal(sampled[0][0], density[0])
    assert not np.array_equal(sampled[1][0], antidiagonal[1][0]), \
        "the two estimates must give other selections here"
