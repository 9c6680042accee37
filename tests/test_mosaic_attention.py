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

import dataclasses

import jax
import jax.numpy as jnp
import mosaic_interpret
import np_attention as npa
import numpy as np
import pytest

from cases import AttentionCase
from xattn_jax import mosaic
from xattn_jax.mosaic.attention import block_sparse_attention as attention
from xattn_jax.mosaic.attention.plan import AttentionPlan

needs_hopper = pytest.mark.skipif(mosaic.available() is not None,
                                  reason=str(mosaic.available()))


@dataclasses.dataclass(frozen=True)
class KernelCase(AttentionCase):
    """An `AttentionCase` run by the Mosaic kernel: its plan overrides (None: the plan's
    choice) and the page size of a paged cache (None: contiguous)."""

    block_kv: int | None = None
    stages: int | None = None
    page_size: int | None = None

    @property
    def kernel_options(self) -> dict:
        """The kernel's keyword arguments that the case fixes: `options`, the keys in use
        as k_len and the plan overrides."""
        return dict(self.options, k_len=self.keys_in_use, block_kv=self.block_kv,
                    stages=self.stages)


def _inputs(rand, case: AttentionCase):
    """q, k, v (standard normal) and a random block mask of `case`."""
    return (*case.qkv(rand), case.mask(rand))


def reference_attention(q, k, v, mask, case: AttentionCase):
    """float64 out [B, Hq, Lq, D] and lse [B, Hq, Lq] of section 6 (`np_attention`) with
    the block size, causal flag and keys in use (None: Lk) of `case`, scale 1/sqrt(D)."""
    return npa.attention(q, k, v, mask, block_size=case.block_size, causal=case.causal,
                         n_keys=case.keys_in_use)


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
        out[b, h, row0:row0 + bq], lse[b, h, row0:row0 + bq] = npa.masked_softmax_attention(
            scores, allowed, v[b, kv, keys])
    return out[:, :, :q_len], lse[:, :, :q_len]


# float32 inputs at D 64 (the tiles planned for bfloat16), each causal and not: square,
# Lq < Lk, Lq > Lk, odd lengths, 256-blocks (two key tiles each), a mask with whole empty
# rows, fewer keys in use than Lk.
WALK_CASES = [
    AttentionCase("square-dense", 1, 2, 1, 256, 256, 64, density=1.0),
    AttentionCase("longer-keys", 1, 2, 2, 384, 640, 64, density=0.5),
    AttentionCase("longer-queries", 2, 4, 2, 300, 200, 64, density=0.6),
    AttentionCase("odd-256-blocks", 1, 2, 1, 200, 461, 64, block_size=256, density=0.5),
    AttentionCase("empty-rows", 1, 1, 1, 517, 517, 64, density=0.2),
    AttentionCase("keys-in-use", 1, 2, 1, 200, 700, 64, density=0.7, keys_in_use=333),
    AttentionCase("keys-in-use-256", 1, 2, 2, 128, 512, 64, block_size=256, density=0.8,
                  keys_in_use=400),
]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("case", WALK_CASES)
def test_key_tile_walk_equals_reference(rand, case, causal):
    case = dataclasses.replace(case, causal=causal)
    q, k, v, mask = _inputs(rand, case)
    plan = attention.attention_plan(case.head_dim, case.head_dim, jnp.bfloat16,
                                    case.block_size, with_lse=True)
    lists = attention.key_tile_lists(mask, q_len=case.q_len, k_len=case.k_len, plan=plan,
                                     keys_in_use=case.keys_in_use, **case.options)
    want_out, want_lse = reference_attention(q, k, v, mask, case)
    got_out, got_lse = walk_key_tiles(q, k, v, lists, plan=plan, causal=causal,
                                      scale=case.head_dim ** -0.5)
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

# each causal and not
KERNEL_CASES = [
    AttentionCase("dense", 1, 4, 2, 1024, 1024, 128, dtype=jnp.bfloat16, density=1.0),
    AttentionCase("sparse", 1, 4, 2, 1024, 1024, 128, dtype=jnp.bfloat16, density=0.3),
    AttentionCase("float16-odd", 2, 4, 1, 1000, 1000, 128, dtype=jnp.float16, density=0.5),
    AttentionCase("d64-256-blocks", 1, 4, 4, 384, 1500, 64, block_size=256,
                  dtype=jnp.bfloat16, density=0.5),
    AttentionCase("d256-short-keys", 1, 2, 1, 700, 300, 256, dtype=jnp.bfloat16,
                  density=0.7),
    AttentionCase("many-empty-rows", 1, 4, 2, 512, 512, 128, dtype=jnp.bfloat16,
                  density=0.05),
]


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("case", KERNEL_CASES)
def test_kernel_equals_reference(rand, case, causal):
    case = dataclasses.replace(case, causal=causal)
    q, k, v, mask = _inputs(rand, case)
    out, lse = attention.block_sparse_attention(q, k, v, mask, return_lse=True,
                                                **case.options)
    assert out.dtype == case.dtype and out.shape == q.shape and lse.shape == q.shape[:3]
    want_out, want_lse = reference_attention(q, k, v, mask, case)
    _assert_close(out, lse, want_out, want_lse, str(rand))


def _assert_close(out, lse, want_out, want_lse, msg):
    """out within bfloat16 rounding, lse within 1e-2, -inf exactly where the reference's."""
    out, lse = np.asarray(out.astype(jnp.float32), np.float64), np.asarray(lse)
    np.testing.assert_allclose(out, want_out, atol=2e-2, rtol=2e-2, err_msg=msg)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse), msg)
    finite = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[finite], want_lse[finite], atol=1e-2, err_msg=msg)


# (case, page size or None, key counts n): a padded cache, causal or not; a chunk of 512
# queries over shuffled pages (NaN in the spare ones), GQA 4:2
KEYS_IN_USE_CASES = [
    (AttentionCase("traced-keys", 1, 4, 2, 256, 1024, 128, causal=True,
                   dtype=jnp.bfloat16, density=0.7), None, (300, 701, 1024)),
    (AttentionCase("traced-keys-noncausal", 1, 4, 2, 256, 1024, 128, causal=False,
                   dtype=jnp.bfloat16, density=0.7), None, (300, 701, 1024)),
] + [(AttentionCase("paged-chunk", 2, 4, 2, 512, 8192, 128, dtype=jnp.bfloat16), page,
      (8192, 5000)) for page in (128, 512, 4096)]


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("case, page_size, key_counts", KEYS_IN_USE_CASES,
                         ids=lambda x: getattr(x, "id", None))
def test_kernel_keys_in_use_traced(rand, case, page_size, key_counts):
    """k_len as a traced int32: one compilation serves several key counts n; keys from n
    on are hidden and row i sits at key i + n - Lq. With `page_size`, k and v are read
    through the block table: equal to the reference on the contiguous cache."""
    q, k, v, mask = _inputs(rand, case)
    cache, table = (k, v), None
    if page_size is not None:
        *cache, table = rand.paged(page_size, k, v)

    @jax.jit
    def attend(q, k, v, mask, table, keys_in_use):
        return attention.block_sparse_attention(q, k, v, mask, return_lse=True,
                                                block_table=table, k_len=keys_in_use,
                                                **case.options)

    for keys_in_use in key_counts:
        out, lse = attend(q, *cache, mask, table, jnp.int32(keys_in_use))
        want_out, want_lse = reference_attention(
            q, k, v, mask, dataclasses.replace(case, keys_in_use=keys_in_use))
        _assert_close(out, lse, want_out, want_lse, f"n={keys_in_use} {rand}")
    assert attend._cache_size() == 1


@pytest.mark.gpu
@needs_hopper
def test_kernel_is_deterministic_and_lse_is_optional(rand):
    case = AttentionCase("gqa-1k", 1, 4, 2, 1024, 1024, 128, dtype=jnp.bfloat16)
    q, k, v, mask = _inputs(rand, case)
    first = attention.block_sparse_attention(q, k, v, mask, **case.options)
    again, _ = attention.block_sparse_attention(q, k, v, mask, return_lse=True,
                                                **case.options)
    np.testing.assert_array_equal(np.asarray(first), np.asarray(again), str(rand))


def _mosaic_gpu_import_error() -> str | None:
    try:
        from jax.experimental.pallas import mosaic_gpu  # noqa: F401
    except Exception as error:  # this jax cannot build Mosaic GPU kernels at all
        return repr(error)
    return None


def _abstract_inputs(case: AttentionCase) -> tuple[jax.ShapeDtypeStruct, ...]:
    """q, k, v and the mask of `case` as shapes and dtypes, to lower without data."""
    return (*(jax.ShapeDtypeStruct(shape, case.dtype)
              for shape in (case.q_shape, case.k_shape, case.v_shape)),
            jax.ShapeDtypeStruct(case.mask_shape, jnp.bool_))


@pytest.mark.skipif(_mosaic_gpu_import_error() is not None,
                    reason=f"Mosaic GPU does not import: {_mosaic_gpu_import_error()}")
@pytest.mark.parametrize("q_len, k_len, dim, block_size, causal, return_lse, plan", [
    (1024, 1024, 128, 128, True, True, {}),
    (1000, 1500, 128, 128, False, False, {}),
    (700, 300, 64, 256, True, True, {}),
    (512, 512, 256, 128, True, False, {}),
    (1024, 1024, 128, 128, True, False, {"block_kv": 64, "stages": 3}),
    (256, 1024, 128, 128, True, True, {"keys_in_use": 700}),
    (256, 1024, 128, 128, False, True, {"keys_in_use": 517}),
])
def test_kernel_lowers_for_cuda(q_len, k_len, dim, block_size, causal, return_lse, plan):
    """Without a GPU: Mosaic GPU's lowering (layout inference included, for sm_90) accepts
    the kernel and the module holds its custom call (GQA 4:2, bfloat16; `plan`: the
    `KernelCase` fields it sets)."""
    case = KernelCase("lowering", 1, 4, 2, q_len, k_len, dim, block_size=block_size,
                      causal=causal, dtype=jnp.bfloat16, **plan)

    def call(q, k, v, mask):
        return attention.block_sparse_attention(q, k, v, mask, return_lse=return_lse,
                                                **case.kernel_options)

    lowered = jax.jit(call).trace(*_abstract_inputs(case)).lower(lowering_platforms=("cuda",))
    assert "stablehlo.custom_call @mosaic_gpu" in lowered.as_text()


@pytest.mark.skipif(_mosaic_gpu_import_error() is not None,
                    reason=f"Mosaic GPU does not import: {_mosaic_gpu_import_error()}")
@pytest.mark.parametrize("page_size, causal", [(128, True), (1024, False)])
def test_paged_kernel_lowers_for_cuda(page_size, causal):
    """The producer's copies out of pages (a [tile, D] box of one KV head of one page, a
    strided TMA source) pass Mosaic GPU's lowering."""
    case = AttentionCase("paged-lowering", 2, 4, 2, 512, 4096, 128, causal=causal,
                         dtype=jnp.bfloat16)
    q, _, _, mask = _abstract_inputs(case)
    pool = jax.ShapeDtypeStruct((40, page_size, case.kv_heads, case.head_dim), case.dtype)
    table = jax.ShapeDtypeStruct((case.batch, case.k_len // page_size), jnp.int32)

    def call(q, k, v, mask, table):
        return attention.block_sparse_attention(q, k, v, mask, block_table=table,
                                                k_len=jnp.int32(3000), **case.options)

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


# shapes seen by no other test, so that no interpreted trace can be cached for them
# elsewhere
INTERPRET_CASES = [
    KernelCase("longer-keys", 1, 2, 1, 256, 384, 64, dtype=jnp.bfloat16, density=0.7),
    KernelCase("longer-queries", 2, 2, 1, 300, 200, 64, dtype=jnp.bfloat16, density=0.6),
    KernelCase("noncausal-256-blocks", 1, 2, 2, 200, 461, 64, block_size=256, causal=False,
               dtype=jnp.bfloat16, density=0.5),
    KernelCase("three-stages", 1, 2, 1, 448, 448, 64, dtype=jnp.bfloat16, density=0.6,
               block_kv=64, stages=3),
    KernelCase("paged", 2, 2, 1, 200, 512, 64, dtype=jnp.bfloat16, density=0.6,
               page_size=256),
]


@pytest.mark.skipif(mosaic_interpret.attention_unsupported_reason() is not None,
                    reason=str(mosaic_interpret.attention_unsupported_reason()))
@pytest.mark.skipif(jax.default_backend() != "cpu", reason="interpret mode runs on CPU")
@pytest.mark.parametrize("case", INTERPRET_CASES)
def test_kernel_in_gpu_interpret_mode(rand, case):
    """The kernel's code (producer, consumers, barriers, lists, masks, empty rows) on CPU:
    equal to the reference up to bfloat16 rounding, no race, every barrier phase seen."""
    q, k, v, mask = _inputs(rand, case)
    options = case.kernel_options
    cache = (k, v)
    if case.page_size is not None:  # the kernel reads shuffled pages with NaN spares
        *cache, options["block_table"] = rand.paged(case.page_size, k, v)
    with mosaic_interpret.interpret_kernel() as races_found:
        out, lse = attention.block_sparse_attention(q, *cache, mask, return_lse=True,
                                                    **options)
        out, lse = np.asarray(out.astype(jnp.float32), np.float64), np.asarray(lse)
        assert not races_found(), str(rand)
    want_out, want_lse = reference_attention(q, k, v, mask, case)
    np.testing.assert_allclose(out, want_out, atol=2e-2, rtol=2e-2, err_msg=str(rand))
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse), str(rand))
    finite = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[finite], want_lse[finite], atol=1e-4, err_msg=str(rand))
