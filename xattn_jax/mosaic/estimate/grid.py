"""Which key tiles each row tile of a Mosaic block-sum call sees (docs/estimate.md section
2), and the tables its grids walk: the compacted grid's cells, the folded statistics'
places, the persistent grid's work items, the row steps and their epilogue loops.

Shared by the plan (`plan`), the kernel (`kernel`), its wrapper (`block_sums`) and the
Triton-backend epilogue (`stats_epilogue`). Row
indices are reshaped query rows; a function given host ints or numpy arrays computes in
numpy (a plan's tables at trace time, without compiling XLA ops per shape), given traced
values in jax.numpy.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from xattn_jax.geometry import Geometry, cdiv
from xattn_jax.row_statistics import step_start


def _array_module(*values):
    host = all(isinstance(v, (int, np.integer, np.ndarray)) for v in values)
    return np if host else jnp


def _div(x, divisor: int):
    """x // divisor for x >= 0 (traced: lax.div, without jnp's sign fix-ups)."""
    if isinstance(x, (np.ndarray, np.integer)):
        return x // np.int32(divisor)
    return jax.lax.div(x, jnp.int32(divisor))


def _seen_columns(geom: Geometry, causal: bool, row0, rows: int, cols=None):
    """Reshaped key columns 0 .. n - 1 hold every column some of `rows` rows from `row0`
    may see: j <= row + (Lk - Lq) / S with causal, j < cols (default k_cols) always."""
    cols = geom.k_cols if cols is None else cols
    xp = _array_module(row0, cols)
    row0, cols = xp.asarray(row0, xp.int32), xp.asarray(cols, xp.int32)
    if not causal:
        return xp.broadcast_to(cols, row0.shape)
    return xp.maximum(xp.minimum(row0 + (rows + geom.row_offset), cols), 0)


def seen_columns(plan, row0, rows: int, cols=None):
    """`_seen_columns` of the plan's call: a consumer's rows bound its masked tile's width."""
    return _seen_columns(plan.geom, plan.causal, row0, rows, cols)


def visible_tiles(plan, row0, cols=None):
    """Key tiles 0 .. n - 1 hold a column some row of the row tile from `row0` sees: the
    tiles the kernel computes and the epilogue reads. cols: key columns in use."""
    seen = _seen_columns(plan.geom, plan.causal, row0, plan.rows, cols)
    return _div(seen + (plan.block_k - 1), plan.block_k)


def unmasked_tiles(plan, row0, cols=None):
    """Key tiles 0 .. n - 1 every row from `row0` on sees in full: the kernel masks only
    later ones."""
    geom = plan.geom
    cols = geom.k_cols if cols is None else cols
    xp = _array_module(row0, cols)
    row0 = xp.asarray(row0, xp.int32)
    whole = _div(xp.asarray(cols, xp.int32), plan.block_k)
    if not plan.causal:
        return xp.broadcast_to(whole, row0.shape)
    return xp.minimum(_div(row0 + (geom.row_offset + 1), plan.block_k), whole)


def tail_tile(plan, cols):
    """The key tile holding the last of `cols` key columns in use (traced; 0 for none):
    the kernel reads it from the wrapper's zeroed copy."""
    return _div(jnp.maximum(cols - 1, 0), plan.block_k)


def row_tiles_seen(plan) -> tuple[int, ...]:
    """`visible_tiles` of each row tile of a whole causal call, concrete: the compacted
    grid's cells and the folded statistics' slots."""
    return _row_tiles_seen(plan.geom, plan.block_k, plan.rows, plan.call_row_tiles)


@functools.lru_cache(maxsize=64)
def _row_tiles_seen(geom: Geometry, block_k: int, rows: int,
                    row_tiles: int) -> tuple[int, ...]:
    seen = _seen_columns(geom, True, np.arange(row_tiles) * rows, rows)
    return tuple(int(n) for n in _div(seen + (block_k - 1), block_k))


@functools.lru_cache(maxsize=64)
def walked_cells(plan) -> tuple[int, ...]:
    """A compacted grid's row axis in launch order: for each CTA, row group g (row tile
    R - 1 - g, the longest first) and key group j as g x key_groups + j, only where
    span j holds a tile the row tile sees."""
    groups, span = plan.key_groups, plan.key_span
    seen = row_tiles_seen(plan)[::-1]
    return tuple(g * groups + j for g in range(len(seen)) for j in range(groups)
                 if j * span < seen[g])


@functools.lru_cache(maxsize=64)
def fold_slots(plan) -> int:
    """Key-tile slots of a folded place: the most tiles its two row tiles see together,
    at least key_tiles (the unfolding reads that many of each)."""
    seen, tiles = row_tiles_seen(plan), plan.call_row_tiles
    together = [seen[p] + (seen[tiles - 1 - p] if p < tiles - 1 - p else 0)
                for p in range(plan.fold_places)]
    return max(together + [plan.key_tiles])


def folded_place(plan, row0, tile):
    """(slot, first row) of key tile `tile` of the row tile from `row0` in folded
    statistics: row tile i < fold_places at place i, slot `tile`; a later one at place
    R - 1 - i, slot fold_slots - 1 - tile. The two never meet in a slot."""
    index = _div(row0, plan.rows)
    late = index >= plan.fold_places
    place = jnp.where(late, plan.call_row_tiles - 1 - index, index)
    return jnp.where(late, plan.fold_slots - 1 - tile, tile), place * plan.rows


def work_items(plan, cols=None):
    """(items, key tiles in use) of a persistent grid, int32 scalars. Item i = (((batch x
    Hq + head) x row_blocks + row block) x tiles + key tile) x row_block_tiles + row tile
    in the block: a key tile's items are consecutive, so CTAs running together share it.
    Items no row of their row tile sees, or past the call's row tiles, are empty."""
    tiles = _div(_seen_columns(plan.geom, False, 0, plan.rows, cols) + (plan.block_k - 1),
                 plan.block_k)
    return tiles * (plan.pairs * plan.row_blocks * plan.row_block_tiles), tiles


def step_first_rows(plan) -> tuple[int, ...]:
    """The first row of each row step, as `row_statistics.in_steps` walks them (the last
    moved back to end at the last query block); (0,) for a call of whole rows."""
    if not plan.call_rows:
        return (0,)
    geom = plan.geom
    blocks = plan.call_rows // geom.block_rows
    return tuple(step_start(step, geom.q_blocks, blocks) * geom.block_rows
                 for step in range(cdiv(geom.q_blocks, blocks)))


def row_step(plan, first_row):
    """The index in `step_first_rows` of the step from `first_row` (traced)."""
    if not plan.call_rows:
        return 0
    return jax.lax.div(first_row + (plan.call_rows - 1), jnp.int32(plan.call_rows))


def _steps_seen(plan) -> np.ndarray:
    """`visible_tiles` of each row tile of each row step, numpy `[steps, call_row_tiles]`."""
    first = np.asarray(step_first_rows(plan))[:, None]
    return visible_tiles(plan, first + np.arange(plan.call_row_tiles) * plan.rows)


def listed_counts(plan) -> np.ndarray:
    """The listed items of one (batch, head) pair in each row step, counted without
    listing them."""
    return _steps_seen(plan).sum(axis=1)


@functools.lru_cache(maxsize=64)
def items_table(plan) -> np.ndarray:
    """A listed persistent grid's items (`EstimatePlan.listed`), int32 `[row steps, 1 +
    n]`: row r holds the count of step r's items of one pair, those items (indices in the
    pair's `work_items`, exactly the visible ones), then zeros. Read-only."""
    blocks, block, tiles = plan.row_blocks, plan.row_block_tiles, plan.key_tiles
    steps_seen = _steps_seen(plan)
    seen = np.zeros((len(steps_seen), blocks * block), np.int64)
    seen[:, :plan.call_row_tiles] = steps_seen
    row_tile = np.arange(blocks)[:, None, None] * block + np.arange(block)[None, None, :]
    tile = np.arange(tiles)[None, :, None]
    lists = [np.flatnonzero(tile < step_seen[row_tile]) for step_seen in seen]
    table = np.zeros((len(lists), 1 + max(map(len, lists))), np.int32)
    for step, items in enumerate(lists):
        table[step, 0] = len(items)
        table[step, 1:1 + len(items)] = items
    table.flags.writeable = False
    return table


def listed_items(plan, step: int = 0) -> tuple[int, ...]:
    """The items of row step `step` of `items_table`."""
    row = items_table(plan)[step]
    return tuple(int(i) for i in row[1:1 + row[0]])


def listed_pair_walk(pair, per_pair, cta, ctas: int):
    """(first, count): CTA `cta` of `ctas` walks items first, first + ctas, .. of pair
    `pair` (`per_pair` items each), exactly the call's items pair x per_pair + k that are
    cta modulo ctas, found without dividing by the traced per_pair."""
    first = cta - jax.lax.rem(pair * per_pair, jnp.int32(ctas))
    first = jnp.where(first < 0, first + ctas, first)
    return first, _div(per_pair - first + (ctas - 1), ctas)


def epilogue_steps(plan) -> tuple[tuple[range, int], ...]:
    """The epilogue's loops over the row steps (`EstimatePlan.epilogue_loops`, as even as
    they split): each loop's steps, and the key-tile slots it reads (the most tiles a row
    of its steps sees; all in a non-causal call)."""
    steps, n = len(step_first_rows(plan)), plan.epilogue_loops
    bounds = [steps * i // n for i in range(n + 1)]
    loops = [range(start, stop) for start, stop in zip(bounds, bounds[1:])]
    if not plan.causal:
        return tuple((loop, plan.key_tiles) for loop in loops)
    seen = _steps_seen(plan).max(axis=1)
    return tuple((loop, int(seen[loop.start:loop.stop].max())) for loop in loops)
