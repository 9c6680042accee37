"""The estimate's block sums with the Mosaic GPU kernel (xattn_jax.mosaic.block_sums),
against the plain-JAX reference (docs/estimate.md sections 1-3).

Both layouts of the queries (`estimate_plan.QUERY_LAYOUTS`: resident, streamed). On CPU,
any jax: the plan's refusals, overrides and shared memory, and the tile walk (which key
tiles a row tile computes, which it masks) against its definition. Where Mosaic GPU
imports (jax >= 0.11): the kernel lowers for CUDA (and Mosaic GPU counts its shared
memory as the plan does), and runs in Pallas' GPU interpret mode
(tests/mosaic_interpret.py) at tiny shapes. Marked `gpu` (Hopper only): the compiled
kernel.
"""

from __future__ import annotations

import contextlib
import dataclasses
import heapq
import re

import jax
import jax.numpy as jnp
import mosaic_interpret
import np_reference as npr
import numpy as np
import pytest
from cases import F32_RTOL

from xattn_jax import impls, mosaic, reference, row_statistics
from xattn_jax.checks import check_qk
from xattn_jax.geometry import Geometry
from xattn_jax.mosaic import block_sums, estimate_plan
from xattn_jax.mosaic.estimate_plan import QUERY_LAYOUTS

needs_hopper = pytest.mark.skipif(mosaic.available() is not None,
                                  reason=str(mosaic.available()))


def _geom(batch, q_heads, kv_heads, q_len, k_len, head_dim, stride, block_size, causal):
    """The Geometry of a valid call (built by the public argument checks)."""
    q = jax.ShapeDtypeStruct((batch, q_heads, q_len, head_dim), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((batch, kv_heads, k_len, head_dim), jnp.bfloat16)
    return check_qk(q, k, stride=stride, block_size=block_size, causal=causal)


@pytest.mark.parametrize("geom, dtype, options, rule", [
    (Geometry(1, 4, 2, 1024, 1024, 128, 8, 128), jnp.float32, {}, "bfloat16 or float16"),
    (Geometry(1, 4, 2, 1024, 1024, 96, 8, 128), jnp.bfloat16, {}, "head_dim in"),
    (Geometry(1, 4, 2, 1024, 1024, 128, 8, 32), jnp.bfloat16, {}, "multiple of 8 x stride"),
    (Geometry(1, 4, 2, 1024, 1024, 128, 8, 128), jnp.bfloat16,
     {"key_len": True, "causal": True}, "key_len in non-causal calls only"),
    (Geometry(1, 4, 2, 1024, 1024, 128, 8, 128), jnp.bfloat16, {"page_size": 256},
     "multiple of 64 x stride = 512 tokens"),
    (Geometry(1, 4, 2, 1024, 1024, 128, 8, 128), jnp.bfloat16, {"page_size": 1000},
     "multiple of 64 x stride = 512 tokens"),
    (Geometry(1, 4, 2, 1024, 1024, 128, 16, 128), jnp.bfloat16, {"queries": "resident"},
     "shared memory"),
    (Geometry(1, 32, 8, 131072, 131072, 128, 8, 128), jnp.bfloat16,
     {"queries": "resident", "max_scratch_bytes": 4 << 20}, "one row step"),
    (Geometry(1, 32, 8, 131072, 131072, 128, 8, 128), jnp.bfloat16,
     {"max_scratch_bytes": 4 << 20}, "one row step"),
])
def test_plan_refuses_unsupported_calls(geom, dtype, options, rule):
    reason = estimate_plan.unsupported_reason(geom, dtype, **options)
    assert reason is not None and rule in reason, reason
    plan_options = {key: value for key, value in options.items()
                    if key in ("queries", "page_size", "max_scratch_bytes")}
    if options == plan_options:
        with pytest.raises(ValueError, match=rule):
            estimate_plan.estimate_plan(geom, dtype, **plan_options)


def test_streamed_queries_fit_where_resident_ones_do_not():
    """S 16 at D 128: the resident queries alone (64 x 16 x 128 bf16) exceed the shared
    memory; streamed, the plan takes the most slots of query and key chunks that fit."""
    geom = Geometry(1, 4, 2, 1024, 1024, 128, 16, 128)
    assert "shared memory" in estimate_plan.unsupported_reason(geom, jnp.bfloat16,
                                                               queries="resident")
    assert estimate_plan.unsupported_reason(geom, jnp.bfloat16, queries="streamed") is None
    plan = estimate_plan.estimate_plan(geom, jnp.bfloat16, queries="streamed", block_k=128)
    assert (plan.queries, plan.rows, plan.stages) == ("streamed", 128, 6)
    with pytest.raises(ValueError, match="queries must be one of"):
        estimate_plan.unsupported_reason(geom, jnp.bfloat16, queries="tiled")


def test_plan_defaults_fit_and_overrides_are_checked():
    geom = Geometry(1, 32, 8, 65536, 65536, 128, 8, 128)
    plan = estimate_plan.estimate_plan(geom, jnp.bfloat16)
    assert (plan.queries, plan.block_k, plan.stagger) == ("streamed", 256, True)
    assert plan.smem_bytes(2) <= estimate_plan.SMEM_BYTES
    deeper = dataclasses.replace(plan, stages=plan.stages + 1)
    assert (plan.stages == estimate_plan.MAX_STAGES
            or deeper.smem_bytes(2) > estimate_plan.SMEM_BYTES)
    # 16 units of 16 columns per tile of 256: maximum, 16 sums, their total
    assert (plan.unit, plan.units_per_tile, plan.stat_planes) == (16, 16, 18)
    resident = estimate_plan.estimate_plan(geom, jnp.bfloat16, queries="resident")
    assert (resident.block_k, resident.stagger) == (128, False)
    with pytest.raises(ValueError, match="block_k"):
        estimate_plan.estimate_plan(geom, jnp.bfloat16, block_k=96)
    with pytest.raises(ValueError, match="shared memory"):
        estimate_plan.estimate_plan(geom, jnp.bfloat16, stages=8)
    with pytest.raises(ValueError, match="stages"):
        estimate_plan.estimate_plan(geom, jnp.bfloat16, stages=1)
    with pytest.raises(ValueError, match="cluster"):
        estimate_plan.estimate_plan(geom, jnp.bfloat16, cluster=3)
    with pytest.raises(ValueError, match="leave_out"):
        estimate_plan.estimate_plan(geom, jnp.bfloat16, leave_out="epilogue")
    with pytest.raises(ValueError, match="queries"):
        estimate_plan.estimate_plan(geom, jnp.bfloat16, queries="tiled")
    # a cluster of the streamed queries: whole clusters of row tiles, no key groups even
    # where a short call would take them (half a chunk takes 2 alone)
    half_chunk = Geometry(1, 16, 4, 4096, 65536, 128, 8, 1024)
    assert estimate_plan.estimate_plan(half_chunk, jnp.bfloat16).key_groups == 2
    clustered = estimate_plan.estimate_plan(half_chunk, jnp.bfloat16, cluster=4)
    assert (clustered.queries, clustered.cluster, clustered.key_groups) == ("streamed", 4, 1)
    assert (clustered.row_tiles, clustered.ctas(False)) == (4, 64)
    with pytest.raises(ValueError, match="stagger needs queries='streamed'"):
        estimate_plan.estimate_plan(geom, jnp.bfloat16, stagger=True, queries="resident")
    # consumer 1's statistics after consumer 0's: non-causal calls of the streamed
    # queries; one barrier more
    causal = estimate_plan.estimate_plan(geom, jnp.bfloat16, causal=True)
    assert (plan.ordered_stats, causal.ordered_stats, resident.ordered_stats) == (
        True, False, False)
    unordered = dataclasses.replace(plan, ordered_stats=False)
    assert plan.smem_bytes(2) == unordered.smem_bytes(2) + 8
    assert estimate_plan.estimate_plan(geom, jnp.bfloat16, causal=True,
                                       ordered_stats=True).ordered_stats
    with pytest.raises(ValueError, match="ordered_stats needs queries='streamed'"):
        estimate_plan.estimate_plan(geom, jnp.bfloat16, ordered_stats=True,
                                    queries="resident")
    # a ring as long as a tile's steps (S 2, D 64: 2 steps) lets consumer 0 run a tile
    # ahead: off by default there, refused when asked for
    short = Geometry(1, 2, 1, 600, 700, 64, 2, 32)
    assert not estimate_plan.estimate_plan(short, jnp.bfloat16, block_k=64).ordered_stats
    assert estimate_plan.estimate_plan(Geometry(1, 2, 1, 300, 556, 128, 4, 64),
                                       jnp.bfloat16, block_k=64, stages=3).ordered_stats
    with pytest.raises(ValueError, match="ordered_stats needs fewer stages than the 2"):
        estimate_plan.estimate_plan(short, jnp.bfloat16, block_k=64, ordered_stats=True)
    # masked tiles trimmed to the columns a consumer's rows see, in steps of 128 columns
    # by default (at most the tile); 0 keeps them whole; a step must divide the tile and
    # be whole wgmma column tiles
    assert (plan.trim_columns, plan.masked_widths) == (128, (128, 256))
    assert estimate_plan.estimate_plan(short, jnp.bfloat16, block_k=64).masked_widths == (64,)
    whole = estimate_plan.estimate_plan(geom, jnp.bfloat16, trim_columns=0)
    assert whole.masked_widths == (256,)
    assert estimate_plan.estimate_plan(geom, jnp.bfloat16,
                                       trim_columns=32).masked_widths[:2] == (32, 64)
    for bad in (48, 12, -8, 512):
        with pytest.raises(ValueError, match="trim_columns must be 0 or a divisor of block_k"):
            estimate_plan.estimate_plan(geom, jnp.bfloat16, trim_columns=bad)
    # a causal call in key groups or on the persistent grid (1M's row steps) multiplies a
    # key tile's steps after the first in a loop (unrolled up to 5 times, a divisor of
    # their count); causal CTAs walking whole rows (1M given persistent=False: key groups
    # 1), non-causal calls and the resident queries unroll them all; a tile of one step
    # has no loop
    assert (causal.key_groups, causal.step_loop, plan.step_loop, resident.step_loop) == (
        4, 5, 0, 0)
    long_geom = Geometry(1, 32, 8, 1 << 20, 1 << 20, 128, 8, 128)
    long = estimate_plan.estimate_plan(long_geom, jnp.bfloat16, causal=True)
    assert (long.persistent_ctas, long.key_groups, long.step_loop) == (132, 1, 5)
    rows = estimate_plan.estimate_plan(long_geom, jnp.bfloat16, causal=True, persistent=False)
    assert (rows.persistent_ctas, rows.key_groups, rows.step_loop) == (0, 1, 0)
    noncausal = estimate_plan.estimate_plan(long_geom, jnp.bfloat16, persistent=True)
    assert (noncausal.persistent_ctas, noncausal.step_loop) == (132, 0)
    for shape, loop in (((4096, 4096, 128, 4, 64), 1),  # 8 steps: 7 after the first
                        ((4096, 4096, 64, 4, 32), 3),  # 4 steps: 3 after
                        ((4096, 4096, 64, 1, 32), 0)):  # 1 step
        short_rows = estimate_plan.estimate_plan(Geometry(1, 2, 1, *shape), jnp.bfloat16,
                                                 causal=True)
        assert (short_rows.key_groups, short_rows.step_loop) == (4, loop), shape
    assert estimate_plan.estimate_plan(geom, jnp.bfloat16, step_loop=15).step_loop == 15
    for bad, options in ((2, {}), (-1, {}), (1, {"queries": "resident"})):
        with pytest.raises(ValueError, match="step_loop must be 0, or with queries='streamed'"):
            estimate_plan.estimate_plan(geom, jnp.bfloat16, causal=True, step_loop=bad,
                                        **options)


def test_pair_rows_plan_and_refusals():
    """pair_rows: off by default; the same scratch; ceil(R / 2) CTAs per head in causal
    calls only (non-causal calls ignore it: one row tile per CTA); streamed queries with
    cluster 1 only."""
    geom = Geometry(1, 32, 8, 65536, 65536, 128, 8, 128)
    plan = estimate_plan.estimate_plan(geom, jnp.bfloat16)
    paired = estimate_plan.estimate_plan(geom, jnp.bfloat16, pair_rows=True)
    assert (plan.pair_rows, paired.pair_rows) == (False, True)
    assert dataclasses.replace(paired, pair_rows=False) == plan
    assert paired.smem_bytes(2) == plan.smem_bytes(2)
    assert plan.row_tiles == 64
    assert (plan.row_groups(True), plan.row_groups(False)) == (64, 64)
    assert (paired.row_groups(True), paired.row_groups(False)) == (32, 64)
    assert (paired.paired(True), paired.paired(False), plan.paired(True)) == (True, False,
                                                                             False)
    odd = estimate_plan.estimate_plan(Geometry(1, 4, 2, 2900, 4948, 128, 8, 128),
                                      jnp.bfloat16, pair_rows=True)
    assert (odd.row_tiles, odd.row_groups(True), odd.row_groups(False)) == (3, 2, 3)
    resident = estimate_plan.estimate_plan(geom, jnp.bfloat16, queries="resident",
                                           cluster=2)
    assert (resident.row_tiles, resident.row_groups(True)) == (128, 64)  # clusters
    rule = "pair_rows needs queries='streamed' and cluster 1"
    for options in ({"queries": "resident"}, {"queries": "resident", "cluster": 2},
                    {"queries": "streamed", "cluster": 2}):
        with pytest.raises(ValueError, match=rule):
            estimate_plan.estimate_plan(geom, jnp.bfloat16, pair_rows=True, **options)


@pytest.mark.parametrize("q_len, k_len, stride, block_size, block_k", [
    (65536, 65536, 8, 128, 256), (2900, 4948, 8, 128, 256), (600, 600, 2, 32, 64),
    (1300, 1812, 4, 512, 128), (1000, 1256, 2, 64, 128), (1024, 1024, 8, 128, 128)])
def test_paired_row_tiles_balance_the_causal_triangle(q_len, k_len, stride, block_size,
                                                      block_k):
    """With pair_rows, CTA g walks row tiles g and R - 1 - g (the middle one of an odd R
    alone, last): every row tile once, and the CTAs of two row tiles walk key tiles in
    numbers at most 1 apart, the lone one no more than any of them."""
    geom = _geom(1, 2, 1, q_len, k_len, 64, stride, block_size, True)
    plan = estimate_plan.estimate_plan(geom, jnp.bfloat16, block_k=block_k, pair_rows=True)
    groups = np.arange(plan.row_groups(True))
    first, second = map(np.asarray, estimate_plan.paired_row_tiles(plan, groups))
    np.testing.assert_array_equal(first, groups)
    np.testing.assert_array_equal(second, plan.row_tiles - 1 - groups)
    alone = first == second
    assert list(np.flatnonzero(alone)) == ([groups[-1]] if plan.row_tiles % 2 else [])
    np.testing.assert_array_equal(np.sort(np.concatenate([first, second[~alone]])),
                                  np.arange(plan.row_tiles))
    tiles = np.asarray(estimate_plan.visible_tiles(plan, True, np.arange(plan.row_tiles)
                                                   * plan.rows))
    pairs = (tiles[first] + tiles[second])[~alone]
    if len(pairs):
        assert pairs.max() - pairs.min() <= 1, pairs
    if alone.any():
        assert tiles[first[alone]].item() <= (pairs.min() if len(pairs) else tiles.max())


def _random_stats(shape, units: int, rng=None) -> np.ndarray:
    """Statistics of `shape` (`[B, H, T, planes, R]`) as the kernel writes them: maxima
    around 0, unit sums in [0, 1), their totals. rng: a numpy Generator (else seed 0)."""
    rng = np.random.default_rng(0) if rng is None else rng
    stats = rng.random(shape, np.float32)
    stats[:, :, :, 0] = rng.normal(size=stats[:, :, :, 0].shape) * 3  # maxima
    if units > 1:
        stats[:, :, :, 1 + units] = stats[:, :, :, 1:1 + units].sum(axis=3)
    return stats


def _folded(plan, stats: np.ndarray) -> np.ndarray:
    """A whole causal call's unfolded statistics `stats` in `plan`'s folded layout
    (`folded_place`), NaN where no row tile's tile is stored; each seen tile gets its own
    slot and rows, within `stats_shape`."""
    rows, shape = plan.rows, plan.stats_shape
    row_tiles = plan.call_row_tiles
    seen = np.asarray(estimate_plan.visible_tiles(plan, True, np.arange(row_tiles) * rows))
    folded = np.full(shape, np.nan, np.float32)
    used = set()
    for i, t in ((i, t) for i in range(row_tiles) for t in range(seen[i])):
        slot, row0 = (int(x) for x in estimate_plan.folded_place(plan, i * rows, t))
        assert 0 <= slot < shape[2] and 0 <= row0 <= shape[4] - rows
        assert (slot, row0) not in used, (i, t)
        used.add((slot, row0))
        folded[:, :, slot, :, row0:row0 + rows] = stats[:, :, t, :, i * rows:(i + 1) * rows]
    return folded


# (Lq, Lk, stride, block_size, block_k, queries, folded slots x places / unfolded):
# Lq = Lk at 16K (T + 1 slots for two row tiles of T key tiles: 9 / 16), an odd R (3
# row tiles, the middle one alone), R = 2 with a key tile of 3 units, Lq < Lk, 64-row
# tiles of the resident queries (T = 4: 5 / 8), query blocks of 2 row tiles (block
# 2048) and of 8 rows (block 64)
@pytest.mark.parametrize("q_len, k_len, stride, block_size, block_k, queries, share", [
    (16384, 16384, 8, 128, 256, "streamed", 9 / 16),
    (600, 600, 2, 32, 64, "streamed", 14 / 15),
    (300, 300, 2, 16, 64, "streamed", 5 / 6),
    (4096, 8192, 8, 128, 256, "streamed", 14 / 16),
    (4096, 4096, 8, 128, 128, "resident", 5 / 8),
    (16384, 16384, 8, 2048, 256, "streamed", 9 / 16),
    (8192, 8192, 8, 64, 256, "streamed", 5 / 8),
])
def test_folded_statistics_hold_each_seen_tile_once(q_len, k_len, stride, block_size,
                                                    block_k, queries, share):
    """Folded statistics (`folded_place`): every key tile a row tile sees gets its own slot
    and rows, within `stats_shape`, and the epilogue reading them in place
    (`block_sums._folded_block_sums`) gives the unfolded epilogue's block sums within
    float32 rounding, whatever the slots nobody writes hold (NaN here). Folded by default
    only where that saves FOLD_MIN_SAVING."""
    geom = _geom(1, 2, 1, q_len, k_len, 64, stride, block_size, True)
    options = {"causal": True, "block_k": block_k, "queries": queries}
    plan = estimate_plan.estimate_plan(geom, jnp.bfloat16, fold=True, **options)
    unfolded = estimate_plan.estimate_plan(geom, jnp.bfloat16, fold=False, **options)
    default = estimate_plan.estimate_plan(geom, jnp.bfloat16, **options)
    assert default.fold == (share <= 1 - estimate_plan.FOLD_MIN_SAVING)
    assert plan.call_rows == unfolded.call_rows == 0
    tiles, rows, row_tiles = plan.key_tiles, plan.rows, plan.call_row_tiles
    shape = plan.stats_shape
    assert shape[2:] == (plan.fold_slots, plan.stat_planes, plan.fold_places * rows)
    assert plan.fold_slots * plan.fold_places / (tiles * row_tiles) == pytest.approx(share)
    assert plan.scratch_bytes == np.prod(shape) * estimate_plan.STAT_BYTES
    stats = _random_stats(unfolded.stats_shape, plan.units_per_tile)
    folded = _folded(plan, stats)
    got = np.asarray(block_sums._folded_block_sums(jnp.asarray(folded), plan, True))
    planes = block_sums._planes(jnp.asarray(stats), unfolded, True, 0, geom.k_cols)
    want = np.asarray(row_statistics.combine(*planes, geom, plan.unit, 0, geom.q_blocks,
                                             True))
    assert got.shape == want.shape == (1, 2, geom.q_blocks, geom.k_blocks)
    assert npr.rel_err(got, want) <= F32_RTOL


def test_fold_defaults_and_refusals():
    """Folded statistics in whole causal calls where they save memory: causal 32K holds
    76 MiB instead of 144, and causal 128K (2.25 GiB unfolded) now fits in one call; not
    in non-causal calls, row steps (1M), clusters, or a chunk over a long context (its
    row tiles see nearly every key tile: 126 slots for 128, less than FOLD_MIN_SAVING).
    fold=True elsewhere is refused."""
    def plan(q_len, k_len, **options):
        geom = Geometry(1, 32, 8, q_len, k_len, 128, 8, 128)
        return estimate_plan.estimate_plan(geom, jnp.bfloat16, **options)

    short = plan(32768, 32768, causal=True)
    unfolded = plan(32768, 32768, causal=True, fold=False)
    assert short.fold and not unfolded.fold
    assert (short.scratch_bytes >> 20, unfolded.scratch_bytes >> 20) == (76, 144)
    long = plan(131072, 131072, causal=True)
    assert long.fold and long.call_rows == 0
    assert long.scratch_bytes <= estimate_plan.MAX_SCRATCH_BYTES
    assert long.row_scratch_bytes * long.padded_rows > estimate_plan.MAX_SCRATCH_BYTES
    unfolded_long = plan(131072, 131072, causal=True, fold=False)  # head steps
    assert (unfolded_long.call_rows, unfolded_long.call_heads) == (0, 16)
    assert not plan(1 << 20, 1 << 20, causal=True).fold  # row steps
    assert not plan(32768, 32768).fold  # non-causal
    assert not plan(32768, 32768, causal=True, cluster=2).fold
    assert not plan(4096, 65536, causal=True).fold
    for options, rule in (({}, "causal=False"), ({"causal": True, "cluster": 2}, "cluster 1"),
                          ({"causal": True, "call_rows": 1024}, "one kernel call")):
        with pytest.raises(ValueError, match=f"fold needs .*{rule}"):
            plan(32768, 32768, fold=True, **options)
    with pytest.raises(ValueError, match="fold needs one kernel call; the folded"):
        plan(1 << 20, 1 << 20, causal=True, fold=True)  # a head's exceed 1.5 GiB


# the epilogue kernel compiled and marked `gpu` on a GPU, in Pallas interpret mode elsewhere
EPILOGUE_MODES = [pytest.param(False, marks=pytest.mark.gpu, id="compiled")
                  if jax.default_backend() == "gpu" else pytest.param(True, id="interpret")]


# (Lq, Lk, block_size, causal, fold, call_rows, first_row, keys in use, whether any):
# folded causal calls (query blocks of 16 and 8 rows, and of 2 row tiles: block 2048),
# an unfolded one, a causal row step, keys in use ending inside a key tile, padded rows
# with a partly filled key block of 2 units, and a call without keys
@pytest.mark.parametrize("q_len, k_len, block_size, causal, fold, call_rows, first_row, "
                         "cols, sees_keys", [
    (4096, 4096, 128, True, True, None, 0, None, True),
    (4096, 4096, 64, True, True, None, 0, None, True),
    (4096, 4096, 2048, True, True, None, 0, None, True),
    (4096, 4096, 128, True, False, None, 0, None, True),
    (8192, 8192, 128, True, False, 256, 512, None, True),
    (2048, 8192, 128, False, False, None, 0, 700, True),
    (1000, 3000, 1024, False, False, None, 0, None, True),
    (2048, 8192, 128, False, False, None, 0, 0, False),
])
@pytest.mark.parametrize("interpret", EPILOGUE_MODES)
def test_stats_epilogue_equals_xla_epilogue(q_len, k_len, block_size, causal, fold,
                                            call_rows, first_row, cols, sees_keys, interpret):
    """The epilogue as one kernel (`mosaic.epilogue.stats_block_sums`; compiled on a GPU,
    else in Pallas interpret mode) gives the XLA epilogue's block sums
    (`_folded_block_sums`, or `_planes` and `combine`) within float32 rounding, folded or
    not, in a row step, with keys in use, and zeros without keys; it never reads the
    entries of key tiles a row tile does not see (NaN here)."""
    geom = _geom(1, 2, 1, q_len, k_len, 64, 8, block_size, causal)
    options = {"causal": causal, "fold": fold, "call_rows": call_rows,
               "stats_epilogue": True}
    plan = estimate_plan.estimate_plan(geom, jnp.bfloat16, **options)
    assert plan.stats_epilogue and plan.fold == fold and plan.call_rows == (call_rows or 0)
    cols = geom.k_cols if cols is None else cols
    got, want = _epilogue_block_sums(plan, causal, cols, first_row, sees_keys, interpret)
    q_blocks = plan.call_rows // geom.block_rows if plan.call_rows else geom.q_blocks
    assert got.shape == want.shape == (1, 2, q_blocks, geom.k_blocks)
    assert not np.isnan(got).any()
    if sees_keys:
        assert npr.rel_err(got, want) <= F32_RTOL
    else:
        assert not got.any() and not want.any()


@pytest.mark.parametrize("interpret", EPILOGUE_MODES)
def test_stats_epilogue_on_random_geometries(rand, interpret):
    """As above on 6 geometries drawn at random (batch, GQA, Lq <= Lk with partial stride
    groups, strides 4-16, blocks 64-2048, key tiles of 64-256 columns, streamed or
    resident queries, folded or plain, keys in use), random statistics included."""
    rng, checked = rand.rng, 0
    while checked < 6:
        stride = int(rng.choice([4, 8, 16]))
        block = int(rng.choice([64, 128, 256, 512, 1024, 2048]))
        k_len = int(rng.integers(1, 12)) * 512 + int(rng.choice([0, 37, 500]))
        causal = bool(rng.integers(2))
        q_len = k_len if causal and rng.random() < 0.6 else min(
            k_len, int(rng.integers(1, k_len // 256 + 2)) * 256)
        heads = [(2, 1), (2, 2), (4, 2), (3, 1)][rng.integers(4)]
        options = {"causal": causal, "stats_epilogue": True,
                   "block_k": int(rng.choice([64, 128, 256])),
                   "queries": str(rng.choice(QUERY_LAYOUTS))}
        try:
            geom = _geom(int(rng.integers(1, 3)), *heads, q_len, k_len,
                         int(rng.choice([64, 128])), stride, block, causal)
            plan = estimate_plan.estimate_plan(geom, jnp.bfloat16, **options)
        except ValueError:  # a drawn block or tile the plan refuses
            continue
        cols = geom.k_cols
        if not causal and rng.random() < 0.4:
            cols = int(rng.integers(1, geom.k_cols + 1))
        got, want = _epilogue_block_sums(plan, causal, cols, 0, True, interpret, rng)
        where = f"{geom} {options} fold={plan.fold} cols={cols} {rand}"
        assert got.shape == want.shape and not np.isnan(got).any(), where
        assert npr.rel_err(got, want) <= F32_RTOL, where
        checked += 1


def _epilogue_block_sums(plan, causal: bool, cols: int, first_row: int, sees_keys: bool,
                         interpret: bool, rng=None) -> tuple[np.ndarray, np.ndarray]:
    """Block sums of random statistics in `plan`'s layout (NaN at the entries of key
    tiles a row tile does not see): the epilogue kernel's and XLA's (`_folded_block_sums`,
    or `_planes` and `combine`), for a call from reshaped query row `first_row` with
    `cols` key columns in use."""
    from xattn_jax.mosaic import epilogue

    geom = plan.geom
    q_blocks = plan.call_rows // geom.block_rows if plan.call_rows else geom.q_blocks
    if plan.fold:
        unfolded = dataclasses.replace(plan, fold=False)
        given = _folded(plan, _random_stats(unfolded.stats_shape, plan.units_per_tile, rng))
        want = block_sums._folded_block_sums(jnp.asarray(given), plan, sees_keys)
    else:
        given = _random_stats(plan.stats_shape, plan.units_per_tile, rng)
        row0 = first_row + np.arange(given.shape[-1] // plan.rows) * plan.rows
        for i, seen in enumerate(estimate_plan.visible_tiles(plan, causal, row0, cols)):
            given[:, :, seen:, :, i * plan.rows:(i + 1) * plan.rows] = np.nan
        planes = block_sums._planes(jnp.asarray(given), plan, causal, first_row,
                                    jnp.int32(cols))
        want = row_statistics.combine(*planes, geom, plan.unit, first_row, q_blocks,
                                      sees_keys)
    scalars = jnp.array([cols, first_row, sees_keys], jnp.int32)
    got = epilogue.stats_block_sums(jnp.asarray(given), scalars, plan=plan, causal=causal,
                                    q_blocks=q_blocks, interpret=interpret)
    return np.asarray(got), np.asarray(want)


def test_stats_epilogue_defaults_and_refusal():
    """The epilogue kernel runs by default where the statistics are folded (whole causal
    calls: FOLDED_STATS_EPILOGUE), XLA's reductions elsewhere (non-causal calls, row
    steps, chunks); stats_epilogue=True needs power-of-two key tiles and blocks."""
    def plan(q_len, k_len, block_size=128, **options):
        geom = Geometry(1, 32, 8, q_len, k_len, 128, 8, block_size)
        return estimate_plan.estimate_plan(geom, jnp.bfloat16, **options)

    assert estimate_plan.FOLDED_STATS_EPILOGUE
    assert plan(32768, 32768, causal=True).stats_epilogue
    assert plan(131072, 131072, causal=True).stats_epilogue
    assert not plan(32768, 32768, causal=True, fold=False).stats_epilogue
    assert not plan(65536, 65536).stats_epilogue
    assert not plan(4096, 65536, block_size=1024).stats_epilogue
    assert not plan(1 << 20, 1 << 20, causal=True).stats_epilogue  # row steps
    assert not plan(32768, 32768, block_size=192, causal=True).stats_epilogue
    for options in ({"block_size": 192}, {"block_k": 192}):
        with pytest.raises(ValueError, match="stats_epilogue needs"):
            plan(32768, 32768, causal=True, stats_epilogue=True, **options)


def test_a_bound_holding_only_the_folded_statistics_takes_the_causal_call():
    """Causal 16K, 8 heads: 5.06 MiB of folded statistics, 9 MiB unfolded, 9.56 MiB for a
    row step holding a wave of row tiles. Within 6 MiB the Mosaic kernel takes the causal
    call as one folded call; the non-causal one, and the causal one unfolded, run in head
    steps of 4 heads (1.125 MiB a head: 5 fit, but 2 steps of 4 compute no head twice);
    within 1 MiB nothing fits (refused)."""
    geom = Geometry(1, 8, 8, 16384, 16384, 128, 8, 128)
    bound = 6 << 20
    plan = estimate_plan.estimate_plan(geom, jnp.bfloat16, causal=True,
                                       max_scratch_bytes=bound)
    assert (plan.fold, plan.call_rows, plan.call_heads) == (True, 0, 0)
    assert plan.scratch_bytes <= bound < plan.row_scratch_bytes * plan.padded_rows
    assert estimate_plan.unsupported_reason(geom, jnp.bfloat16, causal=True,
                                            max_scratch_bytes=bound) is None
    for causal, options in ((False, {}), (True, {"fold": False})):
        assert estimate_plan.unsupported_reason(geom, jnp.bfloat16, causal=causal,
                                                max_scratch_bytes=bound) is None
        stepped = estimate_plan.estimate_plan(geom, jnp.bfloat16, causal=causal,
                                              max_scratch_bytes=bound, **options)
        assert (stepped.fold, stepped.call_rows, stepped.call_heads) == (False, 0, 4)
        assert stepped.scratch_bytes == 4 * (9 << 20) // 8 <= bound
    assert "a wave of row tiles" in estimate_plan.unsupported_reason(
        geom, jnp.bfloat16, max_scratch_bytes=1 << 20)
    chosen, reason = impls._mosaic_plan(geom, jnp.bfloat16, True, False, None, bound,
                                        auto=False)
    assert reason is None and chosen == plan


def test_row_steps_bound_the_statistics_and_fill_the_waves():
    """A call whose statistics exceed the bound, and one head's too, runs in row steps of
    every head: each step's statistics within the bound, whole row tiles and query
    blocks, and the step size with the fewest waves of CTAs in all (`device_sms`: 132 on
    CPU and an H200). Non-causal 128K, 32 heads (2.25 GiB, 72 MiB a head) runs head
    steps instead. 1M: 4.5 GiB a head; steps of 1024 rows (256 CTAs: 2 waves, 128 steps)
    take fewer waves than 1280 (320 CTAs: 3 waves, 103 steps); 512 (128 CTAs) would
    leave SMs idle. Within 3 GiB, 2048 rows (512 CTAs, 4 waves, 64 steps) tie with 1024
    and are taken (the larger). Within 600 MiB (533 rows of every head: 133 CTAs at 512
    rows, short of the wave 640 rows give) it runs row steps of one head instead
    (`test_row_steps_of_one_head_take_the_calls_no_other_step_fits`); a bound holding
    none of the three steps is refused."""
    long = Geometry(1, 32, 8, 131072, 131072, 128, 8, 128)
    whole = estimate_plan.estimate_plan(Geometry(1, 32, 8, 65536, 65536, 128, 8, 128),
                                        jnp.bfloat16)
    assert whole.call_rows == 0 and whole.rows_per_call == 8192
    heads = estimate_plan.estimate_plan(long, jnp.bfloat16)
    assert (heads.call_rows, heads.call_heads) == (0, 16)
    assert heads.scratch_bytes == 16 * (72 << 20)
    million = Geometry(1, 32, 32, 1 << 20, 1 << 20, 128, 8, 128)
    plan = estimate_plan.estimate_plan(million, jnp.bfloat16)
    assert (plan.call_rows, plan.call_heads, plan.row_quantum) == (1024, 0, 128)
    assert plan.scratch_bytes <= estimate_plan.MAX_SCRATCH_BYTES
    assert dataclasses.replace(plan, call_rows=0, call_heads=1).scratch_bytes == 9 << 29
    large = estimate_plan.estimate_plan(million, jnp.bfloat16, max_scratch_bytes=3 << 30)
    assert (large.call_rows, large.scratch_bytes) == (2048, 2048 * 1179648)
    steps = estimate_plan.estimate_plan(million, jnp.bfloat16, max_scratch_bytes=600 << 20)
    assert (steps.call_heads, steps.call_rows) == (1, 16384)
    # 8 MiB: 227 rows of one head, one row tile (512 work items, of the 528 of 4 per SM)
    rule = ("one row step of a wave of row tiles \\(640 rows of every head\\), or "
            "4831838208 bytes for a head step of one head's rows \\(1024 CTAs, of the 99 a "
            "step needs\\), or 9437184 bytes for a row step of one head \\(256 rows, "
            "132 CTAs\\)")
    assert re.search(rule, estimate_plan.unsupported_reason(million, jnp.bfloat16,
                                                            max_scratch_bytes=8 << 20))
    with pytest.raises(ValueError, match="a wave of row tiles"):
        estimate_plan.estimate_plan(million, jnp.bfloat16, max_scratch_bytes=8 << 20)
    # blocks of 4096 tokens (512 rows): steps of whole query blocks, a wave at least
    wide = estimate_plan.estimate_plan(Geometry(1, 32, 8, 1 << 20, 1 << 20, 128, 8, 4096),
                                       jnp.bfloat16, max_scratch_bytes=256 << 20)
    assert wide.row_quantum == 512 and wide.call_rows == 2048
    assert wide.call_rows // 128 * 32 >= estimate_plan.device_sms()
    assert wide.padded_rows >= wide.geom.q_blocks * wide.geom.block_rows
    with pytest.raises(ValueError, match="call_rows must be 0 or a positive multiple of 128"):
        estimate_plan.estimate_plan(long, jnp.bfloat16, call_rows=200)
    paired = estimate_plan.estimate_plan(million, jnp.bfloat16, pair_rows=True)
    assert plan.call_rows and not paired.paired(True)  # row steps: a row tile per CTA


def test_row_steps_and_auto_follow_the_device_sms(monkeypatch):
    """On a Hopper of fewer SMs (an H100 PCIe: 114) a wave is 114 CTAs: non-causal 1M
    within 600 MiB of statistics (533 rows of every head; one head's are 4.5 GiB) runs
    row steps of 512 rows of every head (128 CTAs), where 132 SMs need 640 and take row
    steps of one head instead; and "auto" takes calls from 85 CTAs."""
    million = Geometry(1, 32, 8, 1 << 20, 1 << 20, 128, 8, 128)
    bound = 600 << 20
    monkeypatch.setattr(estimate_plan, "device_sms", lambda: 132)  # an H200
    plan = estimate_plan.estimate_plan(million, jnp.bfloat16, max_scratch_bytes=bound)
    assert (plan.call_heads, plan.call_rows) == (1, 16384)
    assert estimate_plan.auto_min_ctas() == 99
    monkeypatch.setattr(estimate_plan, "device_sms", lambda: 114)
    plan = estimate_plan.estimate_plan(million, jnp.bfloat16, max_scratch_bytes=bound)
    assert (plan.call_heads, plan.call_rows) == (0, 512) and plan.scratch_bytes <= bound
    assert estimate_plan.auto_min_ctas() == 85


def test_head_steps_take_the_calls_no_row_step_of_a_wave_fits():
    """Where no row step of a wave of row tiles fits the bound, a call runs in head steps
    of whole heads: the most heads whose statistics fit, their CTAs (key groups
    included) at least `auto_min_ctas`. Causal 128K (32 heads) within 64 MiB: one head
    a step, folded (36.6 MiB), on the listed persistent grid (132 CTAs; compacted in 4
    key groups, 320 CTAs, where key_groups is given). Non-causal 64K
    block 64: one head (34 MiB), 2 key groups (128 CTAs). GQA 32:8 causal 32K within 16
    MiB: 6 heads fit (2.4 MiB each), but 8 steps of 4 compute no head twice (6 steps of
    6 would compute 36). Explicit call_heads (all rows; steps of 3 start inside a key
    head's query heads) and its refusals."""
    causal_128k = Geometry(1, 32, 8, 131072, 131072, 128, 8, 128)
    bound = 64 << 20
    plan = estimate_plan.estimate_plan(causal_128k, jnp.bfloat16, causal=True,
                                       max_scratch_bytes=bound)
    assert (plan.call_heads, plan.call_rows, plan.fold, plan.key_groups) == (1, 0, True, 1)
    assert (plan.heads, plan.pairs, plan.ctas(True)) == (1, 1, 132)
    assert plan.scratch_bytes == plan.stats_shape[2] * 18 * 8192 * 4 <= bound
    assert plan.stats_shape[:2] == (1, 1) and plan.listed(True) and not plan.compacted(True)
    grouped = estimate_plan.estimate_plan(causal_128k, jnp.bfloat16, causal=True,
                                          max_scratch_bytes=bound, key_groups=4)
    assert (grouped.call_heads, grouped.fold, grouped.ctas(True)) == (1, True, 320)
    assert grouped.compacted(True) and not grouped.persistent_ctas
    wide = estimate_plan.estimate_plan(Geometry(1, 32, 8, 65536, 65536, 128, 8, 64),
                                       jnp.bfloat16, max_scratch_bytes=bound)
    assert (wide.call_heads, wide.key_groups, wide.ctas(False)) == (1, 2, 128)
    assert wide.scratch_bytes == 34 << 20
    gqa = estimate_plan.estimate_plan(Geometry(1, 32, 8, 32768, 32768, 128, 8, 128),
                                      jnp.bfloat16, causal=True, max_scratch_bytes=16 << 20)
    assert (gqa.call_heads, gqa.fold) == (4, True) and gqa.scratch_bytes <= 16 << 20
    assert estimate_plan.unsupported_reason(causal_128k, jnp.bfloat16, causal=True,
                                            max_scratch_bytes=bound) is None
    # a head's folded statistics over the bound, and 1152 rows of one (132 CTAs walking
    # 4 work items each): refused, the three counts in the reason
    reason = estimate_plan.unsupported_reason(causal_128k, jnp.bfloat16, causal=True,
                                              max_scratch_bytes=4 << 20)
    assert re.search(r"\(640 rows of every head\), or 38338560 bytes for a head step of "
                     r"one head's rows \(320 CTAs, of the 99 a step needs\), or 5308416 "
                     r"bytes for a row step of one head \(1152 rows, 132 CTAs\)", reason)
    with pytest.raises(ValueError, match="or 38338560 bytes for a head step"):
        estimate_plan.estimate_plan(causal_128k, jnp.bfloat16, causal=True,
                                    max_scratch_bytes=4 << 20)
    # fewer CTAs than "auto" runs on Mosaic: 16K non-causal, 2 heads of 32 row tiles
    few = Geometry(1, 2, 2, 16384, 16384, 128, 8, 128)
    assert ("(64 CTAs, of the 99 a step needs), or no row step of one head has the work"
            in estimate_plan.unsupported_reason(few, jnp.bfloat16, max_scratch_bytes=1 << 20))
    explicit = estimate_plan.estimate_plan(causal_128k, jnp.bfloat16, causal=True,
                                           call_heads=3)
    assert (explicit.call_heads, explicit.call_rows, explicit.fold) == (3, 0, True)
    for options in ({"call_heads": 33}, {"call_heads": -1}):
        with pytest.raises(ValueError, match="call_heads must be in \\[0, 32\\]"):
            estimate_plan.estimate_plan(causal_128k, jnp.bfloat16, causal=True, **options)


def test_row_steps_of_one_head_take_the_calls_no_other_step_fits():
    """Where neither a head step nor a row step of a wave of every head fits the bound, a
    call runs in row steps of one head (`_head_rows`) on the persistent grid: each step's
    statistics within the bound, at least 4 work items per SM, the fewest steps a head,
    then the fewest items on the busiest SM, then the fewest rows computed. Non-causal
    128K (72 MiB a head) within 64 MiB: block 128, 2 steps of 8192 rows (4096 items, 36
    MiB); block 64 (136 MiB a head), 3 steps of 5504 rows (43 row tiles x 64 key tiles:
    21 items on the busiest SM, where 5632 rows give 22). A step where
    key_groups are given keeps them (128 CTAs at 2). Causal 128K within 32 MiB (one
    head folded: 36.6 MiB): steps of 5504 rows, unfolded, each step's items listed
    (484, 1408 and 2311 a head: the first rows see few key tiles). Explicit
    call_heads with call_rows, and the refusal of call_rows not a multiple of the row
    quantum."""
    bound = 64 << 20
    for block, rows in ((128, 8192), (64, 5504)):
        geom = Geometry(1, 32, 8, 131072, 131072, 128, 8, block)
        assert estimate_plan.unsupported_reason(geom, jnp.bfloat16,
                                                max_scratch_bytes=bound) is None
        plan = estimate_plan.estimate_plan(geom, jnp.bfloat16, max_scratch_bytes=bound)
        assert (plan.call_heads, plan.call_rows, plan.key_groups) == (1, rows, 1)
        assert plan.persistent_ctas == 132 and not plan.listed(False)
        assert plan.scratch_bytes <= bound
        assert plan.stats_shape == (1, 1, 64, plan.stat_planes, rows)
    grouped = estimate_plan.estimate_plan(geom, jnp.bfloat16, max_scratch_bytes=bound,
                                          key_groups=2)
    assert (grouped.call_heads, grouped.key_groups, grouped.persistent_ctas) == (1, 2, 0)
    assert grouped.ctas(False) == grouped.call_rows // 128 * 2 >= 99
    causal_128k = Geometry(1, 32, 8, 131072, 131072, 128, 8, 128)
    causal = estimate_plan.estimate_plan(causal_128k, jnp.bfloat16, causal=True,
                                         max_scratch_bytes=32 << 20)
    assert (causal.call_heads, causal.call_rows, causal.fold) == (1, 5504, False)
    assert (causal.key_groups, causal.persistent_ctas) == (1, 132)
    assert causal.listed(True) and causal.scratch_bytes <= 32 << 20
    assert list(estimate_plan.items_table(causal)[:, 0]) == [484, 1408, 2311]
    both = estimate_plan.estimate_plan(causal_128k, jnp.bfloat16, causal=True,
                                       call_heads=2, call_rows=1024)
    assert (both.call_heads, both.call_rows, both.fold) == (2, 1024, False)
    assert both.stats_shape[1] == 2 and both.stats_shape[-1] == 1024
    with pytest.raises(ValueError, match="call_rows must be 0 or a positive multiple of 128"):
        estimate_plan.estimate_plan(causal_128k, jnp.bfloat16, call_heads=2, call_rows=200)


@pytest.mark.parametrize("q_heads, q_len, k_len, groups", [
    (32, 4096, 131072, 1),  # a chunk on 32 heads: 128 CTAs, a wave already
    (16, 4096, 131072, 2),  # its half (two GPUs): 64 CTAs, 2 x 64 fill the wave best
    (8, 4096, 65536, 4),  # a quarter: 32 CTAs, 4 x 32
    (10, 4096, 65536, 3),  # 40 CTAs: 3 x 40 = 120 of a wave of 132; 2 or 4 x 40 fill less
    (2, 1024, 2048, 1),  # one key tile: nothing to split
])
def test_default_key_groups_fill_the_waves(q_heads, q_len, k_len, groups):
    """A whole call of fewer CTAs than SMs (one per row tile) takes the key groups whose
    CTAs fill their waves best; a row-stepped call takes none (each step holds a wave)."""
    geom = Geometry(1, q_heads, max(q_heads // 4, 1), q_len, k_len, 128, 8, 1024)
    plan = estimate_plan.estimate_plan(geom, jnp.bfloat16)
    assert plan.key_groups == groups
    assert plan.ctas(False) == q_heads * q_len // 8 // plan.rows * groups
    long = Geometry(1, 32, 32, 131072, 131072, 128, 8, 128)
    assert estimate_plan.estimate_plan(long, jnp.bfloat16).key_groups == 1


def _launch_order(plan, causal):
    """The key tiles each CTA of a call from row 0 walks, in launch order (the grid's
    last axis fastest, as `tile_stats._grid` lays it out)."""
    pairs, rows = plan.pairs, plan.grid_rows(causal)
    group = plan.launch_group(causal)
    tiles = [int(estimate_plan.visible_tiles(plan, causal, (rows - 1 - r) * plan.rows))
             for r in range(rows)]  # row group r walks the row tile R - 1 - r
    return [tiles[r] for _ in range(pairs // group) for r in range(rows) for _ in range(group)]


def _idle_share(work, sms):
    """The SMs' idle share when each CTA in turn takes the SM that frees first."""
    free = [0] * sms
    for tiles in work:
        heapq.heapreplace(free, free[0] + tiles)
    return 1 - sum(work) / sms / max(free)


@pytest.mark.parametrize("q_len, kv_heads, group, idle", [
    (16384, 8, 16, 0.04), (32768, 8, 8, 0.02), (65536, 8, 4, 0.01),  # a wave of CTAs
    (16384, 32, 4, 0.17), (32768, 32, 2, 0.10),  # the key heads in LAUNCH_KEY_BYTES
    (65536, 32, 1, 0.06),
    # one key head's pairs (its keys exceed the bound), 2 of which fill a wave: 128K is
    # one call with folded statistics (256 CTAs), not row steps of 64 row tiles a head
    (131072, 8, 2, 0.01)])
def test_causal_launch_groups_keep_the_sms_busy(monkeypatch, q_len, kv_heads, group, idle):
    """Causal calls of one key group launch the row tiles of the fewest (batch, head)
    pairs whose CTAs fill a wave interleaved, longest first, unless their key heads'
    keys exceed LAUNCH_KEY_BYTES (then as many key heads' pairs as it holds, at least
    one's): on 132 SMs less idle time than one pair's row tiles after another (5.5-21% at
    16K-64K, 0.5% at 128K); non-causal calls, causal calls in key groups (the default),
    clusters and paired row tiles keep one pair at a time; head_group overrides the rule
    and is checked."""
    monkeypatch.setattr(estimate_plan, "device_sms", lambda: 132)
    geom = Geometry(1, 32, kv_heads, q_len, q_len, 128, 8, 128)
    plan = estimate_plan.estimate_plan(geom, jnp.bfloat16, causal=True, key_groups=1)
    assert plan.launch_group(True) == group and plan.launch_group(False) == 1
    grouped = estimate_plan.estimate_plan(geom, jnp.bfloat16, causal=True)
    assert (grouped.key_groups, grouped.launch_group(True)) == (4, 1)
    head_keys = q_len * 128 * 2  # bf16 keys of one key head
    assert group == geom.group or group // geom.group * head_keys <= (
        estimate_plan.LAUNCH_KEY_BYTES)
    idle_share = _idle_share(_launch_order(plan, True), 132)
    assert idle_share <= idle
    if not plan.call_rows:  # (the model walks one call from row 0)
        one_at_a_time = estimate_plan.estimate_plan(geom, jnp.bfloat16, causal=True,
                                                    key_groups=1, head_group=1)
        alone = _idle_share(_launch_order(one_at_a_time, True), 132)
        assert alone >= max(idle_share, 0.05 if q_len <= 65536 else 0.0)
    clustered = estimate_plan.estimate_plan(geom, jnp.bfloat16, queries="resident", cluster=2)
    assert clustered.launch_group(True) == 1
    paired = estimate_plan.estimate_plan(geom, jnp.bfloat16, causal=True, pair_rows=True)
    assert paired.paired(True) and paired.launch_group(True) == 1
    assert estimate_plan.estimate_plan(geom, jnp.bfloat16, head_group=2).launch_group(True) == 2
    for options in ({"head_group": 3}, {"head_group": 0},
                    {"head_group": 2, "queries": "resident", "cluster": 2},
                    {"head_group": 2, "persistent": True}):
        with pytest.raises(ValueError,
                           match=r"head_group must divide the \d+ \(batch, head\) pairs"):
            estimate_plan.estimate_plan(geom, jnp.bfloat16, **options)


def test_persistent_plan_and_refusals():
    """persistent: one CTA per SM (`device_sms`: HOPPER_SMS off a GPU), at most one per
    work item (in a head step: the step's), the items of a key tile in blocks of
    ROW_BLOCK_TILES row tiles; refused with the resident queries, a cluster, key groups
    or pair_rows. By default causal calls in steps run on it: row steps of whole rows
    (1M; each step's items listed) and head steps (256K; its items listed) of at least
    PERSISTENT_MIN_ITEMS items per SM, but not whole calls (128K: key groups),
    non-causal calls, or a call given persistent=False, key_groups or head_group."""
    geom = Geometry(1, 32, 32, 32768, 32768, 128, 8, 128)
    plan = estimate_plan.estimate_plan(geom, jnp.bfloat16, persistent=True)
    assert (plan.persistent_ctas, plan.ctas(True), plan.key_groups) == (132, 132, 1)
    assert (plan.row_block_tiles, plan.row_blocks) == (32, 1)
    items, tiles = estimate_plan.work_items(plan)
    assert (int(items), int(tiles)) == (32 * 32 * 16, 16)
    assert int(estimate_plan.work_items(plan, 1000)[0]) == 32 * 32 * 4
    long = Geometry(1, 32, 32, 131072, 131072, 128, 8, 128)
    heads = estimate_plan.estimate_plan(long, jnp.bfloat16, persistent=True)
    assert (heads.call_heads, heads.persistent_ctas, heads.row_block_tiles,
            heads.row_blocks) == (16, 132, 64, 2)
    stepped = estimate_plan.estimate_plan(long, jnp.bfloat16, persistent=True, call_rows=4096)
    assert (stepped.row_block_tiles, stepped.row_blocks) == (32, 1)
    million = Geometry(1, 32, 32, 1 << 20, 1 << 20, 128, 8, 128)
    default = estimate_plan.estimate_plan(million, jnp.bfloat16, causal=True)
    assert (default.persistent_ctas, default.call_rows, default.key_groups) == (132, 1024, 1)
    for options in ({"persistent": False}, {"key_groups": 1}, {"head_group": 1}):
        plan_given = estimate_plan.estimate_plan(million, jnp.bfloat16, causal=True, **options)
        assert (plan_given.persistent_ctas, plan_given.call_rows) == (0, 1024), options
    quarter = Geometry(1, 32, 32, 262144, 262144, 128, 8, 128)
    head_steps = estimate_plan.estimate_plan(quarter, jnp.bfloat16, causal=True)
    assert (head_steps.call_heads, head_steps.persistent_ctas, head_steps.key_groups,
            head_steps.fold) == (8, 132, 1, True)
    assert head_steps.listed(True) and not head_steps.listed(False)
    assert default.listed(True)  # per row step: 128 steps, the first rows seeing least
    table = estimate_plan.items_table(default)
    assert table.shape[0] == 128 and table[0, 0] < table[-1, 0] == table.shape[1] - 1
    assert default.persistent_ctas == 132
    for length, causal in ((131072, True), (1 << 20, False), (262144, False)):
        other = estimate_plan.estimate_plan(Geometry(1, 32, 32, length, length, 128, 8, 128),
                                            jnp.bfloat16, causal=causal)
        assert not other.persistent_ctas, (length, causal)
    # 4 heads of causal 16K within 4 MiB: 288 listed items, under 4 per SM
    small = estimate_plan.estimate_plan(Geometry(1, 32, 32, 16384, 16384, 128, 8, 128),
                                        jnp.bfloat16, causal=True, max_scratch_bytes=4 << 20)
    assert (small.call_heads, small.key_groups, small.persistent_ctas) == (4, 4, 0)
    assert len(estimate_plan.listed_items(small)) * small.pairs == 288
    assert 288 < estimate_plan.PERSISTENT_MIN_ITEMS * estimate_plan.HOPPER_SMS
    tiny = Geometry(1, 2, 1, 256, 4096, 128, 8, 64)  # 2 heads x 1 row tile x 2 key tiles
    assert estimate_plan.estimate_plan(tiny, jnp.bfloat16, persistent=True).ctas(False) == 4
    # causal 4K: 4 row tiles x 2 key tiles, the first two row tiles seeing one: a CTA
    # per listed item (6), none walking nothing
    short = estimate_plan.estimate_plan(Geometry(1, 1, 1, 4096, 4096, 128, 8, 128),
                                        jnp.bfloat16, causal=True, persistent=True)
    assert short.listed(True) and estimate_plan.listed_items(short) == (0, 1, 2, 3, 6, 7)
    assert short.persistent_ctas == 6
    assert not estimate_plan.estimate_plan(geom, jnp.bfloat16).persistent_ctas
    for options in ({"queries": "resident"}, {"key_groups": 2}, {"pair_rows": True}):
        with pytest.raises(ValueError, match="persistent needs queries='streamed'"):
            estimate_plan.estimate_plan(geom, jnp.bfloat16, persistent=True, **options)


def test_key_groups_plan_and_refusals():
    """key_groups G: G CTAs per row tile on the grid's row axis, spans of ceil(T / G)
    key tiles; refused with a cluster, with pair_rows, beyond the key tiles."""
    half = Geometry(1, 16, 4, 4096, 131072, 128, 8, 1024)  # a chunk on one of two GPUs
    plan = estimate_plan.estimate_plan(half, jnp.bfloat16, key_groups=1)
    assert (plan.key_groups, plan.ctas(False)) == (1, 64)
    split = estimate_plan.estimate_plan(half, jnp.bfloat16, key_groups=2)
    assert (split.grid_rows(False), split.ctas(False), split.key_span) == (8, 128, 32)
    three = estimate_plan.estimate_plan(half, jnp.bfloat16, key_groups=3)
    assert three.key_span == 22 and 3 * three.key_span >= three.key_tiles == 64
    geom = Geometry(1, 4, 2, 1024, 8192, 128, 8, 128)  # 4 key tiles
    for options, rule in (({"key_groups": 0}, "at least 1"),
                          ({"key_groups": 2, "pair_rows": True}, "1 with a cluster or pair"),
                          ({"key_groups": 2, "queries": "resident", "cluster": 2},
                           "1 with a cluster or pair"),
                          ({"key_groups": 5}, "at most the 4 key tiles")):
        with pytest.raises(ValueError, match=rule):
            estimate_plan.estimate_plan(geom, jnp.bfloat16, **options)


def test_causal_calls_take_key_groups():
    """A causal call's default plan splits each row tile's key tiles among
    CAUSAL_KEY_GROUPS CTAs (at most its key tiles) up to 32 MiB of keys a head (causal
    1M's 256 MiB take none); they size its head steps, which then run on the persistent
    grid (unfolded, causal 128K takes the non-causal call's steps of 16 heads; folded, it
    is one call, and within 64 MiB steps of one head); the same call non-causal, explicit
    key groups, pair_rows, clusters and the persistent grid keep theirs."""
    geom = Geometry(1, 32, 32, 32768, 32768, 128, 8, 128)  # 16 key tiles
    plan = estimate_plan.estimate_plan(geom, jnp.bfloat16, causal=True)
    assert estimate_plan.CAUSAL_KEY_GROUPS == 4
    # 32 row tiles seeing 1, 1, 2, 2, .. 16 tiles: 8 take 1 CTA, 8 take 2, 3 and 4
    assert (plan.key_groups, plan.key_span, plan.ctas(True)) == (4, 4, 32 * 80)
    assert estimate_plan.estimate_plan(geom, jnp.bfloat16).key_groups == 1
    for options, groups in (({"key_groups": 2}, 2), ({"pair_rows": True}, 1),
                            ({"cluster": 2}, 1), ({"persistent": True}, 1)):
        assert estimate_plan.estimate_plan(geom, jnp.bfloat16, causal=True,
                                           **options).key_groups == groups
    short = Geometry(1, 8, 8, 4096, 4096, 128, 8, 128)  # 512 key columns: 2 key tiles
    assert estimate_plan.estimate_plan(short, jnp.bfloat16, causal=True).key_groups == 2
    long = Geometry(1, 32, 32, 131072, 131072, 128, 8, 128)
    whole = estimate_plan.estimate_plan(long, jnp.bfloat16, causal=True)
    stepped = estimate_plan.estimate_plan(long, jnp.bfloat16, causal=True, fold=False)
    alone = estimate_plan.estimate_plan(long, jnp.bfloat16)
    assert (whole.key_groups, whole.call_rows, whole.fold) == (4, 0, True)
    assert stepped.call_heads == alone.call_heads == 16
    # head steps sized by their key-grouped CTAs, then run on the persistent grid
    assert (stepped.key_groups, stepped.persistent_ctas) == (1, 132)
    grouped = estimate_plan.estimate_plan(long, jnp.bfloat16, causal=True, fold=False,
                                          persistent=False)
    assert (grouped.key_groups, grouped.call_heads) == (4, 16)
    bounded = estimate_plan.estimate_plan(long, jnp.bfloat16, causal=True,
                                          max_scratch_bytes=64 << 20)  # head steps
    assert (bounded.key_groups, bounded.call_heads, bounded.fold) == (1, 1, True)
    assert bounded.persistent_ctas == 132
    assert stepped.head_key_bytes == estimate_plan.CAUSAL_KEY_GROUPS_MAX_BYTES == 32 << 20
    longest = Geometry(1, 32, 32, 1 << 20, 1 << 20, 128, 8, 128)
    assert estimate_plan.estimate_plan(longest, jnp.bfloat16, causal=True).key_groups == 1


@pytest.mark.parametrize("q_len, k_len, stride, block_size, block_k, groups", [
    (32768, 32768, 8, 128, 256, 4), (4096, 7168, 8, 128, 256, 3), (2900, 4948, 8, 128, 128, 4),
    (6144, 6144, 16, 256, 256, 2), (1000, 1256, 2, 64, 64, 3)])
def test_compacted_grid_holds_exactly_the_walking_ctas(q_len, k_len, stride, block_size,
                                                        block_k, groups):
    """A whole causal call in key groups launches one CTA per (row tile, key group) whose
    span holds a tile the row tile sees, the longest row tiles first: every visible tile
    is walked exactly once and no CTA walks none. Row steps, non-causal calls and one
    key group keep the full grid."""
    geom = Geometry(1, 4, 2, q_len, k_len, 128, stride, block_size)
    plan = estimate_plan.estimate_plan(geom, jnp.bfloat16, causal=True, block_k=block_k,
                                       key_groups=groups)
    assert plan.compacted(True) and not plan.compacted(False)
    cells = estimate_plan.walked_cells(plan)
    rows = plan.row_groups(True)
    assert plan.grid_rows(True) == len(cells) and plan.grid_rows(False) == rows * groups
    seen = [int(estimate_plan.visible_tiles(plan, True, (rows - 1 - g) * plan.rows))
            for g in range(rows)]
    walked = [min(seen[c // groups] - c % groups * plan.key_span, plan.key_span)
              for c in cells]
    assert min(walked) > 0 and sum(walked) == sum(seen)
    assert list(cells) == sorted(cells)  # row groups in launch order, spans in turn
    assert [c // groups for c in cells] == [g for g in range(rows)
                                            for _ in range(-(-seen[g] // plan.key_span))]
    assert not estimate_plan.estimate_plan(geom, jnp.bfloat16, causal=True,
                                           key_groups=1).compacted(True)
    stepped = estimate_plan.estimate_plan(geom, jnp.bfloat16, causal=True, block_k=block_k,
                                          key_groups=groups, call_rows=plan.row_quantum)
    assert not stepped.compacted(True) and stepped.grid_rows(True) == (
        stepped.row_groups(True) * groups)


@pytest.mark.parametrize("q_len, k_len, block_tiles, call_rows", [
    (4096, 4096, 64, 0), (4096, 4096, 3, 0), (2560, 8192, 4, 0), (6000, 6000, 64, 0),
    (4096, 4096, 64, 128), (6000, 6000, 2, 256), (2560, 8192, 4, 128)])
def test_listed_items_are_exactly_the_visible_tiles(monkeypatch, q_len, k_len,
                                                    block_tiles, call_rows):
    """A listed persistent grid (a causal call) walks each (row tile, key tile) its row
    tile sees exactly once, in `work_items` order: key tile by key tile within blocks
    of ROW_BLOCK_TILES row tiles (the last block part empty where they do not divide
    the row tiles), and nothing else; in row steps, each step those of its own rows
    (`step_first_rows`, as `row_statistics.in_steps` walks them, the last step moved
    back to end at the last query block), its row of `items_table` the number of them
    (as `listed_counts` counts them), the items, then zeros."""
    monkeypatch.setattr(estimate_plan, "ROW_BLOCK_TILES", block_tiles)
    geom = Geometry(1, 4, 2, q_len, k_len, 128, 8, 128)
    plan = estimate_plan.estimate_plan(geom, jnp.bfloat16, causal=True, persistent=True,
                                       call_rows=call_rows)
    assert plan.listed(True) and not plan.listed(False)
    block, tiles = plan.row_block_tiles, plan.key_tiles
    table = estimate_plan.items_table(plan)
    first_rows = estimate_plan.step_first_rows(plan)
    if call_rows:  # steps of call_rows rows, the last one ending at the last block
        assert len(first_rows) == table.shape[0] == -(-geom.q_blocks * geom.block_rows
                                                      // call_rows)
        assert first_rows[-1] + call_rows == geom.q_blocks * geom.block_rows
        assert first_rows[:-1] == tuple(range(0, call_rows * (len(first_rows) - 1),
                                              call_rows))
    else:
        assert first_rows == (0,) and table.shape[0] == 1
    # counted without listing them, as the table's first column
    assert list(estimate_plan.listed_counts(plan)) == list(table[:, 0])
    for step, first_row in enumerate(first_rows):
        items = estimate_plan.listed_items(plan, step)
        assert list(items) == sorted(set(items))
        assert table[step, 0] == len(items) and not table[step, 1 + len(items):].any()
        walked = sorted((i // (block * tiles) * block + i % block, i // block % tiles)
                        for i in items)
        seen = estimate_plan.visible_tiles(
            plan, True, first_row + np.arange(plan.call_row_tiles) * plan.rows)
        assert walked == [(r, t) for r in range(plan.call_row_tiles)
                          for t in range(seen[r])]
        if not call_rows:
            assert list(seen) == list(estimate_plan.row_tiles_seen(plan))
        if q_len == k_len and step == 0:  # the tiles past the diagonal are left out
            assert len(items) < plan.call_row_tiles * tiles
        traced = jax.jit(lambda row: estimate_plan.row_step(plan, row))(first_row)
        assert int(traced) == step


@pytest.mark.parametrize("ctas", [1, 3, 132])
def test_listed_pair_walk_is_the_call_items_of_each_cta(ctas):
    """Pair by pair, `listed_pair_walk` hands CTA c of G exactly the items its share of
    the call's listed items c, c + G, c + 2G, .. names (item i = pair x n + k, n items a
    pair), in that order: also with fewer items a pair than CTAs, and none."""
    pairs = 7
    for per_pair in (0, 1, 2, 5, 131, 132, 133, 700):
        cta, pair = np.arange(ctas)[:, None], np.arange(pairs)[None, :]
        first, count = (np.asarray(x) for x in estimate_plan.listed_pair_walk(
            jnp.int32(pair), jnp.int32(per_pair), jnp.int32(cta), ctas))
        for c in range(ctas):
            walked = [(p, int(first[c, p]) + j * ctas)
                      for p in range(pairs) for j in range(int(count[c, p]))]
            assert walked == [divmod(i, per_pair) for i in range(c, pairs * per_pair, ctas)]


@pytest.mark.parametrize("q_len, k_len, call_rows, loops", [
    (1 << 20, 1 << 20, None, None), (6000, 6000, 256, 3), (2560, 8192, 128, 2),
    (6000, 6000, 256, 1), (4096, 4096, 128, 4)])
def test_epilogue_loops_read_every_slot_their_rows_see(q_len, k_len, call_rows, loops):
    """A causal call in row steps runs its epilogues in `epilogue_loops` loops: they
    take every row step once, in order, as even in number as they split, and each reads
    the slots of the most key tiles a row tile of its steps sees (`visible_tiles`), no
    fewer (a row's weights would miss a tile) and no more. Causal 1M by default: 16
    loops of 8 of its 128 row steps of 1024 rows, reading 32, 64, .. 512 of the 512
    slots.
    A non-causal call, and a bad count, are refused."""
    geom = Geometry(1, 32, 8, q_len, k_len, 128, 8, 128)
    plan = estimate_plan.estimate_plan(geom, jnp.bfloat16, causal=True, call_rows=call_rows,
                                       epilogue_loops=loops)
    loops_run = estimate_plan.epilogue_steps(plan, True)
    first_rows = estimate_plan.step_first_rows(plan)
    if loops is None:
        assert (plan.call_rows, plan.epilogue_loops) == (1024, estimate_plan.EPILOGUE_LOOPS)
        assert [(len(steps), slots) for steps, slots in loops_run] == [
            (8, 32 * (n + 1)) for n in range(16)]
    assert len(loops_run) == plan.epilogue_loops
    assert [n for steps, _ in loops_run for n in steps] == list(range(len(first_rows)))
    sizes = [len(steps) for steps, _ in loops_run]
    assert max(sizes) - min(sizes) <= 1
    for steps, slots in loops_run:
        seen = [int(estimate_plan.visible_tiles(plan, True, first_rows[n] + tile * plan.rows))
                for n in steps for tile in range(plan.call_row_tiles)]
        assert slots == max(seen) <= plan.key_tiles
    whole = estimate_plan.estimate_plan(geom, jnp.bfloat16, causal=False,
                                        call_rows=call_rows)
    assert estimate_plan.epilogue_steps(whole, False) == tuple(
        (steps, whole.key_tiles) for steps, _ in estimate_plan.epilogue_steps(whole, False))
    assert whole.epilogue_loops == 1
    for causal, bad in ((False, 2), (True, 0), (True, len(first_rows) + 1)):
        with pytest.raises(ValueError, match="epilogue_loops must be in"):
            estimate_plan.estimate_plan(geom, jnp.bfloat16, causal=causal,
                                        call_rows=plan.call_rows, epilogue_loops=bad)


@pytest.mark.parametrize("page_size, queries, block_k", [
    (4096, "streamed", 256), (2048, "streamed", 256), (1024, "streamed", 128),
    (512, "streamed", 64), (1536, "streamed", 192), (1536, "resident", 64),
    (4096, "resident", 128)])
def test_paged_plan_takes_a_key_tile_within_a_page(page_size, queries, block_k):
    """Pages of 64 x S tokens or a multiple: the key tile is the largest multiple of 64
    up to the layout's that divides a page's reshaped columns (page_size / S)."""
    geom = Geometry(1, 32, 8, 4096, 65536, 128, 8, 128)
    plan = estimate_plan.estimate_plan(geom, jnp.bfloat16, page_size=page_size,
                                       queries=queries)
    assert (plan.block_k, plan.page_size) == (block_k, page_size)
    assert (page_size // 8) % plan.block_k == 0
    if page_size == 1024:
        with pytest.raises(ValueError, match="block_k must divide a page's 128"):
            estimate_plan.estimate_plan(geom, jnp.bfloat16, page_size=page_size,
                                        block_k=256)


@pytest.mark.parametrize("causal", [True, False])
def test_tile_walk_with_fewer_keys_in_use(causal):
    """With `cols` key columns in use the walk stops at the tile holding the last one,
    and masks from the first tile it holds only partly (tiles past it are never
    computed)."""
    geom = _geom(1, 2, 1, 512, 4096, 64, 8, 64, causal)
    plan = estimate_plan.estimate_plan(geom, jnp.bfloat16, block_k=64)
    row0 = np.arange(plan.row_tiles) * plan.rows
    for cols in (0, 1, 63, 64, 65, 300, 512):
        computed = np.asarray(estimate_plan.visible_tiles(plan, causal, row0, cols))
        unmasked = np.asarray(estimate_plan.unmasked_tiles(plan, causal, row0, cols))
        full = np.asarray(estimate_plan.visible_tiles(plan, causal, row0))
        assert (computed <= -(-cols // 64)).all() and (unmasked <= cols // 64).all()
        assert (computed <= full).all() and (unmasked <= computed).all()
        if not causal:
            assert (computed == -(-cols // 64)).all() and (unmasked == cols // 64).all()


@pytest.mark.parametrize("block_k, stages", [(64, 8), (128, 6), (256, 4)])
def test_streamed_plan_rows_and_ring(block_k, stages):
    """128 rows per CTA (64 per consumer, 64 for the resident queries); the default ring
    is the deepest whose slots (query chunk [128, 64] + key chunk [block_k, 64]) fit, and
    the count is that of mosaic/smem.py's rules, buffer by buffer."""
    geom = Geometry(1, 32, 8, 1000, 65536, 128, 8, 128)
    resident = estimate_plan.estimate_plan(geom, jnp.bfloat16, block_k=block_k,
                                           queries="resident")
    plan = estimate_plan.estimate_plan(geom, jnp.bfloat16, block_k=block_k,
                                       queries="streamed", stagger=False,
                                       ordered_stats=False)
    assert (resident.queries, resident.rows, resident.row_tiles) == ("resident", 64, 2)
    assert (plan.rows, plan.row_tiles, plan.padded_rows) == (128, 1, 128)
    assert plan.stages == stages
    stats = -(-2 * plan.stat_planes * 64 * 4 // 1024) * 1024
    assert plan.smem_bytes(2) == (stages * (128 + block_k) * 64 * 2 + stats + 2048
                                  + 8 * 2 * stages)
    deeper = estimate_plan.EstimatePlan(geom, block_k, 64, stages + 1, queries="streamed")
    assert (deeper.smem_bytes(2) > estimate_plan.SMEM_BYTES
            or stages == estimate_plan.MAX_STAGES)
    # staggered, and ordered statistics: one barrier more each; consumer 1 half a tile
    # (16 steps) late, or as late as the ring allows
    staggered = estimate_plan.estimate_plan(geom, jnp.bfloat16, block_k=block_k,
                                            queries="streamed", stagger=True,
                                            ordered_stats=False)
    assert staggered.smem_bytes(2) == plan.smem_bytes(2) + 8
    ordered = estimate_plan.estimate_plan(geom, jnp.bfloat16, block_k=block_k,
                                          queries="streamed")
    assert (ordered.stagger, ordered.ordered_stats, ordered.stages) == (True, True, stages)
    assert ordered.smem_bytes(2) == plan.smem_bytes(2) + 16
    assert (plan.lag_steps, staggered.lag_steps) == (0, min(8, stages - 1))


def test_shared_memory_is_counted_as_mosaic_gpu_does():
    """6-stage plans the H200's Mosaic GPU refused (jax 0.11.2), with the byte counts it
    gave: our count equals them, so such plans are no longer chosen."""
    for block_size, planes, refused in ((1024, 2, 232600), (512, 4, 233624)):
        geom = Geometry(1, 32, 8, 16384, 16384, 128, 8, block_size)
        plan = estimate_plan.EstimatePlan(geom, 128, 64, 6, queries="resident")
        assert plan.stat_planes == planes and plan.smem_bytes(2) == refused
        assert estimate_plan.estimate_plan(geom, jnp.bfloat16, queries="resident").stages == 5


@pytest.mark.parametrize("queries", QUERY_LAYOUTS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("q_len, k_len, block_size, block_k", [
    (1024, 1024, 128, 128), (1000, 1512, 64, 64), (256, 4352, 512, 256), (8, 520, 64, 64)])
def test_tile_walk_matches_the_visibility_rule(q_len, k_len, block_size, block_k, causal,
                                               queries):
    """Per row tile: the tiles computed are exactly those holding a column some of its
    rows sees, and the unmasked ones exactly those every one of its rows sees in full."""
    geom = _geom(1, 2, 1, q_len, k_len, 64, 8, block_size, causal)
    plan = estimate_plan.estimate_plan(geom, jnp.bfloat16, block_k=block_k, queries=queries)
    row0 = np.arange(plan.row_tiles) * plan.rows
    computed = np.asarray(estimate_plan.visible_tiles(plan, causal, row0))
    unmasked = np.asarray(estimate_plan.unmasked_tiles(plan, causal, row0))
    rows = np.arange(plan.padded_rows)[:, None]
    cols = np.arange(plan.padded_cols)[None, :]
    seen = (cols < geom.k_cols) & ((cols <= rows + geom.row_offset) | (not causal))
    seen = seen.reshape(plan.row_tiles, plan.rows, plan.key_tiles, block_k)
    np.testing.assert_array_equal(computed, [np.flatnonzero(t.any(axis=(0, 2))).max() + 1
                                             for t in seen])
    np.testing.assert_array_equal(unmasked, [np.argmin(np.append(t.all(axis=(0, 2)), False))
                                             for t in seen])


def _mosaic_gpu_import_error() -> str | None:
    try:
        from jax.experimental.pallas import mosaic_gpu  # noqa: F401
    except Exception as error:  # this jax cannot build Mosaic GPU kernels at all
        return repr(error)
    return None


needs_mosaic_gpu = pytest.mark.skipif(
    _mosaic_gpu_import_error() is not None,
    reason=f"Mosaic GPU does not import: {_mosaic_gpu_import_error()}")

# (batch, q_heads, kv_heads, Lq, Lk, D, stride, block_size), causal, plan options; each
# case is lowered with both layouts of the queries (the streamed ones with their default
# block_k 256 where the case names none)
LOWERING_CASES = [
    ((1, 32, 8, 4096, 4096, 128, 8, 128), True, {}),
    ((1, 32, 8, 4096, 4096, 128, 8, 64), False, {}),
    ((2, 4, 2, 1000, 1512, 64, 8, 64), False, {"block_k": 64}),
    ((1, 4, 1, 512, 2560, 128, 8, 1024), True, {"block_k": 256, "stages": 2}),
    ((1, 32, 8, 4096, 4096, 128, 8, 128), True, {"cluster": 2}),
    ((1, 4, 2, 1000, 1512, 128, 8, 256), False, {"cluster": 2, "block_k": 64}),
    ((1, 32, 8, 8192, 8192, 128, 8, 128), True, {"cluster": 4}),
    ((1, 4, 2, 1024, 2048, 64, 8, 64), True, {"block_k": 256}),
    ((1, 32, 8, 4096, 4096, 128, 8, 128), True, {"leave_out": "product"}),
    ((1, 32, 8, 4096, 4096, 128, 8, 128), True, {"leave_out": "statistics"}),
]
LOWERING_CASES = [(shape, causal, {**options, "queries": queries})
                  for shape, causal, options in LOWERING_CASES for queries in QUERY_LAYOUTS]
LOWERING_CASES += [  # streamed only: S 16 at D 128; block_k 256 with its deepest ring
    ((1, 8, 2, 2048, 2048, 128, 16, 128), True, {"queries": "streamed"}),
    ((1, 32, 8, 4096, 4096, 128, 8, 128), False, {"queries": "streamed", "block_k": 256}),
    ((1, 32, 8, 4096, 4096, 128, 8, 128), True, {"queries": "streamed", "stagger": False}),
    ((1, 32, 8, 4096, 4096, 128, 8, 128), True, {"queries": "streamed", "ordered_stats": True}),
    ((1, 32, 8, 4096, 4096, 128, 8, 128), True, {"queries": "streamed", "trim_columns": 32}),
    ((1, 32, 8, 4096, 4096, 128, 8, 128), True, {"queries": "streamed", "trim_columns": 0}),
    ((1, 32, 8, 4096, 4096, 128, 8, 128), True, {"queries": "streamed", "step_loop": 0}),
    ((1, 32, 8, 4096, 4096, 128, 8, 128), False, {"queries": "streamed", "step_loop": 3}),
]
LOWERING_CASES += [  # paired row tiles: R = 4; R = 3 with Lq < Lk; S 16, R = 3;
    # unstaggered; a non-causal call (which ignores the flag)
    ((1, 32, 8, 4096, 4096, 128, 8, 128), True, {"pair_rows": True}),
    ((1, 4, 2, 2900, 4948, 128, 8, 128), True, {"pair_rows": True}),
    ((1, 8, 2, 6144, 6144, 128, 16, 256), True, {"pair_rows": True}),
    ((1, 32, 8, 4096, 4096, 128, 8, 128), True, {"pair_rows": True, "stagger": False}),
    ((1, 32, 8, 4096, 4096, 128, 8, 64), False, {"pair_rows": True}),
    ((1, 16, 4, 4096, 131072, 128, 8, 1024), False, {"key_groups": 2}),  # a chunk's half
    ((1, 32, 8, 4096, 4096, 128, 8, 128), True, {"persistent": True}),
    ((1, 32, 8, 4096, 65536, 128, 8, 1024), False, {"persistent": True}),
]


def _lower_for_an_h200(fn, *args) -> str:
    """The text of the module jit lowers for CUDA from fn on abstract args. The Triton
    backend's lowering (the statistics epilogue's kernel) asks the device for its compute
    capability: jax >= 0.11 is told of an H200 by an abstract mesh (without it, on a CPU:
    "No supported GPU devices found"); older jax assumes compute capability 9.0 itself."""
    target = contextlib.nullcontext()
    if hasattr(jax.sharding, "AbstractDevice"):
        target = jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh(
            (1,), ("one",), axis_types=(jax.sharding.AxisType.Auto,),
            abstract_device=jax.sharding.AbstractDevice("NVIDIA H200", None, "cuda")))
    with target:
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _lower(shape, causal, plan):
    """The text of the module jit lowers for CUDA: block_sums on bf16 q and k."""
    batch, q_heads, kv_heads, q_len, k_len, dim, _, _ = shape
    q = jax.ShapeDtypeStruct((batch, q_heads, q_len, dim), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((batch, kv_heads, k_len, dim), jnp.bfloat16)

    def call(q, k):
        return block_sums.block_sums(q, k, plan=plan, causal=causal, norm=1.0)

    return _lower_for_an_h200(call, q, k)


@needs_mosaic_gpu
@pytest.mark.parametrize("shape, causal, options", LOWERING_CASES)
def test_kernel_lowers_for_cuda(shape, causal, options):
    """Without a GPU: Mosaic GPU's lowering (layout inference and the shared memory
    budget included, for sm_90) accepts the kernel and the module holds its custom
    call."""
    plan = estimate_plan.estimate_plan(_geom(*shape, causal), jnp.bfloat16, **options)
    assert plan.queries == options.get("queries", estimate_plan.QUERIES)
    assert "stablehlo.custom_call @mosaic_gpu" in _lower(shape, causal, plan)


@needs_mosaic_gpu
@pytest.mark.parametrize("page_size", [None, 4096, 1024])
def test_kernel_lowers_with_keys_in_use_pages_and_row_steps(page_size):
    """The chunk scores' call (a traced key count; a contiguous buffer or pages of 4096
    and 1024 tokens: key tiles of 256 and 128 columns) and a causal call of 128K in row
    steps and, within 64 MiB, in head steps (with the folded statistics' epilogue kernel)
    lower for CUDA."""
    geom = _geom(1, 32, 8, 4096, 65536, 128, 8, 1024, False)
    plan = estimate_plan.estimate_plan(geom, jnp.bfloat16, page_size=page_size)
    q = jax.ShapeDtypeStruct((1, 32, 4096, 128), jnp.bfloat16)
    if page_size is None:
        k, table = jax.ShapeDtypeStruct((1, 8, 65536, 128), jnp.bfloat16), None
    else:
        k = jax.ShapeDtypeStruct((65536 // page_size + 2, page_size, 8, 128), jnp.bfloat16)
        table = jax.ShapeDtypeStruct((1, 65536 // page_size), jnp.int32)
    count = jax.ShapeDtypeStruct((1,), jnp.int32)

    def chunk(q, k, count, table):
        return block_sums.block_sums(q, k, plan=plan, causal=False, norm=1.0, key_len=count,
                                     block_table=table)

    assert "stablehlo.custom_call @mosaic_gpu" in _lower_for_an_h200(chunk, q, k, count, table)
    long = (1, 32, 8, 131072, 131072, 128, 8, 128)
    stepped = estimate_plan.estimate_plan(_geom(*long, True), jnp.bfloat16, call_rows=8192)
    assert "stablehlo.custom_call @mosaic_gpu" in _lower(long, True, stepped)
    heads = estimate_plan.estimate_plan(_geom(*long, True), jnp.bfloat16, causal=True,
                                        max_scratch_bytes=64 << 20)
    assert heads.call_heads == 1 and heads.fold and heads.stats_epilogue
    text = _lower(long, True, heads)
    assert "stablehlo.custom_call @mosaic_gpu" in text
    assert "xla.gpu.triton" in text  # the statistics epilogue's kernel


@needs_mosaic_gpu
@pytest.mark.parametrize("queries", QUERY_LAYOUTS)
@pytest.mark.parametrize("block_size, block_k", [(128, 128), (1024, 128), (128, 256)])
def test_lowering_counts_shared_memory_as_the_plan(queries, block_size, block_k):
    """One slot more than the default ring: Mosaic GPU's lowering refuses it with the
    byte count the plan computes (so the default plan is the deepest that fits)."""
    shape = (1, 32, 8, 4096, 4096, 128, 8, block_size)
    plan = estimate_plan.estimate_plan(_geom(*shape, True), jnp.bfloat16, block_k=block_k,
                                       queries=queries)
    deeper = dataclasses.replace(plan, stages=plan.stages + 1)
    with pytest.raises(Exception, match=f"smem_bytes={deeper.smem_bytes(2)} "):
        _lower(shape, True, deeper)


# (batch, q_heads, kv_heads, Lq, Lk, D, stride, block_size, causal, norm, plan options):
# several units per tile and both consumers, odd lengths with partly filled stride groups
# and tiles, causal Lq < Lk, D 128 (two head-dim parts per step), a ring of 2 slots,
# blocks of several units and of one, clusters of two CTAs sharing the key chunks (an
# odd number of real row tiles; causal: the cluster's first CTA walks a tile it does not
# see; a cluster of four), float16. Streamed queries (128 rows per CTA): causal, where
# consumer 0 computes a tile none of its rows sees; odd lengths, the row tile's second
# half padding; D 128 with a ring of 2 slots and Lq < Lk; block_k 128 and 256, float16;
# staggered consumers (a lag of one step; of stages - 1 = 2, less than half a tile);
# clusters sharing the key chunks: of two (causal, the first CTA walking the second's
# tiles; one CTA of padding rows, unstaggered, batch 2) and of four (the last padding).
# Paired row tiles (pair_rows, causal; no row sees nothing, Lq <= Lk: each walks tile 0
# at least): an odd R = 3, the middle row tile alone in the second CTA, the first CTA's
# 14 steps wrapping its ring of 8 slots, consumer 0 computing tiles none of its rows
# sees in both of its row tiles; R = 4 with Lq < Lk, unstaggered, the second row tile
# starting mid-ring (step 4 of a ring of 3); an odd R with Lq < Lk, D 128 and a ring of
# 2 slots; a non-causal call, which ignores the flag (R = 3, one row tile per CTA).
# Launch groups (causal): 2 of the 4 (batch, head) pairs interleaved; 1 (each pair in
# turn; the small calls above take all their pairs by the rule).
# Key groups (CTAs per row tile, each a span of its key tiles): 2 spans of one tile;
# 3 spans of 2 of 5 tiles, causal and staggered, the first row tile's third CTA walking
# none; the resident queries, their consumers taking turns from the span's first tile.
# Consumer 1's statistics after consumer 0's
# (ordered_stats, the default of non-causal streamed calls whose ring is shorter than a
# tile's steps: above, the non-causal case of S 4, D 128 and 3 stages): causal and
# staggered; causal in 3 key groups; that non-causal call without it.
INTERPRET_CASES = [
    (1, 2, 1, 256, 256, 64, 2, 32, True, 1.0, {"block_k": 64, "queries": "resident"}),
    (2, 2, 1, 190, 251, 64, 2, 16, False, 2.0, {"block_k": 64, "queries": "resident"}),
    (1, 4, 2, 128, 384, 128, 2, 128, True, 1.0,
     {"block_k": 64, "stages": 2, "queries": "resident"}),
    (1, 2, 2, 300, 1324, 64, 4, 512, True, 1.0, {"block_k": 128, "queries": "resident"}),
    (1, 2, 1, 300, 556, 128, 2, 64, True, 1.0,
     {"block_k": 64, "stages": 2, "cluster": 2, "queries": "resident"}),
    (2, 2, 2, 190, 251, 64, 2, 16, False, 1.0,
     {"block_k": 64, "cluster": 2, "queries": "resident"}),
    (1, 2, 1, 256, 384, 64, 2, 32, True, 1.0,
     {"block_k": 64, "dtype": jnp.float16, "queries": "resident"}),
    (1, 2, 1, 300, 556, 64, 2, 64, True, 1.0,
     {"block_k": 64, "stages": 3, "cluster": 4, "queries": "resident"}),
    (1, 2, 1, 256, 256, 64, 2, 32, True, 1.0,
     {"block_k": 64, "queries": "streamed", "stagger": False}),
    (2, 2, 1, 190, 251, 64, 2, 16, False, 2.0, {"block_k": 64, "queries": "streamed"}),
    (1, 4, 2, 128, 384, 128, 2, 128, True, 1.0,
     {"block_k": 64, "stages": 2, "queries": "streamed"}),
    (1, 2, 2, 300, 1324, 64, 4, 512, True, 1.0, {"block_k": 128, "queries": "streamed"}),
    (1, 2, 1, 300, 1100, 64, 2, 64, False, 1.0,
     {"block_k": 256, "queries": "streamed", "dtype": jnp.float16}),
    (1, 2, 1, 256, 384, 64, 2, 32, True, 1.0,
     {"block_k": 64, "queries": "streamed", "stagger": True}),
    (1, 2, 1, 300, 556, 128, 4, 64, False, 1.0,
     {"block_k": 64, "stages": 3, "queries": "streamed", "stagger": True}),
    (1, 2, 1, 300, 556, 128, 2, 64, True, 1.0,
     {"block_k": 64, "stages": 2, "cluster": 2, "queries": "streamed"}),
    (2, 2, 2, 190, 251, 64, 2, 16, False, 1.0,
     {"block_k": 64, "cluster": 2, "queries": "streamed", "stagger": False}),
    (1, 2, 1, 600, 728, 64, 2, 64, True, 1.0,
     {"block_k": 64, "stages": 3, "cluster": 4, "queries": "streamed"}),
    (1, 2, 1, 600, 600, 64, 2, 32, True, 1.0,
     {"block_k": 64, "queries": "streamed", "pair_rows": True}),
    (1, 2, 1, 1000, 1256, 64, 2, 64, True, 1.0,
     {"block_k": 128, "stages": 3, "queries": "streamed", "stagger": False,
      "pair_rows": True}),
    (1, 4, 2, 1300, 1812, 128, 4, 512, True, 1.0,
     {"block_k": 128, "stages": 2, "queries": "streamed", "pair_rows": True}),
    (1, 2, 1, 600, 700, 64, 2, 32, False, 1.0,
     {"block_k": 64, "queries": "streamed", "pair_rows": True}),
    (2, 2, 1, 190, 251, 64, 2, 16, False, 2.0,
     {"block_k": 64, "queries": "streamed", "key_groups": 2}),
    (1, 2, 1, 300, 556, 64, 2, 64, True, 1.0,
     {"block_k": 64, "queries": "streamed", "key_groups": 3}),
    (1, 2, 2, 300, 1324, 64, 4, 512, True, 1.0,
     {"block_k": 128, "queries": "resident", "key_groups": 2}),
    (2, 2, 1, 300, 556, 64, 2, 64, True, 1.0,
     {"block_k": 64, "queries": "streamed", "head_group": 2}),
    (2, 2, 1, 300, 556, 64, 2, 64, True, 1.0,
     {"block_k": 64, "queries": "streamed", "head_group": 1}),
    (1, 2, 1, 300, 556, 128, 4, 64, True, 1.0,
     {"block_k": 64, "stages": 3, "queries": "streamed", "ordered_stats": True}),
    (1, 2, 1, 300, 556, 128, 4, 64, True, 1.0,
     {"block_k": 64, "stages": 2, "queries": "streamed", "key_groups": 3,
      "ordered_stats": True}),
    (1, 2, 1, 300, 556, 128, 4, 64, False, 1.0,
     {"block_k": 64, "stages": 3, "queries": "streamed", "ordered_stats": False}),
    # masked tiles trimmed: widths of 32 up to 256 on the diagonal; Lq < Lk, where a
    # consumer's rows may see none of a tile its row tile sees; whole masked tiles
    (1, 2, 1, 600, 600, 64, 2, 32, True, 1.0,
     {"block_k": 256, "queries": "streamed", "trim_columns": 32}),
    (1, 2, 1, 300, 684, 64, 2, 64, True, 1.0, {"block_k": 256, "queries": "streamed"}),
    (1, 2, 2, 300, 1324, 64, 4, 512, True, 1.0,
     {"block_k": 128, "queries": "streamed", "trim_columns": 0}),
    # the product's steps: unrolled in a causal call (S 4, D 128: 8 steps), a loop in a
    # non-causal one (its 7 later steps, and unrolled 7 times: the loop's own unrolling)
    (1, 2, 1, 300, 556, 128, 4, 64, True, 1.0,
     {"block_k": 64, "stages": 3, "queries": "streamed", "step_loop": 0}),
    (1, 2, 1, 300, 556, 128, 4, 64, False, 1.0,
     {"block_k": 64, "stages": 3, "queries": "streamed", "step_loop": 1}),
    (1, 2, 1, 190, 251, 128, 4, 32, False, 1.0,
     {"block_k": 64, "queries": "streamed", "step_loop": 7}),
    # folded statistics: an odd R (the middle row tile alone in its place) in key
    # groups, with paired row tiles, Lq < Lk, the resident queries (folded by default)
    (1, 2, 1, 600, 600, 64, 2, 32, True, 1.0,
     {"block_k": 64, "queries": "streamed", "fold": True}),
    (1, 2, 1, 600, 600, 64, 2, 32, True, 1.0,
     {"block_k": 64, "queries": "streamed", "pair_rows": True, "fold": True}),
    (1, 2, 1, 300, 684, 64, 2, 64, True, 1.0, {"block_k": 64, "fold": True}),
    (1, 2, 1, 512, 512, 64, 2, 32, True, 1.0,
     {"block_k": 64, "queries": "resident", "key_groups": 2}),
]


@pytest.mark.skipif(mosaic_interpret.unsupported_reason() is not None,
                    reason=str(mosaic_interpret.unsupported_reason()))
@pytest.mark.skipif(jax.default_backend() != "cpu", reason="interpret mode runs on CPU")
@pytest.mark.parametrize("case", INTERPRET_CASES)
def test_kernel_in_gpu_interpret_mode(rand, case):
    """The kernel's code (producer, consumers, ring, barriers, masks) on CPU: equal to the
    reference within float32 rounding, no race, every barrier phase seen. Interpret mode
    fills the kernel's output with NaN first, so statistics the kernel leaves unwritten
    (tiles no row sees) must be replaced by the wrapper."""
    *shape, causal, norm, options = case
    options = dict(options)
    dtype = options.pop("dtype", jnp.bfloat16)
    geom = _geom(*shape, causal)
    q, k = rand.qk(*shape[:6], stride=geom.stride, dtype=dtype)
    plan = estimate_plan.estimate_plan(geom, dtype, causal=causal, **options)
    with mosaic_interpret.interpret_kernel() as races_found:
        got = np.asarray(block_sums.block_sums(q, k, plan=plan, causal=causal, norm=norm))
        assert not races_found(), str(rand)
    want = reference.block_sums(q, k, geom, causal=causal, norm=norm)
    assert got.shape == (geom.batch, geom.q_heads, geom.q_blocks, geom.k_blocks)
    err = npr.rel_err(got, want)
    assert err <= F32_RTOL, f"{case} {rand}: relative error {err:.3g}"


def _keys_in_use(rand, k, key_len: int, page_size: int | None):
    """k with NaN past `key_len` (no kernel may read them into a score), and with
    `page_size` as a shuffled page pool (3 spare pages of NaN) and its block table."""
    k = jnp.where(jnp.arange(k.shape[2])[:, None] < key_len, k, jnp.nan).astype(k.dtype)
    if page_size is None:
        return k, None
    return rand.paged(page_size, k)


def _block_sums_with(q, k, geom, plan, *, causal, key_len, page_size, rand):
    """The Mosaic block sums of q and k with `key_len` keys in use (None: all) and k
    paged with `page_size` (None: contiguous), and the reference's."""
    keys, table = (k, None) if key_len is None else _keys_in_use(rand, k, key_len, page_size)
    count = None if key_len is None else jnp.asarray([key_len], jnp.int32)
    got = block_sums.block_sums(q, keys, plan=plan, causal=causal, norm=1.0,
                                key_len=count, block_table=table)
    want = reference.block_sums(q, k, geom, causal=causal, norm=1.0,
                                key_len=None if key_len is None else jnp.int32(key_len))
    return np.asarray(got), want


def _interpreted_equals_reference(q, k, geom, plan, *, causal, key_len, page_size, rand,
                                  case):
    """`_block_sums_with` in GPU interpret mode: no race, no NaN (keys past the count
    are NaN), the reference's block sums within float32 rounding."""
    with mosaic_interpret.interpret_kernel() as races_found:
        got, want = _block_sums_with(q, k, geom, plan, causal=causal, key_len=key_len,
                                     page_size=page_size, rand=rand)
        assert not races_found(), str(rand)
    assert not np.isnan(got).any(), f"{case} {rand}"
    err = npr.rel_err(got, want)
    assert err <= F32_RTOL, f"{case} {rand}: relative error {err:.3g}"


# (batch, q_heads, kv_heads, Lq, Lk, D, stride, block_size, causal, key_len, page_size,
# plan options): keys in use of a contiguous buffer, ending inside a stride group (the
# tail tile's zeros fill it) and inside a key tile, then at a tile's end, and one key (a
# group of one key and zeros, in the only tile walked); a paged cache of pages of 64 x S
# tokens (a key tile each) with the keys ending in a page; row steps of 128 rows (3
# steps over 19 query blocks, the last overlapping the one before) causal (each step's
# epilogue its own loop by default, and 2 loops: 1 step, then 2) and non-causal, and of
# a cluster of 2 resident row tiles; key groups (3 spans of 2 of 5
# tiles) over the paged cache, and in row steps; head steps: of 3 of 4 heads (GQA 2:1,
# the second step overlapping the first and starting inside a key head's group) causal
# and folded, of 1 head over the paged cache with keys in use, of 2 of 3 heads in batch 2;
# row steps of 128 rows of 3 of 4 heads (both kinds of steps overlapping) in 2 key groups,
# and of one head causal.
INTERPRET_KEY_CASES = [
    (2, 2, 1, 190, 512, 64, 2, 32, False, 301, None, {"block_k": 64}),
    (1, 2, 1, 128, 512, 64, 2, 32, False, 256, None, {"block_k": 64}),
    (1, 2, 1, 128, 512, 64, 2, 32, False, 1, None, {"block_k": 64}),
    (1, 4, 2, 160, 640, 64, 2, 32, False, 411, 128, {}),
    (1, 2, 1, 600, 664, 64, 2, 32, True, None, None, {"block_k": 64, "call_rows": 128}),
    (1, 2, 1, 600, 664, 64, 2, 32, True, None, None,
     {"block_k": 64, "call_rows": 128, "epilogue_loops": 2}),
    (1, 2, 1, 600, 700, 64, 2, 32, False, None, None, {"block_k": 64, "call_rows": 128}),
    (1, 2, 1, 600, 664, 64, 2, 32, True, None, None,
     {"block_k": 64, "call_rows": 128, "queries": "resident", "cluster": 2}),
    (1, 4, 2, 160, 640, 64, 2, 32, False, 411, 128, {"key_groups": 3}),
    (1, 2, 1, 600, 700, 64, 2, 32, False, None, None,
     {"block_k": 64, "call_rows": 128, "key_groups": 2}),
    (1, 4, 2, 600, 664, 64, 2, 32, True, None, None, {"block_k": 64, "call_heads": 3}),
    (1, 4, 2, 160, 640, 64, 2, 32, False, 411, 128, {"call_heads": 1}),
    (2, 3, 3, 190, 512, 64, 2, 32, False, None, None, {"block_k": 64, "call_heads": 2}),
    (1, 4, 2, 600, 700, 64, 2, 32, False, None, None,
     {"block_k": 64, "call_heads": 3, "call_rows": 128, "key_groups": 2}),
    (1, 4, 2, 600, 664, 64, 2, 32, True, None, None,
     {"block_k": 64, "call_heads": 1, "call_rows": 128}),
]


@pytest.mark.skipif(mosaic_interpret.unsupported_reason() is not None,
                    reason=str(mosaic_interpret.unsupported_reason()))
@pytest.mark.skipif(jax.default_backend() != "cpu", reason="interpret mode runs on CPU")
@pytest.mark.parametrize("case", INTERPRET_KEY_CASES)
def test_keys_in_use_pages_and_row_steps_in_gpu_interpret_mode(rand, case):
    """Keys in use (the rest NaN), paged caches and row steps on CPU: equal to the
    reference within float32 rounding, no race."""
    *shape, causal, key_len, page_size, options = case
    geom = _geom(*shape, causal)
    q, k = rand.qk(*shape[:6], stride=geom.stride, dtype=jnp.bfloat16)
    plan = estimate_plan.estimate_plan(geom, jnp.bfloat16, causal=causal,
                                       page_size=page_size, **options)
    assert plan.call_rows == options.get("call_rows", 0)
    assert plan.call_heads == options.get("call_heads", 0)
    _interpreted_equals_reference(q, k, geom, plan, causal=causal, key_len=key_len,
                                  page_size=page_size, rand=rand, case=case)


# (batch, q_heads, kv_heads, Lq, Lk, D, stride, block_size, causal, key_len, page_size,
# plan options, CTAs, ROW_BLOCK_TILES): the persistent grid with fewer CTAs than work
# items (each CTA takes several, in turns); causal in blocks of 2 row tiles (3 row tiles:
# the last block has an empty item per key tile); batch 2; keys in use of a paged cache;
# row steps, one row tile per block; causal with folded statistics; causal head steps of
# 3 of 4 heads (GQA 2:1, the second step overlapping the first), folded and listed, and
# in row steps of 128 rows (causal: each step's items listed), causal and not; causal
# row steps of every head listed.
PERSISTENT_CASES = [
    (1, 2, 1, 600, 664, 64, 2, 32, True, None, None, {"block_k": 64}, 3, 2),
    (2, 2, 1, 190, 251, 64, 2, 16, False, None, None, {"block_k": 64}, 5, 64),
    (1, 4, 2, 160, 640, 64, 2, 32, False, 411, 128, {}, 4, 64),
    (1, 2, 1, 600, 664, 64, 2, 32, True, None, None, {"block_k": 64, "call_rows": 128}, 2, 1),
    (1, 2, 1, 600, 664, 64, 2, 32, True, None, None,
     {"block_k": 64, "causal": True, "fold": True}, 3, 2),
    (1, 4, 2, 600, 664, 64, 2, 32, True, None, None,
     {"block_k": 64, "causal": True, "call_heads": 3}, 5, 2),
    (1, 4, 2, 600, 664, 64, 2, 32, True, None, None,
     {"block_k": 64, "causal": True, "call_heads": 3, "call_rows": 128}, 4, 2),
    (1, 4, 2, 600, 700, 64, 2, 32, False, None, None,
     {"block_k": 64, "call_heads": 3, "call_rows": 128}, 4, 2),
]


@pytest.mark.skipif(mosaic_interpret.unsupported_reason() is not None,
                    reason=str(mosaic_interpret.unsupported_reason()))
@pytest.mark.skipif(jax.default_backend() != "cpu", reason="interpret mode runs on CPU")
@pytest.mark.parametrize("case", PERSISTENT_CASES)
def test_persistent_grid_in_gpu_interpret_mode(rand, monkeypatch, case):
    """The persistent grid on CPU: every work item walked once by one CTA (equal to the
    reference within float32 rounding, no NaN from keys past the count), no race."""
    *shape, causal, key_len, page_size, options, ctas, block_tiles = case
    monkeypatch.setattr(estimate_plan, "ROW_BLOCK_TILES", block_tiles)
    geom = _geom(*shape, causal)
    q, k = rand.qk(*shape[:6], stride=geom.stride, dtype=jnp.bfloat16)
    plan = estimate_plan.estimate_plan(geom, jnp.bfloat16, page_size=page_size,
                                       persistent=True, **options)
    items = int(estimate_plan.work_items(plan)[0])  # with the last block's empty ones
    tiles = geom.batch * plan.heads * plan.call_row_tiles * plan.key_tiles
    # a grid planned as listed (causal given): one CTA per real item of its longest
    # step at most
    walked = (int(estimate_plan.items_table(plan)[:, 0].max()) * plan.pairs
              if plan.listed(options.get("causal", False)) else tiles)
    assert plan.persistent_ctas == min(estimate_plan.HOPPER_SMS, walked) > ctas
    assert items >= tiles
    plan = dataclasses.replace(plan, persistent_ctas=ctas)
    _interpreted_equals_reference(q, k, geom, plan, causal=causal, key_len=key_len,
                                  page_size=page_size, rand=rand, case=case)


@pytest.mark.skipif(mosaic_interpret.unsupported_reason() is not None,
                    reason=str(mosaic_interpret.unsupported_reason()))
@pytest.mark.skipif(jax.default_backend() != "cpu", reason="interpret mode runs on CPU")
@pytest.mark.parametrize("queries", QUERY_LAYOUTS)
def test_timing_variant_without_products_reads_zero_scores(rand, queries):
    """leave_out="product" keeps the pipeline and the statistics and reads every score as
    0: the block sums of q = 0 (each row spread evenly over the columns it sees)."""
    geom = _geom(1, 2, 1, 256, 384, 64, 2, 32, True)
    q, k = rand.qk(1, 2, 1, 256, 384, 64, stride=2, dtype=jnp.bfloat16)
    plan = estimate_plan.estimate_plan(geom, jnp.bfloat16, block_k=64, leave_out="product",
                                       queries=queries)
    with mosaic_interpret.interpret_kernel() as races_found:
        got = np.asarray(block_sums.block_sums(q, k, plan=plan, causal=True, norm=1.0))
        assert not races_found(), str(rand)
    want = reference.block_sums(jnp.zeros_like(q), k, geom, causal=True, norm=1.0)
    assert npr.rel_err(got, want) <= F32_RTOL, str(rand)


# (batch, q_heads, kv_heads, Lq, Lk, D, stride, block_size, causal, plan options; {}: the
# default plan, streamed queries at block_k 256 with staggered consumers, causal calls
# in CAUSAL_KEY_GROUPS key groups (one CTA per row tile in the case that asks for it);
# pair_rows: R = 4, R = 3 with Lq < Lk, S 16 with R = 3, a non-causal call ignoring it;
# clusters of the streamed queries: 2, causal; 4, two of its CTAs padding rows; launch
# groups of 4 of 16 (batch, head) pairs, and of 1; ordered statistics in a causal call,
# a non-causal call without them)
GPU_CASES = [
    (1, 32, 8, 4096, 4096, 128, 8, 128, True, {"queries": "resident"}),
    (1, 32, 8, 4096, 4096, 128, 8, 64, False, {"queries": "resident"}),
    (2, 8, 2, 2000, 3024, 128, 8, 256, False, {"queries": "resident"}),
    (1, 8, 8, 1024, 3072, 64, 8, 1024, True, {"queries": "resident"}),
    (1, 4, 1, 777, 777, 128, 8, 128, True, {"queries": "resident"}),
    (1, 32, 8, 4096, 4096, 128, 8, 128, True, {"queries": "resident", "cluster": 2}),
    (2, 8, 2, 2000, 3024, 128, 8, 256, False,
     {"queries": "resident", "cluster": 2, "block_k": 256}),
    (1, 32, 8, 4096, 8192, 128, 8, 512, True, {"queries": "resident", "cluster": 4}),
    (1, 32, 8, 4096, 4096, 128, 8, 128, True, {}),
    (1, 32, 8, 4096, 4096, 128, 8, 128, True, {"key_groups": 1}),
    (1, 32, 8, 4096, 4096, 128, 8, 64, False, {}),
    (2, 8, 2, 2000, 3024, 128, 8, 256, False, {"block_k": 128}),
    (1, 8, 8, 1024, 3072, 64, 8, 1024, True, {}),
    (1, 4, 1, 777, 777, 128, 8, 128, True, {"stagger": False}),
    (1, 8, 2, 2048, 2048, 128, 16, 128, True, {}),
    (1, 32, 8, 4096, 4096, 128, 8, 128, True, {"stagger": False}),
    (2, 8, 2, 2000, 3024, 128, 8, 256, False, {"block_k": 128, "stagger": False}),
    (1, 32, 8, 4096, 4096, 128, 8, 128, True, {"pair_rows": True}),
    (2, 8, 2, 2900, 4948, 128, 8, 128, True, {"pair_rows": True}),
    (1, 8, 2, 6144, 6144, 128, 16, 256, True, {"pair_rows": True}),
    (2, 8, 2, 2000, 3024, 128, 8, 256, False, {"pair_rows": True}),
    (1, 32, 8, 4096, 4096, 128, 8, 128, True, {"cluster": 2}),
    (2, 8, 2, 2000, 3024, 128, 8, 256, False, {"cluster": 4, "block_k": 128}),
    (2, 8, 2, 2000, 3024, 128, 8, 128, True, {"head_group": 4}),
    (1, 32, 8, 4096, 4096, 128, 8, 128, True, {"head_group": 1}),
    (1, 32, 8, 4096, 4096, 128, 8, 128, True, {"ordered_stats": True}),
    (2, 8, 2, 2000, 3024, 128, 8, 256, False, {"ordered_stats": False}),
]


# (batch, q_heads, kv_heads, Lq, Lk, D, stride, block_size, causal, key_len, page_size,
# plan options): the chunk scores' calls (keys in use ending inside a stride group, in a
# contiguous buffer and in pages of 4096, 1024 and 512 tokens: key tiles of 256, 128 and
# 64 columns), row steps (causal, in the default key groups and in one; non-causal; 8
# and 3 steps, the last overlapping), key groups (a chunk's half on 2 GPUs in 2 spans; a
# paged cache in 3; causal in 3, spans of the long row tiles only), the persistent grid,
# a bound holding only the whole call's folded statistics; head steps: by the bound (4
# of 8 heads, non-causal), GQA 32:8 causal folded in steps of 6 heads (the last
# overlapping), a paged cache with keys in use in steps of 3 heads, GQA 32:8 causal in
# steps of 8 heads on the listed persistent grid (the default there: 576 items), and on
# it in steps of 3 of 8 heads (the last overlapping, starting inside a key head's group);
# row steps of one head by the bound on the persistent grid (non-causal: 2 steps of 2176
# rows a head, the last overlapping; causal: 4 steps of 2176 rows), and of 3 of 4 heads
# over a paged cache with keys in use, batch 2.
GPU_KEY_CASES = [
    (1, 32, 8, 4096, 16384, 128, 8, 1024, False, 12345, None, {}),
    (2, 32, 8, 4096, 16384, 128, 8, 1024, False, 9001, 4096, {}),
    (1, 32, 8, 2048, 16384, 128, 8, 128, False, 16383, 1024, {}),
    (1, 8, 2, 1000, 8192, 64, 8, 256, False, 4097, 512, {}),
    (1, 8, 2, 8192, 8192, 128, 8, 128, True, None, None, {"call_rows": 128}),
    (1, 8, 2, 8192, 8192, 128, 8, 128, True, None, None, {"call_rows": 128, "key_groups": 1}),
    (1, 8, 2, 5000, 7048, 128, 8, 128, False, None, None, {"call_rows": 256}),
    (1, 16, 4, 4096, 32768, 128, 8, 1024, False, 30001, None, {"key_groups": 2}),
    (2, 8, 2, 2048, 16384, 128, 8, 128, False, 16000, 1024, {"key_groups": 3}),
    (1, 8, 2, 4096, 8192, 128, 8, 128, True, None, None, {"key_groups": 3}),
    (2, 32, 8, 4096, 16384, 128, 8, 1024, False, 9001, 4096, {"persistent": True}),
    (1, 8, 2, 8192, 8192, 128, 8, 128, True, None, None,
     {"call_rows": 128, "persistent": True}),
    (1, 2, 1, 81920, 81920, 128, 8, 128, True, None, None, {"persistent": True}),
    (1, 32, 8, 4096, 4096, 128, 8, 128, True, None, None, {"persistent": True}),
    (2, 8, 2, 2000, 3024, 128, 8, 256, False, None, None, {"persistent": True}),
    (1, 8, 2, 2048, 2048, 128, 16, 128, True, None, None, {"persistent": True}),
    (1, 8, 8, 16384, 16384, 128, 8, 128, True, None, None, {"max_scratch_bytes": 6 << 20}),
    (1, 8, 8, 16384, 16384, 128, 8, 128, False, None, None, {"max_scratch_bytes": 6 << 20}),
    (1, 32, 8, 8192, 8192, 128, 8, 128, True, None, None, {"call_heads": 6}),
    (2, 8, 2, 4096, 16384, 128, 8, 1024, False, 12345, 4096, {"call_heads": 3}),
    (1, 32, 8, 16384, 16384, 128, 8, 128, True, None, None, {"max_scratch_bytes": 6 << 20}),
    (1, 8, 2, 16384, 16384, 128, 8, 128, True, None, None,
     {"call_heads": 3, "persistent": True}),
    (1, 4, 2, 32768, 65536, 128, 8, 128, False, None, None, {"max_scratch_bytes": 6 << 20}),
    (1, 2, 1, 65536, 65536, 128, 8, 128, True, None, None, {"max_scratch_bytes": 6 << 20}),
    (2, 4, 2, 4096, 32768, 128, 8, 1024, False, 30001, 4096,
     {"call_heads": 3, "call_rows": 256}),
]


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("case", [(*case[:-1], None, None, case[-1]) for case in GPU_CASES]
                         + GPU_KEY_CASES)
def test_kernel_equals_reference(rand, case):
    """The compiled kernel against the reference within float32 rounding: every plan
    variant on all keys, then keys in use (the rest NaN), pages and row steps."""
    *shape, causal, key_len, page_size, options = case
    geom = _geom(*shape, causal)
    q, k = rand.qk(*shape[:6], stride=geom.stride, dtype=jnp.bfloat16)
    plan = estimate_plan.estimate_plan(geom, jnp.bfloat16, causal=causal,
                                       page_size=page_size, **options)
    got, want = _block_sums_with(q, k, geom, plan, causal=causal, key_len=key_len,
                                 page_size=page_size, rand=rand)
    assert not np.isnan(got).any(), f"{case} {rand}"
    err = npr.rel_err(got, want)
    assert err <= F32_RTOL, f"{case} {rand}: relative error {err:.3g}"

