"""`ragged_xattention`: a serving step of packed chunks and decode rows in one call.

Each sequence of a random step must equal `xattention` on that sequence alone where its
chunk starts on a block boundary (masks equal, outputs within float rounding), attend
densely where it has fewer queries than a block, and, where a chunk starts inside a
block, keep the blocks that docs/estimate.md "Ragged steps" defines (checked against the
float64 numpy reference). Also: bad inputs, one compilation per bucket, fused caches,
checked mode, the Triton kernel in interpret mode, several devices.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import np_reference as npr
import xattn_jax
from ragged_steps import make_step, random_lengths
from xattn_jax.ragged import api as ragged_api
from xattn_jax.ragged import ragged_xattention

BLOCK, STRIDE = 32, 8
OPTIONS = dict(block_size=BLOCK, stride=STRIDE)


def _run(step, **kwargs):
    return ragged_xattention(*step.args(), return_mask=True, **{**OPTIONS, **kwargs})


def _rows_of(mask, s):
    """Sequence s's mask rows `[Hq, its blocks, KB]`."""
    start, stop = int(mask.cu_q_blocks[s]), int(mask.cu_q_blocks[s + 1])
    return np.asarray(mask.blocks[:, start:stop])


def _dense_causal(q, k, v, scale=None):
    """float64 causal attention of one sequence: q `[1, Hq, Lq, D]` at the last Lq of
    k, v `[1, Hkv, Lk, D]` -> `[Lq, Hq, D]`."""
    q, k, v = (npr.f64(x)[0] for x in (q, k, v))
    group = q.shape[0] // k.shape[0]
    k, v = np.repeat(k, group, axis=0), np.repeat(v, group, axis=0)
    s = np.einsum("hqd,hkd->hqk", q, k) * (scale or q.shape[-1] ** -0.5)
    lq, lk = q.shape[1], k.shape[1]
    visible = np.arange(lk)[None, :] <= np.arange(lk - lq, lk)[:, None]
    s = np.where(visible, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("hqk,hkd->qhd", p / p.sum(-1, keepdims=True), v)


def _check_step(step, out, mask, *, tol=2e-5, **kwargs):
    """Every live sequence of `step` against its own computation; dead rows zero."""
    out = np.asarray(out, np.float32)
    for s, (q_len, kv_len) in enumerate(step.lengths):
        rows = out[step.cu_q_lens[s]:step.cu_q_lens[s] + q_len]
        q, k, v = step.sequence(s)
        if q_len == 0:
            assert _rows_of(mask, s).shape[1] == 0
            continue
        if q_len < BLOCK:  # dense over its keys
            np.testing.assert_allclose(rows, _dense_causal(q, k, v), atol=tol, rtol=tol)
            continue
        first = kv_len - q_len
        if first % BLOCK == 0:
            want, want_mask = xattn_jax.xattention(jnp.asarray(q), jnp.asarray(k),
                                                   jnp.asarray(v), return_mask=True,
                                                   impl="reference", **OPTIONS, **kwargs)
            got_mask = _rows_of(mask, s)
            kb = want_mask.shape[-1]
            np.testing.assert_array_equal(got_mask[:, :, :kb], np.asarray(want_mask[0]))
            assert not got_mask[:, :, kb:].any()
            np.testing.assert_allclose(rows, np.asarray(want[0]).transpose(1, 0, 2),
                                       atol=tol, rtol=tol)
    assert not np.abs(out[step.cu_q_lens[step.num_seqs]:]).any()


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**32 - 1), count=st.integers(1, 5), spare_slots=st.integers(0, 2),
       spare_tokens=st.integers(0, 7), page_size=st.sampled_from([8, 16, 48]),
       shared=st.integers(0, 1))
def test_each_sequence_equals_its_own_call(seed, count, spare_slots, spare_tokens,
                                           page_size, shared):
    """Random mixed steps: decode rows, short chunks, aligned and unaligned chunks, empty
    sequences, num_seqs < S, kv_len off page boundaries, shuffled and shared pages."""
    rng = np.random.default_rng(seed)
    lengths = random_lengths(rng, count, block_size=BLOCK, max_kv=200)
    step = make_step(rng, lengths, page_size=page_size, spare_slots=spare_slots,
                     spare_tokens=spare_tokens, shared_prefix_pages=shared)
    out, mask = _run(step, impl="reference")
    _check_step(step, out, mask)


def _unaligned_expected(step, s, threshold):
    """Sequence s's mask rows `[Hq, blocks, KB]` from docs/estimate.md's rule in float64:
    the chunk padded at its front with zero queries to its first block, rows holding no
    query of the chunk dropped from the sums, then section 4 (no widening)."""
    q_len, kv_len = step.lengths[s]
    q, k, _ = step.sequence(s)
    first = kv_len - q_len
    start = first // BLOCK * BLOCK
    padded = np.zeros((1, q.shape[1], kv_len - start, q.shape[3]))
    padded[:, :, first - start:] = npr.f64(q)
    p = npr.probabilities(padded, k, stride=STRIDE, block_size=BLOCK, causal=True)
    empty_rows = (first - start) // STRIDE  # rows before the chunk's first group
    p[:, :, :empty_rows] = 0.0
    n = BLOCK // STRIDE
    b, h, rows, cols = p.shape
    sums = p.reshape(b, h, rows // n, n, cols // n, n).sum(axis=(3, 5))
    return sums, npr.select(sums, threshold, causal=True)


@pytest.mark.parametrize("lengths", [[(70, 150)], [(45, 90), (33, 200), (1, 9)]])
def test_unaligned_chunks_follow_the_partial_block_rule(rand, lengths):
    """Chunks starting inside a block: the first query block is estimated from the rows
    of the chunk alone, and selects as section 4 says."""
    step = make_step(rand.rng, lengths, page_size=16)
    threshold = 0.8
    out, mask = _run(step, impl="reference", threshold=threshold, min_blocks=0,
                     dense_last=0)
    for s, (q_len, kv_len) in enumerate(lengths):
        if q_len < BLOCK:
            continue
        sums, want = _unaligned_expected(step, s, threshold)
        got = _rows_of(mask, s)
        npr.assert_masks_agree(got[None, :, :, :want.shape[-1]], want, sums, threshold,
                               causal=True)
        assert not got[:, :, want.shape[-1]:].any()


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**32 - 1), count=st.integers(1, 4), page_size=st.sampled_from([8, 48]))
def test_sampled_rows_each_sequence_equals_its_own_call(seed, count, page_size):
    """estimate="sampled-rows": aligned chunks select and attend as `xattention` with the
    same estimate on that sequence alone."""
    rng = np.random.default_rng(seed)
    step = make_step(rng, random_lengths(rng, count, block_size=BLOCK, max_kv=200),
                     page_size=page_size, spare_slots=1)
    out, mask = _run(step, impl="reference", estimate="sampled-rows")
    _check_step(step, out, mask, estimate="sampled-rows")


def _sampled_expected(step, s, threshold):
    """Sequence s's sampled-rows block scores `[1, Hq, blocks, KB]` and mask in float64:
    16 rows per query block, the last of 16 equal parts of its positions inside the
    chunk, each row's exact softmax summed per key block (docs/estimate.md)."""
    q_len, kv_len = step.lengths[s]
    q, k, _ = (npr.f64(x)[0] for x in step.sequence(s))
    first, rows = kv_len - q_len, 16
    k = np.repeat(k, q.shape[0] // k.shape[0], axis=0)
    kb = -(-kv_len // BLOCK)
    blocks = range(first // BLOCK, (kv_len - 1) // BLOCK + 1)
    sums = np.zeros((1, q.shape[0], len(blocks), kb))
    for i, b in enumerate(blocks):
        low, high = max(b * BLOCK, first), min((b + 1) * BLOCK, kv_len)
        for position in low + np.maximum(np.arange(1, rows + 1) * (high - low) // rows - 1, 0):
            scores = k[:, :position + 1] @ q[:, position - first, :, None]  # [Hq, keys, 1]
            p = np.exp(scores[..., 0] / np.sqrt(q.shape[-1]))
            p = np.pad(p / p.sum(-1, keepdims=True), ((0, 0), (0, kb * BLOCK - position - 1)))
            sums[0, :, i] += p.reshape(q.shape[0], kb, BLOCK).sum(-1)
    return sums, npr.select(sums, threshold, causal=True)


@pytest.mark.parametrize("lengths", [[(70, 150)], [(45, 90), (33, 200), (1, 9)]])
def test_sampled_rows_of_unaligned_chunks_spread_over_the_chunk(rand, lengths):
    """Chunks starting or ending inside a block: each block's sampled rows are spread
    over its queries inside the chunk."""
    step = make_step(rand.rng, lengths, page_size=16)
    threshold = 0.8
    _, mask = _run(step, impl="reference", threshold=threshold, min_blocks=0,
                   dense_last=0, estimate="sampled-rows")
    for s, (q_len, _) in enumerate(lengths):
        if q_len < BLOCK:
            continue
        sums, want = _sampled_expected(step, s, threshold)
        got = _rows_of(mask, s)
        npr.assert_masks_agree(got[None, :, :, :want.shape[-1]], want, sums, threshold,
                               causal=True)
        assert not got[:, :, want.shape[-1]:].any()


def test_decode_only_and_prefill_only_steps(rand):
    decode = make_step(rand.rng, [(1, 40), (1, 7), (1, 130)], spare_slots=1)
    _check_step(decode, *_run(decode, impl="reference", decode_seqs=3))
    prefill = make_step(rand.rng, [(64, 64), (96, 160)], spare_tokens=3)
    _check_step(prefill, *_run(prefill, impl="reference"))


def test_fused_cache_equals_separate_caches(rand):
    step = make_step(rand.rng, [(64, 96), (1, 20), (50, 120)])
    separate = ragged_xattention(*step.args(), impl="reference", **OPTIONS)
    fused = ragged_xattention(*step.args(k=step.fused(), v=None), impl="reference",
                              **OPTIONS)
    np.testing.assert_array_equal(np.asarray(fused), np.asarray(separate))


def test_threshold_per_head_and_widening_follow_xattention(rand):
    step = make_step(rand.rng, [(96, 128), (64, 192)])
    threshold = np.linspace(0.5, 0.99, 4).astype(np.float32)
    out, mask = _run(step, impl="reference", threshold=threshold, min_blocks=2,
                     dense_last=0)
    _check_step(step, out, mask, threshold=threshold, min_blocks=2, dense_last=0)


def test_one_compilation_per_bucket(rand):
    """Twelve random steps of one bucket (T, S, pages per sequence): one compilation."""
    template = make_step(rand.rng, [(80, 100)], spare_tokens=80, spare_slots=3,
                         pages_per_seq=16)
    call = jax.jit(lambda *args: ragged_xattention(*args, impl="reference", **OPTIONS))
    for _ in range(12):
        count = int(rand.rng.integers(1, 5))
        lengths = random_lengths(rand.rng, count, block_size=BLOCK, max_kv=200)
        while sum(q for q, _ in lengths) > template.q.shape[0]:
            lengths = lengths[:-1]
        step = make_step(rand.rng, lengths, page_size=16, pages_per_seq=16,
                         spare_slots=4 - len(lengths),
                         spare_tokens=template.q.shape[0] - sum(q for q, _ in lengths))
        out = call(*step.args())
        _check_step(step, out, _run(step, impl="reference")[1])
    assert call._cache_size() == 1


def _bad(step, **changes):
    args = dict(zip(("q", "k", "v", "kv_lens", "page_indices", "cu_q_lens", "num_seqs"),
                    step.args()))
    args.update(changes)
    return args


@pytest.mark.parametrize("change, error, match", [
    (lambda s: dict(cu_q_lens=s.cu_q_lens[::-1].copy()), ValueError, "cu_q_lens"),
    (lambda s: dict(cu_q_lens=s.cu_q_lens + np.int32(s.q.shape[0])), ValueError,
     "cu_q_lens"),
    (lambda s: dict(kv_lens=np.maximum(s.kv_lens - 60, 0).astype(np.int32)), ValueError,
     "at most its kv_lens"),
    (lambda s: dict(page_indices=np.full_like(s.page_indices, s.k.shape[0])), ValueError,
     "page_indices"),
    (lambda s: dict(num_seqs=s.kv_lens.shape[0] + 1), ValueError, "num_seqs"),
    (lambda s: dict(num_seqs=1.5), TypeError, "num_seqs"),
    (lambda s: dict(q=s.q.astype(np.float16)), ValueError, "dtype"),
    (lambda s: dict(q=s.q[:, :3]), ValueError, "multiple of the cache's KV heads"),
    (lambda s: dict(q=s.q[None]), ValueError, "rank 3"),
    (lambda s: dict(v=s.v[:, :, :1]), ValueError, "v must have k's pages"),
    (lambda s: dict(k=s.k[..., :8]), ValueError, "head_dim"),
    (lambda s: dict(kv_lens=s.kv_lens.astype(np.float32)), ValueError, "integers"),
    (lambda s: dict(cu_q_lens=s.cu_q_lens[:-1]), ValueError, "cu_q_lens must have shape"),
    (lambda s: dict(kv_lens=s.kv_lens + np.int32(10_000)), ValueError, "capacity"),
])
def test_bad_inputs_name_the_argument(rand, change, error, match):
    step = make_step(rand.rng, [(64, 100), (1, 30)])
    with pytest.raises(error, match=match):
        ragged_xattention(**_bad(step, **change(step)), impl="reference", **OPTIONS)


def test_bad_options_name_the_argument(rand):
    step = make_step(rand.rng, [(64, 100)])
    with pytest.raises(ValueError, match="threshold"):
        ragged_xattention(*step.args(), threshold=1.5, **OPTIONS)
    with pytest.raises(ValueError, match="block_size"):
        ragged_xattention(*step.args(), block_size=20, stride=8)
    with pytest.raises(ValueError, match="decode_seqs"):
        ragged_xattention(*step.args(), decode_seqs=1, **OPTIONS)
    with pytest.raises(ValueError, match="impl"):
        ragged_xattention(*step.args(), impl="cuda", **OPTIONS)
    with pytest.raises(ValueError, match="estimate"):
        ragged_xattention(*step.args(), estimate="exact", **OPTIONS)
    with pytest.raises(ValueError, match="block_size must be at least 16"):
        ragged_xattention(*step.args(), estimate="sampled-rows", block_size=8, stride=8)


def test_traced_offsets_are_checked_in_checked_mode(rand):
    step = make_step(rand.rng, [(64, 100), (1, 30)])
    bad_kv = np.array([40, 30], np.int32)  # fewer keys than queries

    def call(kv_lens):
        return ragged_xattention(*step.args(kv_lens=kv_lens), impl="reference", **OPTIONS)

    err, _ = jax.jit(xattn_jax.checked(call))(jnp.asarray(step.kv_lens))
    err.throw()  # the valid step passes
    err, _ = jax.jit(xattn_jax.checked(call))(jnp.asarray(bad_kv))
    with pytest.raises(Exception, match="offsets break the rules"):
        err.throw()


@pytest.mark.slow
@pytest.mark.parametrize("estimate", ["antidiagonal", "sampled-rows"])
def test_triton_block_sums_equal_the_reference_in_interpret_mode(rand, estimate):
    from xattn_jax.ragged.checks import check_step
    from xattn_jax.ragged.geometry import RaggedSampledGeometry
    from xattn_jax.ragged.layout import ragged_blocks
    from xattn_jax.reference import ragged as reference_ragged
    from xattn_jax.triton import ragged_block_sums as triton_ragged
    from xattn_jax.triton.plan import Tiles

    step = make_step(rand.rng, [(64, 160), (1, 50), (70, 150), (40, 90)], head_dim=32)
    geom, kv_lens, table, cu, num_seqs, decode = check_step(
        *step.args(), None, block_size=BLOCK, stride=STRIDE)
    blocks = ragged_blocks(jnp.asarray(cu), jnp.asarray(kv_lens), num_seqs, decode, geom)
    tiles = Tiles(block_q=16, block_k=16, block_d=16)
    if estimate == "sampled-rows":  # 16 rows per block, key tiles of one block
        geom, tiles = RaggedSampledGeometry.of(geom, 16, 0.3), Tiles(16, BLOCK, 16)
    want = reference_ragged.block_sums(jnp.asarray(step.q), jnp.asarray(step.k),
                                       jnp.asarray(table), blocks, geom, norm=1.0)
    plan = triton_ragged.plan_ragged(geom, step.q.dtype, interpret=True, programs=3,
                                     tiles=tiles)
    got = triton_ragged.ragged_block_sums(jnp.asarray(step.q), jnp.asarray(step.k),
                                          jnp.asarray(table), blocks, plan=plan, norm=1.0)
    rows = np.asarray(blocks.estimated[blocks.row_seq] & blocks.row_live)
    assert rows.sum() == 7
    np.testing.assert_allclose(np.asarray(got)[:, rows], np.asarray(want)[:, rows],
                               rtol=1e-5, atol=1e-6, err_msg=str(rand))


DEVICES = 4


@pytest.mark.skipif(len(jax.devices()) < DEVICES, reason="needs 4 devices (conftest.py)")
@pytest.mark.parametrize("fused, kv_heads", [(False, 2), (True, 2), (True, 4)])
def test_partitions_over_heads_under_jit(rand, partitioner, fused, kv_heads):
    """Heads sharded 4 ways: whole KV groups (4 KV heads) or inside one (2 KV heads, a
    fused cache's K/V pairs kept together): each device computes its own heads, with no
    collective for head-sharded inputs; the result is the one-device result."""
    step = make_step(rand.rng, [(64, 96), (1, 20), (40, 72)], q_heads=8,
                     kv_heads=kv_heads)
    mesh = Mesh(np.array(jax.devices()[:DEVICES]), ("h",))
    k, v = (step.fused(), None) if fused else (step.k, step.v)
    whole = ragged_xattention(*step.args(k=k, v=v), impl="reference", **OPTIONS)
    q = jax.device_put(step.q, NamedSharding(mesh, P(None, "h")))
    def put(cache):  # sharded over its head axis where that divides it
        spec = P(None, None, "h") if cache.shape[2] % DEVICES == 0 else P()
        return jax.device_put(cache, NamedSharding(mesh, spec))

    k, v = put(k), (None if v is None else put(v))
    call = jax.jit(lambda q, k, v: ragged_xattention(*step.args(q=q, k=k, v=v),
                                                     impl="reference", **OPTIONS))
    out = call(q, k, v)
    assert out.sharding.spec[:2] == (None, "h")
    if kv_heads % DEVICES == 0:
        text = call.lower(q, k, v).compile().as_text()
        assert not [c for c in ("all-gather", "all-reduce", "all-to-all") if c in text]
    np.testing.assert_allclose(np.asarray(out), np.asarray(whole), rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(len(jax.devices()) < DEVICES, reason="needs 4 devices (conftest.py)")
def test_inside_shard_map_on_data_parallel_groups(rand):
    """shard_map over 2 groups of sequences x 2 head shards: each device runs its
    group's step on its heads, as engines call their kernels."""
    steps = [make_step(rand.rng, lengths, q_heads=4, kv_heads=2, pages_per_seq=8,
                       spare_tokens=96 - sum(q for q, _ in lengths))
             for lengths in ([(64, 100), (1, 33)], [(32, 64), (40, 120)])]
    stack = [np.stack(parts) for parts in zip(*(s.args() for s in steps))]
    mesh = Mesh(np.array(jax.devices()[:DEVICES]).reshape(2, 2), ("dp", "h"))

    def local(q, k, v, kv_lens, table, cu, n):
        out = ragged_xattention(q[0], k[0], v[0], kv_lens[0], table[0], cu[0], n[0],
                                impl="reference", **OPTIONS)
        return out[None]

    specs = (P("dp", None, "h"), P("dp", None, None, "h"), P("dp", None, None, "h"),
             P("dp"), P("dp"), P("dp"), P("dp"))
    mapped = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=specs,
                                   out_specs=P("dp", None, "h"), check_vma=False))
    out = mapped(*(jnp.asarray(x) for x in stack))
    for group, step in enumerate(steps):
        want = ragged_xattention(*step.args(), impl="reference", **OPTIONS)
        np.testing.assert_allclose(np.asarray(out[group]), np.asarray(want), rtol=1e-6,
                                   atol=1e-6)


needs_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("page_size, fused, estimate", [(16, False, "antidiagonal"),
                                                        (128, True, "antidiagonal"),
                                                        (16, True, "sampled-rows")])
def test_kernels_equal_the_reference_on_gpu(rand, page_size, fused, estimate):
    """A bf16 step of Llama-like heads (Hq 32, Hkv 8, D 128, block 128): the auto
    implementation's block sums and output against the reference's."""
    from xattn_jax import impls
    from xattn_jax.ragged.checks import check_step
    from xattn_jax.ragged.layout import ragged_blocks

    lengths = [(1, 700), (1, 3000), (512, 2048), (700, 2500), (300, 300), (2048, 4096)]
    step = make_step(rand.rng, lengths, q_heads=32, kv_heads=8, head_dim=128,
                     page_size=page_size, spare_slots=2, spare_tokens=40,
                     dtype=jnp.bfloat16, scale=1.0)
    options = dict(block_size=128, stride=8)
    k, v = (step.fused(), None) if fused else (step.k, step.v)
    args = step.args(k=k, v=v)
    geom, kv_lens, table, cu, num_seqs, decode = check_step(*args, None, **options)
    blocks = ragged_blocks(jnp.asarray(cu), jnp.asarray(kv_lens), num_seqs, decode, geom)
    cache = ragged_api._fused_pairs(jnp.asarray(k)) if fused else jnp.asarray(k)
    scores = ragged_api.estimate_geometry(geom, estimate, 128 ** -0.5)
    auto = impls.resolve_ragged("auto", jnp.asarray(step.q)).for_step(
        geom, step.q.dtype, estimate_geom=scores).estimate
    assert auto.name in ("mosaic", "triton")
    got, want = (impl.ragged_block_sums(jnp.asarray(step.q), cache, jnp.asarray(table),
                                        blocks, scores, norm=1.0)
                 for impl in (auto, impls.resolve("reference")))
    rows = np.asarray(blocks.estimated[blocks.row_seq] & blocks.row_live)
    np.testing.assert_allclose(np.asarray(got)[:, rows], np.asarray(want)[:, rows],
                               rtol=2e-4, atol=2e-5, err_msg=str(rand))
    out, mask = ragged_xattention(*args, return_mask=True, estimate=estimate, **options)
    want_out, want_mask = ragged_xattention(*args, return_mask=True, impl="reference",
                                            estimate=estimate, **options)
    differ = np.asarray(mask.blocks != want_mask.blocks)
    assert differ.sum() <= 0.001 * differ.size, f"{differ.sum()} blocks differ; {rand}"
    same_rows = ~differ.any(axis=(0, 2))
    token_rows = np.zeros(step.q.shape[0], bool)  # the rows whose blocks agree
    for row in np.flatnonzero(same_rows & np.asarray(blocks.row_live)):
        s = int(blocks.row_seq[row])
        first = int(blocks.kv_lens[s] - blocks.q_lens[s])
        lo = max(int(blocks.row_block[row]) * 128, first) - first + int(blocks.q_starts[s])
        hi = min((int(blocks.row_block[row]) + 1) * 128, int(blocks.kv_lens[s])) - first \
            + int(blocks.q_starts[s])
        token_rows[lo:hi] = True
    np.testing.assert_allclose(np.asarray(out, np.float32)[token_rows],
                               np.asarray(want_out, np.float32)[token_rows],
                               rtol=2e-2, atol=2e-2, err_msg=str(rand))


@pytest.mark.parametrize("estimate", ["antidiagonal", "sampled-rows"])
def test_triton_block_sums_lower_for_cuda(estimate):
    """A bf16 step of Llama-like heads on 16-token pages, 128K keys per sequence, lowered
    for an H200 without a GPU."""
    from lowering import lower_for_an_h200
    from xattn_jax.ragged.geometry import RaggedGeometry, RaggedSampledGeometry
    from xattn_jax.ragged.layout import ragged_blocks
    from xattn_jax.triton.backend import TritonBackend

    seqs, pages_per_seq = 8, 8192
    geom = RaggedGeometry(tokens=8256, seqs=seqs, q_heads=32, kv_heads=8, head_dim=128,
                          value_dim=128, num_pages=seqs * pages_per_seq, page_size=16,
                          pages_per_seq=pages_per_seq, block_size=128, stride=8,
                          fused=False)
    if estimate == "sampled-rows":
        geom = RaggedSampledGeometry.of(geom, 16, 128 ** -0.5)
    spec = jax.ShapeDtypeStruct
    args = (spec((geom.tokens, 32, 128), jnp.bfloat16),
            spec((geom.num_pages, 16, 8, 128), jnp.bfloat16),
            spec((seqs, pages_per_seq), jnp.int32), spec((seqs + 1,), jnp.int32),
            spec((seqs,), jnp.int32))

    def call(q, k, table, cu_q_lens, kv_lens):
        blocks = ragged_blocks(cu_q_lens, kv_lens, jnp.int32(seqs), jnp.int32(0), geom)
        return TritonBackend().ragged_block_sums(q, k, table, blocks, geom, norm=1.0)

    assert "__gpu$xla.gpu.triton" in lower_for_an_h200(call, *args)


def test_triton_refuses_blocks_its_tiles_do_not_hold():
    from xattn_jax.ragged.geometry import RaggedGeometry, RaggedSampledGeometry
    from xattn_jax.triton.ragged_block_sums import unsupported_reason

    geom = RaggedGeometry(tokens=512, seqs=4, q_heads=4, kv_heads=2, head_dim=64,
                          value_dim=64, num_pages=64, page_size=16, pages_per_seq=16,
                          block_size=128, stride=8, fused=False)
    for dtype in (jnp.bfloat16, jnp.float32):  # float32's key tiles widened to a block
        assert unsupported_reason(geom, dtype) is None
        assert unsupported_reason(RaggedSampledGeometry.of(geom, 16, 0.125), dtype) is None
    odd = RaggedSampledGeometry.of(dataclasses.replace(geom, block_size=96), 16, 0.125)
    assert "key blocks' columns divide 256; got 16 and 96" in unsupported_reason(
        odd, jnp.bfloat16)


@pytest.mark.slow
def test_triton_selection_with_row_diagonals_equals_the_reference(rand):
    from xattn_jax.reference.estimate import select_blocks as reference_select
    from xattn_jax.triton import select_blocks as triton_select
    from xattn_jax.triton.plan import plan_select_blocks

    sums = rand.block_sums((1, 3, 9, 13), zeros=0.2)
    threshold = rand.thresholds(3)
    diagonal = jnp.asarray(rand.rng.integers(0, 13, 9), jnp.int32)
    plan = plan_select_blocks(sums.shape, causal=False, interpret=True)
    got = triton_select.select_blocks(sums, threshold, plan=plan, causal=True,
                                      diagonal=diagonal)
    want = reference_select(sums, threshold, causal=True, diagonal=diagonal)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=str(rand))


@pytest.mark.slow
@pytest.mark.parametrize("estimate", ["antidiagonal", "sampled-rows"])
def test_triton_step_equals_the_reference_in_interpret_mode(rand, estimate):
    """The whole call with the Triton-backend estimate (block sums and selection)."""
    step = make_step(rand.rng, [(64, 96), (1, 20), (40, 72)], head_dim=32)
    out, mask = _run(step, impl="triton", estimate=estimate)
    want_out, want_mask = _run(step, impl="reference", estimate=estimate)
    np.testing.assert_array_equal(np.asarray(mask.blocks), np.asarray(want_mask.blocks))
    np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), rtol=1e-5, atol=1e-5)
