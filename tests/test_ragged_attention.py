"""The ragged step's attention on the Mosaic GPU kernel (`xattn_jax.mosaic.attention.ragged_attention`)
against `reference.ragged.attention` (docs/estimate.md section 6, "Ragged steps").

On CPU:
- `compact_tiles` (cumulative sum and scatter) equals a stable argsort;
- the work table against a direct computation from the reference's semantics: every row of
  q stored by exactly one warpgroup, at its key position, in its query block; each (slot,
  head)'s key tiles the selected and causally visible ones, ascending; the unmasked
  prefixes; the zero slots;
- the work table walked the way the kernel walks it (listed tiles only, the per-element
  mask only past each warpgroup's unmasked prefix, pages read as the producer reads them)
  gives the reference;
- the plan's refusals;
- where Mosaic GPU imports (jax >= 0.11): the kernel lowers for CUDA, and tiny steps run
  in Pallas' GPU interpret mode (tests/mosaic_interpret.py).
Marked `gpu` (skipped unless `xattn_jax.mosaic.available()` is None): the compiled kernel
on bigger random steps, Llama-3.1-8B's heads among them.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import mosaic_interpret
import numpy as np
import pytest
from np_attention import masked_softmax_attention

from bench.ragged_attention_steps import RaggedStep, step_arrays
from xattn_jax import mosaic
from xattn_jax.mosaic.attention import ragged_work as work
from xattn_jax.mosaic.attention.ragged_attention import ragged_attention
from xattn_jax.mosaic.attention.ragged_plan import ragged_plan, unsupported_reason
from xattn_jax.reference import ragged as reference

needs_hopper = pytest.mark.skipif(mosaic.available() is not None,
                                  reason=str(mosaic.available()))


def _mosaic_gpu_import_error() -> str | None:
    try:
        from jax.experimental.pallas import mosaic_gpu  # noqa: F401
    except Exception as error:  # this jax cannot build Mosaic GPU kernels at all
        return repr(error)
    return None


def reference_out(arrays) -> np.ndarray:
    """float64 `[T, Hq, D]`: `reference.ragged.attention` on the step (scale 1/sqrt(D))."""
    keys, values = reference.split_cache(arrays.k, arrays.v)
    out = reference.attention(arrays.q, keys, values, arrays.page_indices, arrays.mask,
                              arrays.blocks, arrays.geom,
                              scale=arrays.geom.head_dim ** -0.5)
    return np.asarray(out.astype(jnp.float32), np.float64)


def _np(x) -> np.ndarray:
    """A floating array as float64 numpy."""
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


# steps of every kind, D 64 (key tiles of 128) unless said: decode rows, chunks starting
# inside a block, an empty sequence (q_len 0), slots past num_seqs, rows past the
# sequences', GQA, pages smaller and larger than a key tile, blocks of 256; decode rows
# only, one slot each
WALK_STEPS = [
    RaggedStep("mixed-page16", (1, 70, 0, 200, 5), (300, 133, 50, 260, 40), tokens=300,
               seqs=6, q_heads=2, kv_heads=1, head_dim=64, page_size=16,
               pages_per_seq=24, num_seqs=4),
    RaggedStep("chunks-page128-dense", (130, 1, 257), (640, 77, 257), tokens=400, seqs=4,
               q_heads=4, kv_heads=2, head_dim=64, page_size=128, pages_per_seq=5,
               density=1.0),
    RaggedStep("blocks256-page32", (300, 1, 1, 90), (900, 1000, 3, 95), tokens=512,
               seqs=4, q_heads=2, kv_heads=2, head_dim=64, page_size=32, pages_per_seq=32,
               block_size=256, density=0.6),
    RaggedStep("d256-page64-fused", (64, 129, 1), (64, 400, 500), tokens=200, seqs=3,
               q_heads=4, kv_heads=1, head_dim=256, page_size=64, pages_per_seq=8,
               fused=True),
    RaggedStep("few-rows", (3, 1), (3, 700), tokens=8, seqs=2, q_heads=2, kv_heads=1,
               head_dim=128, page_size=256, pages_per_seq=3),
    RaggedStep("decode-only", (1,) * 70, tuple(range(5, 705, 10)), tokens=70, seqs=70,
               q_heads=2, kv_heads=1, head_dim=64, page_size=16, pages_per_seq=48),
]


def test_compact_tiles_is_a_stable_argsort(rand):
    visit = rand.rng.random((3, 5, 37)) < rand.rng.random((3, 5, 1))
    tiles, through = work.compact_tiles(jnp.asarray(visit))
    np.testing.assert_array_equal(np.asarray(tiles),
                                  np.argsort(~visit, axis=-1, kind="stable"), str(rand))
    np.testing.assert_array_equal(np.asarray(through), np.cumsum(visit, axis=-1), str(rand))


def _stored_rows(slots: np.ndarray, plan):
    """Per active slot, per warpgroup: (tokens stored, the key position of each)."""
    for slot, row in enumerate(slots):
        if not row[work.ACTIVE]:
            continue
        for w in range(plan.compute_warpgroups):
            load, position, begin, count = row[work.SLOT_FIELDS + w * work.WG_FIELDS:][
                :work.WG_FIELDS]
            rows = np.arange(begin, begin + count)
            yield slot, w, load + rows, position + rows


@pytest.mark.slow
@pytest.mark.parametrize("step", WALK_STEPS, ids=lambda s: s.id)
def test_work_table_follows_the_reference_semantics(rand, step):
    arrays = step_arrays(step, rand.rng)
    geom, blocks = arrays.geom, jax.tree.map(np.asarray, arrays.blocks)
    plan = ragged_plan(geom, step.dtype)
    lists = jax.tree.map(np.asarray, work.ragged_work(arrays.mask, arrays.blocks, geom, plan))
    mask, bs, bkv = np.asarray(arrays.mask), geom.block_size, plan.block_kv
    used = int(blocks.q_starts[-1] + blocks.q_lens[-1])
    stored = np.zeros(work.kernel_rows(geom, plan), int)
    mask_rows, last_position = {}, {}  # per live slot: its rows' query blocks, last key
    for slot, w, tokens, positions in _stored_rows(lists.slots, plan):
        stored[tokens] += 1
        steps = lists.counts[:, slot, 0]
        if tokens.size and tokens[0] >= used:  # a zero slot: no key tile, so zeros
            assert (steps == 0).all(), str(rand)
            continue
        if not tokens.size:
            continue
        seq = int(lists.slots[slot, work.SEQ])
        assert ((tokens >= blocks.q_starts[seq])
                & (tokens < blocks.q_starts[seq] + blocks.q_lens[seq])).all(), str(rand)
        np.testing.assert_array_equal(
            positions, blocks.first_position[seq] + tokens - blocks.q_starts[seq], str(rand))
        rows = blocks.cu_q_blocks[seq] + positions // bs - blocks.first_block[seq]
        mask_rows.setdefault(slot, set()).update(rows.tolist())
        last_position[slot] = max(last_position.get(slot, -1), int(positions.max()))
        for h in range(geom.q_heads):  # the unmasked prefix: tiles ending before the rows
            listed = lists.tiles[h, slot, :steps[h]]
            want = np.sum((listed + 1) * bkv - 1 <= positions.min())
            assert lists.counts[h, slot, 1 + w] == want, str(rand)
    assert (stored[:geom.tokens] == 1).all(), str(rand)
    for slot, rows in mask_rows.items():
        (row,) = rows  # a CTA's rows lie in one query block
        tile = np.arange(lists.tiles.shape[-1])
        for h in range(geom.q_heads):
            want = tile[mask[h, row, tile * bkv // bs] & (tile * bkv <= last_position[slot])]
            np.testing.assert_array_equal(lists.tiles[h, slot, :lists.counts[h, slot, 0]],
                                          want, str(rand))


def _sequence_cache(cache, table, last_entry, geom, page_size, length):
    """float64 `[length, Hkv, ...]` of one sequence read as the producer reads it: page
    table entries clamped to the sequence's last page in use."""
    position = np.arange(length)
    entry = np.minimum(position // page_size, last_entry)
    return np.asarray(cache, np.float64)[table[entry], position % page_size]


def walk_work_table(arrays, plan) -> np.ndarray:
    """float64 `[T, Hq, D]`: what the kernel computes from the work table, per active
    slot, head and warpgroup: its box of q rows against its listed key tiles, the
    per-element causal mask past its unmasked prefix, its real rows stored."""
    geom = arrays.geom
    lists = jax.tree.map(np.asarray, work.ragged_work(arrays.mask, arrays.blocks, geom,
                                                      plan))
    q = _np(arrays.q)
    rows = work.kernel_rows(geom, plan)
    q = np.pad(q, ((0, rows - geom.tokens), (0, 0), (0, 0)))
    if geom.fused:
        keys, values = _np(arrays.k)[:, :, :, 0], _np(arrays.k)[:, :, :, 1]
    else:
        keys, values = _np(arrays.k), _np(arrays.v)
    table = np.asarray(arrays.page_indices)
    bq, bkv, group = plan.block_q, plan.block_kv, geom.group
    length = lists.tiles.shape[-1] * bkv
    out = np.zeros((rows, geom.q_heads, geom.head_dim))
    for slot, row in enumerate(lists.slots):
        if not row[work.ACTIVE]:
            continue
        seq, last_entry = row[work.SEQ], row[work.LAST_ENTRY]
        k_seq, v_seq = (_sequence_cache(x, table[seq], last_entry, geom, geom.page_size,
                                        length) for x in (keys, values))
        for h in range(geom.q_heads):
            steps = lists.counts[h, slot, 0]
            listed = lists.tiles[h, slot, :steps]
            key = (listed[:, None] * bkv + np.arange(bkv)).reshape(-1)
            for w in range(plan.compute_warpgroups):
                load, position, begin, count = row[work.SLOT_FIELDS + w * work.WG_FIELDS:][
                    :work.WG_FIELDS]
                masked = np.repeat(np.arange(steps) >= lists.counts[h, slot, 1 + w], bkv)
                visible = key[None, :] <= position + np.arange(bq)[:, None]
                scores = q[load:load + bq, h] @ k_seq[key, h // group].T / np.sqrt(
                    geom.head_dim)
                box, _ = masked_softmax_attention(scores, ~masked[None, :] | visible,
                                                  v_seq[key, h // group])
                out[load + begin:load + begin + count, h] = box[begin:begin + count]
    return out[:geom.tokens]


@pytest.mark.parametrize("step", WALK_STEPS, ids=lambda s: s.id)
def test_work_table_walk_equals_reference(rand, step):
    step = dataclasses.replace(step, dtype=jnp.float32)
    arrays = step_arrays(step, rand.rng)
    plan = ragged_plan(arrays.geom, jnp.bfloat16)  # the tiles planned for bfloat16
    np.testing.assert_allclose(walk_work_table(arrays, plan), reference_out(arrays),
                               rtol=1e-5, atol=1e-5, err_msg=str(rand))


@pytest.mark.parametrize("change, rule", [
    (dict(head_dim=96, value_dim=96), "head_dim in"),
    (dict(value_dim=64), "v's head dim"),
    (dict(block_size=64), "block_size a multiple of 128"),
    (dict(page_size=8), "got page_size 8"),
    (dict(page_size=48), "got page_size 48"),
    (dict(page_size=192), "got page_size 192"),
])
def test_plan_refuses_unsupported_steps(change, rule):
    geom = dataclasses.replace(WALK_STEPS[1].geom(), head_dim=128, value_dim=128)
    assert unsupported_reason(geom, jnp.bfloat16) is None
    for size in (16, 32, 64, 128, 256, 4096):
        assert unsupported_reason(dataclasses.replace(geom, page_size=size),
                                  jnp.float16) is None
    assert "bfloat16 or float16" in unsupported_reason(geom, jnp.float32)
    reason = unsupported_reason(dataclasses.replace(geom, **change), jnp.bfloat16)
    assert reason is not None and rule in reason
    with pytest.raises(ValueError, match=rule):
        ragged_plan(dataclasses.replace(geom, **change), jnp.bfloat16)


# --- the kernel -------------------------------------------------------------------------


def _abstract_step(step: RaggedStep):
    """The kernel's inputs of `step` as shapes and dtypes, the layout computed from
    traced offsets, to lower without data."""
    geom = step.geom()
    shape = jax.ShapeDtypeStruct
    pages = (geom.num_pages, geom.page_size, geom.kv_heads)
    k = shape(pages + ((2,) if geom.fused else ()) + (geom.head_dim,), step.dtype)
    v = None if geom.fused else shape(pages + (geom.head_dim,), step.dtype)
    inputs = (shape((geom.tokens, geom.q_heads, geom.head_dim), step.dtype), k, v,
              shape((geom.seqs, geom.pages_per_seq), jnp.int32),
              shape((geom.q_heads, geom.q_block_rows, geom.k_blocks), jnp.bool_),
              shape((geom.seqs + 1,), jnp.int32), shape((geom.seqs,), jnp.int32),
              shape((), jnp.int32))

    def call(q, k, v, table, mask, cu_q_lens, kv_lens, num_seqs):
        from xattn_jax.ragged.layout import ragged_blocks
        blocks = ragged_blocks(cu_q_lens, kv_lens, num_seqs, jnp.int32(0), geom)
        return ragged_attention(q, k, v, table, mask, blocks, geom,
                                scale=geom.head_dim ** -0.5)

    return call, inputs


@pytest.mark.skipif(_mosaic_gpu_import_error() is not None,
                    reason=f"Mosaic GPU does not import: {_mosaic_gpu_import_error()}")
@pytest.mark.parametrize("page_size", [16, 128])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_kernel_lowers_for_cuda(page_size, fused, head_dim):
    """Without a GPU: Mosaic GPU's lowering (layout inference included, for sm_90) accepts
    the kernel and the module holds its custom call (GQA 4:2, bfloat16, 300 rows of q:
    boxes at any row)."""
    step = RaggedStep("lowering", (1, 299), (900, 299), tokens=300, seqs=3, q_heads=4,
                      kv_heads=2, head_dim=head_dim, page_size=page_size,
                      pages_per_seq=1024 // page_size, fused=fused)
    call, inputs = _abstract_step(step)
    lowered = jax.jit(call).trace(*inputs).lower(lowering_platforms=("cuda",))
    assert "stablehlo.custom_call @mosaic_gpu" in lowered.as_text()


@pytest.mark.skipif(_mosaic_gpu_import_error() is not None,
                    reason=f"Mosaic GPU does not import: {_mosaic_gpu_import_error()}")
@pytest.mark.parametrize("page_size", [32, 512])
def test_kernel_lowers_for_cuda_at_head_dim_256(page_size):
    """D 256: key tiles of 64, q and out staged in two halves of 128 columns."""
    step = RaggedStep("lowering-d256", (1, 200), (900, 200), tokens=201, seqs=2,
                      q_heads=2, kv_heads=1, head_dim=256, page_size=page_size,
                      pages_per_seq=1024 // page_size)
    call, inputs = _abstract_step(step)
    lowered = jax.jit(call).trace(*inputs).lower(lowering_platforms=("cuda",))
    assert "stablehlo.custom_call @mosaic_gpu" in lowered.as_text()


# tiny steps (GQA 2:1): a decode row, chunks starting inside a block, an empty sequence,
# slots past num_seqs, rows past the sequences'; pages of 16 (8 per key tile) and of 128,
# separate and fused; D 256 (two staged halves, key tiles of 64) on fewer rows than a box
INTERPRET_STEPS = [
    RaggedStep("page16", (1, 70, 0, 40), (200, 133, 30, 60), tokens=120, seqs=5,
               q_heads=2, kv_heads=1, head_dim=64, page_size=16, pages_per_seq=16,
               num_seqs=3, density=0.7),
    RaggedStep("page128-fused", (1, 90), (250, 100), tokens=100, seqs=3, q_heads=2,
               kv_heads=1, head_dim=64, page_size=128, pages_per_seq=2, fused=True,
               density=0.7),
    RaggedStep("d256-page32-few-rows", (1, 30), (150, 30), tokens=40, seqs=2, q_heads=2,
               kv_heads=1, head_dim=256, page_size=32, pages_per_seq=5, density=0.7),
]


def _assert_close(out, want, msg):
    """out within bfloat16 rounding of the reference."""
    out = _np(out)
    assert np.isfinite(out).all(), msg
    np.testing.assert_allclose(out, want, atol=2e-2, rtol=2e-2, err_msg=msg)


@pytest.mark.skipif(mosaic_interpret.attention_unsupported_reason() is not None,
                    reason=str(mosaic_interpret.attention_unsupported_reason()))
@pytest.mark.skipif(jax.default_backend() != "cpu", reason="interpret mode runs on CPU")
@pytest.mark.parametrize("step", INTERPRET_STEPS, ids=lambda s: s.id)
def test_kernel_in_gpu_interpret_mode(rand, step):
    """The kernel's code (staging, paging, barriers of several copies, predicated stores,
    inactive and zero slots) on CPU: equal to the reference up to bfloat16 rounding, no
    race, every barrier phase seen."""
    arrays = step_arrays(step, rand.rng)
    with mosaic_interpret.interpret_kernel() as races_found:
        out = ragged_attention(arrays.q, arrays.k, arrays.v, arrays.page_indices,
                               arrays.mask, arrays.blocks, arrays.geom,
                               scale=step.head_dim ** -0.5)
        out = _np(out)
        assert not races_found(), str(rand)
    _assert_close(out, reference_out(arrays), str(rand))
    used = int(arrays.blocks.q_starts[-1] + arrays.blocks.q_lens[-1])
    assert (out[used:] == 0).all(), str(rand)


# bigger steps: many decode rows and chunks, Llama-3.1-8B's heads (32 query heads, 8 KV
# heads of 128) with vLLM's pages of 16 and with pages of 128, fused; D 64 and 256
def _llama_step(name, page_size, fused, rng):
    decode = 24
    chunks = (1000, 517, 2048, 77)
    q_lens = (1,) * decode + chunks
    kv_lens = tuple(int(x) for x in rng.integers(1, 6000, decode)) + (1000, 3000, 6000, 80)
    return RaggedStep(name, q_lens, kv_lens, tokens=4096, seqs=32, q_heads=32,
                      kv_heads=8, head_dim=128, page_size=page_size,
                      pages_per_seq=8192 // page_size, fused=fused, density=0.4)


GPU_STEPS = [
    ("llama-page16", lambda rng: _llama_step("llama-page16", 16, False, rng)),
    ("llama-page128-fused", lambda rng: _llama_step("llama-page128-fused", 128, True, rng)),
    ("d64-page32", lambda rng: RaggedStep(
        "d64-page32", (1, 1, 300, 129, 1000), (40, 2000, 300, 1300, 1500), tokens=1500,
        seqs=8, q_heads=8, kv_heads=2, head_dim=64, page_size=32, pages_per_seq=64,
        num_seqs=5)),
    ("d256-page64", lambda rng: RaggedStep(
        "d256-page64", (1, 333, 700), (500, 400, 1900), tokens=1100, seqs=4, q_heads=4,
        kv_heads=4, head_dim=256, page_size=64, pages_per_seq=32, block_size=256,
        dtype=jnp.float16)),
]


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("name, make", GPU_STEPS, ids=[name for name, _ in GPU_STEPS])
def test_kernel_equals_reference(rand, name, make):
    step = make(rand.rng)
    arrays = step_arrays(step, rand.rng)
    out = ragged_attention(arrays.q, arrays.k, arrays.v, arrays.page_indices, arrays.mask,
                           arrays.blocks, arrays.geom, scale=step.head_dim ** -0.5)
    assert out.shape == arrays.q.shape and out.dtype == step.dtype
    _assert_close(out, reference_out(arrays), f"{name} {rand}")
    used = int(arrays.blocks.q_starts[-1] + arrays.blocks.q_lens[-1])
    assert used < step.tokens and (_np(out)[used:] == 0).all(), f"{name} {rand}"


@pytest.mark.gpu
@needs_hopper
def test_kernel_runs_new_lengths_without_recompiling(rand):
    """Lengths, pages and num_seqs are data: two steps of one bucket, one compilation;
    the second run of a step is bit-identical."""
    first = _llama_step("bucket", 16, False, rand.rng)
    second = dataclasses.replace(first, q_lens=(1,) * 30 + (2000,),
                                 kv_lens=(4000,) * 30 + (7000,), num_seqs=31)
    geom = first.geom()
    attend = jax.jit(lambda *args: ragged_attention(*args, geom, scale=0.1))
    for step in (first, second):
        arrays = step_arrays(step, rand.rng)
        args = (arrays.q, arrays.k, arrays.v, arrays.page_indices, arrays.mask,
                arrays.blocks)
        out = _np(attend(*args))
        keys, values = reference.split_cache(arrays.k, arrays.v)
        want = reference.attention(arrays.q, keys, values, arrays.page_indices,
                                   arrays.mask, arrays.blocks, geom, scale=0.1)
        _assert_close(out, _np(want), f"{step.id} {rand}")
        np.testing.assert_array_equal(out, _np(attend(*args)), str(rand))
    assert attend._cache_size() == 1
