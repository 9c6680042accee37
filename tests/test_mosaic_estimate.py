"""The Mosaic GPU block sums (xattn_jax.mosaic.estimate): the plan's contract, the grid
tables the kernel walks, the epilogues, the lowering for CUDA and the kernel itself.

The kernel's numerics on the shared cases run in tests/test_block_sums.py (`kernel_impl`
"mosaic"). Here: on CPU with any jax, the plan's refusals and bound, the tuned decisions
docs/tuning.md records, and the tables (visible tiles, compacted cells, listed items,
folded places, epilogue loops) against their definitions. Where Mosaic GPU imports, the
kernel lowers for CUDA; with jax >= 0.11 it runs in Pallas' GPU interpret mode
(tests/mosaic_interpret.py) on default plans of tiny calls, a small SM count and scratch
bounds reaching every grid and step kind. Marked `gpu` (Hopper only): the compiled kernel.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import mosaic_interpret
import np_reference as npr
import numpy as np
import pytest
from lowering import lower_for_an_h200
from cases import F32_RTOL

from xattn_jax import impls, mosaic, reference, row_statistics
from xattn_jax.checks import check_qk
from xattn_jax.geometry import Geometry
from xattn_jax.mosaic.estimate import block_sums, grid, heuristics
from xattn_jax.mosaic.estimate.plan import STAT_BYTES, estimate_plan, unsupported_reason

BF16 = jnp.bfloat16
MIB = 1 << 20
# the scratch bound the tuned decisions were measured at, the default until
# docs/tuning.md: workspace-bound
MEASURED_BOUND = 3 << 29


def _geom(batch, q_heads, kv_heads, q_len, k_len, head_dim, stride, block_size, causal):
    """The Geometry of a valid call (built by the public argument checks)."""
    q = jax.ShapeDtypeStruct((batch, q_heads, q_len, head_dim), BF16)
    k = jax.ShapeDtypeStruct((batch, kv_heads, k_len, head_dim), BF16)
    return check_qk(q, k, stride=stride, block_size=block_size, causal=causal)


def _plan(shape, causal, **options):
    return estimate_plan(Geometry(*shape), BF16, causal=causal, **options)


# --- the plan's contract ---------------------------------------------------------------

LONG = (1, 32, 8, 1 << 20, 1 << 20, 128, 8, 128)


@pytest.mark.parametrize("shape, dtype, options, rule", [
    ((1, 4, 2, 1024, 1024, 128, 8, 128), jnp.float32, {}, "bfloat16 or float16"),
    ((1, 4, 2, 1024, 1024, 96, 8, 128), BF16, {}, "head_dim in"),
    ((1, 4, 2, 1024, 1024, 128, 8, 32), BF16, {}, "multiple of 8 x stride"),
    ((1, 4, 2, 1024, 1024, 128, 8, 128), BF16, {"key_len": True, "causal": True},
     "key_len in non-causal calls only"),
    ((1, 4, 2, 1024, 1024, 128, 8, 128), BF16, {"page_size": 256},
     "multiple of 64 x stride = 512 tokens"),
    ((1, 4, 2, 1024, 1024, 128, 8, 128), BF16, {"page_size": 1000},
     "multiple of 64 x stride = 512 tokens"),
    # 1M within 8 MiB: no step fits; the reason gives the smallest of each kind
    (LONG, BF16, {"max_scratch_bytes": 8 * MIB},
     "one row step of a wave of row tiles (640 rows of every head), or 4831838208 bytes "
     "for a head step of one head's rows (1024 CTAs, of the 99 a step needs), or 9437184 "
     "bytes for a row step of one head (256 rows, 132 CTAs)"),
    ((1, 2, 2, 16384, 16384, 128, 8, 128), BF16, {"max_scratch_bytes": 1 * MIB},
     "(64 CTAs, of the 99 a step needs), or no row step of one head has the work"),
])
def test_unsupported_calls_are_refused_with_the_rule(shape, dtype, options, rule):
    geom = Geometry(*shape)
    options = {"causal": False, **options}
    reason = unsupported_reason(geom, dtype, **options)
    assert reason is not None and rule in reason, reason
    if not options.pop("key_len", False):
        with pytest.raises(ValueError, match=re.escape(rule)):
            estimate_plan(geom, dtype, **options)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize("bound", [None, MEASURED_BOUND, 600 * MIB, 32 * MIB, 6 * MIB])
@pytest.mark.parametrize("length", [4096, 32768, 131072, 1 << 20])
def test_default_plans_keep_their_steps_within_the_bound(length, bound, causal):
    """Every kernel call's statistics within the bound (default DEFAULT_SCRATCH_BYTES),
    steps of whole row tiles and query blocks, and a step's CTAs enough for "auto" to run
    it (or, on a persistent grid, PERSISTENT_MIN_ITEMS work items per SM)."""
    geom = Geometry(1, 32, 8, length, length, 128, 8, 128)
    limit = bound or row_statistics.DEFAULT_SCRATCH_BYTES
    reason = unsupported_reason(geom, BF16, causal=causal, max_scratch_bytes=bound)
    if reason is not None:
        assert "over max_scratch_bytes" in reason and bound is not None
        return
    plan = estimate_plan(geom, BF16, causal=causal, max_scratch_bytes=bound)
    assert plan.scratch_bytes <= limit
    assert plan.call_rows % plan.row_quantum == 0 and plan.call_heads <= geom.q_heads
    if plan.persistent_ctas:  # a step of at least a work item per SM
        assert plan.step_ctas(plan.rows_per_call) >= plan.sms
    elif plan.call_rows or plan.call_heads:
        assert plan.ctas >= heuristics.auto_min_ctas(plan.sms)


# (shape, causal, options) -> the decisions docs/tuning.md records for it
# (shape, causal, options) -> the decisions docs/tuning.md records for it, within the
# bound they were measured at (MEASURED: MEASURED_BOUND)
MEASURED = {"max_scratch_bytes": MEASURED_BOUND}
TUNED = [
    # mosaic-fold, mosaic-causal-key-groups, mosaic-step-loop, mosaic-stats-epilogue
    ((1, 32, 8, 32768, 32768, 128, 8, 128), True, MEASURED,
     dict(fold=True, key_groups=4, step_loop=5, stats_epilogue=True, scratch_mib=76)),
    ((1, 32, 8, 131072, 131072, 128, 8, 128), True, MEASURED,
     dict(fold=True, call_heads=0, call_rows=0, key_groups=4)),
    # mosaic-fold: a chunk over a long context saves too little to fold
    ((1, 32, 8, 4096, 65536, 128, 8, 128), True, MEASURED,
     dict(fold=False, stats_epilogue=False)),
    # mosaic-head-steps, mosaic-persistent-grid
    ((1, 32, 32, 262144, 262144, 128, 8, 128), True, MEASURED,
     dict(call_heads=8, persistent_ctas=132, key_groups=1, fold=True, listed=True)),
    ((1, 32, 8, 131072, 131072, 128, 8, 128), True, {"max_scratch_bytes": 64 * MIB},
     dict(call_heads=1, fold=True, persistent_ctas=132, step_loop=5)),
    # mosaic-row-steps, mosaic-epilogue-loops, mosaic-causal-key-groups (none at 1M)
    (LONG, True, MEASURED, dict(call_rows=1024, call_heads=0, persistent_ctas=132,
                                key_groups=1, epilogue_loops=16, step_loop=5)),
    # mosaic-head-row-steps
    ((1, 32, 8, 131072, 131072, 128, 8, 128), False, {"max_scratch_bytes": 64 * MIB},
     dict(call_heads=1, call_rows=8192, persistent_ctas=132, key_groups=1)),
    ((1, 32, 8, 131072, 131072, 128, 8, 128), True, {"max_scratch_bytes": 32 * MIB},
     dict(call_heads=1, call_rows=5504, fold=False, listed=True, epilogue_loops=3)),
    # mosaic-ordered-stats: non-causal calls order the consumers' statistics
    ((1, 32, 8, 65536, 65536, 128, 8, 128), False, MEASURED,
     dict(ordered_stats=True, key_groups=1, fold=False, step_loop=0, stages=4)),
    # mosaic-key-groups: half a chunk on 16 heads fills a wave in 2 key groups
    ((1, 16, 4, 4096, 131072, 128, 8, 1024), False, MEASURED, dict(key_groups=2, ctas=128)),
    ((1, 32, 8, 4096, 131072, 128, 8, 1024), False, MEASURED, dict(key_groups=1, ctas=128)),
    # mosaic-launch-groups: a causal call of one key group interleaves its pairs
    ((1, 32, 8, 4096, 262144, 128, 8, 128), True, MEASURED,
     dict(key_groups=1, launch_group=4)),
    # a paged cache of 1536-token pages: key tiles of 192 columns, XLA's epilogue
    ((1, 32, 8, 4096, 65536, 128, 8, 1024), False, {"page_size": 1536, **MEASURED},
     dict(block_k=192, masked_widths=(64, 128, 192))),
    # the device's SMs size the waves: an H100 PCIe (114 SMs) takes row steps of every
    # head where an H200 runs row steps of one head
    ((1, 32, 8, 1 << 20, 1 << 20, 128, 8, 128), False, {"max_scratch_bytes": 600 * MIB},
     dict(call_heads=1, call_rows=16384)),
    ((1, 32, 8, 1 << 20, 1 << 20, 128, 8, 128), False,
     {"max_scratch_bytes": 600 * MIB, "sms": 114}, dict(call_heads=0, call_rows=512)),
]


@pytest.mark.parametrize("shape, causal, options, decisions", TUNED)
def test_default_plans_take_the_tuned_decisions(shape, causal, options, decisions):
    plan = _plan(shape, causal, **options)
    for name, value in decisions.items():
        got = plan.scratch_bytes // MIB if name == "scratch_mib" else getattr(plan, name)
        assert got == value, (name, plan)


def test_auto_min_ctas_is_three_quarters_of_the_sms():
    assert (heuristics.auto_min_ctas(132), heuristics.auto_min_ctas(114)) == (99, 85)


@pytest.mark.parametrize("page_size, block_k", [(4096, 256), (2048, 256), (1024, 128),
                                                (512, 64), (1536, 192)])
def test_paged_plan_takes_a_key_tile_within_a_page(page_size, block_k):
    plan = _plan((1, 32, 8, 4096, 65536, 128, 8, 128), False, page_size=page_size)
    assert (plan.block_k, plan.page_size) == (block_k, page_size)
    assert (page_size // 8) % plan.block_k == 0


@pytest.mark.parametrize("block_k, stages", [(64, 8), (128, 6), (256, 4)])
def test_ring_is_the_deepest_that_fits(block_k, stages):
    """The default ring holds the most slots (query chunk [128, 64] + key chunk
    [block_k, 64]) that fit, as mosaic/smem.py counts them, buffer by buffer."""
    geom = Geometry(1, 32, 8, 1000, 65536, 128, 8, 128)
    plan = dataclasses.replace(estimate_plan(geom, BF16, causal=False), block_k=block_k)
    plan = heuristics.deepest_ring(plan, 2)
    assert plan.stages == stages and plan.ordered_stats
    stats = -(-2 * plan.stat_planes * 64 * 4 // 1024) * 1024
    assert plan.smem_bytes(2) == (stages * (128 + block_k) * 64 * 2 + stats + 2048
                                  + 8 * (2 * stages + 2))
    deeper = dataclasses.replace(plan, stages=stages + 1)
    assert deeper.smem_bytes(2) > heuristics.SMEM_BYTES or stages == heuristics.MAX_STAGES


# --- the tables the kernel walks -------------------------------------------------------

@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("q_len, k_len, block_size, block_k", [
    (1024, 1024, 128, 128), (1000, 1512, 64, 64), (256, 4352, 512, 256), (8, 520, 64, 64)])
def test_tile_walk_matches_the_visibility_rule(q_len, k_len, block_size, block_k, causal):
    """Per row tile: the tiles computed are exactly those holding a column some of its
    rows sees, and the unmasked ones exactly those every one of its rows sees in full;
    with fewer key columns in use the walk stops at the tile holding the last one."""
    geom = _geom(1, 2, 1, q_len, k_len, 64, 8, block_size, causal)
    plan = dataclasses.replace(estimate_plan(geom, BF16, causal=causal), block_k=block_k)
    row0 = np.arange(plan.row_tiles) * plan.rows
    rows = np.arange(plan.padded_rows)[:, None]
    for cols in {c for c in (geom.k_cols, 1, block_k, block_k + 1, geom.k_cols - 1)
                 if 0 < c <= geom.k_cols}:
        computed = np.asarray(grid.visible_tiles(plan, row0, cols))
        unmasked = np.asarray(grid.unmasked_tiles(plan, row0, cols))
        column = np.arange(plan.padded_cols)[None, :]
        seen = (column < cols) & ((column <= rows + geom.row_offset) | (not causal))
        seen = seen.reshape(plan.row_tiles, plan.rows, plan.key_tiles, block_k)
        np.testing.assert_array_equal(
            computed, [np.append(np.flatnonzero(t.any(axis=(0, 2))), -1).max() + 1
                       for t in seen])
        np.testing.assert_array_equal(
            unmasked, [np.argmin(np.append(t.all(axis=(0, 2)), False)) for t in seen])


@pytest.mark.parametrize("q_len, k_len, stride, block_size, groups", [
    (32768, 32768, 8, 128, 4), (4096, 7168, 8, 128, 3), (2900, 4948, 8, 128, 4),
    (6144, 6144, 16, 256, 2), (1000, 1256, 2, 64, 3)])
def test_compacted_grid_holds_exactly_the_walking_ctas(q_len, k_len, stride, block_size,
                                                        groups):
    """A whole causal call in key groups launches one CTA per (row tile, key group) whose
    span holds a tile the row tile sees, the longest row tiles first: every visible tile
    walked once, no CTA walking none. Row steps keep the full grid."""
    geom = Geometry(1, 4, 2, q_len, k_len, 128, stride, block_size)
    plan = dataclasses.replace(estimate_plan(geom, BF16, causal=True), key_groups=groups,
                               persistent_ctas=0, call_heads=0, call_rows=0)
    assert plan.compacted and not dataclasses.replace(plan, causal=False).compacted
    cells, rows = grid.walked_cells(plan), plan.call_row_tiles
    assert plan.grid_rows == len(cells)
    seen = grid.row_tiles_seen(plan)[::-1]
    walked = [min(seen[c // groups] - c % groups * plan.key_span, plan.key_span)
              for c in cells]
    assert min(walked) > 0 and sum(walked) == sum(seen)
    assert list(cells) == sorted(cells)
    assert [c // groups for c in cells] == [g for g in range(rows)
                                            for _ in range(-(-seen[g] // plan.key_span))]
    stepped = dataclasses.replace(plan, call_rows=plan.row_quantum)
    assert not stepped.compacted and stepped.grid_rows == stepped.call_row_tiles * groups


@pytest.mark.parametrize("q_len, k_len, call_rows", [
    (4096, 4096, 0), (2560, 8192, 0), (6000, 6000, 0), (4096, 4096, 128), (6000, 6000, 256),
    (2560, 8192, 128), (81920, 81920, 0)])
def test_listed_items_are_exactly_the_visible_tiles(q_len, k_len, call_rows):
    """A listed persistent grid (causal) walks each (row tile, key tile) its row tile sees
    exactly once, in `work_items` order (key tile by key tile within blocks of
    ROW_BLOCK_TILES row tiles), and nothing else; in row steps each step those of its
    own rows (the last step ending at the last query block), its row of `items_table`
    the count of them (as `listed_counts` counts them), the items, then zeros."""
    geom = Geometry(1, 4, 2, q_len, k_len, 128, 8, 128)
    plan = dataclasses.replace(estimate_plan(geom, BF16, causal=True), key_groups=1,
                               persistent_ctas=132, call_rows=call_rows, call_heads=0,
                               fold=False)
    assert plan.listed and not dataclasses.replace(plan, causal=False).listed
    block, tiles = plan.row_block_tiles, plan.key_tiles
    table, first_rows = grid.items_table(plan), grid.step_first_rows(plan)
    if call_rows:
        assert len(first_rows) == table.shape[0] == -(-geom.q_blocks * geom.block_rows
                                                      // call_rows)
        assert first_rows[-1] + call_rows == geom.q_blocks * geom.block_rows
        assert first_rows[:-1] == tuple(range(0, call_rows * (len(first_rows) - 1),
                                              call_rows))
    else:
        assert first_rows == (0,) and table.shape[0] == 1
    assert list(grid.listed_counts(plan)) == list(table[:, 0])
    for step, first_row in enumerate(first_rows):
        items = grid.listed_items(plan, step)
        assert table[step, 0] == len(items) and not table[step, 1 + len(items):].any()
        walked = sorted((i // (block * tiles) * block + i % block, i // block % tiles)
                        for i in items)
        seen = grid.visible_tiles(plan, first_row + np.arange(plan.call_row_tiles)
                                  * plan.rows)
        assert walked == [(r, t) for r in range(plan.call_row_tiles) for t in range(seen[r])]
        if not call_rows:
            assert list(seen) == list(grid.row_tiles_seen(plan))
        traced = jax.jit(lambda row: grid.row_step(plan, row))(first_row)
        assert int(traced) == step


@pytest.mark.parametrize("ctas", [1, 3, 132])
def test_listed_pair_walk_is_the_call_items_of_each_cta(ctas):
    """Pair by pair, `listed_pair_walk` hands CTA c of G exactly the items its share of
    the call's listed items c, c + G, .. names (item i = pair x n + k), in that order,
    also with fewer items a pair than CTAs, and none."""
    pairs = 7
    for per_pair in (0, 1, 2, 5, 131, 132, 133, 700):
        cta, pair = np.arange(ctas)[:, None], np.arange(pairs)[None, :]
        first, count = (np.asarray(x) for x in grid.listed_pair_walk(
            jnp.int32(pair), jnp.int32(per_pair), jnp.int32(cta), ctas))
        for c in range(ctas):
            walked = [(p, int(first[c, p]) + j * ctas)
                      for p in range(pairs) for j in range(int(count[c, p]))]
            assert walked == [divmod(i, per_pair) for i in range(c, pairs * per_pair, ctas)]


@pytest.mark.parametrize("q_len, k_len, call_rows", [
    (1 << 20, 1 << 20, None), (6000, 6000, 256), (2560, 8192, 128), (4096, 4096, 128)])
def test_epilogue_loops_read_every_slot_their_rows_see(q_len, k_len, call_rows):
    """A causal call's row steps run their epilogues in `epilogue_loops` loops taking
    every step once, in order, as even as they split, each reading the slots of the most
    key tiles a row of its steps sees, no fewer and no more (causal 1M within 1.5 GiB: 16
    loops of 8 of its 128 steps reading 32, 64, .. 512 slots); one loop reading every
    slot in a non-causal call."""
    geom = Geometry(1, 32, 8, q_len, k_len, 128, 8, 128)
    plan = estimate_plan(geom, BF16, causal=True, max_scratch_bytes=MEASURED_BOUND)
    if call_rows is not None:
        plan = dataclasses.replace(plan, call_rows=call_rows, fold=False, key_groups=1)
    loops, first_rows = grid.epilogue_steps(plan), grid.step_first_rows(plan)
    if call_rows is None:
        assert [(len(steps), slots) for steps, slots in loops] == [
            (8, 32 * (n + 1)) for n in range(16)]
    assert len(loops) == plan.epilogue_loops == min(16, len(first_rows))
    assert [n for steps, _ in loops for n in steps] == list(range(len(first_rows)))
    assert max(map(len, (s for s, _ in loops))) - min(map(len, (s for s, _ in loops))) <= 1
    for steps, slots in loops:
        seen = [int(grid.visible_tiles(plan, first_rows[n] + tile * plan.rows))
                for n in steps for tile in range(plan.call_row_tiles)]
        assert slots == max(seen) <= plan.key_tiles
    noncausal = dataclasses.replace(plan, causal=False)
    assert noncausal.epilogue_loops == 1
    assert grid.epilogue_steps(noncausal) == ((range(len(first_rows)), plan.key_tiles),)


# --- the epilogues ---------------------------------------------------------------------

def _random_stats(shape, units: int, rng) -> np.ndarray:
    """Statistics of `shape` `[B, H, T, planes, R]` as the kernel writes them: maxima
    around 0, unit sums in [0, 1), their totals."""
    stats = rng.random(shape, np.float32)
    stats[:, :, :, 0] = rng.normal(size=stats[:, :, :, 0].shape) * 3
    if units > 1:
        stats[:, :, :, 1 + units] = stats[:, :, :, 1:1 + units].sum(axis=3)
    return stats


def _folded(plan, stats: np.ndarray) -> np.ndarray:
    """A whole causal call's unfolded statistics in `plan`'s folded layout, NaN where no
    row tile's tile is stored; each seen tile gets its own slot and rows."""
    rows, shape = plan.rows, plan.stats_shape
    seen = grid.row_tiles_seen(plan)
    folded = np.full(shape, np.nan, np.float32)
    used = set()
    for i, t in ((i, t) for i in range(plan.call_row_tiles) for t in range(seen[i])):
        slot, row0 = (int(x) for x in grid.folded_place(plan, i * rows, t))
        assert 0 <= slot < shape[2] and 0 <= row0 <= shape[4] - rows
        assert (slot, row0) not in used, (i, t)
        used.add((slot, row0))
        folded[:, :, slot, :, row0:row0 + rows] = stats[:, :, t, :, i * rows:(i + 1) * rows]
    return folded


def _whole(plan, **fields):
    """`plan` as one kernel call of a CTA per row tile, with `fields` replaced."""
    return dataclasses.replace(plan, **{"key_groups": 1, "persistent_ctas": 0,
                                        "call_rows": 0, "call_heads": 0, **fields})


# (Lq, Lk, stride, block_size, block_k, folded slots x places / unfolded): Lq = Lk at
# 16K (T + 1 slots for two row tiles of T key tiles), an odd R (the middle row tile
# alone), a key tile of 3 units, Lq < Lk, query blocks of 2 row tiles and of 8 rows
@pytest.mark.parametrize("q_len, k_len, stride, block_size, block_k, share", [
    (16384, 16384, 8, 128, 256, 9 / 16), (600, 600, 2, 32, 64, 14 / 15),
    (300, 300, 2, 16, 64, 5 / 6), (4096, 8192, 8, 128, 256, 14 / 16),
    (16384, 16384, 8, 2048, 256, 9 / 16), (8192, 8192, 8, 64, 256, 5 / 8),
])
@pytest.mark.slow
def test_folded_statistics_hold_each_seen_tile_once(q_len, k_len, stride, block_size,
                                                    block_k, share, rand):
    """Folded statistics: every key tile a row tile sees has its own slot and rows within
    `stats_shape`, and the epilogue reading them in place gives the unfolded epilogue's
    block sums within float32 rounding, whatever the unwritten slots hold (NaN here).
    By default a whole causal call folds where that saves FOLD_MIN_SAVING."""
    geom = _geom(1, 2, 1, q_len, k_len, 64, stride, block_size, True)
    default = estimate_plan(geom, BF16, causal=True)
    plan = _whole(default, block_k=block_k, fold=True)
    unfolded = _whole(default, block_k=block_k, fold=False)
    if block_k == default.block_k:
        assert default.fold == (share <= 1 - heuristics.FOLD_MIN_SAVING)
    shape = plan.stats_shape
    assert shape[2:] == (plan.fold_slots, plan.stat_planes, plan.fold_places * plan.rows)
    assert plan.fold_slots * plan.fold_places / (plan.key_tiles * plan.call_row_tiles) == (
        pytest.approx(share))
    assert plan.scratch_bytes == np.prod(shape) * STAT_BYTES
    stats = _random_stats(unfolded.stats_shape, plan.units_per_tile, rand.rng)
    got = np.asarray(block_sums._folded_block_sums(jnp.asarray(_folded(plan, stats)), plan,
                                                   True))
    planes = block_sums._planes(jnp.asarray(stats), unfolded, 0, geom.k_cols)
    want = np.asarray(row_statistics.combine(*planes, geom, plan.unit, 0, geom.q_blocks,
                                             True))
    assert got.shape == want.shape == (1, 2, geom.q_blocks, geom.k_blocks)
    assert npr.rel_err(got, want) <= F32_RTOL, str(rand)


# the epilogue kernel compiled and marked `gpu` on a GPU, in Pallas interpret mode elsewhere
EPILOGUE_MODES = [pytest.param(False, marks=pytest.mark.gpu, id="compiled")
                  if jax.default_backend() == "gpu" else pytest.param(True, id="interpret")]


def _epilogue_block_sums(plan, cols: int, first_row: int, sees_keys: bool,
                         interpret: bool, rng) -> tuple[np.ndarray, np.ndarray]:
    """Block sums of random statistics in `plan`'s layout (NaN at tiles a row tile does
    not see): the Triton-backend epilogue kernel's and XLA's."""
    from xattn_jax.mosaic.estimate import stats_epilogue

    geom = plan.geom
    q_blocks = plan.call_rows // geom.block_rows if plan.call_rows else geom.q_blocks
    if plan.fold:
        unfolded = dataclasses.replace(plan, fold=False)
        given = _folded(plan, _random_stats(unfolded.stats_shape, plan.units_per_tile, rng))
        want = block_sums._folded_block_sums(jnp.asarray(given), plan, sees_keys)
    else:
        given = _random_stats(plan.stats_shape, plan.units_per_tile, rng)
        row0 = first_row + np.arange(given.shape[-1] // plan.rows) * plan.rows
        for i, seen in enumerate(grid.visible_tiles(plan, row0, cols)):
            given[:, :, seen:, :, i * plan.rows:(i + 1) * plan.rows] = np.nan
        planes = block_sums._planes(jnp.asarray(given), plan, first_row, jnp.int32(cols))
        want = row_statistics.combine(*planes, geom, plan.unit, first_row, q_blocks,
                                      sees_keys)
    scalars = jnp.array([cols, first_row, sees_keys], jnp.int32)
    got = stats_epilogue.stats_block_sums(jnp.asarray(given), scalars, plan=plan,
                                          q_blocks=q_blocks, interpret=interpret)
    return np.asarray(got), np.asarray(want)


# (Lq, Lk, block_size, causal, fold, call_rows, first_row, keys in use, whether any)
@pytest.mark.parametrize("q_len, k_len, block_size, causal, fold, call_rows, first_row, "
                         "cols, sees_keys", [
    (4096, 4096, 128, True, True, 0, 0, None, True),
    (4096, 4096, 64, True, True, 0, 0, None, True),
    (4096, 4096, 2048, True, True, 0, 0, None, True),
    (4096, 4096, 128, True, False, 0, 0, None, True),
    (8192, 8192, 128, True, False, 256, 512, None, True),
    (2048, 8192, 128, False, False, 0, 0, 700, True),
    (1000, 3000, 1024, False, False, 0, 0, None, True),
    (2048, 8192, 128, False, False, 0, 0, 0, False),
])
@pytest.mark.parametrize("interpret", EPILOGUE_MODES)
def test_stats_epilogue_equals_xla_epilogue(q_len, k_len, block_size, causal, fold,
                                            call_rows, first_row, cols, sees_keys,
                                            interpret, rand):
    """The epilogue kernel gives XLA's block sums within float32 rounding: folded or not,
    in a row step, with keys in use, zeros without keys; it never reads the statistics
    of key tiles a row tile does not see (NaN here)."""
    geom = _geom(1, 2, 1, q_len, k_len, 64, 8, block_size, causal)
    plan = _whole(estimate_plan(geom, BF16, causal=causal), fold=fold, call_rows=call_rows)
    cols = geom.k_cols if cols is None else cols
    got, want = _epilogue_block_sums(plan, cols, first_row, sees_keys, interpret, rand.rng)
    q_blocks = call_rows // geom.block_rows if call_rows else geom.q_blocks
    assert got.shape == want.shape == (1, 2, q_blocks, geom.k_blocks)
    assert not np.isnan(got).any()
    if sees_keys:
        assert npr.rel_err(got, want) <= F32_RTOL, str(rand)
    else:
        assert not got.any() and not want.any()


@pytest.mark.parametrize("interpret", EPILOGUE_MODES)
def test_stats_epilogue_on_random_geometries(rand, interpret):
    """As above on 6 random geometries (batch, GQA, Lq <= Lk with partial stride groups,
    strides 4-16, blocks 64-2048, key tiles of 64-256 columns, folded or not, keys in
    use)."""
    rng, checked = rand.rng, 0
    while checked < 6:
        stride = int(rng.choice([4, 8, 16]))
        block = int(rng.choice([64, 128, 256, 512, 1024, 2048]))
        k_len = int(rng.integers(1, 12)) * 512 + int(rng.choice([0, 37, 500]))
        causal = bool(rng.integers(2))
        q_len = k_len if causal and rng.random() < 0.6 else min(
            k_len, int(rng.integers(1, k_len // 256 + 2)) * 256)
        heads = [(2, 1), (2, 2), (4, 2), (3, 1)][rng.integers(4)]
        try:
            geom = _geom(int(rng.integers(1, 3)), *heads, q_len, k_len,
                         int(rng.choice([64, 128])), stride, block, causal)
        except ValueError:  # a drawn causal chunk the rule refuses
            continue
        if geom.block_rows % 8:
            continue
        plan = estimate_plan(geom, BF16, causal=causal)
        block_k = int(rng.choice([64, 128, 256]))
        plan = _whole(plan, block_k=block_k, fold=False)
        if causal and q_len == k_len and rng.random() < 0.5:
            plan = dataclasses.replace(plan, fold=True)
        cols = geom.k_cols
        if not causal and rng.random() < 0.4:
            cols = int(rng.integers(1, geom.k_cols + 1))
        got, want = _epilogue_block_sums(plan, cols, 0, True, interpret, rng)
        where = f"{geom} block_k={block_k} fold={plan.fold} cols={cols} {rand}"
        assert got.shape == want.shape and not np.isnan(got).any(), where
        assert npr.rel_err(got, want) <= F32_RTOL, where
        checked += 1


# --- lowering for CUDA, without a GPU --------------------------------------------------

def _mosaic_gpu_import_error() -> str | None:
    try:
        from jax.experimental.pallas import mosaic_gpu  # noqa: F401
    except Exception as error:  # this jax cannot build Mosaic GPU kernels at all
        return repr(error)
    return None


needs_mosaic_gpu = pytest.mark.skipif(
    _mosaic_gpu_import_error() is not None,
    reason=f"Mosaic GPU does not import: {_mosaic_gpu_import_error()}")


def _lower(plan, key_len: bool = False) -> str:
    geom, page = plan.geom, plan.page_size
    q = jax.ShapeDtypeStruct((geom.batch, geom.q_heads, geom.q_len, geom.head_dim), BF16)
    if page is None:
        k = jax.ShapeDtypeStruct((geom.batch, geom.kv_heads, geom.k_len, geom.head_dim), BF16)
        table = None
    else:
        pages = -(-geom.k_len // page)
        k = jax.ShapeDtypeStruct((pages + 2, page, geom.kv_heads, geom.head_dim), BF16)
        table = jax.ShapeDtypeStruct((geom.batch, pages), jnp.int32)
    count = jax.ShapeDtypeStruct((1,), jnp.int32) if key_len else None

    def call(q, k, count, table):
        return block_sums.block_sums(q, k, plan=plan, norm=1.0, key_len=count,
                                     block_table=table)

    return lower_for_an_h200(call, q, k, count, table)


# (shape, causal, options, key_len): whole calls causal and not, S 16, D 64, a chunk's
# half in key groups, a chunk over a paged cache with keys in use, launch groups, and
# the steps: causal 1M's row steps (of one head by default, of every head within 1.5
# GiB), head steps within 64 MiB, row steps of one head
LOWERING_CASES = [
    ((1, 32, 8, 4096, 4096, 128, 8, 128), True, {}, False),
    ((1, 32, 8, 4096, 4096, 128, 8, 64), False, {}, False),
    ((1, 8, 2, 2048, 2048, 128, 16, 128), True, {}, False),
    ((2, 4, 2, 1000, 1512, 64, 8, 64), False, {}, False),
    ((1, 16, 4, 4096, 131072, 128, 8, 1024), False, {}, True),
    ((1, 32, 8, 4096, 65536, 128, 8, 1024), False, {"page_size": 1024}, True),
    ((1, 32, 8, 4096, 262144, 128, 8, 128), True, MEASURED, False),
    (LONG, True, {}, False),
    (LONG, True, MEASURED, False),
    ((1, 32, 8, 131072, 131072, 128, 8, 128), True, {"max_scratch_bytes": 64 * MIB}, False),
    ((1, 32, 8, 131072, 131072, 128, 8, 128), False, {"max_scratch_bytes": 64 * MIB}, False),
]


@needs_mosaic_gpu
@pytest.mark.parametrize("shape, causal, options, key_len", LOWERING_CASES)
def test_kernel_lowers_for_cuda(shape, causal, options, key_len):
    """Mosaic GPU's lowering for sm_90 (layout inference and the shared memory budget
    included) accepts the kernel; a folded call's module holds the epilogue's Triton
    kernel too."""
    plan = _plan(shape, causal, **options)
    text = _lower(plan, key_len)
    assert "stablehlo.custom_call @mosaic_gpu" in text
    assert ("xla.gpu.triton" in text) == plan.stats_epilogue


@needs_mosaic_gpu
@pytest.mark.parametrize("block_size", [128, 1024])
def test_lowering_counts_shared_memory_as_the_plan(block_size):
    """One slot more than the default ring: Mosaic GPU refuses it with the byte count
    the plan computes (so the default ring is the deepest that fits)."""
    plan = _plan((1, 32, 8, 4096, 4096, 128, 8, block_size), True)
    deeper = dataclasses.replace(plan, stages=plan.stages + 1)
    with pytest.raises(Exception, match=f"smem_bytes={deeper.smem_bytes(2)} "):
        _lower(deeper)


# --- the kernel in GPU interpret mode (CPU) and compiled (Hopper) ----------------------

def _keys_in_use(rand, k, key_len: int, page_size: int | None):
    """k with NaN past `key_len` (no score may read them), and with `page_size` as a
    shuffled page pool (3 spare pages of NaN) and its block table."""
    k = jnp.where(jnp.arange(k.shape[2])[:, None] < key_len, k, jnp.nan).astype(k.dtype)
    if page_size is None:
        return k, None
    return rand.paged(page_size, k)


def _block_sums_with(plan, q, k, *, key_len, norm, rand):
    """The Mosaic block sums of q and k with `key_len` keys in use (None: all), k paged
    as the plan says, and the reference's."""
    keys, table = (k, None) if key_len is None else _keys_in_use(rand, k, key_len,
                                                                  plan.page_size)
    count = None if key_len is None else jnp.asarray([key_len], jnp.int32)
    got = block_sums.block_sums(q, keys, plan=plan, norm=norm, key_len=count,
                                block_table=table)
    want = reference.block_sums(q, k, plan.geom, causal=plan.causal, norm=norm,
                                key_len=None if key_len is None else jnp.int32(key_len))
    return np.asarray(got), want


# (shape, causal, plan options, key_len, dtype, norm) -> the plan's structure
INTERPRET_CASES = [
    # folded, compacted in 4 key groups, the Triton-backend epilogue
    ((1, 4, 2, 2048, 2048, 64, 2, 32), True, {"sms": 1}, None, BF16, 1.0,
     dict(fold=True, key_groups=4, stats_epilogue=True)),
    # folded, XLA's epilogue in place (blocks of 24 rows)
    ((1, 2, 1, 1536, 1536, 64, 2, 48), True, {}, None, BF16, 1.0,
     dict(fold=True, key_groups=3, stats_epilogue=False)),
    # one key tile: a launch group of 4 pairs interleaved
    ((2, 2, 1, 300, 300, 64, 2, 64), True, {}, None, BF16, 1.0, dict(launch_group=4)),
    ((2, 2, 1, 190, 251, 64, 2, 16), False, {}, None, BF16, 2.0, dict(key_groups=1)),
    # S 4, D 128: ordered statistics, float16
    ((1, 2, 1, 300, 556, 128, 4, 64), False, {}, None, jnp.float16, 1.0,
     dict(ordered_stats=True)),
    # keys in use ending inside a stride group of tile 1 of 3 (3 key groups), and one key
    ((2, 2, 1, 190, 1100, 64, 2, 32), False, {}, 701, BF16, 1.0, dict(key_groups=3)),
    ((1, 2, 1, 128, 512, 64, 2, 32), False, {}, 1, BF16, 1.0, dict(key_groups=1)),
    # paged caches with keys in use: pages of 128 (key tiles of 64) and of 512 tokens
    ((1, 4, 2, 160, 640, 64, 2, 32), False, {"page_size": 128}, 411, BF16, 1.0,
     dict(block_k=64, key_groups=4)),
    ((2, 4, 2, 160, 2048, 64, 2, 32), False, {"page_size": 512}, 1500, BF16, 1.0,
     dict(block_k=256, key_groups=4)),
    # row steps of every head, the last overlapping; causal, in 2 key groups, 4 loops
    ((1, 4, 2, 1300, 1400, 64, 2, 32), False, {"max_scratch_bytes": 110592, "sms": 2},
     None, BF16, 1.0, dict(call_heads=0, call_rows=128)),
    ((1, 2, 1, 1024, 1024, 64, 2, 32), True, {"max_scratch_bytes": 49152, "sms": 1},
     None, BF16, 1.0, dict(call_rows=128, key_groups=2, epilogue_loops=4)),
    # head steps: 2 of 3 heads (the last overlapping) in batch 2; causal folded in 3 key
    # groups; causal folded on the listed persistent grid, 1 and 2 batch elements
    ((2, 3, 3, 190, 512, 64, 2, 32), False, {"max_scratch_bytes": 36864, "sms": 4}, None,
     BF16, 1.0, dict(call_heads=2, call_rows=0)),
    ((1, 4, 2, 1500, 1500, 64, 2, 32), True, {"max_scratch_bytes": 110592, "sms": 4},
     None, BF16, 1.0, dict(call_heads=1, fold=True, key_groups=3)),
    ((1, 4, 2, 1500, 1500, 64, 2, 32), True, {"max_scratch_bytes": 221184, "sms": 4},
     None, BF16, 1.0, dict(call_heads=2, fold=True, persistent_ctas=4)),
    ((2, 4, 2, 1024, 1024, 64, 2, 32), True, {"max_scratch_bytes": 221184, "sms": 2},
     None, BF16, 1.0, dict(call_heads=2, fold=True, persistent_ctas=2)),
    # row steps of one head on the persistent grid, the last overlapping: causal (listed,
    # 2 epilogue loops) and not
    ((1, 4, 2, 1500, 1500, 64, 2, 32), True, {"max_scratch_bytes": 86016, "sms": 2},
     None, BF16, 1.0, dict(call_heads=1, call_rows=384, persistent_ctas=2,
                           epilogue_loops=2)),
    ((1, 4, 2, 1300, 1400, 64, 2, 32), False, {"max_scratch_bytes": 86016, "sms": 2},
     None, BF16, 1.0, dict(call_heads=1, call_rows=384, persistent_ctas=2)),
]


def _interpret_case(case):
    shape, causal, options, key_len, dtype, norm, structure = case
    return pytest.param(case, id=f"{'c' if causal else 'n'}{shape[3]}x{shape[4]}-"
                        + "-".join(f"{k}{v}" for k, v in structure.items()))


@pytest.mark.skipif(mosaic_interpret.unsupported_reason() is not None,
                    reason=str(mosaic_interpret.unsupported_reason()))
@pytest.mark.skipif(jax.default_backend() != "cpu", reason="interpret mode runs on CPU")
@pytest.mark.parametrize("case", [_interpret_case(c) for c in INTERPRET_CASES])
def test_kernel_in_gpu_interpret_mode(rand, case):
    """The kernel's code (producer, consumers, ring, barriers, masks, grids, steps) on CPU
    with a default plan: the reference's block sums within float32 rounding, no race,
    every barrier phase seen, no NaN from keys past the count. Interpret mode fills the
    kernel's output with NaN first: statistics left unwritten must never be read."""
    shape, causal, options, key_len, dtype, norm, structure = case
    geom = _geom(*shape, causal)
    plan = estimate_plan(geom, dtype, causal=causal, **options)
    assert {name: getattr(plan, name) for name in structure} == structure, plan
    q, k = rand.qk(*shape[:6], stride=geom.stride, dtype=dtype)
    with mosaic_interpret.interpret_kernel() as races_found:
        got, want = _block_sums_with(plan, q, k, key_len=key_len, norm=norm, rand=rand)
        assert not races_found(), str(rand)
    assert got.shape == (geom.batch, geom.q_heads, geom.q_blocks, geom.k_blocks)
    assert not np.isnan(got).any(), f"{case} {rand}"
    assert npr.rel_err(got, want) <= F32_RTOL, f"{case} {rand}"


# (shape, causal, plan options, key_len): whole calls (causal in key groups, compacted
# and folded; non-causal; GQA; batch 2; S 16; odd lengths), the chunk scores (keys in
# use, pages of 4096, 1024 and 512 tokens, half a chunk in 2 key groups), launch
# groups, and the steps by the bound: head steps, row steps of every head (causal 1M's
# shape at a smaller size), row steps of one head, causal and not
GPU_CASES = [
    ((1, 32, 8, 4096, 4096, 128, 8, 128), True, {}, None),
    ((1, 32, 8, 4096, 4096, 128, 8, 64), False, {}, None),
    ((2, 8, 2, 2000, 3024, 128, 8, 256), False, {}, None),
    ((1, 8, 8, 1024, 3072, 64, 8, 1024), True, {}, None),
    ((1, 4, 1, 777, 777, 128, 8, 128), True, {}, None),
    ((1, 8, 2, 2048, 2048, 128, 16, 128), True, {}, None),
    ((2, 8, 2, 2900, 4948, 128, 8, 128), True, {}, None),
    ((1, 32, 8, 4096, 16384, 128, 8, 1024), False, {}, 12345),
    ((2, 32, 8, 4096, 16384, 128, 8, 1024), False, {"page_size": 4096}, 9001),
    ((1, 32, 8, 2048, 16384, 128, 8, 128), False, {"page_size": 1024}, 16383),
    ((1, 8, 2, 1000, 8192, 64, 8, 256), False, {"page_size": 512}, 4097),
    ((1, 16, 4, 4096, 32768, 128, 8, 1024), False, {}, 30001),
    ((2, 8, 2, 2000, 3024, 128, 8, 128), True, {"sms": 16}, None),
    ((1, 8, 8, 16384, 16384, 128, 8, 128), True, {"max_scratch_bytes": 6 * MIB}, None),
    ((1, 8, 8, 16384, 16384, 128, 8, 128), False, {"max_scratch_bytes": 6 * MIB}, None),
    ((1, 32, 8, 16384, 16384, 128, 8, 128), True, {"max_scratch_bytes": 6 * MIB}, None),
    ((1, 8, 2, 16384, 16384, 128, 8, 128), True, {"max_scratch_bytes": 6 * MIB, "sms": 8},
     None),
    ((1, 4, 2, 32768, 65536, 128, 8, 128), False, {"max_scratch_bytes": 6 * MIB}, None),
    ((1, 2, 1, 65536, 65536, 128, 8, 128), True, {"max_scratch_bytes": 6 * MIB}, None),
    ((2, 4, 2, 4096, 32768, 128, 8, 1024), False,
     {"page_size": 4096, "max_scratch_bytes": 1 * MIB, "sms": 8}, 30001),
    ((1, 32, 32, 8192, 8192, 128, 8, 128), True, {"max_scratch_bytes": 8 * MIB}, None),
]


@pytest.mark.gpu
@pytest.mark.skipif(mosaic.available() is not None, reason=str(mosaic.available()))
@pytest.mark.parametrize("case", GPU_CASES)
def test_compiled_kernel_equals_reference(rand, case):
    """The compiled kernel of default plans against the reference within float32
    rounding: whole calls, keys in use (the rest NaN), pages and every step kind."""
    shape, causal, options, key_len = case
    geom = _geom(*shape, causal)
    q, k = rand.qk(*shape[:6], stride=geom.stride, dtype=BF16)
    plan = estimate_plan(geom, BF16, causal=causal, **options)
    got, want = _block_sums_with(plan, q, k, key_len=key_len, norm=1.0, rand=rand)
    assert not np.isnan(got).any(), f"{case} {rand}"
    assert npr.rel_err(got, want) <= F32_RTOL, f"{case} {rand}: {plan}"

