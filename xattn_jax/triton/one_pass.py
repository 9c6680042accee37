"""Sections 2-3 in one pass over the key tiles, then a small exact epilogue.

A row's softmax needs its maximum and sum over every key before any block sum can be
normalized, and block sums add up rows that normalize differently. So the kernel stores,
per reshaped query row and key tile t (score tile from `RowTile`):

- m[t, r] = max over the tile's columns of A'[r, c] (A' = A * log2(e));
- x[t, r, u] = sum over the columns c of unit u of 2^(A'[r, c] - m[t, r]);
- s[t, r] = sum_u x[t, r, u], stored where a tile has several units, so that the
  epilogue reads the large x once, not twice (docs/tuning.md: triton-row-totals),

where a unit is `Plan.unit` = gcd(block_rows, block_k) columns (a block is a whole
number of units). Every key tile is independent, so programs can split a row's keys among
them (`Plan.span` tiles each) and a short chunk of queries still fills the GPU. The
epilogue (`xattn_jax.row_statistics.combine`, plain JAX fused by XLA) forms per row M = max_t m, L = sum_t 2^(m - M) s,
and p[t, r, u] = x * 2^(m - M) / L: exactly the softmax mass of each row in each unit,
then sums rows and units into blocks. Each score is computed once, at the price of a
scratch of 1 + block_k / unit floats (one more with several units) per row, head and
key tile; calls whose scratch would exceed a bound walk the heads, and if need be the
rows of each head, in steps (`Plan.call_heads`, `Plan.call_rows`: `plan.py` sizes them).
Where keys are read unmasked and their count is data, the column of a partly filled last
stride group is scored outside the kernel and merged into these statistics
(`xattn_jax.last_group`).
"""

from __future__ import annotations

import functools
import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from xattn_jax.last_group import merge_column, split_last_group
from xattn_jax.row_statistics import combine, in_steps
from xattn_jax.triton.common import COL_AXIS, ROW_AXIS, head_spec, kernel_grid
from xattn_jax.partitioning import kernel_output
from xattn_jax.triton.plan import Plan
from xattn_jax.triton.row_tile import RowTile, key_operands, row_tile_refs

def _tile_stats_kernel(q_ref, k_ref, *refs, plan: Plan, causal: bool, norm: float,
                       paged: bool, row_extent: int, head_offset: bool):
    table_ref, scalars_ref, (max_ref, sum_ref, *total_ref) = row_tile_refs(refs, paged)
    tile = RowTile(q_ref, k_ref, table_ref, scalars_ref, plan=plan, causal=causal,
                   norm=norm, row_extent=row_extent, whole_groups=True,
                   head_offset=head_offset)
    rows, span, unit, per_tile = plan.block_q, plan.span, plan.unit, plan.units_per_tile
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
    # (docs/tuning.md: triton-tile-step-loop). A paged
    # cache's table is read once per tile, a tile ahead: `pages` and `next_pages` are the
    # pages of the tile the step is in and of the one after (None for a contiguous k).
    steps = tile.steps

    def step(i, carry):
        product, pages, next_pages = carry
        # lax.div/rem: i >= 0, and jnp's floor division lowers to i1 selects on GPU
        col_tile, j = first + jax.lax.div(i, steps), jax.lax.rem(i, steps)
        pages, next_pages = jax.lax.cond(
            j == 0, lambda: (next_pages, tile.tile_pages(col_tile + 1)),
            lambda: (pages, next_pages))
        product = product + tile.step_product(col_tile, j, pages)

        def last_step(product):
            tile_stats(col_tile, tile.finish(product, col_tile))
            return jnp.zeros_like(product)

        product = jax.lax.cond(j == steps - 1, last_step, lambda p: p, product)
        return product, pages, next_pages

    first_pages = tile.tile_pages(first)
    jax.lax.fori_loop(0, seen * steps, step,
                      (jnp.zeros((rows, plan.block_k), jnp.float32), first_pages, first_pages))

    def unseen(i, carry):  # loops from 0: a traced lower bound trips jax 0.11.2
        zeros = jnp.zeros((rows,) if per_tile == 1 else (rows, per_tile), jnp.float32)
        store(first + seen + i, jnp.full((rows,), -jnp.inf, jnp.float32), zeros,
              jnp.zeros((rows,), jnp.float32))
        return carry

    jax.lax.fori_loop(0, span - seen, unseen, None)


def one_pass_block_sums(q, k, *, plan: Plan, causal: bool, norm: float, key_len,
                        block_table) -> jax.Array:
    """Block sums `[B, Hq, qb, kb]` (arguments as `block_sums.block_sums`),
    `plan.call_heads` query heads and `plan.call_rows` reshaped query rows per kernel
    call."""
    geom, heads, call_rows = plan.geom, plan.call_heads, plan.call_rows
    grid = kernel_grid(plan, call_rows // plan.block_q, plan.key_groups, heads)
    key_tiles, unit, per_tile = plan.stored_key_tiles, plan.unit, plan.units_per_tile
    all_rows = plan.all_rows
    # The last of several row steps ends at the last query block.
    row_extent = call_rows if all_rows else geom.q_blocks * geom.block_rows
    kernel = functools.partial(_tile_stats_kernel, plan=plan, causal=causal, norm=norm,
                               paged=block_table is not None,
                               row_extent=row_extent, head_offset=heads < geom.q_heads)
    stats_shape = (geom.batch, heads, key_tiles, call_rows)

    sees_keys = True if key_len is None else key_len[0] > 0
    kernel_keys, last_group = key_len, None
    if key_len is not None and plan.keys_fit and geom.stride > 1:  # S 1: no partial group
        kernel_keys, *last_group = split_last_group(q, k, key_len, block_table, geom, norm)

    def block_sums_of(first_head, first_row, q_blocks):
        in_specs, operands = key_operands(q, k, kernel_keys, block_table, plan, first_row,
                                          first_head)
        shapes = [stats_shape, stats_shape + (per_tile,)] + [stats_shape] * (per_tile > 1)
        maxes, sums, *totals = pl.pallas_call(
            kernel,
            grid=grid,
            in_specs=in_specs,
            out_specs=[head_spec(shape[2:]) for shape in shapes],
            out_shape=[kernel_output(shape, jnp.float32, q, k) for shape in shapes],
            compiler_params=plgpu.CompilerParams(num_warps=plan.num_warps,
                                                 num_stages=plan.num_stages),
            interpret=plan.interpret,
        )(*operands)
        totals = totals[0] if totals else sums[..., 0]
        if last_group is not None:
            maxes, sums, totals = merge_column(
                maxes, sums, totals, last_group, first_head=first_head, first_row=first_row,
                row_extent=row_extent, block_k=plan.block_k, unit=unit)
        return combine(maxes, sums, totals, geom, unit, first_row, q_blocks, sees_keys)

    if heads == geom.q_heads and all_rows:
        return block_sums_of(0, 0, geom.q_blocks)
    return in_steps(geom, heads, geom.q_blocks if all_rows else call_rows // geom.block_rows,
                    block_sums_of)
