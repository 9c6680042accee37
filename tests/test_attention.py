"""block_sparse_attention and xattention (docs/estimate.md section 6) against the float64 numpy
model `np_attention`, on random block masks; NaN policy, paged caches, argument checks,
the implementation choice."""

from __future__ import annotations

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import np_attention as npa
import xattn_jax
from cases import AttentionCase
from xattn_jax import impls, mosaic, partitioning
from xattn_jax.backend import AttentionCall
from xattn_jax.defaults import DENSE_LAST, MIN_BLOCKS
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


def qkv(rand, case: AttentionCase):
    """`case.qkv` with q and k scaled so that softmax rows are peaked but not degenerate."""
    return case.qkv(rand, qk_scale=1.5)


def assert_matches_model(out, lse, q, k, v, mask, case: AttentionCase, rand, *,
                         tol=F32_TOL, **model_kwargs):
    """out and lse as the float64 model's for `case` (its block size, causal flag and keys
    in use)."""
    want, want_lse = npa.attention(q, k, v, mask, block_size=case.block_size,
                                   causal=case.causal, n_keys=case.keys_in_use,
                                   **model_kwargs)
    np.testing.assert_allclose(np.asarray(out, np.float64), want, err_msg=str(rand), **tol)
    np.testing.assert_allclose(np.asarray(lse), want_lse, err_msg=str(rand), **tol)


CASES = {case.id: case for case in (
    AttentionCase("gqa-causal-odd", 1, 4, 2, 37, 131, 16, block_size=16, empty_rows=0.2),
    AttentionCase("gqa-noncausal-dv", 2, 4, 2, 37, 131, 16, block_size=16, causal=False,
                  v_head_dim=8, empty_rows=0.2),
    AttentionCase("square-causal", 1, 2, 1, 64, 64, 8, block_size=16, empty_rows=0.2),
    AttentionCase("mha-ragged-block", 1, 2, 2, 50, 53, 8, block_size=8, v_head_dim=12,
                  empty_rows=0.2),
)}


@pytest.mark.parametrize("case", CASES.values(), ids=lambda case: case.id)
def test_matches_numpy_model(case, rand):
    q, k, v = qkv(rand, case)
    mask = case.mask(rand)
    out, lse = attend(q, k, v, mask, return_lse=True, **case.options)
    assert out.shape == case.q_shape[:3] + case.v_shape[3:] and out.dtype == q.dtype
    assert lse.shape == case.q_shape[:3] and lse.dtype == jnp.float32
    assert_matches_model(out, lse, q, k, v, mask, case, rand)


@pytest.mark.parametrize("tile,rows", [(16, 10), (48, 7), (131, 37), (7, 36), (500, 99)])
def test_tiles_and_chunks_change_nothing(tile, rows, rand):
    """Several key tiles and query chunks, the last of each clamped (overlapping the one
    before it), tiles that are not whole blocks: the same results as the model."""
    case = CASES["gqa-causal-odd"]
    q, k, v = qkv(rand, case)
    mask = case.mask(rand)
    out, lse = jax.jit(reference_attention, static_argnames=(
        "block_size", "causal", "return_lse", "key_tile_size", "query_chunk_size"))(
        q, k, v, mask, return_lse=True, key_tile_size=tile, query_chunk_size=rows,
        **case.options)
    assert_matches_model(out, lse, q, k, v, mask, case, rand)


def test_scale(rand):
    case = AttentionCase("scale", 1, 2, 1, 20, 40, 8, block_size=8)
    q, k, v = qkv(rand, case)
    mask = case.mask(rand)
    out, lse = attend(q, k, v, mask, block_size=case.block_size, scale=0.7,
                      return_lse=True)
    assert_matches_model(out, lse, q, k, v, mask, case, rand, scale=0.7)


def test_empty_rows_give_zeros_and_minus_inf(rand):
    case = dataclasses.replace(CASES["gqa-noncausal-dv"], density=0.6, empty_rows=0.0)
    q, k, v = qkv(rand, case)
    mask = np.array(case.mask(rand))
    mask[0, 1, 1] = False  # rows 16..31 of head 1
    mask[1] = False  # the whole second batch element
    out, lse = attend(q, k, v, jnp.asarray(mask), return_lse=True, **case.options)
    out, lse = np.asarray(out), np.asarray(lse)
    for rows in (out[0, 1, 16:32], out[1]):
        assert np.all(rows == 0), rand
    for rows in (lse[0, 1, 16:32], lse[1]):
        assert np.all(rows == -np.inf), rand
    assert np.all(np.isfinite(lse[0, 0])), rand  # a row with blocks: finite


def test_causal_rows_before_their_first_allowed_key(rand):
    """Causal with Lq = Lk: mask only the diagonal's later blocks; a row whose allowed
    blocks all lie after it sees nothing."""
    case = AttentionCase("one-head", 1, 1, 1, 32, 32, 8, block_size=16)
    q, k, v = qkv(rand, case)
    mask = jnp.asarray([[[[False, True], [False, False]]]])  # rows 0-15 may see keys 16-31
    out, lse = attend(q, k, v, mask, return_lse=True, **case.options)
    assert np.all(np.asarray(out) == 0) and np.all(np.asarray(lse) == -np.inf), rand


@pytest.mark.parametrize("causal", [True, False])
def test_all_true_mask_is_dense_attention(causal, rand):
    case = dataclasses.replace(CASES["gqa-causal-odd"], causal=causal)
    q, k, v = qkv(rand, case)
    mask = jnp.ones(case.mask_shape, bool)
    out, lse = attend(q, k, v, mask, return_lse=True, **case.options)
    assert_matches_model(out, lse, q, k, v, None, case, rand)
    pairs = npa.allowed_pairs(None, q_len=case.q_len, k_len=case.k_len,
                              block_size=case.block_size, causal=causal)
    dense = jax.nn.dot_product_attention(  # [B, L, H, D] layout, GQA by head groups
        q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3),
        mask=jnp.asarray(np.broadcast_to(pairs, case.q_shape[:3] + (case.k_len,))),
        implementation="xla")
    np.testing.assert_allclose(np.asarray(out), np.asarray(dense.transpose(0, 2, 1, 3)),
                               err_msg=str(rand), **F32_TOL)


def test_bf16(rand):
    case = dataclasses.replace(CASES["gqa-causal-odd"], dtype=jnp.bfloat16)
    q, k, v = qkv(rand, case)
    mask = case.mask(rand)
    out, lse = attend(q, k, v, mask, return_lse=True, **case.options)
    assert out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
    # the model reads the same bf16 values, exactly upcast
    assert_matches_model(out, lse, q, k, v, mask, case, rand, tol=BF16_TOL)


def test_reruns_are_bit_identical(rand):
    case = CASES["gqa-causal-odd"]
    q, k, v = qkv(rand, case)
    mask = case.mask(rand)
    runs = [attend(q, k, v, mask, block_size=case.block_size, return_lse=True)
            for _ in range(2)]
    for first, second in zip(*runs):
        assert np.asarray(first).tobytes() == np.asarray(second).tobytes(), rand


# --- non-finite inputs -----------------------------------------------------------------

NAN_CASE = AttentionCase("one-head-48", 1, 1, 1, 48, 48, 8, block_size=16)


def _nan_case(rand):
    """`NAN_CASE` (Lq = Lk = 48, block 16, causal, one head): a mask where key block 1 is
    allowed for query block 1 only and key block 2 is allowed for no query block."""
    q, k, v = qkv(rand, NAN_CASE)
    mask = jnp.asarray([[[[True, False, False], [True, True, False], [True, False, False]]]])
    return q, k, v, mask


def _run(q, k, v, mask):
    out, lse = attend(q, k, v, mask, return_lse=True, **NAN_CASE.options)
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
    scores /= np.sqrt(NAN_CASE.head_dim)
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
    case = AttentionCase("paged", 2, 4, 2, 20, 96, 8, block_size=16, v_head_dim=4,
                         empty_rows=0.2)
    q, k, v = qkv(rand, case)
    mask = case.mask(rand)
    k_pages, v_pages, table = rand.paged(page_size, k, v)
    for causal in (True, False):
        want = attend(q, k, v, mask, block_size=case.block_size, causal=causal,
                      return_lse=True)
        got = attend(q, k_pages, v_pages, mask, block_size=case.block_size,
                     causal=causal, return_lse=True, block_table=table)
        for g, w in zip(got, want):  # the gathered keys may sum in another order
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), err_msg=str(rand),
                                       **F32_TOL)


def test_k_len_hides_later_keys_without_recompiling(rand):
    """A padded cache with NaN past k_len: the model on the keys in use, the queries the
    last Lq of them; a traced k_len compiles once for every value."""
    case = AttentionCase("padded", 1, 2, 1, 12, 64, 8, block_size=16)  # k_len: capacity
    q, k, v = qkv(rand, case)
    mask = case.mask(rand)
    before = partitioning._run._cache_size()
    for n in (40, 57, 12):
        garbage = jnp.arange(case.k_len) >= n
        k_pad = jnp.where(garbage[:, None], jnp.nan, k)
        v_pad = jnp.where(garbage[:, None], jnp.inf, v)
        for causal in (True, False):
            seen = dataclasses.replace(case, causal=causal, keys_in_use=n)
            out, lse = attend(q, k_pad, v_pad, mask, return_lse=True, k_len=jnp.int32(n),
                              **seen.options)
            assert_matches_model(out, lse, q, k, v, mask, seen, rand)
    assert partitioning._run._cache_size() - before == 2  # one per causal value
    out_int = attend(q, k, v, mask, block_size=case.block_size, k_len=40)
    out_arr = attend(q, k, v, mask, block_size=case.block_size, k_len=jnp.int32(40))
    np.testing.assert_array_equal(np.asarray(out_int), np.asarray(out_arr))


@pytest.mark.parametrize("rows,share", [(None, 8), (1024, 64)])
def test_reference_never_builds_a_query_by_key_array(rows, share):
    """Compiled (not run) at Lq = Lk = 16384, 2 heads: XLA's temporaries stay below
    1/share of one float32 [Lq, Lk] score matrix per head, and shrink with the chunk."""
    case = AttentionCase("mha-16k", 1, 2, 2, 16384, 16384, 64)
    q, k, v = (jax.ShapeDtypeStruct(shape, case.dtype)
               for shape in (case.q_shape, case.k_shape, case.v_shape))
    mask = jax.ShapeDtypeStruct(case.mask_shape, jnp.bool_)
    fn = jax.jit(reference_attention, static_argnames=("block_size", "query_chunk_size"))
    stats = fn.lower(q, k, v, mask, block_size=case.block_size,
                     query_chunk_size=rows).compile().memory_analysis()
    full = case.batch * case.q_heads * case.q_len * case.k_len * 4
    assert stats.temp_size_in_bytes < full / share, stats.temp_size_in_bytes


# --- xattention ------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [True, False])
def test_xattention_is_estimate_then_attention(causal, rand):
    case = AttentionCase("xattention-gqa", 1, 4, 2, 64, 128, 16, stride=4, block_size=16,
                         causal=causal, v_head_dim=8)
    layout = dict(case.options, stride=case.stride)
    q, k, v = qkv(rand, case)
    widening = dict(min_blocks=2, dense_last=1)
    out, mask = xattend(q, k, v, threshold=0.8, return_mask=True, **widening, **layout)
    _, want_mask = xattn_jax.xattn_estimate(q, k, threshold=0.8, impl="reference",
                                            **widening, **layout)
    np.testing.assert_array_equal(np.asarray(mask), np.asarray(want_mask), err_msg=str(rand))
    assert not np.all(np.asarray(mask)), "a mask with nothing dropped tests little"
    want = attend(q, k, v, want_mask, **case.options)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-6, atol=1e-6,
                               err_msg=str(rand))
    alone = xattend(q, k, v, threshold=0.8, **widening, **layout)
    np.testing.assert_array_equal(np.asarray(alone), np.asarray(out))


def test_xattention_threshold_is_data(rand):
    case = AttentionCase("xattention-mha", 1, 2, 2, 64, 64, 8, stride=4, block_size=16)
    q, k, v = qkv(rand, case)
    kwargs = dict(block_size=case.block_size, stride=case.stride, return_mask=True,
                  min_blocks=0, dense_last=0)
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

VALID = AttentionCase("valid", 1, 4, 2, 20, 40, 8, block_size=8, v_head_dim=6)


def _valid():
    """A valid call's arguments for `VALID` (zeros, every block): (q, k, v, mask), keyword
    arguments."""
    q, k, v = (jnp.zeros(shape, VALID.dtype)
               for shape in (VALID.q_shape, VALID.k_shape, VALID.v_shape))
    return [q, k, v, jnp.ones(VALID.mask_shape, bool)], dict(block_size=VALID.block_size)


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
    "impl-triton": ("impl", "triton", "has no block_sparse_attention kernel"),
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
    """The backends' choice for attention (xattn_jax.impls), with the Mosaic kernel's
    availability stubbed: "auto" and "mosaic" resolve to the Mosaic backend where it runs,
    "auto" to the reference elsewhere; the Mosaic backend hands pages that are not whole
    key tiles to the reference ("auto") or refuses them ("mosaic")."""
    gpu = types.SimpleNamespace(platform="gpu")

    def choose(impl):
        return impls.resolve(impl, ops=impls.ATTENTION, device=gpu)

    def runs(impl, page_size=None):
        """The backend that runs a call of D 128, bf16, blocks of 128."""
        call = AttentionCall(128, 128, jnp.bfloat16, 128, page_size)
        return choose(impl).attention_backend(call).name

    monkeypatch.setattr(mosaic, "available", lambda device=None: None)
    assert choose("auto").name == choose("mosaic").name == "mosaic"
    assert choose("reference").name == runs("reference") == "reference"
    assert runs("auto") == runs("mosaic") == "mosaic"
    assert runs("auto", page_size=256) == runs("mosaic", page_size=4096) == "mosaic"
    assert runs("auto", page_size=16) == "reference"
    with pytest.raises(ValueError, match="pages hold a multiple of its key tile of 128"):
        runs("mosaic", page_size=64)
    with pytest.raises(ValueError, match="no block_sparse_attention kernel"):
        choose("triton")
    monkeypatch.setattr(mosaic, "available", lambda device=None: "needs a Hopper GPU")
    assert choose("auto").name == "reference"
    with pytest.raises(ValueError, match="needs a Hopper GPU"):
        choose("mosaic")


# --- on a GPU: the chosen implementation (the Mosaic kernel on Hopper) at kernel shapes --

# GQA 8:2 at D 128, bf16, 4k x 4k (tests vary the lengths), blocks of 128, causal
GPU = AttentionCase("gpu-gqa", 1, 8, 2, 4096, 4096, 128, dtype=jnp.bfloat16, density=0.3,
                    empty_rows=0.1)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
class TestGpu:
    @pytest.mark.parametrize("lq,lk", [(2048, 2048), (1024, 4096)])
    def test_auto_matches_reference(self, lq, lk, rand):
        case = dataclasses.replace(GPU, q_len=lq, k_len=lk)
        q, k, v = qkv(rand, case)
        mask = case.mask(rand)
        got = attend(q, k, v, mask, block_size=case.block_size, return_lse=True, impl="auto")
        want = attend(q, k, v, mask, block_size=case.block_size, return_lse=True)
        for g, w in zip(got, want):
            np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                       err_msg=str(rand), **BF16_TOL)

    def test_auto_reads_paged_caches(self, rand):
        """Pages of whole key tiles: "auto" takes the Mosaic kernel on Hopper, which reads
        the pages through the block table; the result equals the contiguous reference."""
        case = dataclasses.replace(GPU, batch=2, q_len=1024, keys_in_use=3500)
        q, k, v = qkv(rand, case)
        mask = case.mask(rand)
        k_pages, v_pages, table = rand.paged(256, k, v)
        got = attend(q, k_pages, v_pages, mask, block_size=case.block_size, return_lse=True,
                     block_table=table, k_len=case.keys_in_use, impl="auto")
        want = attend(q, k, v, mask, block_size=case.block_size, return_lse=True,
                      k_len=case.keys_in_use)
        for g, w in zip(got, want):
            np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                       err_msg=str(rand), **BF16_TOL)

    def test_dense_matches_cudnn(self, rand):
        q, k, v = qkv(rand, GPU)
        everything = jnp.ones(GPU.mask_shape, bool)
        out = attend(q, k, v, everything, block_size=GPU.block_size, impl="auto")
        dense = jax.nn.dot_product_attention(
            *(x.transpose(0, 2, 1, 3) for x in (q, k, v)), is_causal=True,
            implementation="cudnn").transpose(0, 2, 1, 3)
        np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(dense, np.float32),
                                   err_msg=str(rand), **BF16_TOL)

    def test_xattention(self, rand):
        q, k, v = qkv(rand, GPU)
        out, mask = xattend(q, k, v, threshold=0.9, return_mask=True, impl="auto")
        _, want_mask = xattn_jax.xattn_estimate(q, k, threshold=0.9, min_blocks=MIN_BLOCKS,
                                                dense_last=DENSE_LAST)
        np.testing.assert_array_equal(np.asarray(mask), np.asarray(want_mask))
        want = attend(q, k, v, want_mask, block_size=GPU.block_size, impl="auto")
        np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32),
                                   err_msg=str(rand), **BF16_TOL)
