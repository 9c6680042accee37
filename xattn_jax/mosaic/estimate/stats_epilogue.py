"""The Mosaic block sums' epilogue (docs/estimate.md sections 2-3) as one Triton-backend
Pallas kernel over the statistics `xattn_jax.mosaic.estimate.kernel` wrote
(`EstimatePlan.stats_epilogue`): `row_statistics.combine`'s math, without XLA's several
reductions over the statistics (and, folded, their unfolding).

One program per (batch, head, row tile) walks the key tiles its row tile sees
(`grid.visible_tiles`), where the kernel stored them (`grid.folded_place` when folded),
twice: the rows' M and L as a running maximum and rescaled sum, then each tile's unit
sums weighed by 2^(m - M) / L and summed over chunks of min(block_rows, rows) rows. Each
pass reads several tiles at once (`tiles_per_step`). Where a query block lies in one row
tile and a key block is one unit (`_direct`) the output is the block sums; else
`stats_block_sums` adds it up into blocks. Padded rows, and every row of a call without
keys, add nothing (`row_counts`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from xattn_jax.geometry import cdiv, next_pow2
from xattn_jax.mosaic.estimate.grid import visible_tiles
from xattn_jax.mosaic.estimate.plan import EstimatePlan
from xattn_jax.partitioning import kernel_output
from xattn_jax.row_statistics import fit, row_counts

# warps per program and floats a program reads at once (docs/tuning.md:
# mosaic-stats-epilogue)
EPILOGUE_WARPS, STEP_ELEMENTS = 4, 8192
_M_START = -1e30  # the running maximum before any tile: finite, so 2^(start - M) is 0


def _direct(plan: EstimatePlan) -> bool:
    """Whether a row tile's rows are whole query blocks and a unit is a key block."""
    return plan.geom.block_rows <= plan.rows and plan.unit == plan.geom.block_rows


def tiles_per_step(plan: EstimatePlan, planes: int) -> int:
    """Key tiles a program reads at once: `planes` planes of its rows each, about
    STEP_ELEMENTS floats in all (a power of two, at most the key tiles' next one)."""
    fit_tiles = max(1, STEP_ELEMENTS // (planes * plan.rows))
    return min(1 << (fit_tiles.bit_length() - 1), next_pow2(plan.key_tiles))


def _kernel(scalars_ref, stats_ref, out_ref, *, plan: EstimatePlan, max_tiles: int,
            sum_tiles: int):
    """max_tiles / sum_tiles: key tiles read at once for the maxima and totals (pass 1)
    and for the unit sums (pass 2)."""
    geom, rows, units = plan.geom, plan.rows, plan.units_per_tile
    tile_row = pl.program_id(1)
    cols, first_row, sees_keys = scalars_ref[0], scalars_ref[1], scalars_ref[2]
    row0 = first_row + tile_row * rows  # of all the query rows
    seen = visible_tiles(plan, row0, cols)
    place, late = tile_row, None
    if plan.fold:
        late = tile_row >= plan.fold_places
        place = jnp.where(late, plan.call_row_tiles - 1 - tile_row, tile_row)
    stat_rows = place * rows + jnp.arange(rows)  # index arrays throughout: gathers
    total_plane = 1 + units if units > 1 else 1

    def tiles(first, count):
        """Key tiles first .. first + count - 1: their slots (clamped into the
        statistics) and whether the row tile sees them."""
        t = first + jnp.arange(count)
        slot = t if late is None else jnp.where(late, plan.fold_slots - 1 - t, t)
        return jnp.clip(slot, 0, plan.stats_shape[2] - 1), t < seen

    def plane(at, where, index, other):
        """Plane `index` of key tiles, `[n, rows]`: at, the gather's slots `[n, 1]` and
        rows `[1, rows]`; `other` where `where` (`[n, 1]`: the row tile sees the tile)
        is False."""
        return plgpu.load(stats_ref.at[at[0], index, at[1]], mask=where, other=other)

    def running(step, carry):
        row_max, row_sum = carry
        slots, inside = tiles(step * max_tiles, max_tiles)
        where = inside[:, None]
        at = (slots[:, None], stat_rows[None, :])  # both planes' gather
        maxes = plane(at, where, 0, -jnp.inf)
        totals = plane(at, where, total_plane, 0.0)
        new_max = jnp.maximum(row_max, maxes.max(axis=0))
        row_sum = (row_sum * jnp.exp2(row_max - new_max)
                   + (totals * jnp.exp2(maxes - new_max[None, :])).sum(axis=0))
        return new_max, row_sum

    row_max, row_sum = lax.fori_loop(
        0, lax.div(seen + (max_tiles - 1), max_tiles), running,
        (jnp.full((rows,), _M_START, jnp.float32), jnp.zeros((rows,), jnp.float32)))
    counted = row_counts(row0 + jnp.arange(rows), geom, sees_keys > 0)
    chunks = rows // min(geom.block_rows, rows)

    def weighed(step, carry):
        """Key tiles step x sum_tiles ..: their unit sums weighed, summed into chunks of
        rows, stored (0 for tiles the row tile does not see)."""
        slots, inside = tiles(step * sum_tiles, sum_tiles)
        maxes = plane((slots[:, None], stat_rows[None, :]), inside[:, None], 0, -jnp.inf)
        sums = plgpu.load(stats_ref.at[slots[:, None, None],
                                       1 + jnp.arange(units)[None, :, None],
                                       stat_rows[None, None, :]],
                          mask=inside[:, None, None], other=0.0)  # [sum_tiles, P, rows]
        weight = jnp.exp2(maxes - row_max[None, :]) / row_sum[None, :]
        probs = jnp.where(counted[None, None, :], sums * weight[:, None, :], 0.0)
        chunk_sums = probs.reshape(sum_tiles, units, chunks, rows // chunks).sum(axis=3)
        out_ref[pl.ds(tile_row * chunks, chunks),
                pl.ds(step * sum_tiles * units, sum_tiles * units)] = (
            chunk_sums.transpose(2, 0, 1).reshape(chunks, sum_tiles * units))
        return carry

    lax.fori_loop(0, cdiv(plan.key_tiles, sum_tiles), weighed, None)


@functools.partial(jax.jit, static_argnames=("plan", "q_blocks", "interpret"))
def stats_block_sums(stats: jax.Array, scalars: jax.Array, *, plan: EstimatePlan,
                     q_blocks: int, interpret: bool = False) -> jax.Array:
    """Block sums `[B, heads, q_blocks, kb]` float32 of one kernel call's rows from its
    statistics (`plan.stats_shape`, folded or not; entries of tiles a row tile does not
    see are never read). scalars: int32 `[3]`: the reshaped key columns in use, the
    call's first reshaped query row (a multiple of block_rows) and whether the call has
    any key (0 / 1). q_blocks: the call's query blocks (`combine`'s)."""
    geom = plan.geom
    b, heads, _, _, stat_rows = plan.stats_shape
    row_tiles = plan.call_row_tiles if plan.fold else stat_rows // plan.rows
    chunk = min(geom.block_rows, plan.rows)
    units = plan.units_per_tile
    max_tiles = tiles_per_step(plan, 2)
    sum_tiles = tiles_per_step(plan, 1 + units)
    out_rows = row_tiles * (plan.rows // chunk)
    out_cols = cdiv(plan.key_tiles, sum_tiles) * sum_tiles * units  # whole steps
    kernel = functools.partial(_kernel, plan=plan, max_tiles=max_tiles, sum_tiles=sum_tiles)

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
