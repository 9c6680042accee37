"""The sampled rows' Triton-backend kernel (the one-pass and two-pass block-sum kernels on
a `SampledGeometry`) against the plain-JAX sampled rows (`xattn_jax.reference.
sampled_rows`): the same block scores within float32 rounding and the same masks away
from ties, on contiguous keys (causal and not, any lengths, GQA), a chunk over a buffer
with a traced key count, a paged cache, in scratch steps; the public calls that run it;
its plans' scratch bound; its lowering for CUDA. Off a GPU the kernels run in Pallas'
interpret mode; on a GPU compiled, marked `gpu`, with larger cases of their own."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from lowering import lower_for_an_h200

import np_reference as npr
import xattn_jax
from cases import GPU_SLACK
from xattn_jax import impls, kv_blocks
from xattn_jax.checks import check_qk
from xattn_jax.reference import sampled_rows as reference_rows
from xattn_jax.reference.backend import ReferenceBackend
from xattn_jax.row_statistics import DEFAULT_SCRATCH_BYTES
from xattn_jax.sampled_geometry import SampledGeometry, sampled_positions
from xattn_jax.defaults import SAMPLED_ROWS as ROWS
from xattn_jax.triton.backend import TritonBackend
from xattn_jax.triton.block_sums import block_sums as triton_block_sums
from xattn_jax.triton.plan import BLOCK_SUM_KERNELS, ONE_PASS, TWO_PASS, Tiles, plan_block_sums

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
ON_GPU = jax.default_backend() == "gpu"
# the kernels: compiled and marked gpu on a GPU, in Pallas' interpret mode elsewhere
KERNELS = [pytest.param(k, marks=pytest.mark.gpu) if ON_GPU else k for k in BLOCK_SUM_KERNELS]
# float32 scores relative to the largest: the contract's 1e-5 (the kernel's exp2 against
# the reference's exp, other summation orders), looser on a GPU (approximate exp2)
RTOL = 1e-5 * GPU_SLACK
gpu_only = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
# a test that runs the kernel: compiled on a GPU, and then marked gpu like KERNELS
runs_the_kernel = pytest.mark.gpu if ON_GPU else (lambda test: test)


@dataclasses.dataclass(frozen=True)
class Case:
    """q `[batch, q_heads, q_len, head_dim]` and k `[batch, kv_heads, k_len, head_dim]`,
    `rows` sampled per block of `block_size`; tile: the kernel's (rows, keys)."""

    id: str
    batch: int
    q_heads: int
    kv_heads: int
    q_len: int
    k_len: int
    head_dim: int
    block_size: int
    rows: int
    causal: bool
    dtype: object = F32
    tile: tuple[int, int] = (16, 16)

    def inputs(self, rand):
        # scores of standard deviation near 2: peaked softmax rows, not degenerate ones
        scale = 2.0 ** 0.5 * self.head_dim ** 0.25
        q = rand.normal((self.batch, self.q_heads, self.q_len, self.head_dim), self.dtype,
                        scale)
        k = rand.normal((self.batch, self.kv_heads, self.k_len, self.head_dim), self.dtype,
                        scale)
        return q, k

    def geom(self, q, k) -> SampledGeometry:
        geom = check_qk(q, k, stride=1, block_size=self.block_size, causal=self.causal)
        return SampledGeometry.of(geom, self.rows, None)


CASES = [
    # odd length, GQA 2:1, 3 rows per block of 16
    Case("c70_bs16_r3_gqa2", 1, 4, 2, 70, 70, 16, 16, 3, True),
    # causal Lq < Lk (two blocks of context), every row of a block sampled, bf16, GQA 4:1
    Case("c48x112_bs16_r16_gqa4_bf16", 1, 4, 1, 48, 112, 32, 16, 16, True, BF16),
    # non-causal, odd lengths, a block of 12 (units of 4 keys), head dim 24 (masked
    # columns), float16
    Case("nc37x131_bs12_r5_d24_f16", 1, 2, 1, 37, 131, 24, 12, 5, False, F16),
    # batch 2, tiles of 16 rows x 32 keys, a short last block repeating rows
    Case("c200_b2_bs32_r8", 2, 2, 2, 200, 200, 16, 32, 8, True, tile=(16, 32)),
    # one query token, one row per block of 4
    Case("nc1x5_bs4_r1", 1, 1, 1, 1, 5, 16, 4, 1, False),
    # a block of 64 wider than the key tile, tiles of 32 rows x 16 keys
    Case("nc96x160_bs64_r16_bf16", 1, 2, 1, 96, 160, 16, 64, 16, False, BF16, (32, 16)),
]


def kernel_mass(case: Case, q, k, *, kernel: str, key_len=None, block_table=None,
                **bounds) -> np.ndarray:
    """The kernel's block scores `[B, Hq, qb, kb]` with the case's tiles."""
    geom = case.geom(q, k if block_table is None else _contiguous_shape(q, k, block_table))
    rows, cols = case.tile
    plan = plan_block_sums(geom, q.dtype, case.causal, interpret=not ON_GPU, kernel=kernel,
                           tiles=Tiles(rows, cols, block_d=16 if case.head_dim > 16 else None),
                           **bounds)
    out = triton_block_sums(q, k, plan=plan, causal=case.causal, norm=1.0,
                            key_len=None if key_len is None else jnp.full((1,), key_len,
                                                                          jnp.int32),
                            block_table=block_table)
    assert out.dtype == jnp.float32
    return np.asarray(out)


def _contiguous_shape(q, pages, table):
    """A stand-in for the contiguous keys `[B, Hkv, capacity, D]` of a paged cache."""
    return jax.ShapeDtypeStruct((q.shape[0], pages.shape[2], table.shape[1] * pages.shape[1],
                                 pages.shape[3]), pages.dtype)


def reference_mass(case: Case, q, k, key_len=None) -> np.ndarray:
    key_len = None if key_len is None else jnp.int32(key_len)
    return np.asarray(reference_rows.block_mass(q, k, key_len, geom=case.geom(q, k),
                                                causal=case.causal))


def assert_close(got, want, msg):
    err = npr.rel_err(got, want)
    assert err <= RTOL, f"{msg}: relative error {err:.3g} > {RTOL}"


# --- the sampled positions ---------------------------------------------------------------

@pytest.mark.parametrize("block_size", [1, 4, 12, 16])
def test_query_position_is_the_sampled_position(block_size):
    """The kernel's traced positions are `sampled_positions`' (docs/estimate.md, "Sampled
    rows"); padded rows past the last read the last row's token."""
    for q_len in (1, 3, 17, 71):
        for rows in {1, min(3, block_size), block_size // 2 + 1, block_size}:
            geom = SampledGeometry(1, 1, 1, q_len, q_len, 8, 1, block_size, rows, 1.0)
            want = sampled_positions(q_len, block_size, rows).reshape(-1)
            got = np.asarray(geom.query_position(jnp.arange(want.size + 7, dtype=jnp.int32)))
            np.testing.assert_array_equal(got[:want.size], want, f"{q_len} {block_size} {rows}")
            assert np.all(got[want.size:] == want[-1]) and want[-1] < q_len


def test_geometry_refuses_what_it_cannot_place():
    with pytest.raises(ValueError, match="stride 1"):
        SampledGeometry(1, 1, 1, 8, 8, 8, 2, 8, 2, 1.0)
    with pytest.raises(ValueError, match="rows must lie in"):
        SampledGeometry(1, 1, 1, 8, 8, 8, 1, 8, 9, 1.0)
    with pytest.raises(ValueError, match="below 2"):
        SampledGeometry(1, 1, 1, 8, 8, 8, 1, 65536, 32768, 1.0)


# --- the kernel against the plain JAX --------------------------------------------------

@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_kernel_matches_plain_jax(kernel, case, rand):
    q, k = case.inputs(rand)
    got = kernel_mass(case, q, k, kernel=kernel)
    want = reference_mass(case, q, k)
    qb, kb = -(-case.q_len // case.block_size), -(-case.k_len // case.block_size)
    assert got.shape == (case.batch, case.q_heads, qb, kb)
    assert_close(got, want, f"{kernel} {case.id} {rand}")
    np.testing.assert_allclose(got.sum(-1), case.rows, rtol=1e-5 * GPU_SLACK,
                               err_msg=f"each sampled row sums to 1, {rand}")
    if case.causal:  # nothing after the diagonal
        after = np.arange(kb)[None, :] > np.arange(qb)[:, None] + (kb - qb)
        assert np.all(got[..., after] == 0), f"{kernel} {case.id} {rand}"


@runs_the_kernel
@pytest.mark.parametrize("case", [CASES[0], CASES[1], CASES[2]], ids=lambda c: c.id)
def test_masks_agree_away_from_ties(case, rand):
    """The threshold rule on the kernel's scores selects as on the plain JAX's, but for
    rows where float rounding decides."""
    q, k = case.inputs(rand)
    got = kernel_mass(case, q, k, kernel=ONE_PASS)
    want = reference_mass(case, q, k)
    t = rand.thresholds(case.q_heads, 0.5, 0.95)
    rules = dict(causal=case.causal)
    mask = xattn_jax.select_blocks(got, t, impl="reference", **rules)
    expected = xattn_jax.select_blocks(want, t, impl="reference", **rules)
    npr.assert_masks_agree(mask, expected, want, t, rtol=4 * RTOL, near_ties=True,
                           msg=f"{case.id} {rand}", **rules)


@runs_the_kernel
@pytest.mark.parametrize("steps", ["heads", "rows"])
def test_scratch_steps_change_nothing(steps, rand):
    """With a scratch bound below the whole call's, the kernel covers the heads, or one
    head's rows, in several calls: the same scores as one call, each call's scratch
    within the bound."""
    case = CASES[0] if steps == "heads" else CASES[3]  # 16 rows; 56 rows in steps of 16
    q, k = case.inputs(rand)
    geom, tiles = case.geom(q, k), Tiles(*case.tile)
    whole = plan_block_sums(geom, q.dtype, True, interpret=True, tiles=tiles)
    bound = whole.head_row_scratch_bytes * (whole.padded_rows if steps == "heads" else 16)
    stepped = plan_block_sums(geom, q.dtype, True, interpret=True, tiles=tiles,
                              max_scratch_bytes=bound)
    assert stepped.kernel == ONE_PASS and stepped.calls > 1 and stepped.scratch_bytes <= bound
    assert (stepped.call_heads == 1) and stepped.all_rows == (steps == "heads")
    got = kernel_mass(case, q, k, kernel=ONE_PASS, max_scratch_bytes=bound)
    assert_close(got, kernel_mass(case, q, k, kernel=ONE_PASS), f"{steps} steps {rand}")


@runs_the_kernel
def test_two_pass_where_no_row_step_fits(rand):
    case = CASES[3]
    q, k = case.inputs(rand)
    plan = plan_block_sums(case.geom(q, k), q.dtype, True, interpret=True,
                           tiles=Tiles(*case.tile), max_scratch_bytes=64)
    assert plan.kernel == TWO_PASS
    assert_close(kernel_mass(case, q, k, kernel=None, max_scratch_bytes=64),
                 reference_mass(case, q, k), f"{rand}")


# --- a chunk over a cache: a traced key count, paged keys ---------------------------------

CHUNK = Case("chunk40_cap192_bs16_r4", 1, 4, 2, 40, 192, 16, 16, 4, False)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("k_len", [192, 131, 16, 3])
def test_key_count_hides_the_keys_past_it(kernel, k_len, rand):
    """NaN past the key count changes nothing: the scores of the k_len keys alone."""
    q, k = CHUNK.inputs(rand)
    k = k.at[:, :, k_len:].set(jnp.nan)
    got = kernel_mass(CHUNK, q, k, kernel=kernel, key_len=k_len)
    assert_close(got, reference_mass(CHUNK, q, k, key_len=k_len), f"{kernel} {rand}")
    zeros_past = jnp.where(jnp.arange(CHUNK.k_len)[:, None] < k_len, k, 0)
    assert_close(got, reference_mass(CHUNK, q, zeros_past, key_len=k_len),
                 f"{kernel} vs zeros past k_len {rand}")
    held = -(-k_len // CHUNK.block_size)  # blocks that hold keys
    assert np.all(got[..., held:] == 0) and np.all(got[..., :held] > 0)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("page_size", [5, 16, 64])
def test_paged_cache_reads_as_contiguous(kernel, page_size, rand):
    """A shuffled page pool (spare pages NaN; table entries past the key count's pages
    anything) read through the block table: the scores of the contiguous keys; pages of
    5 tokens straddle key tiles and blocks."""
    q, k = CHUNK.inputs(rand)
    capacity = 40 * page_size if page_size == 5 else CHUNK.k_len
    k = jnp.pad(k, ((0, 0), (0, 0), (0, capacity - CHUNK.k_len), (0, 0)))
    pool, table = rand.paged(page_size, k)
    k_len = 150
    table = np.array(table)
    table[:, -(-k_len // page_size):] = 10**6  # clamped into the pool, never seen
    got = kernel_mass(CHUNK, q, pool, kernel=kernel, key_len=k_len,
                      block_table=jnp.asarray(table))
    assert_close(got, reference_mass(CHUNK, q, k, key_len=k_len), f"{kernel} {rand}")


# --- the public calls that run it -----------------------------------------------------

KERNEL_BACKEND = TritonBackend(interpret=not ON_GPU)
PUBLIC = [pytest.param(KERNEL_BACKEND, marks=pytest.mark.gpu) if ON_GPU else KERNEL_BACKEND]


@pytest.mark.parametrize("backend", PUBLIC)
@pytest.mark.parametrize("impl_of", ["name", "backend"])
def test_sampled_block_mass_runs_the_kernel(backend, impl_of, rand):
    case = CASES[1]
    q, k = case.inputs(rand)
    impl = "triton" if impl_of == "name" else backend
    got = xattn_jax.sampled_block_mass(q, k, block_size=case.block_size, rows=case.rows,
                                       impl=impl)
    want = xattn_jax.sampled_block_mass(q, k, block_size=case.block_size, rows=case.rows,
                                        impl="reference")
    assert_close(got, want, f"{rand}")


@pytest.mark.parametrize("backend", PUBLIC)
def test_xattention_selects_on_the_kernels_scores(backend, rand):
    """xattention(estimate="sampled-rows") with the kernel for its estimate: the mask of
    the plain JAX's scores, away from ties, and the attention on its own mask."""
    case = Case("x", 1, 4, 2, 128, 128, 16, 16, ROWS, True)
    q, k = case.inputs(rand)
    v = rand.normal((1, 2, 128, 16))
    t = jnp.asarray([0.5, 0.7, 0.9, 0.95])
    pair = impls.XAttentionBackends(ReferenceBackend(), backend)
    out, mask = xattn_jax.xattention(q, k, v, threshold=t, block_size=16, return_mask=True,
                                     estimate="sampled-rows", impl=pair)
    scores = xattn_jax.sampled_block_mass(q, k, block_size=16, impl="reference")
    expected = xattn_jax.xattention(q, k, v, threshold=t, block_size=16, return_mask=True,
                                    estimate="sampled-rows", impl="reference")[1]
    npr.assert_masks_agree(mask, expected, scores, t, causal=True, rtol=4 * RTOL,
                           near_ties=True, msg=str(rand))
    want = xattn_jax.block_sparse_attention(q, k, v, mask, block_size=16, impl="reference")
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-5, atol=1e-6)


COLLECTIVES = ("all-gather", "all-reduce", "collective-permute", "all-to-all",
               "reduce-scatter")


@pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 devices (conftest.py)")
@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_partitions_over_batch_and_heads_without_collectives(impl, rand):
    """Under jit over q and k sharded by batch and (whole KV groups of) heads on 4
    devices, each device scores its own shard: no collective, the one-device scores."""
    case = Case("sharded", 2, 8, 4, 64, 64, 16, 16, 3, True)
    q, k = case.inputs(rand)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("b", "h"))
    sharded = [jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(
        "b", "h"))) for x in (q, k)]

    def scores(q, k):
        return xattn_jax.sampled_block_mass(q, k, block_size=16, rows=3, impl=impl)

    text = jax.jit(scores).lower(*sharded).compile().as_text()
    assert not [c for c in COLLECTIVES if c in text]
    assert_close(jax.jit(scores)(*sharded), scores(q, k), f"{impl} {rand}")


def _kv_model(q, k, k_len: int, *, estimate_block: int, stride: int, kv_block: int):
    """float64: the exact softmax of every estimate block's sampled rows over the first
    k_len keys, summed per KV block (docs/estimate.md section 5)."""
    q, k = npr.f64(q), npr.f64(k)[:, :, :k_len]
    b, hq, lq, d = q.shape
    rows = sampled_positions(lq, estimate_block, estimate_block // stride).reshape(-1)
    s = np.einsum("bkgnd,bkjd->bkgnj", q[:, :, rows].reshape(b, k.shape[1], -1, rows.size, d),
                  k).reshape(b, hq, rows.size, k_len) * d ** -0.5
    p = np.exp(s - s.max(-1, keepdims=True))
    p = (p / p.sum(-1, keepdims=True)).sum(2)
    blocks = -(-k_len // kv_block)
    return np.pad(p, ((0, 0), (0, 0), (0, blocks * kv_block - k_len))).reshape(
        b, hq, blocks, kv_block).sum(-1)


@pytest.mark.parametrize("impl", ["reference", pytest.param("triton", marks=pytest.mark.gpu)
                                  if ON_GPU else "triton"])
@pytest.mark.parametrize("page_size", [None, 16])
def test_kv_block_scores_on_sampled_rows(impl, page_size, rand):
    """kv_block_scores(estimate="sampled-rows"), contiguous or paged: the float64 model's
    scores, EMPTY_BLOCK past the key count, one per sampled row in all; one compilation
    for every key count."""
    q, k = CHUNK.inputs(rand)
    cache, table = k, None
    if page_size is not None:
        cache, table = rand.paged(page_size, k)
    call = jax.jit(lambda q, cache, n, table: kv_blocks.kv_block_scores(
        q, cache, kv_block_size=64, estimate_block_size=16, stride=4, k_len=n,
        block_table=table, impl=impl, estimate="sampled-rows"))
    for k_len in (192, 101):
        got = np.asarray(call(q, cache, jnp.int32(k_len), table))
        want = _kv_model(q, k, k_len, estimate_block=16, stride=4, kv_block=64)
        n = want.shape[-1]
        assert_close(got[..., :n], want, f"{impl} k_len {k_len} {rand}")
        assert np.all(got[..., n:] == kv_blocks.EMPTY_BLOCK)
        np.testing.assert_allclose(got[..., :n].sum(-1), 3 * 4, rtol=1e-5 * GPU_SLACK)
    assert call._cache_size() == 1


def test_xattention_refuses_blocks_shorter_than_the_sampled_rows(rand):
    q, k = CASES[0].inputs(rand)
    with pytest.raises(ValueError, match="block_size must be at least 16"):
        xattn_jax.xattention(q, k, k, block_size=8, stride=4, estimate="sampled-rows")


def test_kv_block_scores_refuses_an_unknown_estimate(rand):
    q, k = CHUNK.inputs(rand)
    with pytest.raises(ValueError, match="estimate must be one of"):
        kv_blocks.kv_block_scores(q, k, kv_block_size=64, estimate_block_size=16,
                                  estimate="rows")


# --- plans at the benchmark shapes: the workspace bound ---------------------------------

LLAMA = dict(q_heads=32, kv_heads=8, head_dim=128)  # Llama-3.1-8B's attention
PLAN_SHAPES = {  # name: (Lq, Lk, block_size, rows, causal)
    "causal-32k": (32768, 32768, 128, ROWS, True),
    "causal-128k": (131072, 131072, 128, ROWS, True),
    "chunk4096-ctx128k": (4096, 131072, 1024, 1024 // 8, False),
}


@pytest.mark.parametrize("name", PLAN_SHAPES)
def test_plans_keep_the_scratch_bound(name):
    q_len, k_len, block_size, rows, causal = PLAN_SHAPES[name]
    geom = SampledGeometry(1, LLAMA["q_heads"], LLAMA["kv_heads"], q_len, k_len,
                           LLAMA["head_dim"], 1, block_size, rows, 128 ** -0.5)
    plan = plan_block_sums(geom, BF16, causal, interpret=False)
    assert plan.kernel == ONE_PASS and 0 < plan.scratch_bytes <= DEFAULT_SCRATCH_BYTES


# --- lowering for CUDA -------------------------------------------------------------------

LOWERING = {  # name: (Lq, Lk, block_size, rows, causal, dtype, key count, page size)
    "causal-32k": (32768, 32768, 128, ROWS, True, BF16, False, None),
    "causal-128k-steps": (131072, 131072, 128, ROWS, True, BF16, False, None),
    "chunk-key-count": (4096, 131072, 1024, 128, False, BF16, True, None),
    "chunk-paged16": (4096, 65536, 1024, 128, False, BF16, True, 16),
    "odd-f32": (300, 517, 12, 5, False, F32, True, None),
}


@pytest.mark.parametrize("name", LOWERING)
def test_kernel_lowers_for_cuda(name):
    q_len, k_len, block_size, rows, causal, dtype, key_count, page = LOWERING[name]
    heads, kv_heads, d = LLAMA["q_heads"], LLAMA["kv_heads"], LLAMA["head_dim"]
    geom = SampledGeometry(1, heads, kv_heads, q_len, k_len, d, 1, block_size, rows,
                           d ** -0.5)
    q = jax.ShapeDtypeStruct((1, heads, q_len, d), dtype)
    if page is None:
        k, table = jax.ShapeDtypeStruct((1, kv_heads, k_len, d), dtype), None
    else:
        k = jax.ShapeDtypeStruct((k_len // page + 3, page, kv_heads, d), dtype)
        table = jax.ShapeDtypeStruct((1, k_len // page), jnp.int32)
    count = jax.ShapeDtypeStruct((), jnp.int32) if key_count else None
    backend = TritonBackend(interpret=False)

    def call(q, k, count, table):
        return backend.sampled_block_mass(q, k, geom=geom, causal=causal, key_len=count,
                                          block_table=table)

    text = lower_for_an_h200(call, q, k, count, table)
    assert "__gpu$xla.gpu.triton" in text


# --- GPU cases at larger shapes ----------------------------------------------------------

GPU_CASES = [
    Case("gpu-causal-8k-llama", 1, 32, 8, 8192, 8192, 128, 128, ROWS, True, BF16),
    Case("gpu-noncausal-2kx6k-f16", 2, 8, 2, 2048, 6000, 64, 64, 8, False, F16),
]


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.id)
def test_gpu_kernel_matches_plain_jax_with_its_tuned_plan(case, rand):
    """`impl="auto"` (the Mosaic backend's Triton companion on Hopper) against the plain
    JAX, scores and masks."""
    q, k = case.inputs(rand)
    options = dict(block_size=case.block_size, rows=case.rows, causal=case.causal)
    got = np.asarray(xattn_jax.sampled_block_mass(q, k, impl="auto", **options))
    want = np.asarray(xattn_jax.sampled_block_mass(q, k, impl="reference", **options))
    assert_close(got, want, f"{case.id} {rand}")
    t = rand.thresholds(case.q_heads, 0.5, 0.95)
    mask = xattn_jax.select_blocks(got, t, causal=case.causal)
    expected = xattn_jax.select_blocks(want, t, causal=case.causal)
    npr.assert_masks_agree(mask, expected, want, t, causal=case.causal, rtol=4 * RTOL,
                           near_ties=True, msg=f"{case.id} {rand}")


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("page_size", [None, 16, 1024])
def test_gpu_chunk_scores_match_plain_jax(page_size, rand):
    """A 1024-query chunk over a 16K cache (Llama-3.1-8B heads, bf16), contiguous or
    paged, at key counts inside and at the end of the cache: kv_block_scores on sampled
    rows under "auto" against the reference."""
    case = Case("chunk", 1, 32, 8, 1024, 16384, 128, 1024, 128, False, BF16)
    q, k = case.inputs(rand)
    cache, table = k, None
    if page_size is not None:
        cache, table = rand.paged(page_size, k)

    def scores(impl):
        return jax.jit(lambda q, cache, n, table: kv_blocks.kv_block_scores(
            q, cache, kv_block_size=4096, estimate_block_size=1024, k_len=n,
            block_table=table, impl=impl, estimate="sampled-rows"))

    auto, reference = scores("auto"), scores("reference")
    for k_len in (16384, 9999):
        n = jnp.int32(k_len)
        got, want = np.asarray(auto(q, cache, n, table)), np.asarray(reference(q, cache, n,
                                                                              table))
        assert_close(got, want, f"page {page_size} k_len {k_len} {rand}")
