"""Block-sparse attention with the Mosaic GPU kernel (xattn_jax.mosaic), against a float64
numpy reference of docs/estimate.md section 6.

On CPU:
- the key-tile lists built on the device, walked the way the kernel walks them (listed
  tiles only; the per-element mask only past each warpgroup's unmasked prefix; padded keys
  are zeros, as in the kernel), give the reference exactly (float64);
- the plan's refusals and `available()`;
- where Mosaic GPU imports (jax >= 0.11): the kernel lowers for CUDA, and the kernel itself
  runs in Pallas' GPU interpret mode (tests/mosaic_interpret.py).
Marked `gpu` (skipped unless `xattn_jax.mosaic.available()` is None, i.e. on a Hopper GPU):
the compiled kernel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import mosaic_interpret
import numpy as np
import pytest

from xattn_jax import mosaic
from xattn_jax.mosaic import attention
from xattn_jax.mosaic.plan import AttentionPlan

needs_hopper = pytest.mark.skipif(mosaic.available() is not None,
                                  reason=str(mosaic.available()))


def reference_attention(q, k, v, mask, *, block_size, causal, scale, keys_in_use=None):
    """float64 out [B, Hq, Lq, D] and lse [B, Hq, Lq] of section 6 (dense, mask expanded),
    n = `keys_in_use` (default Lk) keys in use."""
    q, k, v = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    q_len, k_len = q.shape[2], k.shape[2]
    n = k_len if keys_in_use is None else keys_in_use
    rows, keys = np.arange(q_len)[:, None], np.arange(k_len)[None, :]
    allowed = np.asarray(mask)[:, :, rows // block_size, keys // block_size] & (keys < n)
    if causal:
        allowed = allowed & (keys <= rows + n - q_len)
    return _masked_softmax_attention(np.einsum("bhid,bhjd->bhij", q, k) * scale, allowed, v)


def _masked_softmax_attention(scores, allowed, v):
    """softmax over the allowed entries of `scores` [.., rows, keys] applied to v
    [.., keys, D]; rows with nothing allowed give zeros and lse -inf."""
    scores = np.where(allowed, scores, -np.inf)
    top = scores.max(-1, keepdims=True, initial=-np.inf)
    top = np.where(np.isfinite(top), top, 0.0)
    weights = np.exp(scores - top)
    total = weights.sum(-1, keepdims=True)
    out = (weights @ v) / np.where(total > 0, total, 1.0)
    with np.errstate(divide="ignore"):
        lse = np.log(total[..., 0]) + top[..., 0]
    return out, lse


def walk_key_tiles(q, k, v, lists, *, plan: AttentionPlan, causal, scale):
    """What the kernel computes from `lists`, in float64: per (b, h, CTA, warpgroup), the
    listed tiles only, masked per element only past the warpgroup's unmasked prefix."""
    q, k, v = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (q, k, v))
    tiles, counts = np.asarray(lists.tiles), np.asarray(lists.counts)
    offset, keys_in_use = (int(x) for x in np.asarray(lists.bounds))
    batch, heads, q_len, dim = q.shape
    group = heads // k.shape[1]
    bq, bkv = plan.block_q, plan.block_kv
    num_ctas, num_tiles = tiles.shape[2], tiles.shape[3]
    pad = lambda x, n: np.pad(x, [(0, 0), (0, 0), (0, n - x.shape[2]), (0, 0)])
    q = pad(q, num_ctas * plan.rows_per_cta)
    k, v = pad(k, num_tiles * bkv), pad(v, num_tiles * bkv)
    out = np.zeros_like(q)
    lse = np.zeros(q.shape[:3])
    for b, h, c, w in np.ndindex(batch, heads, num_ctas, plan.compute_warpgroups):
        row0 = c * plan.rows_per_cta + w * bq
        rows = np.arange(row0, row0 + bq)[:, None]
        listed = tiles[b, h, c, :counts[b, h, c, 0]]
        keys = (listed[:, None] * bkv + np.arange(bkv)).reshape(-1)
        masked = np.repeat(np.arange(listed.size) >= counts[b, h, c, 1 + w], bkv)
        visible = keys[None, :] <= rows + offset if causal else keys[None, :] < keys_in_use
        allowed = ~masked[None, :] | visible
        kv = h // group
        scores = q[b, h, row0:row0 + bq] @ k[b, kv, keys].T * scale
        out[b, h, row0:row0 + bq], lse[b, h, row0:row0 + bq] = _masked_softmax_attention(
            scores, allowed, v[b, kv, keys])
    return out[:, :, :q_len], lse[:, :, :q_len]


def _inputs(rand, batch, heads, kv_heads, q_len, k_len, dim, block_size, density,
            dtype=jnp.bfloat16):
    q = rand.normal((batch, heads, q_len, dim), dtype)
    k = rand.normal((batch, kv_heads, k_len, dim), dtype)
    v = rand.normal((batch, kv_heads, k_len, dim), dtype)
    blocks = (batch, heads, -(-q_len // block_size), -(-k_len // block_size))
    mask = jnp.asarray(rand.rng.random(blocks) < density)
    return q, k, v, mask


# (batch, heads, kv_heads, Lq, Lk, block_size, density, keys in use): square, Lq < Lk,
# Lq > Lk, odd lengths, 256-blocks (two key tiles each), a mask with whole empty rows,
# fewer keys in use than Lk.
WALK_CASES = [
    (1, 2, 1, 256, 256, 128, 1.0, None),
    (1, 2, 2, 384, 640, 128, 0.5, None),
    (2, 4, 2, 300, 200, 128, 0.6, None),
    (1, 2, 1, 200, 461, 256, 0.5, None),
    (1, 1, 1, 517, 517, 128, 0.2, None),
    (1, 2, 1, 200, 700, 128, 0.7, 333),
    (1, 2, 2, 128, 512, 256, 0.8, 400),
]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("case", WALK_CASES)
def test_key_tile_walk_equals_reference(rand, case, causal):
    batch, heads, kv_heads, q_len, k_len, block_size, density, keys_in_use = case
    dim = 64
    q, k, v, mask = _inputs(rand, batch, heads, kv_heads, q_len, k_len, dim, block_size,
                            density, dtype=jnp.float32)
    plan = attention.attention_plan(dim, dim, jnp.bfloat16, block_size, with_lse=True)
    lists = attention.key_tile_lists(mask, q_len=q_len, k_len=k_len,
                                     block_size=block_size, causal=causal, plan=plan,
                                     keys_in_use=keys_in_use)
    scale = dim ** -0.5
    want_out, want_lse = reference_attention(q, k, v, mask, block_size=block_size,
                                             causal=causal, scale=scale,
                                             keys_in_use=keys_in_use)
    got_out, got_lse = walk_key_tiles(q, k, v, lists, plan=plan, causal=causal, scale=scale)
    np.testing.assert_allclose(got_out, want_out, rtol=1e-9, atol=1e-9, err_msg=str(rand))
    np.testing.assert_array_equal(np.isneginf(got_lse), np.isneginf(want_lse), str(rand))
    finite = np.isfinite(want_lse)
    np.testing.assert_allclose(got_lse[finite], want_lse[finite], rtol=1e-9,
                               err_msg=str(rand))


def test_key_tile_lists_skip_unselected_and_causally_hidden_tiles():
    """Lq = Lk = 512, blocks of 128 = tiles: a CTA lists exactly its selected blocks at or
    before its diagonal, ascending, and only the diagonal tile is masked per element."""
    plan = attention.attention_plan(128, 128, jnp.bfloat16, 128, with_lse=False)
    mask = np.zeros((1, 1, 4, 4), bool)
    mask[0, 0, 3, [0, 2, 3]] = True
    mask[0, 0, 2, [1, 3]] = True  # block 3 lies past row block 2's diagonal
    lists = attention.key_tile_lists(jnp.asarray(mask), q_len=512, k_len=512,
                                     block_size=128, causal=True, plan=plan)
    counts = np.asarray(lists.counts)[0, 0]
    np.testing.assert_array_equal(counts, [[0, 0, 0], [0, 0, 0], [1, 1, 1], [3, 2, 2]])
    np.testing.assert_array_equal(np.asarray(lists.tiles)[0, 0, 3, :3], [0, 2, 3])
    np.testing.assert_array_equal(np.asarray(lists.tiles)[0, 0, 2, :1], [1])


@pytest.mark.parametrize("head_dim, value_dim, dtype, block_size, rule", [
    (128, 128, jnp.float32, 128, "bfloat16 or float16"),
    (96, 96, jnp.bfloat16, 128, "head_dim in"),
    (128, 64, jnp.bfloat16, 128, "v's head dim"),
    (128, 128, jnp.bfloat16, 64, "block_size a multiple of 128"),
])
def test_plan_refuses_unsupported_arguments(head_dim, value_dim, dtype, block_size, rule):
    reason = attention.unsupported_reason(head_dim, value_dim, dtype, block_size)
    assert reason is not None and rule in reason
    with pytest.raises(ValueError, match=rule):
        attention.attention_plan(head_dim, value_dim, dtype, block_size, with_lse=False)


def test_plan_counts_shared_memory_as_mosaic_gpu_does():
    """3 stages at D 128: Mosaic GPU asked for 232568 bytes with lse on the H200 (over the
    232448 available) and ran the plan without lse."""
    plan = attention.attention_plan(128, 128, jnp.bfloat16, 128, with_lse=False, stages=3)
    assert plan.smem_bytes(2, with_lse=True) == 232568
    with pytest.raises(ValueError, match="shared memory"):
        attention.attention_plan(128, 128, jnp.bfloat16, 128, with_lse=True, stages=3)


def test_plan_refuses_overrides_that_do_not_fit():
    with pytest.raises(ValueError, match="shared memory"):
        attention.attention_plan(256, 256, jnp.bfloat16, 256, with_lse=False, block_kv=128,
                                 stages=4)
    with pytest.raises(ValueError, match="block_kv"):
        attention.attention_plan(128, 128, jnp.bfloat16, 128, with_lse=False, block_kv=96)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the reason off a GPU")
def test_available_names_the_missing_hopper_gpu():
    reason = mosaic.available()
    assert reason is not None and "Hopper" in reason and jax.devices()[0].platform in reason


# --- the kernel (Hopper only) ----------------------------------------------------------

# (batch, heads, kv_heads, Lq, Lk, dim, block_size, density, dtype)
KERNEL_CASES = [
    (1, 4, 2, 1024, 1024, 128, 128, 1.0, jnp.bfloat16),
    (1, 4, 2, 1024, 1024, 128, 128, 0.3, jnp.bfloat16),
    (2, 4, 1, 1000, 1000, 128, 128, 0.5, jnp.float16),
    (1, 4, 4, 384, 1500, 64, 256, 0.5, jnp.bfloat16),
    (1, 2, 1, 700, 300, 256, 128, 0.7, jnp.bfloat16),
    (1, 4, 2, 512, 512, 128, 128, 0.05, jnp.bfloat16),  # many empty rows
]


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("case", KERNEL_CASES)
def test_kernel_equals_reference(rand, case, causal):
    batch, heads, kv_heads, q_len, k_len, dim, block_size, density, dtype = case
    q, k, v, mask = _inputs(rand, batch, heads, kv_heads, q_len, k_len, dim, block_size,
                            density, dtype)
    out, lse = attention.block_sparse_attention(q, k, v, mask, block_size=block_size,
                                                causal=causal, return_lse=True)
    assert out.dtype == dtype and out.shape == q.shape and lse.shape == q.shape[:3]
    want_out, want_lse = reference_attention(q, k, v, mask, block_size=block_size,
                                             causal=causal, scale=dim ** -0.5)
    _assert_close(out, lse, want_out, want_lse, str(rand))


def _assert_close(out, lse, want_out, want_lse, msg):
    """out within bfloat16 rounding, lse within 1e-2, -inf exactly where the reference's."""
    out, lse = np.asarray(out.astype(jnp.float32), np.float64), np.asarray(lse)
    np.testing.assert_allclose(out, want_out, atol=2e-2, rtol=2e-2, err_msg=msg)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse), msg)
    finite = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[finite], want_lse[finite], atol=1e-2, err_msg=msg)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("causal", [True, False])
def test_kernel_keys_in_use_traced(rand, causal):
    """k_len as a traced int32: one compilation serves several key counts n; keys from n
    on are hidden and row i sits at key i + n - Lq."""
    q, k, v, mask = _inputs(rand, 1, 4, 2, 256, 1024, 128, 128, 0.7)

    @jax.jit
    def attend(q, k, v, mask, keys_in_use):
        return attention.block_sparse_attention(q, k, v, mask, block_size=128, causal=causal,
                                                return_lse=True, k_len=keys_in_use)

    for keys_in_use in (300, 701, 1024):
        out, lse = attend(q, k, v, mask, jnp.int32(keys_in_use))
        want_out, want_lse = reference_attention(q, k, v, mask, block_size=128,
                                                 causal=causal, scale=128 ** -0.5,
                                                 keys_in_use=keys_in_use)
        _assert_close(out, lse, want_out, want_lse, f"n={keys_in_use} {rand}")
    assert attend._cache_size() == 1


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("page_size", [128, 512, 4096])
def test_kernel_reads_paged_caches(rand, page_size):
    """Shuffled pages (NaN in the spare ones) through the block table, a chunk of 512
    queries at the end of n cached keys (n traced: one compilation), GQA 4:2: equal to
    the reference on the contiguous cache."""
    q, k, v, mask = _inputs(rand, 2, 4, 2, 512, 8192, 128, 128, 0.5)
    k_pages, v_pages, table = rand.paged(page_size, k, v)

    @jax.jit
    def attend(q, k, v, mask, table, keys_in_use):
        return attention.block_sparse_attention(q, k, v, mask, block_size=128, causal=True,
                                                return_lse=True, block_table=table,
                                                k_len=keys_in_use)

    for keys_in_use in (8192, 5000):
        out, lse = attend(q, k_pages, v_pages, mask, table, jnp.int32(keys_in_use))
        want_out, want_lse = reference_attention(q, k, v, mask, block_size=128,
                                                 causal=True, scale=128 ** -0.5,
                                                 keys_in_use=keys_in_use)
        _assert_close(out, lse, want_out, want_lse, f"n={keys_in_use} {rand}")
    assert attend._cache_size() == 1


@pytest.mark.gpu
@needs_hopper
def test_kernel_is_deterministic_and_lse_is_optional(rand):
    q, k, v, mask = _inputs(rand, 1, 4, 2, 1024, 1024, 128, 128, 0.5)
    first = attention.block_sparse_attention(q, k, v, mask, block_size=128, causal=True)
    again, _ = attention.block_sparse_attention(q, k, v, mask, block_size=128, causal=True,
                                                return_lse=True)
    np.testing.assert_array_equal(np.asarray(first), np.asarray(again), str(rand))


def _mosaic_gpu_import_error() -> str | None:
    try:
        from jax.experimental.pallas import mosaic_gpu  # noqa: F401
    except Exception as error:  # this jax cannot build Mosaic GPU kernels at all
        return repr(error)
    return None


@pytest.mark.skipif(_mosaic_gpu_import_error() is not None,
                    reason=f"Mosaic GPU does not import: {_mosaic_gpu_import_error()}")
@pytest.mark.parametrize("q_len, k_len, dim, block_size, causal, return_lse, plan", [
    (1024, 1024, 128, 128, True, True, {}),
    (1000, 1500, 128, 128, False, False, {}),
    (700, 300, 64, 256, True, True, {}),
    (512, 512, 256, 128, True, False, {}),
    (1024, 1024, 128, 128, True, False, {"block_kv": 64, "stages": 3}),
    (256, 1024, 128, 128, True, True, {"k_len": 700}),
    (256, 1024, 128, 128, False, True, {"k_len": 517}),
])
def test_kernel_lowers_for_cuda(q_len, k_len, dim, block_size, causal, return_lse, plan):
    """Without a GPU: Mosaic GPU's lowering (layout inference included, for sm_90) accepts
    the kernel and the module holds its custom call."""
    q = jax.ShapeDtypeStruct((1, 4, q_len, dim), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, 2, k_len, dim), jnp.bfloat16)
    mask = jax.ShapeDtypeStruct((1, 4, -(-q_len // block_size), -(-k_len // block_size)),
                                jnp.bool_)

    def call(q, k, v, mask):
        return attention.block_sparse_attention(q, k, v, mask, block_size=block_size,
                                                causal=causal, return_lse=return_lse, **plan)

    lowered = jax.jit(call).trace(q, k, k, mask).lower(lowering_platforms=("cuda",))
    assert "stablehlo.custom_call @mosaic_gpu" in lowered.as_text()


@pytest.mark.skipif(_mosaic_gpu_import_error() is not None,
                    reason=f"Mosaic GPU does not import: {_mosaic_gpu_import_error()}")
@pytest.mark.parametrize("page_size, causal", [(128, True), (1024, False)])
def test_paged_kernel_lowers_for_cuda(page_size, causal):
    """The producer's copies out of pages (a [tile, D] box of one KV head of one page, a
    strided TMA source) pass Mosaic GPU's lowering."""
    pages, per_seq = 40, 4096 // page_size
    q = jax.ShapeDtypeStruct((2, 4, 512, 128), jnp.bfloat16)
    pool = jax.ShapeDtypeStruct((pages, page_size, 2, 128), jnp.bfloat16)
    table = jax.ShapeDtypeStruct((2, per_seq), jnp.int32)
    mask = jax.ShapeDtypeStruct((2, 4, 4, 32), jnp.bool_)

    def call(q, k, v, mask, table):
        return attention.block_sparse_attention(q, k, v, mask, block_size=128,
                                                causal=causal, block_table=table,
                                                k_len=jnp.int32(3000))

    lowered = jax.jit(call).trace(q, pool, pool, mask, table).lower(
        lowering_platforms=("cuda",))
    assert "stablehlo.custom_call @mosaic_gpu" in lowered.as_text()


def test_plan_refuses_pages_that_are_not_whole_key_tiles():
    assert attention.unsupported_reason(128, 128, jnp.bfloat16, 128, 256) is None
    for page_size in (16, 64, 192):
        reason = attention.unsupported_reason(128, 128, jnp.bfloat16, 128, page_size)
        assert reason is not None and f"got page_size {page_size}" in reason
        with pytest.raises(ValueError, match="multiple of its key tile of 128"):
            attention.attention_plan(128, 128, jnp.bfloat16, 128, with_lse=False,
                                     page_size=page_size)


# (batch, heads, kv_heads, Lq, Lk, dim, block_size, density, causal, options): shapes seen
# by no other test, so that no interpreted trace can be cached for them elsewhere.
INTERPRET_CASES = [
    (1, 2, 1, 256, 384, 64, 128, 0.7, True, {}),
    (2, 2, 1, 300, 200, 64, 128, 0.6, True, {}),
    (1, 2, 2, 200, 461, 64, 256, 0.5, False, {}),
    (1, 2, 1, 448, 448, 64, 128, 0.6, True, {"block_kv": 64, "stages": 3}),
    (2, 2, 1, 200, 512, 64, 128, 0.6, True, {"page_size": 256}),
]


@pytest.mark.skipif(mosaic_interpret.unsupported_reason() is not None,
                    reason=str(mosaic_interpret.unsupported_reason()))
@pytest.mark.skipif(jax.default_backend() != "cpu", reason="interpret mode runs on CPU")
@pytest.mark.parametrize("case", INTERPRET_CASES)
def test_kernel_in_gpu_interpret_mode(rand, case):
    """The kernel's code (producer, consumers, barriers, lists, masks, empty rows) on CPU:
    equal to the reference up to bfloat16 rounding, no race, every barrier phase seen."""
    batch, heads, kv_heads, q_len, k_len, dim, block_size, density, causal, options = case
    q, k, v, mask = _inputs(rand, batch, heads, kv_heads, q_len, k_len, dim, block_size,
                            density)
    options = dict(options)
    cache = (k, v)
    if "page_size" in options:  # the kernel reads shuffled pages with NaN spares
        *cache, options["block_table"] = rand.paged(options.pop("page_size"), k, v)
    with mosaic_interpret.interpret_kernel() as races_found:
        out, lse = attention.block_sparse_attention(
            q, *cache, mask, block_size=block_size, causal=causal, return_lse=True,
            **options)
        out, lse = np.asarray(out.astype(jnp.float32), np.float64), np.asarray(lse)
        assert not races_found(), str(rand)
    want_out, want_lse = reference_attention(q, k, v, mask, block_size=block_size,
                                             causal=causal, scale=dim ** -0.5,
                                             keys_in_use=options.get("k_len"))
    np.testing.assert_allclose(out, want_out, atol=2e-2, rtol=2e-2, err_msg=str(rand))
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse), str(rand))
    finite = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[finite], want_lse[finite], atol=1e-4, err_msg=str(rand))
