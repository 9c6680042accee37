"""The Mosaic block sums' epilogue (docs/estimate.md sections 2-3) as one Triton-backend
Pallas kernel over the statistics `tile_stats` wrote (`EstimatePlan.stats_epilogue`).

The math is `row_statistics.combine`'s: per reshaped query row, M = max of the tiles'
maxima m and L = sum of 2^(m - M) x totals over the key tiles the row's row tile sees
(`visible_tiles`), then each unit sum weighed by 2^(m - M) / L and the rows summed into
query blocks. XLA runs that as several reductions over the statistics (and, folded, an
unfolding); here one program per (batch, head, row tile) walks its row tile's key tiles
twice, reading them where the kernel stored them (`folded_place` with `plan.fold`):

1. M and L together, as a running maximum and a rescaled running sum (2 planes a tile);
2. per key tile, its unit sums `[P, rows]` weighed and summed over each query block's
   rows, stored as block sums (units past the key tiles seen: 0).

The kernel writes, per row tile, the sums of each chunk of min(block_rows, rows) rows
per unit, padded to whole row tiles and key tiles: the block sums themselves where a
query block lies in one row tile and a key block is one unit (`_direct`), else sums that
`stats_block_sums` adds up into blocks. Rows past the queries, and every row of a call
without keys, add nothing (`row_counts`). Each program walks its key tiles one at a
time: where they are many and the programs few (non-causal calls, chunks, row steps),
XLA's reductions stay faster (`estimate_plan.FOLDED_STATS_EPILOGUE`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from xattn_jax.mosaic.estimate_plan import EstimatePlan, visible_tiles
from xattn_jax.partitioning import kernel_output
from xattn_jax.row_statistics import fit, row_counts

EPILOGUE_WARPS = 4  # Triton's default; not tuned
_M_START = -1e30  # the running maximum before any tile: finite, so 2^(start - M) is 0


def _direct(plan: EstimatePlan) -> bool:
    """Whether a row tile's rows are whole query blocks and a unit is a key block."""
    return plan.geom.block_rows <= plan.rows and plan.unit == plan.geom.block_rows


def _kernel(scalars_ref, stats_ref, out_ref, *, plan: EstimatePlan, causal: bool):
    geom, rows, units = plan.geom, plan.rows, plan.units_per_tile
    tile_row = pl.program_id(1)
    cols, first_row, sees_keys = scalars_ref[0], scalars_ref[1], scalars_ref[2]
    row0 = first_row + tile_row * rows  # of all the query rows
    seen = visible_tiles(plan, causal, row0, cols)
    place, late = tile_row, None
    if plan.fold:
        late = tile_row >= plan.fold_places
        place = jnp.where(late, plan.call_row_tiles - 1 - tile_row, tile_row)
    stat_rows = pl.ds(place * rows, rows)
    total_plane = 1 + units if units > 1 else 1

    def slot(t):
        return t if late is None else jnp.where(late, plan.fold_slots - 1 - t, t)

    def running(t, carry):
        row_max, row_sum = carry
        maxes = stats_ref[slot(t), 0, stat_rows]
        totals = stats_ref[slot(t), total_plane, stat_rows]
        new_max = jnp.maximum(row_max, maxes)
        row_sum = (row_sum * jnp.exp2(row_max - new_max)
                   + totals * jnp.exp2(maxes - new_max))
        return new_max, row_sum

    row_max, row_sum = lax.fori_loop(
        0, seen, running, (jnp.full((rows,), _M_START, jnp.float32),
                           jnp.zeros((rows,), jnp.float32)))
    counted = row_counts(row0 + jnp.arange(rows), geom, sees_keys > 0)
    chunks = rows // min(geom.block_rows, rows)

    def store(t, value):  # value [chunks, units]: key tile t's sums
        out_ref[pl.ds(tile_row * chunks, chunks), pl.ds(t * units, units)] = value

    def weighed(t, carry):
        maxes = stats_ref[slot(t), 0, stat_rows]
        sums = stats_ref[slot(t), pl.ds(1, units), stat_rows]  # [P, rows]
        weight = jnp.exp2(maxes - row_max) / row_sum
        probs = jnp.where(counted[None, :], sums * weight[None, :], 0.0)
        store(t, probs.reshape(units, chunks, rows // chunks).sum(axis=2).T)
        return carry

    lax.fori_loop(0, seen, weighed, None)
    zeros = jnp.zeros((chunks, units), jnp.float32)
    lax.fori_loop(seen, plan.key_tiles, lambda t, c: (store(t, zeros), c)[1], None)


@functools.partial(jax.jit, static_argnames=("plan", "causal", "q_blocks", "interpret"))
def stats_block_sums(stats: jax.Array, scalars: jax.Array, *, plan: EstimatePlan,
                     causal: bool, q_blocks: int, interpret: bool = False) -> jax.Array:
    """Block sums `[B, heads, q_blocks, kb]` float32 of one kernel call's rows from its
    statistics (`plan.stats_shape`, folded or not; entries of tiles a row tile does not
    see are never read). scalars: int32 `[3]`: the reshaped key columns in use, the
    call's first reshaped query row (a multiple of block_rows) and whether the call has
    any key (0 / 1). q_blocks: the call's query blocks (`combine`'s)."""
    geom = plan.geom
    b, heads, _, _, stat_rows = plan.stats_shape
    row_tiles = plan.call_row_tiles if plan.fold else stat_rows // plan.rows
    chunk = min(geom.block_rows, plan.rows)
    out_rows, out_cols = row_tiles * (plan.rows // chunk), plan.key_tiles * plan.units_per_tile
    kernel = functools.partial(_kernel, plan=plan, causal=causal)

    def pair_block(pair, tile_row):  # the (batch, head) pair's whole arrays
        del tile_row
        return lax.div(pair, heads), lax.rem(pair, heads), 0, 0

    out = pl.pallas_call(
        kernel,
        grid=(b * heads, row_tiles),
        in_specs=[pl.BlockSpec((3,), lambda pair, tile_row: (0,)),
                  pl.BlockSpec((None, None) + plan.stats_shape[2:],
                               lambda *ids: pair_block(*ids) + (0,))],
        out_specs=pl.BlockSpec((None, None, out_rows, out_cols), pair_block),
        out_shape=kernel_output((b, heads, out_rows, out_cols), jnp.float32, stats, scalars),
        compiler_params=plgpu.CompilerParams(num_warps=EPILOGUE_WARPS),
        interpret=interpret,
    )(scalars, stats)
    if _direct(plan):  # whole query blocks of the rows, a unit a key block
        return out[:, :, :q_blocks, :geom.k_blocks]
    # a query block of several row tiles, a key block of several units
    per_row_block = geom.block_rows // chunk
    out = fit(out, 2, q_blocks * per_row_block)
    out = out.reshape(b, heads, q_blocks, per_row_block, out_cols).sum(axis=3)
    per_block = geom.block_rows // plan.unit
    out = fit(out, 3, geom.k_blocks * per_block)
    return out.reshape(b, heads, q_blocks, geom.k_blocks, per_block).sum(axis=4)
