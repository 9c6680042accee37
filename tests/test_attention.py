"""block_sparse_attention and xattention (docs/estimate.md section 6) against the float64 numpy
model `np_attention`, on random block masks; NaN policy, paged caches, argument checks,
the implementation choice."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import np_attention as npa
import xattn_jax
from xattn_jax import impls, mosaic, partitioning
from xattn_jax.reference.attention import block_sparse_attention as reference_attention

F32_TOL = dict(rtol=2e-5, atol=2e-5)  # outputs are averages of N(0, 1) values
BF16_TOL = dict(rtol=3e-2, atol=3e-2)  # bf16 weights and output, against float64


def attend(q, k, v, mask, **kwargs):
    """`xattn_jax.block_sparse_attention`, impl="reference" unless told: these tests check
    the reference at shapes a kernel may refuse (`TestGpu` runs impl="auto")."""
    return xattn_jax.block_sparse_attention(q, k, v, mask, **{"impl": "reference", **kwargs})


def xattend(q, k, v, **kwargs):
    """`xattn_jax.xattention`, impl="reference" unless told."""
    return xattn_jax.xattention(q, k, v, **{"impl": "reference", **kwargs})


def qkv(rand, b, hq, hkv, lq, lk, d, dv=None, dtype=jnp.float32):
    """q `[b, hq, lq, d]`, k `[b, hkv, lk, d]`, v `[b, hkv, lk, dv]`; q and k scaled so
    softmax rows are peaked but not degenerate."""
    return (rand.normal((b, hq, lq, d), dtype, 1.5), rand.normal((b, hkv, lk, d), dtype, 1.5),
            rand.normal((b, hkv, lk, dv or d), dtype))


def blocks(n: int, block_size: int) -> int:
    return -(-n // block_size)


def mask_for(rand, b, hq, lq, lk, block_size, *, density=0.5, empty_rows=0.2):
    shape = (b, hq, blocks(lq, block_size), blocks(lk, block_size))
    return jnp.asarray(npa.random_mask(rand.rng, shape, density=density,
                                       empty_rows=empty_rows))


def assert_matches_model(out, lse, q, k, v, mask, *, block_size, causal, rand, tol=F32_TOL,
                         **model_kwargs):
    want, want_lse = npa.attention(q, k, v, mask, block_size=block_size, causal=causal,
                                   **model_kwargs)
    np.testing.assert_allclose(np.asarray(out, np.float64), want, err_msg=str(rand), **tol)
    np.testing.assert_allclose(np.asarray(lse), want_lse, err_msg=str(rand), **tol)


# (B, Hq, Hkv, Lq, Lk, D, Dv, block_size, causal)
CASES = {
    "gqa-causal-odd": (1, 4, 2, 37, 131, 16, 16, 16, True),
    "gqa-noncausal-dv": (2, 4, 2, 37, 131, 16, 8, 16, False),
    "square-causal": (1, 2, 1, 64, 64, 8, 8, 16, True),
    "mha-ragged-block": (1, 2, 2, 50, 53, 8, 12, 8, True),
}


@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_numpy_model(case, rand):
    b, hq, hkv, lq, lk, d, dv, bs, causal = CASES[case]
    q, k, v = qkv(rand, b, hq, hkv, lq, lk, d, dv)
    mask = mask_for(rand, b, hq, lq, lk, bs)
    out, lse = attend(q, k, v, mask, block_size=bs, causal=causal, return_lse=True)
    assert out.shape == (b, hq, lq, dv) and out.dtype == q.dtype
    assert lse.shape == (b, hq, lq) and lse.dtype == jnp.float32
    assert_matches_model(out, lse, q, k, v, mask, block_size=bs, causal=causal, rand=rand)


@pytest.mark.parametrize("tile,rows", [(16, 10), (48, 7), (131, 37), (7, 36), (500, 99)])
def test_tiles_and_chunks_change_nothing(tile, rows, rand):
    """Several key tiles and query chunks, the last of each clamped (overlapping the one
    before it), tiles that are not whole blocks: the same results as the model."""
    b, hq, hkv, lq, lk, d, dv, bs, causal = CASES["gqa-causal-odd"]
    q, k, v = qkv(rand, b, hq, hkv, lq, lk, d, dv)
    mask = mask_for(rand, b, hq, lq, lk, bs)
    out, lse = jax.jit(reference_attention, static_argnames=(
        "block_size", "causal", "return_lse", "key_tile_size", "query_chunk_size"))(
        q, k, v, mask, block_size=bs, causal=causal, return_lse=True, key_tile_size=tile,
        query_chunk_size=rows)
    assert_matches_model(out, lse, q, k, v, mask, block_size=bs, causal=causal, rand=rand)


def test_scale(rand):
    q, k, v = qkv(rand, 1, 2, 1, 20, 40, 8)
    mask = mask_for(rand, 1, 2, 20, 40, 8, empty_rows=0.0)
    out, lse = attend(q, k, v, mask, block_size=8, scale=0.7,
                      return_lse=True)
    assert_matches_model(out, lse, q, k, v, mask, block_size=8, causal=True, rand=rand,
                         scale=0.7)


def test_empty_rows_give_zeros_and_minus_inf(rand):
    b, hq, hkv, lq, lk, d, dv, bs, causal = CASES["gqa-noncausal-dv"]
    q, k, v = qkv(rand, b, hq, hkv, lq, lk, d, dv)
    mask = np.array(mask_for(rand, b, hq, lq, lk, bs, density=0.6, empty_rows=0.0))
    mask[0, 1, 1] = False  # rows 16..31 of head 1
    mask[1] = False  # the whole second batch element
    out, lse = attend(q, k, v, jnp.asarray(mask), block_size=bs,
                      causal=causal, return_lse=True)
    out, lse = np.asarray(out), np.asarray(lse)
    for rows in (out[0, 1, 16:32], out[1]):
        assert np.all(rows == 0), rand
    for rows in (lse[0, 1, 16:32], lse[1]):
        assert np.all(rows == -np.inf), rand
    assert np.all(np.isfinite(lse[0, 0])), rand  # a row with blocks: finite


def test_causal_rows_before_their_first_allowed_key(rand):
    """Causal with Lq = Lk: mask only the diagonal's later blocks; a row whose allowed
    blocks all lie after it sees nothing."""
    q, k, v = qkv(rand, 1, 1, 1, 32, 32, 8)
    mask = jnp.asarray([[[[False, True], [False, False]]]])  # rows 0-15 may see keys 16-31
    out, lse = attend(q, k, v, mask, block_size=16, causal=True,
                      return_lse=True)
    assert np.all(np.asarray(out) == 0) and np.all(np.asarray(lse) == -np.inf), rand


@pytest.mark.parametrize("causal", [True, False])
def test_all_true_mask_is_dense_attention(causal, rand):
    b, hq, hkv, lq, lk, d = 1, 4, 2, 37, 131, 16
    q, k, v = qkv(rand, b, hq, hkv, lq, lk, d)
    mask = jnp.ones((b, hq, blocks(lq, 16), blocks(lk, 16)), bool)
    out, lse = attend(q, k, v, mask, block_size=16, causal=causal,
                      return_lse=True)
    assert_matches_model(out, lse, q, k, v, None, block_size=16, causal=causal, rand=rand)
    pairs = npa.allowed_pairs(None, q_len=lq, k_len=lk, block_size=16, causal=causal)
    dense = jax.nn.dot_product_attention(  # [B, L, H, D] layout, GQA by head groups
        q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3),
        mask=jnp.asarray(np.broadcast_to(pairs, (b, hq, lq, lk))), implementation="xla")
    np.testing.assert_allclose(np.asarray(out), np.asarray(dense.transpose(0, 2, 1, 3)),
                               err_msg=str(rand), **F32_TOL)


def test_bf16(rand):
    b, hq, hkv, lq, lk, d, dv, bs, causal = CASES["gqa-causal-odd"]
    q, k, v = qkv(rand, b, hq, hkv, lq, lk, d, dv, dtype=jnp.bfloat16)
    mask = mask_for(rand, b, hq, lq, lk, bs)
    out, lse = attend(q, k, v, mask, block_size=bs, causal=causal,
                      return_lse=True)
    assert out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
    # the model reads the same bf16 values, exactly upcast
    assert_matches_model(out, lse, q, k, v, mask, block_size=bs, causal=causal, rand=rand,
                         tol=BF16_TOL)


def test_reruns_are_bit_identical(rand):
    b, hq, hkv, lq, lk, d, dv, bs, causal = CASES["gqa-causal-odd"]
    q, k, v = qkv(rand, b, hq, hkv, lq, lk, d, dv)
    mask = mask_for(rand, b, hq, lq, lk, bs)
    runs = [attend(q, k, v, mask, block_size=bs, return_lse=True)
            for _ in range(2)]
    for first, second in zip(*runs):
        assert np.asarray(first).tobytes() == np.asarray(second).tobytes(), rand


# --- non-finite inputs -----------------------------------------------------------------

def _nan_case(rand):
    """Lq = Lk = 48, block 16, causal, one head: a mask where key block 1 is allowed for
    query block 1 only and key block 2 is allowed for no query block."""
    q, k, v = qkv(rand, 1, 1, 1, 48, 48, 8)
    mask = jnp.asarray([[[[True, False, False], [True, True, False], [True, False, False]]]])
    return q, k, v, mask


def _run(q, k, v, mask, **kwargs):
    out, lse = attend(q, k, v, mask, block_size=16,
                      return_lse=True, **kwargs)
    return np.asarray(out), np.asarray(lse)


@pytest.mark.parametrize("where", ["k", "v"])
def test_nan_in_masked_keys_does_not_leak(where, rand):
    """NaN and inf in key block 2 (allowed for nobody) and in key 40 (block 2) change
    nothing; in key block 1, allowed for query block 1 only, they reach only query block 1
    (query block 2 shares the key tile but may not see block 1)."""
    q, k, v, mask = _nan_case(rand)
    clean = _run(q, k, v, mask)
    x = {"k": k, "v": v}[where]
    dirty = x.at[:, :, 32:48].set(jnp.nan).at[:, :, 40, 0].set(jnp.inf)
    args = {"k": (q, dirty, v), "v": (q, k, dirty)}[where]
    out, lse = _run(*args, mask)
    np.testing.assert_array_equal(out, clean[0], err_msg=str(rand))
    np.testing.assert_array_equal(lse, clean[1], err_msg=str(rand))

    dirty = x.at[:, :, 20].set(jnp.nan)  # key 20: block 1
    args = {"k": (q, dirty, v), "v": (q, k, dirty)}[where]
    out, lse = _run(*args, mask)
    seeing = np.arange(48) >= 20  # causal: rows 20.. of query block 1 see key 20
    seeing &= np.arange(48) < 32
    assert np.all(np.isnan(out[0, 0, seeing])), rand
    np.testing.assert_array_equal(out[0, 0, ~seeing], clean[0][0, 0, ~seeing],
                                  err_msg=str(rand))
    if where == "k":
        assert np.all(np.isnan(lse[0, 0, seeing])), rand
    else:  # v does not enter the log-sum-exp
        np.testing.assert_array_equal(lse, clean[1], err_msg=str(rand))


def test_nan_in_q_reaches_its_row_only(rand):
    q, k, v, mask = _nan_case(rand)
    clean = _run(q, k, v, mask)
    out, lse = _run(q.at[:, :, 5, 3].set(jnp.nan), k, v, mask)
    assert np.all(np.isnan(out[0, 0, 5])) and np.isnan(lse[0, 0, 5]), rand
    others = np.arange(48) != 5
    np.testing.assert_array_equal(out[0, 0, others], clean[0][0, 0, others],
                                  err_msg=str(rand))


def test_minus_inf_score_is_weight_zero(rand):
    """k[3, 0] = -inf and q[10, 0] = 1 give row 10 a score of -inf for key 3: weight 0,
    as if key 3 were masked (rows with q[i, 0] < 0 get +inf, and NaN)."""
    q, k, v, mask = _nan_case(rand)
    q = q.at[:, :, 10, 0].set(1.0)
    out, lse = _run(q, k.at[:, :, 3, 0].set(-jnp.inf), v, mask)
    keep = (np.arange(48) != 3) & (np.arange(48) <= 10)  # causal: row 10 sees keys 0..10
    scores = np.asarray(k, np.float64)[0, 0, keep] @ np.asarray(q, np.float64)[0, 0, 10]
    scores /= np.sqrt(8)
    weights = np.exp(scores - scores.max())
    expected = weights @ np.asarray(v, np.float64)[0, 0, keep] / weights.sum()
    np.testing.assert_allclose(out[0, 0, 10], expected, err_msg=str(rand), **F32_TOL)
    np.testing.assert_allclose(lse[0, 0, 10], np.log(weights.sum()) + scores.max(),
                               err_msg=str(rand), **F32_TOL)
    plus_inf = (np.arange(48) >= 3) & (np.asarray(q[0, 0, :, 0]) < 0)  # all see block 0
    assert plus_inf.any() and np.all(np.isnan(out[0, 0, plus_inf])), rand


# --- paged and padded caches -----------------------------------------------------------

@pytest.mark.parametrize("page_size", [8, 12])
def test_paged_cache_equals_contiguous(page_size, rand):
    b, hq, hkv, lq, lk, d, dv, bs = 2, 4, 2, 20, 96, 8, 4, 16
    q, k, v = qkv(rand, b, hq, hkv, lq, lk, d, dv)
    mask = mask_for(rand, b, hq, lq, lk, bs)
    k_pages, v_pages, table = rand.paged(page_size, k, v)
    for causal in (True, False):
        want = attend(q, k, v, mask, block_size=bs, causal=causal,
                      return_lse=True)
        got = attend(q, k_pages, v_pages, mask, block_size=bs,
                     causal=causal, return_lse=True,
                     block_table=table)
        for g, w in zip(got, want):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6,
                                       err_msg=str(rand))


def test_k_len_hides_later_keys_without_recompiling(rand):
    """A padded cache with NaN past k_len: the model on the keys in use, the queries the
    last Lq of them; a traced k_len compiles once for every value."""
    b, hq, hkv, lq, capacity, d, bs = 1, 2, 1, 12, 64, 8, 16
    q, k, v = qkv(rand, b, hq, hkv, lq, capacity, d)
    mask = mask_for(rand, b, hq, lq, capacity, bs, empty_rows=0.0)
    before = partitioning._run._cache_size()
    for n in (40, 57, 12):
        garbage = jnp.arange(capacity) >= n
        k_pad = jnp.where(garbage[:, None], jnp.nan, k)
        v_pad = jnp.where(garbage[:, None], jnp.inf, v)
        for causal in (True, False):
            out, lse = attend(
                q, k_pad, v_pad, mask, block_size=bs, causal=causal, return_lse=True,
                k_len=jnp.int32(n))
            assert_matches_model(out, lse, q, k, v, mask, block_size=bs, causal=causal,
                                 rand=rand, n_keys=n)
    assert partitioning._run._cache_size() - before == 2  # one per causal value
    out_int = attend(q, k, v, mask, block_size=bs, k_len=40)
    out_arr = attend(q, k, v, mask, block_size=bs,
                     k_len=jnp.int32(40))
    np.testing.assert_array_equal(np.asarray(out_int), np.asarray(out_arr))


@pytest.mark.parametrize("rows,share", [(None, 8), (1024, 64)])
def test_reference_never_builds_a_query_by_key_array(rows, share):
    """Compiled (not run) at Lq = Lk = 16384, 2 heads: XLA's temporaries stay below
    1/share of one float32 [Lq, Lk] score matrix per head, and shrink with the chunk."""
    b, h, length, d = 1, 2, 16384, 64
    x = jax.ShapeDtypeStruct((b, h, length, d), jnp.float32)
    mask = jax.ShapeDtypeStruct((b, h, length // 128, length // 128), jnp.bool_)
    fn = jax.jit(reference_attention, static_argnames=("block_size", "query_chunk_size"))
    stats = fn.lower(x, x, x, mask, block_size=128,
                     query_chunk_size=rows).compile().memory_analysis()
    full = b * h * length * length * 4
    assert stats.temp_size_in_bytes < full / share, stats.temp_size_in_bytes


# --- xattention ------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [True, False])
def test_xattention_is_estimate_then_attention(causal, rand):
    b, hq, hkv, lq, lk, d, bs, stride = 1, 4, 2, 64, 128, 16, 16, 4
    q, k, v = qkv(rand, b, hq, hkv, lq, lk, d, 8)
    out, mask = xattend(q, k, v, threshold=0.8, block_size=bs, stride=stride,
                        causal=causal, return_mask=True)
    _, want_mask = xattn_jax.xattn_estimate(q, k, threshold=0.8, block_size=bs,
                                            stride=stride, causal=causal, impl="reference")
    np.testing.assert_array_equal(np.asarray(mask), np.asarray(want_mask), err_msg=str(rand))
    assert not np.all(np.asarray(mask)), "a mask with nothing dropped tests little"
    want = attend(q, k, v, want_mask, block_size=bs, causal=causal)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-6, atol=1e-6,
                               err_msg=str(rand))
    alone = xattend(q, k, v, threshold=0.8, block_size=bs, stride=stride,
                    causal=causal)
    np.testing.assert_array_equal(np.asarray(alone), np.asarray(out))


def test_xattention_threshold_is_data(rand):
    q, k, v = qkv(rand, 1, 2, 2, 64, 64, 8)
    kwargs = dict(block_size=16, stride=4, return_mask=True)
    xattend(q, k, v, threshold=0.9, **kwargs)
    compiled = partitioning._run._cache_size()
    masks = [np.asarray(xattend(q, k, v, threshold=t, **kwargs)[1])
             for t in (0.3, 0.6, 0.99)]
    assert partitioning._run._cache_size() == compiled
    assert masks[0].sum() < masks[2].sum(), "thresholds must change the mask"
    per_head = xattend(q, k, v, threshold=jnp.asarray([0.3, 0.99]), **kwargs)
    assert partitioning._run._cache_size() == compiled
    np.testing.assert_array_equal(np.asarray(per_head[1])[:, 0], masks[0][:, 0])


# --- arguments -------------------------------------------------------------------------

def _valid():
    """A valid call's arguments: (q, k, v, mask), keyword arguments."""
    q = jnp.zeros((1, 4, 20, 8), jnp.float32)
    k = jnp.zeros((1, 2, 40, 8), jnp.float32)
    v = jnp.zeros((1, 2, 40, 6), jnp.float32)
    return [q, k, v, jnp.ones((1, 4, 3, 5), bool)], dict(block_size=8)


BAD = {  # name -> (argument index or keyword, value, words the error must contain)
    "mask-shape": (3, jnp.ones((1, 4, 3, 4), bool), "mask must have shape"),
    "mask-dtype": (3, jnp.ones((1, 4, 3, 5), jnp.float32), "mask must be bool"),
    "v-heads": (2, jnp.zeros((1, 1, 40, 6)), "v must have k's batch, heads and length"),
    "v-length": (2, jnp.zeros((1, 2, 39, 6)), "v must have k's batch, heads and length"),
    "v-rank": (2, jnp.zeros((2, 40, 6)), "v must have rank 4"),
    "v-dtype": (2, jnp.zeros((1, 2, 40, 6), jnp.bfloat16), "v must have k's dtype"),
    "qk-dtype": (1, jnp.zeros((1, 2, 40, 8), jnp.bfloat16), "same dtype"),
    "head-dim": (1, jnp.zeros((1, 2, 40, 7)), "head_dim"),
    "q-longer": (1, jnp.zeros((1, 2, 19, 8)), "q may not be longer than k"),
    "heads": (1, jnp.zeros((1, 3, 40, 8)), "multiple of the key heads"),
    "block-size-zero": ("block_size", 0, "block_size must be a positive integer"),
    "block-size-float": ("block_size", 8.0, "block_size must be a positive integer"),
    "block-size-bool": ("block_size", True, "block_size must be a positive integer"),
    "scale-zero": ("scale", 0.0, "scale must be None or a finite number > 0"),
    "scale-inf": ("scale", float("inf"), "scale must be None or a finite number > 0"),
    "scale-nan": ("scale", float("nan"), "scale must be None or a finite number > 0"),
    "scale-str": ("scale", "0.5", "scale must be None or a finite number > 0"),
    "k-len-short": ("k_len", 19, "k_len must lie in [Lq, Lk]"),
    "k-len-long": ("k_len", 41, "k_len must lie in [Lq, Lk]"),
    "k-len-float": ("k_len", jnp.float32(30), "k_len must be None, an int"),
    "impl-unknown": ("impl", "pallas", "impl must be one of"),
    "impl-triton": ("impl", "triton", "has no block-sparse attention kernel"),
    "block-table-dtype": ("block_table", jnp.zeros((1, 5), jnp.float32), "block_table"),
}


@pytest.mark.parametrize("name", BAD, ids=str)
def test_bad_arguments_raise(name):
    args, kwargs = _valid()
    where, value, words = BAD[name]
    if isinstance(where, int):
        args[where] = value
    else:
        kwargs[where] = value
    with pytest.raises(ValueError, match=words.replace("[", r"\[")):
        attend(*args, **kwargs)


def test_paged_arguments_raise():
    args, kwargs = _valid()
    q, _, _, mask = args
    pages = jnp.zeros((6, 8, 2, 8))
    table = jnp.zeros((1, 5), jnp.int32)
    with pytest.raises(ValueError, match="v must have k's pages, page size and heads"):
        attend(q, pages, jnp.zeros((6, 4, 2, 8)), mask,
               block_table=table, **kwargs)
    with pytest.raises(ValueError, match="block_table must have one row per batch"):
        attend(q, pages, pages, mask,
               block_table=jnp.zeros((2, 5), jnp.int32), **kwargs)
    with pytest.raises(ValueError, match="mask must have shape"):  # Lk = 3 pages of 8
        attend(q, pages, pages, mask,
               block_table=jnp.zeros((1, 3), jnp.int32), **kwargs)


def test_xattention_bad_arguments_raise():
    (q, k, v, _), _ = _valid()
    with pytest.raises(ValueError, match="Lk - Lq must be a multiple of block_size"):
        xattend(q, k, v, block_size=16, stride=8)
    with pytest.raises(ValueError, match="v must have k's batch, heads and length"):
        xattend(q, k, v[:, :, :30], block_size=4, stride=4)
    with pytest.raises(ValueError, match="threshold must lie in"):
        xattend(q, k, v, block_size=4, stride=4, threshold=1.5)
    with pytest.raises(ValueError, match="norm must be"):
        xattend(q, k, v, block_size=4, stride=4, norm=0.0)


# --- implementation choice -------------------------------------------------------------

def test_mosaic_refused_where_unavailable():
    args, kwargs = _valid()
    if mosaic.available(impls.device_of(args[0])) is None:
        pytest.skip("the Mosaic kernel runs here")
    with pytest.raises(ValueError, match="impl='mosaic' needs"):
        attend(*args, impl="mosaic", **kwargs)


def test_impl_choice(monkeypatch):
    """The implementation table's choice for attention (xattn_jax.impls), with the Mosaic
    kernel's availability stubbed: pages that are not whole key tiles go to the reference
    ("auto") or are refused ("mosaic")."""
    gpu = types.SimpleNamespace(platform="gpu")

    def choose(impl, device=gpu, page_size=None):
        args = (128, 128, jnp.bfloat16, 128, page_size)  # D, Dv, dtype, block, page
        return impls.resolve(impl, op=impls.ATTENTION, device=device,
                             attention_args=args).name

    monkeypatch.setattr(mosaic, "available", lambda device=None: None)
    assert choose("auto") == choose("mosaic") == "mosaic"
    assert choose("reference") == "reference"
    assert choose("auto", page_size=256) == choose("mosaic", page_size=4096) == "mosaic"
    assert choose("auto", page_size=16) == "reference"
    with pytest.raises(ValueError, match="pages hold a multiple of its key tile of 128"):
        choose("mosaic", page_size=64)
    with pytest.raises(ValueError, match="no block-sparse attention kernel"):
        choose("triton")
    monkeypatch.setattr(mosaic, "available", lambda device=None: "needs a Hopper GPU")
    assert choose("auto") == "reference"
    with pytest.raises(ValueError, match="needs a Hopper GPU"):
        choose("mosaic")


# --- on a GPU: the chosen implementation (the Mosaic kernel on Hopper) at kernel shapes --

@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
class TestGpu:
    @pytest.mark.parametrize("lq,lk", [(2048, 2048), (1024, 4096)])
    def test_auto_matches_reference(self, lq, lk, rand):
        q, k, v = qkv(rand, 1, 8, 2, lq, lk, 128, dtype=jnp.bfloat16)
        mask = mask_for(rand, 1, 8, lq, lk, 128, density=0.3, empty_rows=0.1)
        got = attend(q, k, v, mask, block_size=128, return_lse=True, impl="auto")
        want = attend(q, k, v, mask, block_size=128, return_lse=True)
        for g, w in zip(got, want):
            np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                       err_msg=str(rand), **BF16_TOL)

    def test_auto_reads_paged_caches(self, rand):
        """Pages of whole key tiles: "auto" takes the Mosaic kernel on Hopper, which reads
        the pages through the block table; the result equals the contiguous reference."""
        q, k, v = qkv(rand, 2, 8, 2, 1024, 4096, 128, dtype=jnp.bfloat16)
        mask = mask_for(rand, 2, 8, 1024, 4096, 128, density=0.3, empty_rows=0.1)
        k_pages, v_pages, table = rand.paged(256, k, v)
        got = attend(q, k_pages, v_pages, mask, block_size=128, return_lse=True,
                     block_table=table, k_len=3500, impl="auto")
        want = attend(q, k, v, mask, block_size=128, return_lse=True, k_len=3500)
        for g, w in zip(got, want):
            np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                       err_msg=str(rand), **BF16_TOL)

    def test_dense_matches_cudnn(self, rand):
        b, hq, hkv, length, d = 1, 8, 2, 4096, 128
        q, k, v = qkv(rand, b, hq, hkv, length, length, d, dtype=jnp.bfloat16)
        everything = jnp.ones((b, hq, length // 128, length // 128), bool)
        out = attend(q, k, v, everything, block_size=128, impl="auto")
        dense = jax.nn.dot_product_attention(
            *(x.transpose(0, 2, 1, 3) for x in (q, k, v)), is_causal=True,
            implementation="cudnn").transpose(0, 2, 1, 3)
        np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(dense, np.float32),
                                   err_msg=str(rand), **BF16_TOL)

    def test_xattention(self, rand):
        q, k, v = qkv(rand, 1, 8, 2, 4096, 4096, 128, dtype=jnp.bfloat16)
        out, mask = xattend(q, k, v, threshold=0.9, return_mask=True, impl="auto")
        _, want_mask = xattn_jax.xattn_estimate(q, k, threshold=0.9)
        np.testing.assert_array_equal(np.asarray(mask), np.asarray(want_mask))
        want = attend(q, k, v, want_mask, block_size=128, impl="auto")
        np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32),
                                   err_msg=str(rand), **BF16_TOL)
