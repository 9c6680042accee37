"""Section 5: KV-block scores of a chunk and their selection, both implementations.

The float64 numpy block sums (np_reference.py, sections 1-3) at the KV block size are the
independent check of the scores (the direct computation the hierarchical one must equal);
"triton" runs the Pallas kernels in interpret mode on CPU, compiled on a GPU. The
cross-checks against the pure-torch reference are in test_bridge_reference.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import np_reference as npr
from xattn_jax import kv_blocks, mosaic, reference
from xattn_jax.checks import check_qk
from xattn_jax.kv_blocks import kv_block_scores, select_kv_blocks
from xattn_jax.triton.block_sums import block_sums
from xattn_jax.triton.plan import BLOCK_SUM_KERNELS, ONE_PASS, Tiles, plan_block_sums

ON_GPU = jax.default_backend() == "gpu"
IMPLS = ["reference", pytest.param("triton", marks=pytest.mark.gpu) if ON_GPU else "triton"]
RTOL = 5e-5 if ON_GPU else 1e-5


def _chunk(seed, *, q_len=160, capacity=1024, q_heads=4, kv_heads=2, head_dim=16):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, q_heads, q_len, head_dim)) * 1.5
    k = rng.standard_normal((1, kv_heads, capacity, head_dim)) * 1.5
    return rng, jnp.asarray(q, jnp.float32), jnp.asarray(k, jnp.float32)


@pytest.fixture
def seed():
    return int(np.random.default_rng().integers(2**31))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("k_len", [1024, 777, 300, 5])
def test_scores_match_float64_block_sums(impl, k_len, seed):
    _, q, k = _chunk(seed)
    got = np.asarray(kv_block_scores(q, k, kv_block_size=256, estimate_block_size=64,
                                     stride=8, k_len=jnp.int32(k_len), impl=impl))
    want = npr.block_sums(q, k[:, :, :k_len], stride=8, block_size=256,
                          causal=False).sum(axis=2)
    n = want.shape[-1]
    np.testing.assert_allclose(got[..., :n], want, rtol=RTOL, atol=RTOL * want.max(),
                               err_msg=f"seed={seed}")
    assert np.all(got[..., n:] == kv_blocks.EMPTY_BLOCK), \
        f"blocks past k_len must score EMPTY_BLOCK, seed={seed}"
    np.testing.assert_allclose(got[..., :n].sum(-1), 160 // 8, rtol=1e-5)  # one per query row


@pytest.mark.parametrize("impl", IMPLS)
def test_keys_past_k_len_never_leak(impl, seed):
    """Garbage (huge values, NaN) past k_len changes nothing: the same scores as a buffer
    holding exactly k_len keys."""
    rng, q, k = _chunk(seed)
    k_len = 613  # not a multiple of the stride: a partly filled last stride group
    tail = rng.standard_normal(k[:, :, k_len:].shape) * 1e4
    tail[..., 0, 0] = np.nan
    poisoned = k.at[:, :, k_len:].set(jnp.asarray(tail, jnp.float32))
    got = kv_block_scores(q, poisoned, kv_block_size=128, estimate_block_size=64, stride=8,
                          k_len=jnp.int32(k_len), impl=impl)
    exact = kv_block_scores(q, k[:, :, :k_len], kv_block_size=128, estimate_block_size=64,
                            stride=8, impl=impl)
    n = exact.shape[-1]
    np.testing.assert_allclose(np.asarray(got[..., :n]), np.asarray(exact), rtol=RTOL,
                               atol=1e-7, err_msg=f"seed={seed}")
    assert np.all(np.asarray(got[..., n:]) == kv_blocks.EMPTY_BLOCK)


@pytest.mark.parametrize("impl", IMPLS)
def test_hierarchical_equals_direct(impl, seed):
    """For every power-of-two estimate block (a multiple of the stride) dividing the KV
    block, the scores equal the direct computation at the KV block size."""
    _, q, k = _chunk(seed, capacity=1024)
    kv_block = 512
    direct = np.asarray(kv_block_scores(q, k, kv_block_size=kv_block,
                                        estimate_block_size=kv_block, stride=8,
                                        k_len=jnp.int32(900), impl=impl))
    for estimate in (8, 16, 32, 64, 128, 256):
        got = np.asarray(kv_block_scores(q, k, kv_block_size=kv_block,
                                         estimate_block_size=estimate, stride=8,
                                         k_len=jnp.int32(900), impl=impl))
        np.testing.assert_allclose(got, direct, rtol=1e-5, atol=1e-6,
                                   err_msg=f"estimate_block_size={estimate}, seed={seed}")


@pytest.mark.parametrize("impl", IMPLS)
def test_one_compilation_for_a_growing_context(impl, seed):
    """16 chunks of a growing context in one padded buffer: zero recompilations."""
    _, q, k = _chunk(seed, q_len=64, capacity=1088)
    call = jax.jit(lambda q, k, n: kv_block_scores(q, k, kv_block_size=256,
                                                   estimate_block_size=64, stride=8,
                                                   k_len=n, impl=impl))
    before = kv_blocks._kv_scores._cache_size()
    for chunk in range(16):
        scores = call(q, k, jnp.int32(64 * (chunk + 1)))
        holding = -(-64 * (chunk + 1) // 256)  # blocks that hold keys
        assert np.all(np.asarray(scores[..., holding:]) == kv_blocks.EMPTY_BLOCK)
        assert float(scores[..., :holding].sum()) == pytest.approx(4 * 64 // 8, rel=1e-4)
    assert call._cache_size() == 1
    assert kv_blocks._kv_scores._cache_size() - before <= 1


def test_selection_rules_by_construction():
    scores = jnp.asarray([[[0.05, 0.5, 0.3, 0.1, 0.05, 0.0]]], jnp.float32)  # [1, 1, 6]
    mask = select_kv_blocks(scores, threshold=0.75, keep_first=False, keep_last=False)
    assert mask.tolist() == [[False, True, True, False, False, False]]  # 0.5 + 0.3 >= 0.75
    mask = select_kv_blocks(scores, threshold=0.75, num_valid=5)
    assert mask.tolist() == [[True, True, True, False, True, False]]  # + first and last
    mask = select_kv_blocks(jnp.zeros((1, 1, 6)), threshold=0.5, num_valid=4,
                            keep_first=False, keep_last=False)
    assert mask.tolist() == [[True] * 4 + [False] * 2]  # no mass: every valid block
    traced = jax.jit(lambda s, n: select_kv_blocks(s, threshold=0.75, num_valid=n))
    assert traced(scores, jnp.asarray([5])).tolist() == [[True, True, True, False, True, False]]


@pytest.mark.slow
def test_ranking_by_pairs_is_the_sorted_rule(seed):
    """Up to RANK_BY_PAIRS_MAX_BLOCKS blocks the selection ranks blocks by pairwise
    comparison: the same blocks as `reference.take_descending` (sorting), ties to the
    lower index, non-candidates never taken, on values whose sums are exact in float32
    (eighths: many ties, no rounding to tell the two summation orders apart); and
    select_kv_blocks gives the same masks by either path, both rules."""
    rng = np.random.default_rng(seed)
    for _ in range(50):
        shape = (int(rng.integers(1, 4)), int(rng.integers(1, 5)), int(rng.integers(1, 40)))
        values = jnp.asarray(rng.integers(0, 6, size=shape) / 8.0, jnp.float32)
        candidate = jnp.asarray(rng.random(shape) < 0.8)
        total = jnp.where(candidate, values, 0.0).sum(axis=-1, keepdims=True)
        target = total * float(rng.choice([0.0, 0.3, 0.5, 0.9, 1.0, 1.2]))
        by_pairs = kv_blocks._take_ranked_by_pairs(values, candidate, target)
        sorted_ = reference.take_descending(values, candidate, jnp.zeros_like(total), target)
        assert np.array_equal(by_pairs, sorted_), f"seed {seed}"
        assert not np.asarray(by_pairs & ~candidate).any()
    scores = jnp.asarray(rng.integers(0, 9, size=(2, 8, 3, 24)) / 8.0, jnp.float32)
    scores = scores.at[1, :, :, 20:].set(kv_blocks.EMPTY_BLOCK)
    for rule, rows in (("score", scores.sum(axis=2)), ("vote", scores)):
        select = functools.partial(kv_blocks._select_kv.__wrapped__, rows,
                                   jnp.asarray([24, 22]), jnp.float32(0.7), rule=rule,
                                   groups=2, keep_first=True, keep_last=True,
                                   per_kv_head=True)
        assert rows.shape[-1] <= kv_blocks.RANK_BY_PAIRS_MAX_BLOCKS
        by_pairs = np.asarray(select())
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(kv_blocks, "RANK_BY_PAIRS_MAX_BLOCKS", 0)
            assert np.array_equal(by_pairs, np.asarray(select())), f"{rule}, seed {seed}"
        assert by_pairs.any() and not by_pairs.all()


@pytest.mark.parametrize("kwargs, match", [
    (dict(rule="majority"), "rule"),
    (dict(threshold=0.0), "threshold"),
    (dict(threshold=1.5), "threshold"),
    (dict(per_kv_head=True), "kv_heads"),
    (dict(per_kv_head=True, kv_heads=3), "kv_heads"),
    (dict(num_valid=9), "num_valid"),
    (dict(rule="vote"), "rank"),
])
def test_selection_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        select_kv_blocks(jnp.ones((1, 4, 8)), **kwargs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(kv_block_size=256, estimate_block_size=96),
     r"kv_block_size must be a positive multiple of estimate_block_size \(96\)"),
    (dict(kv_block_size=0), "kv_block_size"),
    (dict(estimate_block_size=60, kv_block_size=120), "block_size"),
    (dict(k_len=0), "k_len"),
    (dict(k_len=2000), "k_len"),
])
def test_score_errors(kwargs, match, seed):
    _, q, k = _chunk(seed, q_len=64, capacity=1024)
    args = dict(kv_block_size=256, estimate_block_size=64, stride=8) | kwargs
    with pytest.raises(ValueError, match=match):
        kv_block_scores(q, k, **args)


@pytest.mark.parametrize("impl", IMPLS)
def test_paged_cache_equals_contiguous(impl, seed):
    """Two sequences in one shuffled page pool (unused pages hold NaN) give the scores of
    their contiguous keys; GQA heads read their KV head's pages."""
    rng = np.random.default_rng(seed)
    page_size, per_seq, pool = 64, 16, 40
    q = jnp.asarray(rng.standard_normal((2, 4, 96, 16)) * 1.5, jnp.float32)
    k = rng.standard_normal((2, 2, page_size * per_seq, 16)) * 1.5
    pages = np.full((pool, page_size, 2, 16), np.nan)
    table = rng.permutation(pool)[:2 * per_seq].reshape(2, per_seq)
    for b in range(2):
        for i, page in enumerate(table[b]):
            pages[page] = k[b, :, i * page_size:(i + 1) * page_size].transpose(1, 0, 2)
    args = dict(kv_block_size=256, estimate_block_size=64, stride=8, k_len=jnp.int32(901),
                impl=impl)
    got = kv_block_scores(q, jnp.asarray(pages, jnp.float32),
                          block_table=jnp.asarray(table, jnp.int32), **args)
    want = kv_block_scores(q, jnp.asarray(k, jnp.float32), **args)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=RTOL, atol=1e-7,
                               err_msg=f"seed={seed}")


@pytest.mark.gpu
@pytest.mark.skipif(mosaic.available() is not None, reason=str(mosaic.available()))
@pytest.mark.parametrize("page_size", [None, 512, 4096])
def test_mosaic_chunk_scores_equal_triton_without_recompiling(page_size, seed):
    """On Hopper, "mosaic" (the chunk calls "auto" gives it: bf16, D 128) scores a
    growing context in one buffer or shuffled page pool (unused pages NaN) as the
    Triton kernel does, with one compilation for every k_len."""
    rng = np.random.default_rng(seed)
    capacity, chunk = 8192, 1024
    q = jnp.asarray(rng.standard_normal((1, 8, chunk, 128)) * 1.5, jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((1, 2, capacity, 128)) * 1.5, jnp.bfloat16)
    table = None
    if page_size is not None:
        per_seq, pool = capacity // page_size, capacity // page_size + 3
        order = rng.permutation(pool)[:per_seq]
        pages = np.full((pool, page_size, 2, 128), np.nan, np.float32)
        pages[order] = np.asarray(k[0], np.float32).reshape(
            2, per_seq, page_size, 128).transpose(1, 2, 0, 3)
        k, table = jnp.asarray(pages, jnp.bfloat16), jnp.asarray(order[None], jnp.int32)

    def scores(impl):
        return jax.jit(lambda q, k, n, table: kv_block_scores(
            q, k, kv_block_size=2048, estimate_block_size=1024, k_len=n,
            block_table=table, impl=impl))

    mosaic_call, triton_call = scores("mosaic"), scores("triton")
    for k_len in (1024, 3001, 5555, 8192):
        n = jnp.int32(k_len)
        got, want = mosaic_call(q, k, n, table), triton_call(q, k, n, table)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=5e-5,
                                   atol=5e-5 * float(want.max()), err_msg=f"seed={seed}")
    assert mosaic_call._cache_size() == 1


@pytest.mark.parametrize("pages, table, match", [
    (np.zeros((4, 64, 2)), np.zeros((1, 2), np.int32), "paged cache"),
    (np.zeros((4, 64, 2, 16)), np.zeros((2,), np.int32), "block_table"),
    (np.zeros((4, 64, 2, 16)), np.zeros((1, 2), np.float32), "block_table"),
    (np.zeros((4, 64, 2, 16)), np.zeros((3, 2), np.int32), "one row per batch"),
])
def test_paged_errors(pages, table, match, seed):
    _, q, _ = _chunk(seed, q_len=64)
    with pytest.raises(ValueError, match=match):
        kv_block_scores(q, jnp.asarray(pages, jnp.float32), block_table=jnp.asarray(table),
                        kv_block_size=128, estimate_block_size=64)


@pytest.mark.parametrize("kernel", BLOCK_SUM_KERNELS)
@pytest.mark.parametrize("page_size", [None, 4, 16, 256],
                         ids=["buffer", "paged4", "paged16", "paged256"])
def test_both_kernels_read_key_len_and_pages(kernel, page_size, seed):
    """Each block-sum kernel, on a buffer padded past k_len (NaN there) or on a shuffled
    page pool read through a block table (whose entries past k_len's pages lie outside
    the pool), equals the reference on the k_len real keys. Key tiles of 16 columns (128
    tokens) read the table (`common.tile_pages`): with pages of 256 or 16 tokens one
    entry per column (a stride group) per tile, of 4 one per token. One-pass programs of
    3 key tiles read each tile's table entries a tile ahead, the last one past the table."""
    rng, q, k = _chunk(seed, q_len=96, capacity=512)
    k_len = 333
    k = k.at[:, :, k_len:].set(jnp.nan)
    geom = check_qk(q, k, stride=8, block_size=64, causal=False)
    want = reference.block_sums(q, k, geom, causal=False, norm=1.0, key_len=jnp.int32(k_len))
    plan = plan_block_sums(geom, q.dtype, False, interpret=not ON_GPU, kernel=kernel,
                           tiles=Tiles(16, 16, span=3))
    args = dict(plan=plan, causal=False, norm=1.0, key_len=jnp.full((1,), k_len, jnp.int32))
    if page_size is not None:
        assert (page_size % geom.stride == 0) == (page_size != 4)
        pool_size = 512 // page_size + 4
        table = rng.permutation(pool_size)[:512 // page_size]
        pool = np.full((pool_size, page_size, 2, 16), np.nan, np.float32)
        for i, page in enumerate(table):
            pool[page] = np.asarray(k[0, :, i * page_size:(i + 1) * page_size]).swapaxes(0, 1)
        used = -(-k_len // page_size)
        table[used:] = -7  # entries past k_len's pages (with 16-token pages) hold anything
        table[used + 1:] = 10**6
        got = block_sums(q, jnp.asarray(pool), block_table=jnp.asarray(table[None], jnp.int32),
                         **args)
    else:
        got = block_sums(q, k, **args)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=RTOL,
                               atol=RTOL * float(want.max()), err_msg=f"seed={seed}")


@pytest.mark.parametrize("k_len", [333, 336, 5])
def test_key_len_over_several_row_steps(k_len, seed):
    """The one-pass kernel with unmasked keys (the key tiles end within the buffer)
    covering the query rows in several calls, with NaN past k_len: the partly filled
    last stride group, scored outside the kernel, joins every call's rows."""
    _, q, k = _chunk(seed, q_len=512, capacity=512)
    k = k.at[:, :, k_len:].set(jnp.nan)
    geom = check_qk(q, k, stride=8, block_size=64, causal=False)

    def plan(**bound):
        return plan_block_sums(geom, q.dtype, False, interpret=not ON_GPU,
                               tiles=Tiles(16, 16), kernel=ONE_PASS, **bound)

    stepped = plan(max_scratch_bytes=plan().head_row_scratch_bytes * 16)
    assert stepped.keys_fit and (stepped.call_heads, stepped.call_rows) == (1, 16)
    want = reference.block_sums(q, k, geom, causal=False, norm=1.0, key_len=jnp.int32(k_len))
    got = block_sums(q, k, plan=stepped, causal=False, norm=1.0,
                     key_len=jnp.full((1,), k_len, jnp.int32))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=RTOL,
                               atol=RTOL * float(want.max()), err_msg=f"seed={seed}")
