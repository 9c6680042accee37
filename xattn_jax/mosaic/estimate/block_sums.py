"""Sections 1-3 fused on Hopper: the Mosaic GPU block sums.

`block_sums` pads q (and a contiguous k) to whole tiles, runs the statistics kernel
(`kernel.tile_stats`, imported on first call: this module imports with any jax) in one kernel
call or in the plan's steps (`row_statistics.in_steps`), and normalizes the statistics
exactly: with XLA's reductions (`row_statistics.combine`, the Triton one-pass kernel's
epilogue; tiles a row tile never sees, which the kernel does not write, read as empty),
in place when folded (`_folded_block_sums`), or with the Triton-backend epilogue kernel
(`stats_epilogue`). With a count of keys in use, the kernel reads the
tile holding the last key from a copy whose later tokens are zero (`_tail_tile`: a
partly filled stride group reads zeros, section 1).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from xattn_jax.mosaic.estimate import stats_epilogue
from xattn_jax.mosaic.estimate.grid import (epilogue_steps, row_step, row_tiles_seen,
                                            tail_tile, visible_tiles)
from xattn_jax.mosaic.estimate.plan import COLUMN_TILE, EstimatePlan
from xattn_jax.row_statistics import (LOG2_E, blocks_of_units, combine, fit, in_steps,
                                     row_counts, row_weights)


def _strided(x: jax.Array, stride: int, length: int) -> jax.Array:
    """`[B, H, L, D]` zero-padded to `length` tokens, viewed as `[B, H, length / S, S, D]`."""
    b, h, tokens, d = x.shape
    if tokens < length:
        x = jnp.pad(x, ((0, 0), (0, 0), (0, length - tokens), (0, 0)))
    return x.reshape(b, h, length // stride, stride, d)


def _planes(stats: jax.Array, plan: EstimatePlan, first_row, cols):
    """The kernel's statistics `[B, Hq, T, planes, R]` of rows first_row .. first_row + R
    (T: the first key tiles, at least those the rows see) as `combine` takes them:
    maxima and totals `[B, Hq, T, R]`, unit sums `[B, Hq, T, R, P]`; tiles a row tile
    does not see (`cols`: the key columns in use) become empty (-inf, 0), whatever their
    memory holds."""
    row0 = first_row + jnp.arange(stats.shape[-1], dtype=jnp.int32) // plan.rows * plan.rows
    seen = (jnp.arange(stats.shape[2])[:, None]
            < visible_tiles(plan, row0, cols)[None, :])
    maxes, sums, totals = _split_planes(stats, plan.units_per_tile)
    return (jnp.where(seen, maxes, -jnp.inf), jnp.where(seen[..., None], sums, 0.0),
            jnp.where(seen, totals, 0.0))


def _folded_block_sums(stats: jax.Array, plan: EstimatePlan, sees_keys) -> jax.Array:
    """Block sums `[B, Hq, qb, kb]` of a whole causal call from its folded statistics
    `plan.stats_shape`, read in place: place p holds row tile p in its first slots and
    row tile R - 1 - p in its last ones (`grid.folded_place`), weighed apart into one
    array of weights (each unit sum multiplied once); only the rows' chunk sums are
    unfolded. Slots a place's row tiles do not see are never read into a sum."""
    geom = plan.geom
    b, h, slots = stats.shape[:3]
    rows, tiles, units = plan.rows, plan.key_tiles, plan.units_per_tile
    row_tiles, places = plan.call_row_tiles, plan.fold_places
    late = row_tiles - places  # places holding a later row tile: 0 .. late - 1
    seen = jnp.asarray(row_tiles_seen(plan))  # [R]
    slot, place = jnp.arange(slots)[:, None], jnp.arange(places)[None, :]
    later_tile = row_tiles - 1 - place  # [1, P], in [R - P, R - 1]
    early = slot < seen[place]  # [S, P]: slots of row tile p at place p
    later = (place < late) & (slot >= slots - seen[later_tile])
    row = jnp.arange(rows)
    maxes, sums, totals = _split_planes(stats, units)
    weights = jnp.zeros(maxes.shape, jnp.float32)  # [B, Hq, S, N]
    counted = jnp.zeros(maxes.shape[2:], jnp.bool_)  # [S, N]
    for part, tile in ((early, place), (later, later_tile)):
        mask = jnp.repeat(part, rows, axis=1)  # [S, N]
        counts = row_counts((tile.T * rows + row).reshape(-1), geom, sees_keys)  # [N]
        weights = jnp.where(mask, row_weights(maxes, totals, where=mask), weights)
        counted = counted | (mask & counts)
    probs = jnp.where(counted[..., None], sums * weights[..., None], 0.0)
    chunk = math.gcd(rows, geom.block_rows)
    chunks = probs.reshape(b, h, slots, places, rows // chunk, chunk, units).sum(axis=5)

    def part_chunks(part, first_slot, places_of_part):
        """The chunk sums of one row tile of each place, slots first_slot .. + T."""
        cut = chunks[:, :, first_slot:first_slot + tiles, :places_of_part]
        return jnp.where(part[first_slot:first_slot + tiles, :places_of_part, None, None],
                         cut, 0.0)

    later_chunks = jnp.flip(part_chunks(later, slots - tiles, late), axis=(2, 3))
    chunks = jnp.concatenate([part_chunks(early, 0, places), later_chunks], axis=3).reshape(
        b, h, tiles, row_tiles * rows // chunk, units)
    per_block = geom.block_rows // chunk
    chunks = fit(chunks, 3, geom.q_blocks * per_block)
    rows_summed = chunks.reshape(b, h, tiles, geom.q_blocks, per_block, units).sum(axis=4)
    return blocks_of_units(rows_summed, geom, plan.unit)


def _split_planes(stats: jax.Array, units: int):
    """Statistics `[B, Hq, T, planes, R]` -> maxima and totals `[B, Hq, T, R]`, unit
    sums `[B, Hq, T, R, P]` (the total plane is the one unit's sum when P = 1)."""
    sums = jnp.moveaxis(stats[:, :, :, 1:1 + units], 3, 4)
    totals = stats[:, :, :, 1 + units] if units > 1 else sums[..., 0]
    return stats[:, :, :, 0], sums, totals


def _keys(k: jax.Array, block_table, plan: EstimatePlan):
    """k as the kernel reads it: contiguous `[B, Hkv, Lk, D]` zero-padded to whole key
    tiles and viewed `[B, Hkv, padded_cols, S, D]`, or a paged cache `[num_pages,
    page_size, Hkv, D]` viewed `[num_pages, page_size / S, S, Hkv, D]` with its table's ids
    clamped into [0, num_pages)."""
    s = plan.geom.stride
    if block_table is None:
        return _strided(k, s, plan.padded_cols * s), None
    pages, page_size, kv_heads, d = k.shape
    return (k.reshape(pages, page_size // s, s, kv_heads, d),
            jnp.clip(block_table.astype(jnp.int32), 0, pages - 1))


def _tail_tile(keys: jax.Array, table, count, cols, plan: EstimatePlan) -> jax.Array:
    """The key tile holding the last of the `cols` reshaped key columns in use (tile 0
    for none) of `keys` as `_keys` gives them, with every token from `count` on zero
    (count, cols: int32 scalars, count in [0, Lk], cols = ceil(count / S)): `[B, Hkv,
    block_k, S, D]`, the contiguous layout whatever k's (a paged tile is gathered from
    its page through `table`)."""
    geom, bk = plan.geom, plan.block_k
    s = geom.stride
    tile = tail_tile(plan, cols)
    if table is None:
        chunk = jax.lax.dynamic_slice_in_dim(keys, tile * bk, bk, axis=2)
    else:  # keys [num_pages, page_size / S, S, Hkv, D]: a tile lies in one page
        per_page = plan.page_size // s // bk
        start = jax.lax.rem(tile, jnp.int32(per_page)) * bk
        pages = table[:, jax.lax.div(tile, jnp.int32(per_page))]  # [B]
        chunk = jax.vmap(lambda page: jax.lax.dynamic_slice(
            keys, (page, start, 0, 0, 0), (1, bk) + keys.shape[2:])[0])(pages)
        chunk = chunk.transpose(0, 3, 1, 2, 4)  # [B, Hkv, block_k, S, D]
    tokens = (tile * bk + jnp.arange(bk)[:, None]) * s + jnp.arange(s)
    return jnp.where((tokens < count)[..., None], chunk, jnp.zeros((), chunk.dtype))


@functools.partial(jax.jit, static_argnames=("plan", "norm"))
def block_sums(q: jax.Array, k: jax.Array, *, plan: EstimatePlan, norm: float,
               key_len: jax.Array | None = None,
               block_table: jax.Array | None = None) -> jax.Array:
    """Mosaic GPU sections 1-3: float32 block sums `[B, Hq, ceil(Lq/bs), ceil(Lk/bs)]`.

    q: `[B, Hq, Lq, D]`, k: `[B, Hkv, Lk, D]`, bfloat16 or float16 (one dtype), or with
    `block_table` (int32 `[B, pages_per_seq]`) a paged cache `[num_pages, page_size, Hkv,
    D]` (Lk = pages_per_seq x page_size; `plan.page_size` = page_size; ids are clamped
    into the cache). key_len: int32 `[1]`, the keys in use (non-causal calls; default
    all Lk, more counts as Lk): later keys are never seen, whatever the buffer holds
    there, and one compiled kernel serves every count. plan: from
    `plan.estimate_plan` for this geometry, dtype and page size. Arguments are
    assumed checked (`xattn_jax.checks`).
    """
    from xattn_jax.mosaic.estimate import kernel  # imports Mosaic GPU: only where it runs

    geom = plan.geom
    keys, table = _keys(k, block_table, plan)
    queries = _strided(q, geom.stride, plan.padded_rows * geom.stride)
    # all keys: the last group's padding zeros count, as without the kernel (section 1)
    cols = geom.k_cols  # the reshaped key columns in use
    tail, sees_keys = None, True
    if key_len is not None:
        count = jnp.clip(key_len[0], 0, geom.k_len)
        # whole groups, the last one maybe partly filled (the tail tile's zeros)
        cols = jax.lax.div(count + (geom.stride - 1), jnp.int32(geom.stride))
        tail, sees_keys = _tail_tile(keys, table, count, cols, plan), count > 0
    kernel_keys = jnp.asarray(cols * geom.stride, jnp.int32).reshape(1)
    scale = geom.scale / norm * LOG2_E

    def block_sums_of(first_head, first_row, q_blocks, slots=plan.key_tiles):
        """`[B, plan.heads, q_blocks, kb]` of the heads from first_head and the rows from
        first_row, whose epilogue reads the statistics of the first `slots` key tiles
        (no row of the step sees a later one)."""
        first = jnp.asarray(first_row, jnp.int32)[None] // COLUMN_TILE  # the kernel's unit
        scalars = jnp.concatenate([kernel_keys, first,
                                   jnp.asarray(first_head, jnp.int32)[None]])
        stats = kernel.tile_stats(queries, keys, table, tail, scalars, plan=plan,
                                      scale=scale, step=row_step(plan, first_row))
        if plan.stats_epilogue:  # one kernel, folded or not
            epilogue_scalars = jnp.stack([jnp.asarray(v, jnp.int32)
                                          for v in (cols, first_row, sees_keys)])
            return stats_epilogue.stats_block_sums(stats, epilogue_scalars, plan=plan,
                                                   q_blocks=q_blocks)
        if plan.fold:  # a whole causal call: all rows, all keys
            return _folded_block_sums(stats, plan, sees_keys)
        maxes, sums, totals = _planes(stats[:, :, :slots], plan, first_row, cols)
        return combine(maxes, sums, totals, geom, plan.unit, first_row, q_blocks, sees_keys)

    if not plan.call_rows and not plan.call_heads:
        return block_sums_of(0, 0, geom.q_blocks)
    row_blocks = plan.call_rows // geom.block_rows if plan.call_rows else geom.q_blocks
    out = None
    for steps, slots in epilogue_steps(plan):
        out = in_steps(geom, plan.heads, row_blocks,
                       functools.partial(block_sums_of, slots=slots), steps, out)
    return out
