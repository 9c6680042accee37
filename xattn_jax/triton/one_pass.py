"""Sections 2-3 in one pass over the key tiles, then a small exact epilogue.

A row's softmax needs its maximum and sum over every key before any block sum can be
normalized, and block sums add up rows that normalize differently. So the kernel stores,
per reshaped query row and key tile t (score tile from `RowTile`):

- m[t, r] = max over the tile's columns of A'[r, c] (A' = A * log2(e));
- x[t, r, u] = sum over the columns c of unit u of 2^(A'[r, c] - m[t, r]);
- s[t, r] = sum_u x[t, r, u], stored where a tile has several units, so that the
  epilogue reads the large x once, not twice (tuning.md note 18),

where a unit is `unit = gcd(block_rows, cols)` columns (a block is a whole number of
units). Every key tile is independent, so programs can split a row's keys among them
(`Tiling.key_span` tiles each) and a short chunk of queries still fills the GPU. The
epilogue (plain JAX, fused by XLA) forms per row M = max_t m, L = sum_t 2^(m - M) s,
and p[t, r, u] = x * 2^(m - M) / L: exactly the softmax mass of each row in each unit,
then sums rows and units into blocks. Each score is computed once, at the price of a
scratch of 1 + cols / unit floats (one more with several units) per row, head and key
tile (`head_row_scratch_bytes`); calls whose scratch would exceed a bound walk the heads,
and if need be the rows of each head, in steps (`call_shape`).
Where keys are read unmasked and their count is data, the column of a partly filled last
stride group is scored outside the kernel and merged into these statistics
(`_split_last_group`).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from xattn_jax import reference
from xattn_jax.geometry import Geometry
from xattn_jax.triton.common import COL_AXIS, LOG2_E, ROW_AXIS, head_spec, kernel_grid
from xattn_jax.triton.row_tile import RowTile, key_operands, keys_fit, row_tile_refs
from xattn_jax.triton.tiling import Tiling

def _unit(geom: Geometry, tiling: Tiling) -> int:
    return math.gcd(geom.block_rows, tiling.cols)


def _key_groups(geom: Geometry, tiling: Tiling) -> int:
    return pl.cdiv(tiling.key_tiles(geom), tiling.key_span(geom))


def _stored_key_tiles(geom: Geometry, tiling: Tiling) -> int:
    """Key tiles the scratch holds: the real ones padded to whole program spans."""
    return _key_groups(geom, tiling) * tiling.key_span(geom)


def _units(geom: Geometry, tiling: Tiling) -> int:
    """Units per key tile: x's last axis."""
    return tiling.cols // _unit(geom, tiling)


def head_row_scratch_bytes(geom: Geometry, tiling: Tiling) -> int:
    """Scratch bytes per reshaped query row and query head (m, x and s for every key tile,
    for every batch element)."""
    units = _units(geom, tiling)
    per_tile = 1 + units + (units > 1)
    return (geom.batch * _stored_key_tiles(geom, tiling) * per_tile
            * jnp.dtype(jnp.float32).itemsize)


def padded_rows(geom: Geometry, tiling: Tiling) -> int:
    """The reshaped query rows a call covering all of them holds: whole row tiles."""
    return pl.cdiv(geom.q_rows, tiling.rows) * tiling.rows


class CallShape(NamedTuple):
    """The query heads and reshaped query rows one kernel call covers."""

    heads: int
    rows: int


def scratch_bytes(geom: Geometry, tiling: Tiling, call: CallShape) -> int:
    """Scratch bytes of one kernel call of that shape."""
    return head_row_scratch_bytes(geom, tiling) * call.heads * call.rows


def _even_steps(total: int, fit: int, quantum: int) -> int | None:
    """The size of the steps that cover `total` (heads, or rows): a multiple of
    `quantum`, the smallest that needs no more steps than the largest within `fit` (the
    last step overlaps the one before it: whatever it repeats is work done twice). None
    if not even one quantum fits."""
    if fit < quantum:
        return None
    steps = pl.cdiv(total, fit // quantum * quantum)
    return pl.cdiv(pl.cdiv(total, steps), quantum) * quantum


def call_shape(geom: Geometry, tiling: Tiling, max_scratch_bytes: int) -> CallShape | None:
    """The heads and rows one kernel call covers so that its scratch stays within
    `max_scratch_bytes`; calls then run one after another and reuse the scratch.

    Every row of as many heads as fit (all heads if they do: one call); else one head,
    its rows in steps that are multiples of both the tile's rows and block_rows. A call's
    programs then share one head's keys, which stay in L2; steps over all heads with a
    few rows each read every head's keys again in every step, and measured 2-10% slower
    (tuning.md, note 24). None if not even one row step of one head fits.
    """
    all_rows = padded_rows(geom, tiling)
    head_rows = max_scratch_bytes // head_row_scratch_bytes(geom, tiling)  # that fit
    if head_rows >= all_rows:
        return CallShape(_even_steps(geom.q_heads, head_rows // all_rows, 1), all_rows)
    rows = _even_steps(geom.q_rows, head_rows, math.lcm(tiling.rows, geom.block_rows))
    return None if rows is None else CallShape(1, rows)


def _tile_stats_kernel(q_ref, k_ref, *refs, geom: Geometry, causal: bool, norm: float,
                       tiling: Tiling, paged: bool, row_extent: int, head_offset: bool):
    table_ref, scalars_ref, (max_ref, sum_ref, *total_ref) = row_tile_refs(refs, paged)
    tile = RowTile(q_ref, k_ref, table_ref, scalars_ref, geom=geom, causal=causal,
                   norm=norm, tiling=tiling, row_extent=row_extent, whole_groups=True,
                   head_offset=head_offset)
    rows, span = tiling.rows, tiling.key_span(geom)
    unit = _unit(geom, tiling)
    per_tile = _units(geom, tiling)
    first = pl.program_id(COL_AXIS) * span
    seen = jnp.clip(tile.visible_tiles - first, 0, span)
    row0 = pl.program_id(ROW_AXIS) * rows  # in this call's scratch (tile.row0 counts all rows)

    def store(col_tile, m, x, total):
        plgpu.store(max_ref.at[col_tile, pl.ds(row0, rows)], m)
        if per_tile == 1:  # x: [rows], in m's layout (no reshape: Triton pays for those)
            plgpu.store(sum_ref.at[col_tile, pl.ds(row0, rows), jnp.int32(0)], x)
        else:
            plgpu.store(sum_ref.at[col_tile, pl.ds(row0, rows), :], x)
            plgpu.store(total_ref[0].at[col_tile, pl.ds(row0, rows)], total)

    def tile_stats(col_tile, a):
        m = a.max(axis=1)
        shift = jnp.where(m == -jnp.inf, 0.0, m)  # a row that sees nothing here: x = 0
        p = jnp.exp2(a - shift[:, None])
        if per_tile == 1:
            store(col_tile, m, p.sum(axis=1), None)
        else:
            x = p.reshape(rows, per_tile, unit).sum(axis=2)
            store(col_tile, m, x, x.sum(axis=1))

    # One loop over (key tile, step) pairs: Triton pipelines the loads across key tiles
    # (measured 2-12% faster than a loop over tiles around `score_tile`'s loop).
    steps = tile.steps

    def step(i, product):
        # lax.div/rem: i >= 0, and jnp's floor division lowers to i1 selects on GPU
        col_tile, j = first + jax.lax.div(i, steps), jax.lax.rem(i, steps)
        product = product + tile.step_product(col_tile, j)

        def last_step(product):
            tile_stats(col_tile, tile.finish(product, col_tile))
            return jnp.zeros_like(product)

        return jax.lax.cond(j == steps - 1, last_step, lambda p: p, product)

    jax.lax.fori_loop(0, seen * steps, step, jnp.zeros((rows, tiling.cols), jnp.float32))

    def unseen(i, carry):  # loops from 0: a traced lower bound trips jax 0.11.2
        zeros = jnp.zeros((rows,) if per_tile == 1 else (rows, per_tile), jnp.float32)
        store(first + seen + i, jnp.full((rows,), -jnp.inf, jnp.float32), zeros,
              jnp.zeros((rows,), jnp.float32))
        return carry

    jax.lax.fori_loop(0, span - seen, unseen, None)


def _fit(x: jax.Array, axis: int, size: int) -> jax.Array:
    """Cuts or zero-pads `axis` to `size`."""
    if x.shape[axis] >= size:
        return jax.lax.slice_in_dim(x, 0, size, axis=axis)
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad)


def _combine(maxes: jax.Array, sums: jax.Array, totals: jax.Array, geom: Geometry,
             unit: int, first_row, q_blocks: int) -> jax.Array:
    """maxes `[B, Hq, T, R]`, sums `[B, Hq, T, R, P]` and totals `[B, Hq, T, R]` (sums
    summed over P) of rows first_row .. first_row + R -> block sums `[B, Hq, q_blocks,
    kb]` of those rows.

    Written in the kernel's layout, rows summed into blocks first, so that XLA fuses the
    weighting into that reduction and no temporary as large as the scratch is made.
    """
    b, h, key_tiles, rows = maxes.shape
    row_max = maxes.max(axis=2, keepdims=True)  # [B, Hq, 1, R]
    scale = jnp.exp2(maxes - row_max)  # [B, Hq, T, R]
    total = (totals * scale).sum(axis=2, keepdims=True)
    # Padded rows, and rows that see no key at all (an empty cache: every x is 0), add
    # nothing. A row holding a NaN stays NaN even where a maximum skipped the NaN: its x
    # is NaN.
    empty = (row_max == -jnp.inf) & (totals.sum(axis=2, keepdims=True) == 0)
    counts = ((first_row + jnp.arange(rows)) < geom.q_rows) & ~empty
    probs = jnp.where(counts[..., None], sums * (scale / total)[..., None], 0.0)
    probs = _fit(probs, 3, q_blocks * geom.block_rows)
    rows_summed = probs.reshape(b, h, key_tiles, q_blocks, geom.block_rows, -1).sum(axis=4)
    per_block = geom.block_rows // unit
    units = jnp.moveaxis(rows_summed, 2, 3).reshape(b, h, q_blocks, -1)  # [B, Hq, qb, T*P]
    units = _fit(units, 3, geom.k_blocks * per_block)
    return units.reshape(b, h, q_blocks, geom.k_blocks, per_block).sum(axis=4)


def _split_last_group(q, k, key_len, block_table, geom: Geometry, norm: float):
    """Splits a traced key count for a kernel that reads keys unmasked (`keys_fit`):
    the kernel gets the count rounded down to whole stride groups, and the column of the
    partly filled group after them (its tokens past the count read as zeros) is scored
    here, by the reference's section 1, for `_add_column` to merge into the kernel's
    statistics. Keys past the count never enter a score.

    Returns the whole groups' tokens (int32 `[1]`), the column's index, its scores
    A * log2(e) (float32 `[B, Hq, q_rows]`) and whether there is such a column.
    """
    s = geom.stride
    count = jnp.minimum(key_len[0], geom.k_len)
    whole = count - count % s
    # A count of whole groups may end at Lk: then no token of the group is real.
    tokens = jnp.minimum(whole, geom.k_len - s) + jnp.arange(s)
    if block_table is None:
        group = jax.lax.dynamic_slice_in_dim(k, tokens[0], s, axis=2)
    else:  # pages [num_pages, page_size, Hkv, D]; table entries past the keys: anything
        pages = jnp.clip(block_table[:, tokens // k.shape[1]], 0, k.shape[0] - 1)
        group = k[pages, tokens % k.shape[1]].transpose(0, 2, 1, 3)  # [B, Hkv, S, D]
    real = (tokens >= whole) & (tokens < count)
    group = jnp.where(real[:, None], group, jnp.zeros((), group.dtype))
    scores = reference.strided_scores(q, group, geom, norm)[..., 0] * jnp.float32(LOG2_E)
    return whole.reshape(1), whole // s, scores, count != whole


def _add_column(maxes, sums, totals, scores, column, cols: int, unit: int, present):
    """The kernel's statistics (maxes and totals `[B, Hq, T, R]`, sums `[B, Hq, T, R, P]`)
    with one more column of key tile column // cols, of scores `[B, Hq, R]`, where
    `present`."""
    tile = column // cols

    def at_tile(a):
        return jax.lax.dynamic_index_in_dim(a, tile, axis=2, keepdims=False)

    def update(a, new, old):
        return jax.lax.dynamic_update_index_in_dim(a, jnp.where(present, new, old), tile, 2)

    m, x, t = at_tile(maxes), at_tile(sums), at_tile(totals)
    m_new = jnp.maximum(m, scores)
    rescale, added = jnp.exp2(m - m_new), jnp.exp2(scores - m_new)
    own_unit = jnp.arange(sums.shape[-1]) == (column % cols) // unit
    x_new = x * rescale[..., None] + jnp.where(own_unit, added[..., None], 0.0)
    return (update(maxes, m_new, m), update(sums, x_new, x),
            update(totals, t * rescale + added, t))


def one_pass_block_sums(q, k, *, geom: Geometry, causal: bool, norm: float, key_len,
                        block_table, tiling: Tiling, call: CallShape,
                        interpret: bool) -> jax.Array:
    """Block sums `[B, Hq, qb, kb]` (arguments as `block_sums.block_sums`), `call.heads`
    query heads and `call.rows` reshaped query rows per kernel call (`call_shape`)."""
    heads, call_rows = call
    grid = kernel_grid(geom, call_rows // tiling.rows, _key_groups(geom, tiling), heads)
    key_tiles = _stored_key_tiles(geom, tiling)
    unit = _unit(geom, tiling)
    per_tile = _units(geom, tiling)
    all_rows = call_rows >= geom.q_rows
    # The last of several row steps ends at the last query block.
    row_extent = call_rows if all_rows else geom.q_blocks * geom.block_rows
    kernel = functools.partial(_tile_stats_kernel, geom=geom, causal=causal, norm=norm,
                               tiling=tiling, paged=block_table is not None,
                               row_extent=row_extent, head_offset=heads < geom.q_heads)
    stats_shape = (geom.batch, heads, key_tiles, call_rows)

    kernel_keys, last_group = key_len, None
    if key_len is not None and keys_fit(geom, tiling):
        kernel_keys, *last_group = _split_last_group(q, k, key_len, block_table, geom, norm)

    def block_sums_of(first_head, first_row, q_blocks):
        in_specs, operands = key_operands(q, k, kernel_keys, block_table, geom, first_row,
                                          first_head)
        shapes = [stats_shape, stats_shape + (per_tile,)] + [stats_shape] * (per_tile > 1)
        maxes, sums, *totals = pl.pallas_call(
            kernel,
            grid=grid,
            in_specs=in_specs,
            out_specs=[head_spec(shape[2:]) for shape in shapes],
            out_shape=[jax.ShapeDtypeStruct(shape, jnp.float32) for shape in shapes],
            compiler_params=plgpu.CompilerParams(num_warps=tiling.num_warps,
                                                 num_stages=tiling.num_stages),
            interpret=interpret,
        )(*operands)
        totals = totals[0] if totals else sums[..., 0]
        if last_group is not None:
            column, scores, present = last_group
            scores = jax.lax.dynamic_slice_in_dim(scores, first_head, heads, axis=1)
            scores = jax.lax.dynamic_slice_in_dim(_fit(scores, 2, row_extent), first_row,
                                                  call_rows, axis=2)
            maxes, sums, totals = _add_column(maxes, sums, totals, scores, column,
                                              tiling.cols, unit, present)
        return _combine(maxes, sums, totals, geom, unit, first_row, q_blocks)

    if heads == geom.q_heads and all_rows:
        return block_sums_of(0, 0, geom.q_blocks)
    # Several calls, each writing its heads' query blocks into the result in place; the
    # last head group and the last row step of each start early enough to end at the
    # last head and block (recomputing a few the one before wrote, identically), so
    # nothing is padded or copied.
    per_call = geom.q_blocks if all_rows else call_rows // geom.block_rows
    row_steps = pl.cdiv(geom.q_blocks, per_call)

    def one_call(i, out):
        # lax.div/rem: i >= 0
        head = jnp.minimum(jax.lax.div(i, row_steps) * heads, geom.q_heads - heads)
        start = jnp.minimum(jax.lax.rem(i, row_steps) * per_call, geom.q_blocks - per_call)
        part = block_sums_of(head, start * geom.block_rows, per_call)
        return jax.lax.dynamic_update_slice(out, part, (0, head, start, 0))

    out = jnp.zeros((geom.batch, geom.q_heads, geom.q_blocks, geom.k_blocks), jnp.float32)
    return jax.lax.fori_loop(0, pl.cdiv(geom.q_heads, heads) * row_steps, one_call, out)
