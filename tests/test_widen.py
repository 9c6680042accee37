"""docs/estimate.md section 4's widening (`min_blocks`, `dense_last`), every
implementation, against a float64 model; and `dense_last` in `xattention`: those rows see
every key."""

from __future__ import annotations

import numpy as np
import pytest

import np_reference as npr
import xattn_jax
from test_attention import AttentionCase, attend, qkv, xattend


def widened(sums, threshold, *, causal: bool, min_blocks: int, dense_last: int):
    """The float64 model: the rule's mask, plus each row's `min_blocks` largest allowed
    blocks (equal sums: lower index first), plus every allowed block of the last
    `dense_last` rows."""
    sums = np.asarray(sums, np.float64)
    mask = npr.select(sums, threshold, causal=causal)
    qb, kb = sums.shape[-2:]
    _, allowed = npr.forced_allowed(qb, kb, causal=causal)
    for idx in np.ndindex(*sums.shape[:3]):
        row = np.where(allowed[idx[2]], sums[idx], -1.0)
        order = sorted(range(kb), key=lambda j: (-row[j], j))[:min_blocks]
        mask[idx][order] |= allowed[idx[2]][order]
    mask[..., qb - dense_last:, :] |= allowed[qb - dense_last:] if dense_last else False
    return mask


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("min_blocks,dense_last", [(0, 0), (1, 0), (3, 0), (0, 2), (4, 1),
                                                   (40, 0)])
def test_select_blocks_widens_as_the_model(impl, causal, min_blocks, dense_last, rand):
    shape = (1, 3, 6, 11)
    sums = np.array(rand.block_sums(shape, zeros=0.2))
    sums[..., 4] = sums[..., 5]  # equal sums: the lower index goes first
    if causal:
        _, allowed = npr.forced_allowed(*shape[2:], causal=True)
        sums[..., ~allowed] = 0.0
    t = np.asarray(rand.thresholds(shape[1], 0.2, 0.6))
    mask = np.asarray(xattn_jax.select_blocks(sums, t, causal=causal, min_blocks=min_blocks,
                                              dense_last=dense_last, impl=impl.api))
    want = widened(sums, t, causal=causal, min_blocks=min_blocks, dense_last=dense_last)
    assert np.array_equal(mask, want), f"{impl} {rand}"
    plain = npr.select(sums, t, causal=causal)
    if min_blocks >= 3 or dense_last:  # the rule alone always keeps a row's largest block
        assert mask.sum() > plain.sum(), "the case must widen something"


def test_estimate_widens_its_own_selection(impl, rand):
    q, k = rand.qk(1, 2, 1, 96, 96, 16, stride=4)
    rules = dict(block_size=16, stride=4, threshold=0.3, impl=impl.api)
    sums, mask = xattn_jax.xattn_estimate(q, k, min_blocks=3, dense_last=1, **rules)
    want = xattn_jax.select_blocks(sums, 0.3, min_blocks=3, dense_last=1, impl=impl.api)
    assert np.array_equal(np.asarray(mask), np.asarray(want)), f"{impl} {rand}"
    _, plain = xattn_jax.xattn_estimate(q, k, **rules)
    assert np.asarray(mask).sum() > np.asarray(plain).sum()


def test_dense_last_rows_see_every_key(rand):
    """The rows of the last query block attend exactly as dense attention does; the
    others do not (the threshold drops blocks there)."""
    case = AttentionCase("dense-last", 1, 4, 2, 96, 96, 16, stride=4, block_size=16)
    q, k, v = qkv(rand, case)
    options = dict(block_size=case.block_size, stride=case.stride, threshold=0.3,
                   min_blocks=0)
    out = np.asarray(xattend(q, k, v, dense_last=1, **options))
    dense = np.asarray(attend(q, k, v, np.ones(case.mask_shape, bool), **case.options))
    last = slice(case.q_len - case.block_size, None)
    np.testing.assert_allclose(out[:, :, last], dense[:, :, last], rtol=1e-6, atol=1e-6,
                               err_msg=str(rand))
    assert not np.allclose(out[:, :, :last.start], dense[:, :, :last.start], atol=1e-3)
    sparse = np.asarray(xattend(q, k, v, dense_last=0, **options))
    assert not np.allclose(sparse[:, :, last], dense[:, :, last], atol=1e-3), \
        "without dense_last the last rows must drop something"


@pytest.mark.parametrize("name,value,error", [
    ("min_blocks", -1, ValueError), ("min_blocks", 1.5, TypeError),
    ("dense_last", -2, ValueError), ("dense_last", True, TypeError),
])
def test_bad_widening_is_refused(name, value, error, rand):
    q, k = rand.qk(1, 2, 1, 32, 32, 16, stride=4)
    with pytest.raises(error, match=name):
        xattn_jax.xattn_estimate(q, k, block_size=16, stride=4, **{name: value})
    with pytest.raises(error, match=name):
        xattn_jax.select_blocks(np.ones((1, 2, 2, 2), np.float32), **{name: value})
    with pytest.raises(error, match=name):
        xattn_jax.xattention(q, k, k, block_size=16, stride=4, **{name: value})
