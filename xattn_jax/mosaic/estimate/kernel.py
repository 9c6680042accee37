"""The warp-specialized Mosaic GPU kernel of the estimate's row statistics per key tile
(docs/estimate.md sections 1-3; the statistics of `xattn_jax.triton.one_pass`).

A CTA walks units of work, each a row tile of ROWS reshaped query rows of one (batch,
query head) and a run of its key tiles (`_cta_work`: one row tile per CTA, a span of its
key tiles with key groups, or work items of one key tile on a persistent grid). With q
viewed as `[B, Hq, rows, S, D]` and k as `[B, Hkv, cols, S, D]`, section 1 is one product
with K = S x D:

    A[r, c] = sum_s q[r, S-1-s, :] . k[c, s, :] * scale

A key tile runs in `steps_per_tile` steps (stride member s, head-dim part), each a ring
slot holding the query chunk `[ROWS, BLOCK_D]` and the key chunk `[block_k, BLOCK_D]`,
both copied by TMA onto the slot's ready barrier. The producer warpgroup fills the slots
in the CTA's step order; consumer w multiplies rows 64w .. 64w + 63 of each slot's query
chunk and both release the slot. Consumer 1 starts `lag_steps` behind consumer 0, so one's
statistics overlap the other's products; with `ordered_stats` it also waits for consumer
0's statistics of each tile (the turn barrier). Per key tile, each consumer stores, in
log2 units, for its 64 rows: the maximum m, each unit's sum x of 2^(A' - m) and their
total (`UnitSums.stat_planes`), at the slot and rows of `grid.folded_place` with `fold`.
Tiles after a consumer's unmasked ones are masked per element and computed only up to
the last column its rows see, in one of `masked_widths`. Tiles no row of the row tile
sees are neither computed nor stored (the wrapper ignores them).

The scalars operand (int32 `[3]`) holds the keys in use (whole stride groups; the tile
holding their end is read from the tail operand, the wrapper's copy with later keys
zeroed), the call's first row / COLUMN_TILE (row steps) and its first head (head steps).
A paged k is read through the block table, each key tile within one page.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from xattn_jax.mosaic.common import (CONSUMER_REGISTERS, PRODUCER_REGISTERS, WG_AXIS,
                                     tile_transforms)
from xattn_jax.mosaic.estimate.grid import (folded_place, items_table, listed_pair_walk,
                                            seen_columns, tail_tile, unmasked_tiles,
                                            visible_tiles, walked_cells, work_items)
from xattn_jax.mosaic.estimate.plan import (BLOCK_D, COLUMN_TILE, CONSUMERS, WGMMA_ROWS,
                                            EstimatePlan)

PERSISTENT_AXIS = "ctas"
PAIR_AXIS = "pairs"  # (batch, query head) pairs: batch x Hq + head
GROUP_AXIS = "pair_groups"  # launch groups of pairs (`EstimatePlan.launch_group`)
ROW_AXIS = "row_groups"
ROW_LAYOUT = plgpu.Layout.WGMMA.reduce(1)  # a value per row of a consumer's scores


def _grid(plan: EstimatePlan) -> dict[str, int]:
    """The grid by axis name; Mosaic GPU launches the last axis fastest: a persistent
    grid, each pair's row groups in turn, or a launch group's row groups interleaved."""
    if plan.persistent_ctas:
        return {PERSISTENT_AXIS: plan.persistent_ctas}
    rows, group = plan.grid_rows, plan.launch_group
    if group == 1:
        return {PAIR_AXIS: plan.pairs, ROW_AXIS: rows}
    return {GROUP_AXIS: plan.pairs // group, ROW_AXIS: rows, PAIR_AXIS: group}


def _batch_and_head(plan: EstimatePlan):
    pair = lax.axis_index(PAIR_AXIS)
    group = plan.launch_group
    if group > 1:
        pair = lax.axis_index(GROUP_AXIS) * group + pair
    heads = jnp.int32(plan.heads)
    return lax.div(pair, heads), lax.rem(pair, heads)


def _cta_work(plan: EstimatePlan, first_row, cols, cells_ref, items_ref):
    """each(walk): runs walk(batch, head, row0, lo, n, walked) for each unit of the CTA
    (the row tile from row0 of the call, its key tiles lo .. lo + n - 1; walked: the
    tiles of earlier units) and returns the tiles walked. cells_ref: a compacted grid's
    `walked_cells`; items_ref: a listed grid's row of `items_table`."""
    if plan.persistent_ctas:
        return functools.partial(_walk_items, plan, first_row, cols, items_ref)
    batch, head = _batch_and_head(plan)
    group, lo = lax.axis_index(ROW_AXIS), 0
    if plan.key_groups > 1:
        cell = group if cells_ref is None else cells_ref[group]
        group = lax.div(cell, jnp.int32(plan.key_groups))
        lo = lax.rem(cell, jnp.int32(plan.key_groups)) * plan.key_span
    row0 = (plan.call_row_tiles - 1 - group) * plan.rows  # the long row tiles first
    num_tiles = visible_tiles(plan, first_row + row0, cols)
    if plan.key_groups > 1:
        num_tiles = jnp.clip(num_tiles - lo, 0, plan.key_span)

    def single(walk):
        walk(batch, head, row0, lo, num_tiles, 0)
        return num_tiles

    return single


def _walk_items(plan: EstimatePlan, first_row, cols, items_ref, walk):
    """A persistent CTA's units: work items c, c + G, .. of `work_items`, or of a listed
    grid's items pair by pair (`listed_pair_walk`: no division by the traced count)."""
    cta = lax.axis_index(PERSISTENT_AXIS)
    ctas, block = plan.persistent_ctas, plan.row_block_tiles
    items, tiles = work_items(plan, cols)
    heads = jnp.int32(plan.heads)

    def unit(item, walked, pair=None):
        row_in_block, i = lax.rem(item, jnp.int32(block)), lax.div(item, jnp.int32(block))
        tile, i = lax.rem(i, tiles), lax.div(i, tiles)
        row_block = i
        if pair is None:
            row_blocks = jnp.int32(plan.row_blocks)
            row_block, pair = lax.rem(i, row_blocks), lax.div(i, row_blocks)
        row_tile = row_block * block + row_in_block
        row0 = row_tile * plan.rows
        seen = ((row_tile < plan.call_row_tiles)
                & (tile < visible_tiles(plan, first_row + row0, cols)))
        num_tiles = seen.astype(jnp.int32)
        walk(lax.div(pair, heads), lax.rem(pair, heads), row0, tile, num_tiles, walked)
        return walked + num_tiles

    if items_ref is None:
        return lax.fori_loop(0, lax.div(items - cta + (ctas - 1), jnp.int32(ctas)),
                             lambda j, walked: unit(cta + j * ctas, walked), jnp.int32(0))
    per_pair = items_ref[0]

    def one_pair(pair, walked):
        first, count = listed_pair_walk(pair, per_pair, cta, ctas)
        return lax.fori_loop(
            0, count, lambda j, walked: unit(items_ref[1 + first + j * ctas], walked, pair),
            walked)

    return lax.fori_loop(0, plan.pairs, one_pair, jnp.int32(0))


def _shift(x, offset):
    """x + offset, x itself for the Python int 0 (no key groups or head steps)."""
    return x if isinstance(offset, int) and offset == 0 else x + offset


def _seen(shape, first_column, cols, diagonal):
    """Which scores of a consumer's tile `shape` (the WGMMA layout) its rows see: column
    first_column + c by row i iff it is in use and, causal (`diagonal` not None), at most
    i + diagonal. 1-D row bounds and column indices, compared only in the broadcast (2-D
    index arrays spilled registers on the H200)."""
    bound = cols - first_column
    if diagonal is not None:
        rows = plgpu.broadcasted_iota(jnp.int32, shape[:1], 0, layout=ROW_LAYOUT)
        bound = lax.broadcast_in_dim(jnp.minimum(rows + (diagonal + 1 - first_column), bound),
                                     shape, [0])
    columns = plgpu.broadcasted_iota(jnp.int32, shape[1:], 0,
                                     layout=plgpu.Layout.WGMMA.reduce(0))
    return lax.broadcast_in_dim(columns, shape, [1]) < bound


def _store_stats(plan: EstimatePlan, a, scale: float, out, stats_ref, batch, head, row0,
                 own_row0, tile):
    """The statistics of a consumer's scores `a` `[64, width]` of key tile `tile`
    (consumer rows from `own_row0` of the row tile from `row0`), stored to `stats_ref`
    through the shared buffer `out`."""
    unit, units = plan.unit, plan.units_per_tile
    width = a.shape[1]
    # scale > 0: the maximum of the products, scaled, is the maximum of A', and A' - m
    # is one fused multiply-add per score
    m = a.max(axis=1) * jnp.float32(scale)
    shift = jnp.where(m == -jnp.inf, 0.0, m)  # a row seeing nothing: x = 0
    p = jnp.exp2(a * jnp.float32(scale) - lax.broadcast_in_dim(shift, a.shape, [0]))
    sums = [p[:, u * unit:min((u + 1) * unit, width)].sum(axis=1)
            if u * unit < width else None for u in range(units)]  # None: unseen units
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last copy read it
    out.at[0][...] = m
    for u, x in enumerate(sums):
        out.at[1 + u][...] = (plgpu.layout_cast(jnp.zeros_like(m), ROW_LAYOUT)
                              if x is None else x)
    if len(sums) > 1:
        out.at[1 + units][...] = functools.reduce(jnp.add,
                                                  [x for x in sums if x is not None])
    plgpu.commit_smem()
    slot, stat_row0 = tile, own_row0
    if plan.fold:
        slot, place_row0 = folded_place(plan, row0, tile)
        stat_row0 = place_row0 + (own_row0 - row0)
    plgpu.copy_smem_to_gmem(out, stats_ref.at[batch, head, slot, :,
                                              pl.ds(stat_row0, WGMMA_ROWS)])


def _consumer(plan: EstimatePlan, scale: float, wg, cols, first_row, each_unit, stats_ref,
              q_smem, k_smem, stats_smem, ready, free, lead, turn):
    """Consumer `wg`: its 64 rows of every key tile of the CTA's units."""
    plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
    geom, bk, stages = plan.geom, plan.block_k, plan.stages
    out = stats_smem.at[wg]
    steps, widths = plan.steps_per_tile, plan.masked_widths

    def consume(batch, head, row0, lo, num_tiles, walked):
        own_row0 = row0 + wg * WGMMA_ROWS
        query_row = first_row + own_row0  # of all the reshaped query rows
        unmasked = _shift(unmasked_tiles(plan, query_row, cols), -lo)  # may be < 0
        plain = jnp.clip(unmasked, 0, num_tiles)

        def one_tile(n, carry, *, masked: bool):
            tile = _shift(n, lo)
            first_step = (walked + n) * steps  # the CTA's step count

            @pl.when((wg == 1) & (walked + n == 0))  # consumer 1 starts late
            def _():
                plgpu.barrier_wait(lead)

            if not masked or len(widths) == 1:
                tile_at_width(tile, first_step, bk, masked=masked)
                return carry
            # the columns up to the last one the consumer's rows see, in whole widths
            seen = seen_columns(plan, query_row, WGMMA_ROWS, cols) - tile * bk
            index = jnp.clip(lax.div(seen + (widths[0] - 1), jnp.int32(widths[0])) - 1,
                             0, len(widths) - 1)
            for i, width in enumerate(widths):
                pl.when(index == i)(functools.partial(
                    tile_at_width, tile, first_step, width, masked=True))
            return carry

        def tile_at_width(tile, first_step, width, *, masked: bool):
            def one_step(acc_ref, step):
                slot = lax.rem(first_step + step, jnp.int32(stages))
                plgpu.barrier_wait(ready.at[slot])
                keys = k_smem.at[slot] if width == bk else k_smem.at[slot, pl.ds(0, width)]
                rows = q_smem.at[slot, pl.ds(wg * WGMMA_ROWS, WGMMA_ROWS)]
                plgpu.wgmma(acc_ref, rows, keys.transpose((1, 0)))
                lag_step = step == plan.lag_steps - 1  # a Python bool for an int step
                if lag_step is not False:  # consumer 1 may start
                    @pl.when(lag_step & (wg == 0) & (first_step == 0))
                    def _():
                        plgpu.barrier_arrive(lead)

            def release(step, in_flight: int):
                plgpu.wgmma_wait(in_flight)
                plgpu.barrier_arrive(free.at[lax.rem(first_step + step, jnp.int32(stages))])

            def later_step(acc_ref, step):
                one_step(acc_ref, step)
                release(step - 1, 1)

            def product(acc_ref):
                one_step(acc_ref, 0)
                if plan.step_loop:  # one copy of the later steps' code
                    pl.loop(1, steps, unroll=plan.step_loop)(
                        functools.partial(later_step, acc_ref))
                else:
                    for step in range(1, steps):
                        later_step(acc_ref, step)
                release(steps - 1, 0)
                return acc_ref[...]

            shape = (WGMMA_ROWS, width)
            a = pl.run_scoped(product, plgpu.ACC(shape, jnp.float32))
            if plan.ordered_stats:  # consumer 0's statistics of the tile first
                @pl.when(wg == 1)
                def _():
                    plgpu.barrier_wait(turn)

            if masked:
                a = jnp.where(_seen(shape, tile * bk, cols, query_row + geom.row_offset
                                    if plan.causal else None), a, -jnp.inf)
            _store_stats(plan, a, scale, out, stats_ref, batch, head, row0, own_row0, tile)
            if plan.ordered_stats:
                @pl.when(wg == 0)
                def _():
                    plgpu.barrier_arrive(turn)

        lax.fori_loop(0, plain, functools.partial(one_tile, masked=False), None)
        lax.fori_loop(plain, num_tiles, functools.partial(one_tile, masked=True), None)

    each_unit(consume)
    plgpu.wait_smem_to_gmem(0)


def _producer(plan: EstimatePlan, first_row, first_head, cols, each_unit, q_ref, k_ref,
              table_ref, tail_ref, q_smem, k_smem, ready, free):
    """The query and key chunks of every step of the CTA's units, through the ring."""
    plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")
    geom, bk, stages = plan.geom, plan.block_k, plan.stages
    parts, steps = plan.head_parts, plan.steps_per_tile

    def produce(batch, head, row0, lo, num_tiles, walked):
        head = _shift(head, first_head)  # of all the query heads
        kv_head = lax.div(head, jnp.int32(geom.group))

        def key_chunk(tile, member, columns):
            """Stride member `member`'s `columns` of key tile `tile`, in k or its page."""
            if table_ref is None:
                return k_ref.at[batch, kv_head, pl.ds(tile * bk, bk), member, columns]
            tiles_per_page = jnp.int32(plan.page_size // geom.stride // bk)
            page = table_ref[batch, lax.div(tile, tiles_per_page)]
            return k_ref.at[page, pl.ds(lax.rem(tile, tiles_per_page) * bk, bk),
                            member, kv_head, columns]

        def tail_chunk(tile, member, columns):
            del tile
            return tail_ref.at[batch, kv_head, pl.ds(0, bk), member, columns]

        def load(first_tile, last_tile, chunk_of):
            """The steps of the unit's key tiles first_tile .. last_tile - 1."""
            @pl.loop((walked + first_tile) * steps, (walked + last_tile) * steps)
            def _(index):
                tile = _shift(lax.div(index, jnp.int32(steps)) - walked, lo)
                step = lax.rem(index, jnp.int32(steps))
                member = lax.div(step, jnp.int32(parts))
                columns = pl.ds(lax.rem(step, jnp.int32(parts)) * BLOCK_D, BLOCK_D)
                slot = lax.rem(index, jnp.int32(stages))

                @pl.when(index >= stages)
                def _():
                    plgpu.barrier_wait(free.at[slot])

                plgpu.copy_gmem_to_smem(
                    q_ref.at[batch, head, pl.ds(first_row + row0, plan.rows),
                             geom.stride - 1 - member, columns],
                    q_smem.at[slot], ready.at[slot])
                plgpu.copy_gmem_to_smem(chunk_of(tile, member, columns), k_smem.at[slot],
                                        ready.at[slot])

        if tail_ref is None:
            load(0, num_tiles, key_chunk)
        else:  # no tile past the tail's is visible: it is the last one walked, if any
            from_k = jnp.clip(tail_tile(plan, cols) - lo, 0, num_tiles)
            load(0, from_k, key_chunk)
            load(from_k, num_tiles, tail_chunk)

    total = each_unit(produce) * steps

    @pl.loop(jnp.maximum(total - stages, 0), total)  # every phase of `free` observed
    def _(index):
        plgpu.barrier_wait(free.at[lax.rem(index, jnp.int32(stages))])


def _kernel_body(q_ref, k_ref, *refs, plan: EstimatePlan, scale: float, keys_in_use: bool):
    """Refs: q, k (or a paged cache and its block table), the tail tile with
    `keys_in_use`, a compacted grid's cells, a listed grid's items, the scalars, the
    statistics, then the scratch of `_scratch_types`. The scalars are read only where
    they vary, so a whole call of all keys runs with static bounds."""
    refs = list(refs)
    table_ref = refs.pop(0) if plan.page_size else None
    tail_ref = refs.pop(0) if keys_in_use else None
    cells_ref = refs.pop(0) if plan.compacted else None
    items_ref = refs.pop(0) if plan.listed else None
    scalars_ref, stats_ref, q_smem, k_smem, stats_smem, ready, free, lead, turn = refs
    wg = lax.axis_index(WG_AXIS)
    cols = plan.geom.k_cols  # key columns in use
    if keys_in_use:
        cols = lax.div(scalars_ref[0], jnp.int32(plan.geom.stride))
    first_row = 0
    if plan.call_rows:  # a multiple of COLUMN_TILE: TMA's layout inference needs it known
        first_row = scalars_ref[1] * COLUMN_TILE
    first_head = scalars_ref[2] if plan.call_heads else 0
    each_unit = _cta_work(plan, first_row, cols, cells_ref, items_ref)
    pl.when(wg < CONSUMERS)(functools.partial(
        _consumer, plan, scale, wg, cols, first_row, each_unit, stats_ref, q_smem, k_smem,
        stats_smem, ready, free, lead, turn))
    pl.when(wg == CONSUMERS)(functools.partial(
        _producer, plan, first_row, first_head, cols, each_unit, q_ref, k_ref, table_ref,
        tail_ref, q_smem, k_smem, ready, free))


def _scratch_types(plan: EstimatePlan, dtype) -> tuple:
    """The query and key rings, the statistics buffers `[CONSUMERS, stat_planes, 64]`,
    and the barriers ready (a slot's chunks landed), free (both consumers read a slot),
    lead (consumer 1 may start) and turn (with `ordered_stats`: consumer 0 stored a
    tile's statistics)."""
    transforms = tile_transforms(dtype)
    return (
        plgpu.SMEM((plan.stages, plan.rows, BLOCK_D), dtype, transforms=transforms),
        plgpu.SMEM((plan.stages, plan.block_k, BLOCK_D), dtype, transforms=transforms),
        plgpu.SMEM((CONSUMERS, plan.stat_planes, WGMMA_ROWS), jnp.float32),
        plgpu.Barrier(num_arrivals=2, num_barriers=plan.stages),
        plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=plan.stages),
        plgpu.Barrier(),
        plgpu.Barrier() if plan.ordered_stats else None,
    )


@functools.partial(jax.jit, static_argnames=("plan", "scale"))
def tile_stats(q: jax.Array, k: jax.Array, table: jax.Array | None,
               tail: jax.Array | None, scalars: jax.Array, *, plan: EstimatePlan,
               scale: float, step: jax.Array | int = 0) -> jax.Array:
    """Runs the kernel: q `[B, Hq, padded_rows, S, D]`, k `[B, Hkv, padded_cols, S, D]`
    (bf16 or f16, zero-padded), or with `plan.page_size` a paged cache `[num_pages,
    page_size / S, S, Hkv, D]` read through `table` (int32 `[B, pages_per_seq]`, ids in
    range); scalars int32 `[3]` (module docstring); tail: None (all keys in use) or the
    tile holding the last key in use, `[B, Hkv, block_k, S, D]`, later keys zero; scale =
    log2(e) / (sqrt(D) S norm); step: the call's row step (`grid.step_first_rows`,
    maybe traced), whose items a listed grid walks. Returns float32 `plan.stats_shape`;
    tiles no row of a row tile sees are not written. Jitted: a call in several epilogue
    loops lowers the kernel once."""
    out_type = jax.ShapeDtypeStruct(plan.stats_shape, jnp.float32)
    body = functools.partial(_kernel_body, plan=plan, scale=scale,
                             keys_in_use=tail is not None)
    cells = (jnp.asarray(walked_cells(plan), jnp.int32),) if plan.compacted else ()
    listed = (jnp.asarray(items_table(plan))[step],) if plan.listed else ()
    operands = ((q, k) + ((table,) if plan.page_size else ())
                + ((tail,) if tail is not None else ()) + cells + listed + (scalars,))
    grid = _grid(plan)
    return plgpu.kernel(
        body,
        out_type=out_type,
        scratch_types=_scratch_types(plan, q.dtype),
        grid=tuple(grid.values()),
        grid_names=tuple(grid),
        num_threads=CONSUMERS + 1,
        thread_name=WG_AXIS,
        # no automatic warpgroup barriers around the statistics' stores: no thread
        # reads them back (docs/tuning.md: mosaic-no-auto-barriers)
        compiler_params=plgpu.CompilerParams(approx_math=True, unsafe_no_auto_barriers=True),
    )(*operands)
