"""The warp-specialized Mosaic GPU kernel of the estimate's row statistics per key tile
(docs/estimate.md sections 1-3; the statistics of `xattn_jax.triton.one_pass`).

One CTA = `plan.rows` reshaped query rows of one (batch, query head) (a row tile; two
with paired row tiles, below) + two consumer warpgroups + one producer warpgroup.
Section 1 as one product with K = S x D: with q viewed as `[B, Hq, rows, S, D]` and k as
`[B, Hkv, cols, S, D]` (free reshapes),

    A[r, c] = sum_s q[r, S-1-s, :] . k[c, s, :] * scale

so that stride member s of a key tile is a `[block_k, D]` box of k with a row stride of
S x D, which TMA loads directly. A key tile's product runs in `plan.steps_per_tile` steps
(stride member s, head-dim part of `block_d` columns), each one wgmma of 64 query rows
`[64, block_d]` by a key chunk `[block_k, block_d]` into a float32 `[64, block_k]`
accumulator. The producer streams the chunks of every key tile the CTA sees, in tile
order, step by step, through a ring of `plan.stages` slots; a slot is refilled once the
consumers reading it released it. Two layouts of the queries (`plan.queries`):

- "resident" (64 rows per CTA): the producer first loads all the CTA's queries (S x
  head_parts chunks `[64, block_d]`, one barrier) and keeps them; a ring slot holds a key
  chunk. The consumers take the key tiles in turns (consumer w the tiles t = w, w + 2,
  ...): each chunk signals the ready barrier of its tile's consumer, so each consumer
  waits on every phase of its own barriers and never on the other's; one's statistics
  run while the other multiplies the next tile.
- "streamed" (128 rows per CTA, consumer w rows 64w .. 64w + 63): a ring slot holds the
  query chunk `[128, block_d]` (stride member S-1-s) and the key chunk (member s) of one
  step, both copies arriving on the slot's one ready barrier; both consumers compute
  every key tile, each multiplying its 64 rows of the query chunk, and both release the
  slot (its free barrier counts two arrivals). Both reach their statistics together,
  which the tensor cores wait for while the ring fills; with `plan.stagger`, consumer 1
  waits until consumer 0 has issued `plan.lag_steps` steps of its first tile (a barrier
  arrived on once), and the shared ring keeps it at most `stages` steps behind. With
  `plan.ordered_stats`, consumer 1 starts a tile's statistics only once consumer 0 has
  stored its own (the turn barrier, arrived on once per tile by consumer 0 and waited
  on once per tile by consumer 1, which walk the same tiles): the two then never
  compute statistics at once, and one's run while the other multiplies. Consumer 0
  cannot arrive for the next tile before consumer 1 has waited: its last step needs a
  slot consumer 1 frees only in that next tile, the ring being shorter than a tile's
  steps (`estimate_plan`).

Paired row tiles (`plan.pair_rows`, streamed queries, causal calls only: a non-causal
call's row tiles all walk every key tile, and it runs one per CTA): the CTA with index g
on the grid's row axis (`plan.row_groups`: ceil(R / 2) per head, R = `plan.row_tiles`)
walks row tiles g and R - 1 - g (`estimate_plan.paired_row_tiles`) one after the other,
about the same number of key tiles in all whatever g (R + 1 at block_k 128 and Lq =
Lk); an odd R's middle row tile is alone in the last CTA. The producer streams the first
row tile's chunks, then the second's, and the consumers compute their rows of each (own
first row, masked tiles, stores per row tile as above); the CTA's step count goes on
across the two, so the ring's slots and barrier phases simply continue (no barrier is
initialized twice), and the stagger barrier is arrived on once, in the CTA's first key
tile. Unpaired, each (batch, head) pair runs the row tiles that see the most key tiles
first; in causal calls of one key group the grid interleaves them across a launch
group of pairs (`EstimatePlan.launch_group`), so that every pair's long row tiles start
early.

Consumers, per key tile: the steps' wgmmas (a step's slot is released once at most one
wgmma is in flight after it; unrolled, or with `plan.step_loop` the steps after the first
as a loop, one copy of their code), then the statistics of the consumer's 64 rows, in log2
units:

- m[r] = max over the tile's columns of A'[r, c] (A' = A * log2(e), -inf where not seen),
- x[u, r] = sum over the columns c of unit u of 2^(A'[r, c] - m[r]) (a row that sees no
  column of the tile gets x = 0),
- with several units, their total,

stored to `stats[b, h, t, :, rows]` (planes: m, x_0 .. x_{P-1}[, total]; with `plan.fold`
at the slot and rows of `estimate_plan.folded_place`) through a shared memory buffer and
TMA. Only tiles holding a column some of the consumer's rows do not see (past the keys,
or after its first row's causal diagonal) come last and are masked per element; such a
tile is multiplied and summed only over its first columns, up to the last one its rows
see (`estimate_plan.seen_columns`) rounded up to a width of `plan.masked_widths` (one
variant of the tile's code per width, chosen per tile; later units' sums are 0). Tiles
no row of the row tile sees are neither computed nor stored
(`estimate_plan.visible_tiles`: the caller fills them).

Keys in use, pages, row steps and head steps (the scalars input, int32 `[3]`, read from
global memory by every warpgroup): the kernel sees only the first `scalars[0]` keys, whole
stride groups, and reads the key tile holding the last of them from the tail operand
(`[B, Hkv, block_k, S, D]`: the caller's copy of that tile with every key past the
count zero, so a partly filled last group reads zeros, section 1): a CTA walks no key
tile past them and masks the one holding their end, so later keys (past a chunk's
context, or any bytes a buffer holds there) never enter a statistic. With
`plan.page_size`, k is a paged cache viewed as `[num_pages, page_size / S, S, Hkv, D]`:
a key tile lies in one page (page_size a multiple of block_k x S), which the producer
looks up in the block table, so that the key chunk is the same TMA box of another
source. A call in row steps
(`plan.call_rows`) covers the rows COLUMN_TILE x `scalars[1]` .. + call_rows of every
head (a multiple of COLUMN_TILE, as Mosaic GPU's TMA layout inference wants the query
rows' index known to be): the queries are read at those rows and visibility counts
them, while the statistics are written at the call's own rows (its scratch holds
call_rows). A call in head steps (`plan.call_heads`) covers the query heads
`scalars[2]` .. + call_heads, all their rows: the queries (and their key heads) are read
at those heads, the statistics written at the call's own (its scratch holds call_heads).
A call of both (a row step of one head, `estimate_plan._head_rows`) covers those rows of
those heads.

`plan.leave_out` (timing only) skips the consumers' products or their statistics past
the maxima; the pipeline and the stores stay.

Clusters (`plan.cluster` = c > 1, one key group, unpaired): the CTAs of c consecutive
row tiles walk the same key tiles (those the last one sees; earlier ones mask their
extra tiles whole) and each key chunk is multicast to all, each CTA's producer loading
1/c of it (streamed: and its own query chunk); the ring's release barrier then counts
the slot's readers in every CTA of the cluster. A CTA's producer waits for the last
releases of all, so no CTA exits while another may still write to its shared memory or
arrive on its barriers.

Key groups (`plan.key_groups` = G > 1, cluster 1, unpaired): G consecutive CTAs on the
grid's row axis share a row tile, CTA g walking its visible key tiles g x span .. (g +
1) x span - 1 (`plan.key_span`; possibly none). Each tile's statistics have their own
place, so nothing is combined across CTAs; the ring and barriers count the CTA's own
tiles from its span's first. A whole causal call's grid is compacted
(`EstimatePlan.compacted`): it holds only the CTAs whose span holds a visible tile, each
reading its row group and key group from the cells operand, so that no CTA is launched
past a row tile's diagonal.

Persistent grid (`plan.persistent_ctas` = G, streamed queries, unpaired, one key
group): G CTAs, CTA c walking work items c, c + G, ... of `estimate_plan.work_items`,
each the (batch, head, row tile, key tile) its index names, or nothing where no row of
the row tile sees the key tile. In a causal call (`EstimatePlan.listed`) the CTAs walk
only the items whose row tile sees their key tile, read from the items operand (the
call's row step's row of `estimate_plan.items_table`: their number, then one pair's
items, the same for every pair), so that each CTA walks as many (one more at most). As
with paired row tiles, the CTA's step count goes on across its items, and consumer 1
waits for its lead at the CTA's first walked tile.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from xattn_jax.mosaic.estimate_plan import (COLUMN_TILE, CONSUMERS, WGMMA_ROWS,
                                            EstimatePlan, paired_row_tiles, seen_columns,
                                            folded_place, items_table, listed_pair_walk,
                                            tail_tile, unmasked_tiles, visible_tiles,
                                            walked_cells, work_items)
from xattn_jax.mosaic.kernel import (CONSUMER_REGISTERS, PRODUCER_REGISTERS, WG_AXIS,
                                     _tile_transforms)

# Pallas' automatic warpgroup barriers around every store to shared memory: off. They
# cost two barriers per statistics plane and key tile in each consumer (36 at block
# 128, 68 at block 64). Their two conditions hold here (CompilerParams): the threads'
# only stores to shared memory are the statistics, which no thread reads back (TMA
# copies them out), each tile's after `wait_smem_to_gmem` and before `commit_smem`,
# both of which synchronize the warpgroup themselves. H200, kernel alone, medians of 6
# rounds in rotating order, with / without (session 18): non-causal 64K block 64 7.885
# / 7.498 ms, block 128 7.524 / 7.272, causal 64K 3.936 / 3.874, causal 32K 1.053 /
# 1.042, the 4096-query chunk over 64K 0.4446 / 0.4434; block sums bit-identical.
AUTO_BARRIERS = False
CLUSTER_AXIS = "cluster"
PERSISTENT_AXIS = "ctas"
PAIR_AXIS = "pairs"  # (batch, query head) pairs: batch x Hq + head
GROUP_AXIS = "pair_groups"  # launch groups of pairs (`EstimatePlan.launch_group`)
ROW_AXIS = "row_groups"
ROW_LAYOUT = plgpu.Layout.WGMMA.reduce(1)  # a value per row of a consumer's scores


def _grid(plan: EstimatePlan, causal: bool) -> dict[str, int]:
    """The kernel's grid, by axis name. Mosaic GPU launches its last axis fastest (CUDA's
    x): a persistent grid; or each (batch, head) pair's row groups in turn (launch group
    1; a cluster's CTAs are consecutive row tiles); or per launch group of G pairs, the
    row groups interleaved across its pairs (`EstimatePlan.launch_group`)."""
    if plan.persistent_ctas:
        return {PERSISTENT_AXIS: plan.persistent_ctas}
    rows, group = plan.grid_rows(causal), plan.launch_group(causal)
    if group == 1:
        return {PAIR_AXIS: plan.pairs, ROW_AXIS: rows}
    return {GROUP_AXIS: plan.pairs // group, ROW_AXIS: rows, PAIR_AXIS: group}


def _batch_and_head(plan: EstimatePlan, causal: bool):
    """This CTA's batch element and query head of the call (of `plan.heads`) on the grid
    of `_grid` (not persistent)."""
    pair = lax.axis_index(PAIR_AXIS)
    group = plan.launch_group(causal)
    if group > 1:
        pair = lax.axis_index(GROUP_AXIS) * group + pair
    heads = jnp.int32(plan.heads)
    return lax.div(pair, heads), lax.rem(pair, heads)


def _cta_work(plan: EstimatePlan, causal: bool, first_row, cols, cells_ref, items_ref):
    """The work of this CTA, in order: a function each(walk) that runs walk(batch, head,
    row0, lo, n, walked) for each of its units (a row tile of (batch, head) starting at
    reshaped query row row0 of this call, whose key tiles lo .. lo + n - 1 the CTA walks;
    walked = the key tiles walked for the units before) and returns the key tiles
    walked in all. `first_row`: the call's first row; `cols`: the key columns in use;
    `cells_ref`: with a compacted grid (`EstimatePlan.compacted`), the int32 cells of
    `estimate_plan.walked_cells`, else None; `items_ref`: with a listed persistent grid
    (`EstimatePlan.listed`), the int32 row of `estimate_plan.items_table` of the call's
    row step (the number of items, then the items), else None.

    - Persistent (`plan.persistent_ctas` = G): the call's work items (`work_items`; or
      those listed) c, c + G, c + 2G, ... for CTA c, each one key tile (n = 1) or none
      (n = 0: a tile no row of the row tile sees, or a row tile past the call's).
    - Else one unit per row tile on the grid (`_grid`: (batch, head) pairs and row
      groups), or two with paired row tiles (`estimate_plan.paired_row_tiles`).
      Unpaired, the clusters run long row tiles first, and the CTAs of a cluster walk
      the key tiles its last row tile sees; with `plan.key_groups` = G, the G CTAs of a
      row tile walk consecutive spans of `plan.key_span` of them (compacted: those of
      the spans holding a visible tile, a cell each)."""
    if plan.persistent_ctas:
        return functools.partial(_walk_items, plan, causal, first_row, cols, items_ref)
    batch, head = _batch_and_head(plan, causal)
    index = lax.axis_index(ROW_AXIS)
    if plan.paired(causal):  # one kernel call, one key group: first_row = 0
        pair = paired_row_tiles(plan, index)

        def paired(walk):
            def one(j, walked):
                row0 = jnp.where(j == 0, *pair) * plan.rows
                num_tiles = visible_tiles(plan, causal, row0, cols)
                walk(batch, head, row0, 0, num_tiles, walked)
                return walked + num_tiles

            return lax.fori_loop(0, jnp.where(pair[0] == pair[1], 1, 2), one, jnp.int32(0))

        return paired
    group, lo = index, 0
    if plan.key_groups > 1:
        cell = index if cells_ref is None else cells_ref[index]
        group = lax.div(cell, jnp.int32(plan.key_groups))
        lo = lax.rem(cell, jnp.int32(plan.key_groups)) * plan.key_span
    first_tile = (plan.row_groups(causal) - 1 - group) * plan.cluster  # long first
    row0 = (first_tile + lax.axis_index(CLUSTER_AXIS)) * plan.rows
    num_tiles = visible_tiles(plan, causal,
                              first_row + (first_tile + plan.cluster - 1) * plan.rows, cols)
    if plan.key_groups > 1:
        num_tiles = jnp.clip(num_tiles - lo, 0, plan.key_span)

    def single(walk):
        walk(batch, head, row0, lo, num_tiles, 0)
        return num_tiles

    return single


def _walk_items(plan: EstimatePlan, causal: bool, first_row, cols, items_ref, walk):
    """The persistent CTA's units (`_cta_work`): work item c + G j, j = 0, 1, ..., of
    `work_items`, or with `items_ref` (`EstimatePlan.listed`) of the call's listed items
    (each pair's, `listed_items`, in turn), as (batch, head, row0, tile, 0 or 1,
    walked).

    A listed grid walks the pairs in an outer loop, in each pair the listed items
    `estimate_plan.listed_pair_walk` gives: the same items in the same order as
    dividing each of the call's item indices by the pair's items (traced, read from the
    step's row of `items_table`), without that division (an emulated 32-bit division,
    35 dependent instructions per item in every warp; mosaic_estimate_h200.md, session
    32)."""
    cta = lax.axis_index(PERSISTENT_AXIS)
    ctas, block = plan.persistent_ctas, plan.row_block_tiles
    items, tiles = work_items(plan, cols)
    heads = jnp.int32(plan.heads)

    def unit(item, walked, pair=None):
        """Walks `item`: a work item of the call (`work_items` order), or with `pair`
        the index of one within that (batch, head) pair's items."""
        row_in_block, i = lax.rem(item, jnp.int32(block)), lax.div(item, jnp.int32(block))
        tile, i = lax.rem(i, tiles), lax.div(i, tiles)
        row_block = i
        if pair is None:
            row_blocks = jnp.int32(plan.row_blocks)
            row_block, pair = lax.rem(i, row_blocks), lax.div(i, row_blocks)
        row_tile = row_block * block + row_in_block
        row0 = row_tile * plan.rows
        seen = ((row_tile < plan.call_row_tiles)
                & (tile < visible_tiles(plan, causal, first_row + row0, cols)))
        num_tiles = seen.astype(jnp.int32)
        walk(lax.div(pair, heads), lax.rem(pair, heads), row0, tile, num_tiles, walked)
        return walked + num_tiles

    if items_ref is None:
        return lax.fori_loop(0, lax.div(items - cta + (ctas - 1), jnp.int32(ctas)),
                             lambda j, walked: unit(cta + j * ctas, walked), jnp.int32(0))
    per_pair = items_ref[0]  # the items follow

    def one_pair(pair, walked):
        first, count = listed_pair_walk(pair, per_pair, cta, ctas)
        return lax.fori_loop(
            0, count, lambda j, walked: unit(items_ref[1 + first + j * ctas], walked, pair),
            walked)

    return lax.fori_loop(0, plan.pairs, one_pair, jnp.int32(0))


def _shift(x, offset):
    """x + offset, x itself where offset is the Python int 0 (no key groups, no head
    steps: the kernel stays the one measured without them)."""
    return x if isinstance(offset, int) and offset == 0 else x + offset


def _seen(shape, first_column, cols, diagonal):
    """Which scores of a consumer's tile (`shape` = [64 rows, block_k], the WGMMA layout)
    its rows see: column first_column + c is seen by row i iff it is one of the `cols`
    in use and, with `diagonal` (None: not causal), at most i + diagonal (section 2).
    Each row's bound is one number and each column's index another: 1-D arrays in the
    layout's row and column parts, compared element by element only in the broadcast
    (2-D index arrays spilled registers: ncu counted 1.4M local-memory requests at
    causal 32K on the H200, none without the masks; mosaic_estimate_h200.md)."""
    bound = cols - first_column  # columns c < bound
    if diagonal is not None:
        rows = plgpu.broadcasted_iota(jnp.int32, shape[:1], 0,
                                      layout=ROW_LAYOUT)
        bound = lax.broadcast_in_dim(jnp.minimum(rows + (diagonal + 1 - first_column), bound),
                                     shape, [0])
    columns = plgpu.broadcasted_iota(jnp.int32, shape[1:], 0,
                                     layout=plgpu.Layout.WGMMA.reduce(0))
    return lax.broadcast_in_dim(columns, shape, [1]) < bound


def _kernel_body(q_ref, k_ref, *refs, plan: EstimatePlan, causal: bool, scale: float,
                 keys_in_use: bool):
    """Refs: q [B, Hq, padded_rows, S, D], k [B, Hkv, padded_cols, S, D] (or a paged
    cache viewed as [num_pages, page_size / S, S, Hkv, D], then the block table int32
    [B, pages_per_seq]), with `keys_in_use` the tail tile [B, Hkv, block_k, S, D], with
    a compacted grid its cells int32 [grid_rows] (`estimate_plan.walked_cells`), with
    a listed persistent grid its items int32 [1 + n] (a row of `estimate_plan.
    items_table`), the
    scalars int32 [3] (the keys in use, whole stride groups; the call's first reshaped
    query row / COLUMN_TILE; its first query head), stats float32 `plan.stats_shape`;
    scratch as `_scratch_types` makes it (q_ready None with the streamed queries, lead
    None without stagger, turn None without ordered_stats); scale: A' = product x scale.
    The scalars are read only where they vary: the keys with `keys_in_use` (else all
    k_cols columns), the first row in row steps and the first head in head steps (else
    0), so that a whole call of all keys runs with static bounds."""
    refs = list(refs)
    table_ref = refs.pop(0) if plan.page_size else None
    tail_ref = refs.pop(0) if keys_in_use else None
    cells_ref = refs.pop(0) if plan.compacted(causal) else None
    items_ref = refs.pop(0) if plan.listed(causal) else None
    (scalars_ref, stats_ref, q_smem, k_smem, stats_smem, q_ready, ready, free,
     lead, turn) = refs
    geom = plan.geom
    bk, bd, stages, parts = plan.block_k, plan.block_d, plan.stages, plan.head_parts
    steps, unit, units = plan.steps_per_tile, plan.unit, plan.units_per_tile
    widths = plan.masked_widths
    streamed = plan.queries == "streamed"
    wg = lax.axis_index(WG_AXIS)
    cols = geom.k_cols  # key columns in use
    if keys_in_use:
        cols = lax.div(scalars_ref[0], jnp.int32(geom.stride))
    first_row = 0
    if plan.call_rows:
        # a multiple of COLUMN_TILE rows, so that TMA's layout inference knows the
        # queries' row index to be one (block_rows is: `unsupported_reason`)
        first_row = scalars_ref[1] * COLUMN_TILE
    first_head = scalars_ref[2] if plan.call_heads else 0
    each_unit = _cta_work(plan, causal, first_row, cols, cells_ref, items_ref)
    multicast = CLUSTER_AXIS if plan.cluster > 1 else None
    multiply = plan.leave_out != "product"

    @pl.when(wg < CONSUMERS)
    def _consumer():
        plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
        # Resident: consumer w takes tiles lo + w, lo + w + 2, ...; streamed: every tile,
        # rows 64w ..
        first, turns = (0, 1) if streamed else (wg, CONSUMERS)
        own_ready = 0 if streamed else wg * stages  # the consumer's ready barriers
        out = stats_smem.at[wg]
        if not streamed:
            plgpu.barrier_wait(q_ready)

        def queries(step, slot):
            """The wgmma's left operand `[64, block_d]` of this step."""
            if streamed:
                return q_smem.at[slot, pl.ds(wg * WGMMA_ROWS, WGMMA_ROWS)]
            member, part = divmod(step, parts)
            return q_smem.at[(geom.stride - 1 - member) * parts + part]

        def consume(batch, head, row0, lo, num_tiles, walked):
            """The consumer's key tiles (of lo .. lo + num_tiles - 1) of the row tile of
            (batch, head) starting at row0 of the call."""
            own_row0 = row0 + wg * WGMMA_ROWS if streamed else row0
            query_row = first_row + own_row0  # of all the reshaped query rows
            own_tiles = lax.div(num_tiles - first + (turns - 1), jnp.int32(turns))
            unmasked = _shift(unmasked_tiles(plan, causal, query_row, cols), -lo)  # may be < 0
            plain = jnp.clip(lax.div(unmasked - first + (turns - 1), jnp.int32(turns)), 0,
                             own_tiles)

            def one_tile(n, carry, *, masked: bool):
                walked_here = first + n * turns  # tiles of this row tile before it
                tile = _shift(walked_here, lo)
                first_step = (walked + walked_here) * steps  # the CTA's step count

                if plan.stagger:  # consumer 1 starts with the CTA's first tile
                    @pl.when((wg == 1) & (walked + walked_here == 0))
                    def _():
                        plgpu.barrier_wait(lead)

                if not masked or len(widths) == 1:
                    tile_at_width(tile, first_step, bk, masked=masked)
                    return carry
                # the columns up to the last one the consumer's rows see, in whole widths
                seen = seen_columns(plan, causal, query_row, WGMMA_ROWS, cols) - tile * bk
                index = jnp.clip(lax.div(seen + (widths[0] - 1), jnp.int32(widths[0])) - 1,
                                 0, len(widths) - 1)
                for i, width in enumerate(widths):
                    pl.when(index == i)(functools.partial(
                        tile_at_width, tile, first_step, width, masked=True))
                return carry

            def tile_at_width(tile, first_step, width, *, masked: bool):
                """Key tile `tile` (its steps from the CTA's `first_step` on): the products
                and statistics of its first `width` columns (the rest unseen), stored."""
                def one_step(acc_ref, step):
                    """Step `step` of the tile (a Python int, or the step loop's traced
                    one): wait for its slot and multiply; let consumer 1 start."""
                    slot = lax.rem(first_step + step, jnp.int32(stages))
                    plgpu.barrier_wait(ready.at[own_ready + slot])
                    if multiply:
                        keys = (k_smem.at[slot] if width == bk else
                                k_smem.at[slot, pl.ds(0, width)])
                        plgpu.wgmma(acc_ref, queries(step, slot), keys.transpose((1, 0)))
                    lag_step = step == plan.lag_steps - 1  # a Python bool for an int step
                    if plan.stagger and lag_step is not False:  # consumer 1 may start
                        @pl.when(lag_step & (wg == 0) & (first_step == 0))
                        def _():
                            plgpu.barrier_arrive(lead)

                def release(step, in_flight: int):
                    """Step `step` has finished reading its slot (at most `in_flight`
                    wgmmas after it): the slot is free."""
                    if multiply:
                        plgpu.wgmma_wait(in_flight)
                    plgpu.barrier_arrive(
                        free.at[lax.rem(first_step + step, jnp.int32(stages))])

                def later_step(acc_ref, step):
                    one_step(acc_ref, step)
                    release(step - 1, 1)

                def product(acc_ref):
                    one_step(acc_ref, 0)
                    if plan.step_loop:  # one copy of the later steps' code
                        pl.loop(1, steps, unroll=plan.step_loop)(
                            functools.partial(later_step, acc_ref))
                    else:
                        for step in range(1, steps):  # static: the resident queries' index
                            later_step(acc_ref, step)
                    release(steps - 1, 0)
                    return acc_ref[...] if multiply else None

                shape = (WGMMA_ROWS, width)
                if multiply:
                    a = pl.run_scoped(product, plgpu.ACC(shape, jnp.float32))
                else:  # the chunks are waited for and released all the same
                    product(None)
                    a = plgpu.layout_cast(jnp.zeros(shape, jnp.float32),
                                          plgpu.Layout.WGMMA)
                if plan.ordered_stats:  # consumer 0's statistics of the tile first
                    @pl.when(wg == 1)
                    def _():
                        plgpu.barrier_wait(turn)

                if masked:
                    a = jnp.where(_seen(shape, tile * bk, cols, query_row + geom.row_offset
                                        if causal else None), a, -jnp.inf)
                # scale > 0: the maximum of the products, scaled, is the maximum of A',
                # and A' - m is one fused multiply-add per score (no pass scaling A)
                m = a.max(axis=1) * jnp.float32(scale)
                sums = []
                if plan.leave_out != "statistics":
                    shift = jnp.where(m == -jnp.inf, 0.0, m)  # a row seeing nothing: x = 0
                    p = jnp.exp2(a * jnp.float32(scale)
                                 - lax.broadcast_in_dim(shift, a.shape, [0]))
                    # units past the width: no column seen, x = 0
                    sums = [p[:, u * unit:min((u + 1) * unit, width)].sum(axis=1)
                            if u * unit < width else None for u in range(units)]
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last copy read it
                out.at[0][...] = m
                for u, x in enumerate(sums):
                    out.at[1 + u][...] = (plgpu.layout_cast(jnp.zeros_like(m), ROW_LAYOUT)
                                          if x is None else x)
                if len(sums) > 1:
                    out.at[1 + units][...] = functools.reduce(
                        jnp.add, [x for x in sums if x is not None])
                plgpu.commit_smem()
                slot, stat_row0 = tile, own_row0
                if plan.fold:
                    slot, place_row0 = folded_place(plan, row0, tile)
                    stat_row0 = place_row0 + (own_row0 - row0)
                plgpu.copy_smem_to_gmem(out, stats_ref.at[batch, head, slot, :,
                                                          pl.ds(stat_row0, WGMMA_ROWS)])
                if plan.ordered_stats:
                    @pl.when(wg == 0)
                    def _():
                        plgpu.barrier_arrive(turn)

            lax.fori_loop(0, plain, functools.partial(one_tile, masked=False), None)
            lax.fori_loop(plain, own_tiles, functools.partial(one_tile, masked=True), None)

        each_unit(consume)
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == CONSUMERS)
    def _producer():
        plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")

        def produce(batch, head, row0, lo, num_tiles, walked):
            """The chunks of key tiles lo .. lo + num_tiles - 1 of the row tile of (batch,
            head) starting at row0 of the call, the CTA's steps `index` (resident
            queries: the row tile's queries first; a CTA has one row tile then)."""
            head = _shift(head, first_head)  # of all the query heads
            if not streamed:
                for member in range(geom.stride):
                    for part in range(parts):
                        plgpu.copy_gmem_to_smem(
                            q_ref.at[batch, head, pl.ds(first_row + row0, plan.rows),
                                     member, pl.ds(part * bd, bd)],
                            q_smem.at[member * parts + part], q_ready)
            kv_head = lax.div(head, jnp.int32(geom.group))

            def key_chunk(tile, member, columns):
                """Stride member `member`'s `columns` of key tile `tile`: `[block_k,
                block_d]` of k, or of the page holding the tile (a tile never crosses a
                page)."""
                if table_ref is None:
                    return k_ref.at[batch, kv_head, pl.ds(tile * bk, bk), member, columns]
                tiles_per_page = jnp.int32(plan.page_size // geom.stride // bk)
                page = table_ref[batch, lax.div(tile, tiles_per_page)]
                return k_ref.at[page, pl.ds(lax.rem(tile, tiles_per_page) * bk, bk),
                                member, kv_head, columns]

            def tail_chunk(tile, member, columns):
                """`key_chunk` of the tile holding the last key in use: the tail's."""
                del tile
                return tail_ref.at[batch, kv_head, pl.ds(0, bk), member, columns]

            def load(first_tile, last_tile, chunk_of):
                """The steps of the row tile's key tiles first_tile .. last_tile - 1 (of
                those it walks, 0 .. num_tiles - 1), their key chunks from
                chunk_of(tile, member, columns)."""
                @pl.loop((walked + first_tile) * steps, (walked + last_tile) * steps)
                def _(index):
                    walked_here = lax.div(index, jnp.int32(steps)) - walked
                    tile = _shift(walked_here, lo)
                    step = lax.rem(index, jnp.int32(steps))
                    member = lax.div(step, jnp.int32(parts))
                    columns = pl.ds(lax.rem(step, jnp.int32(parts)) * bd, bd)
                    slot = lax.rem(index, jnp.int32(stages))

                    @pl.when(index >= stages)
                    def _():
                        plgpu.barrier_wait(free.at[slot])

                    if streamed:
                        slot_ready = ready.at[slot]
                        plgpu.copy_gmem_to_smem(
                            q_ref.at[batch, head, pl.ds(first_row + row0, plan.rows),
                                     geom.stride - 1 - member, columns],
                            q_smem.at[slot], slot_ready)
                    else:  # the ready barrier of the consumer owning the tile
                        slot_ready = ready.at[lax.rem(walked_here, jnp.int32(CONSUMERS))
                                              * stages + slot]
                    plgpu.copy_gmem_to_smem(chunk_of(tile, member, columns),
                                            k_smem.at[slot], slot_ready,
                                            collective_axes=multicast)

            if tail_ref is None:
                load(0, num_tiles, key_chunk)
            else:  # no tile past the tail's is visible: it is the last one walked, if any
                from_k = jnp.clip(tail_tile(plan, cols) - lo, 0, num_tiles)
                load(0, from_k, key_chunk)
                load(from_k, num_tiles, tail_chunk)

        total = each_unit(produce) * steps

        # Observe the last releases too: every completed phase of `free` is waited for.
        @pl.loop(jnp.maximum(total - stages, 0), total)
        def _(index):
            plgpu.barrier_wait(free.at[lax.rem(index, jnp.int32(stages))])


def _scratch_types(plan: EstimatePlan, dtype) -> tuple:
    """The kernel's scratch (`EstimatePlan.smem_bytes` counts it): queries (resident:
    `[S x head_parts, 64, block_d]`; streamed: a ring `[stages, 128, block_d]`), the key
    ring `[stages, block_k, block_d]`, statistics `[CONSUMERS, stat_planes, 64]` float32,
    and the barriers q_ready (resident only), ready, free, lead (stagger only) and turn
    (ordered_stats only)."""
    transforms = _tile_transforms(dtype)
    keys = plgpu.SMEM((plan.stages, plan.block_k, plan.block_d), dtype,
                      transforms=transforms)
    stats = plgpu.SMEM((CONSUMERS, plan.stat_planes, WGMMA_ROWS), jnp.float32)
    streamed = plan.queries == "streamed"
    # free: a slot is refilled once its readers are done (streamed: both consumers;
    # resident: the tile's consumer), in every CTA of the cluster (whose key chunks the
    # refill writes)
    readers = CONSUMERS if streamed else 1
    free = (plgpu.ClusterBarrier(collective_axes=(CLUSTER_AXIS,), num_arrivals=readers,
                                 num_barriers=plan.stages) if plan.cluster > 1 else
            plgpu.Barrier(num_arrivals=readers, num_barriers=plan.stages))
    if streamed:
        return (
            plgpu.SMEM((plan.stages, plan.rows, plan.block_d), dtype, transforms=transforms),
            keys, stats,
            None,
            # ready: the slot's query and key chunks landed
            plgpu.Barrier(num_arrivals=2, num_barriers=plan.stages),
            free,
            plgpu.Barrier() if plan.stagger else None,  # lead: consumer 1 may start
            # turn: consumer 0 has stored a tile's statistics
            plgpu.Barrier() if plan.ordered_stats else None,
        )
    chunks = plan.geom.stride * plan.head_parts
    return (
        plgpu.SMEM((chunks, plan.rows, plan.block_d), dtype, transforms=transforms),
        keys, stats,
        plgpu.Barrier(num_arrivals=chunks),  # q_ready: every query chunk landed
        plgpu.Barrier(num_barriers=CONSUMERS * plan.stages),  # ready, per consumer
        free,
        None,  # lead
        None,  # turn
    )


@functools.partial(jax.jit, static_argnames=("plan", "causal", "scale"))
def tile_stats(q: jax.Array, k: jax.Array, table: jax.Array | None,
               tail: jax.Array | None, scalars: jax.Array, *, plan: EstimatePlan,
               causal: bool, scale: float, step: jax.Array | int = 0) -> jax.Array:
    """Runs the kernel: q `[B, Hq, padded_rows, S, D]`, k `[B, Hkv, padded_cols, S, D]`
    (bfloat16 or float16, zero-padded) or, with `plan.page_size`, a paged cache viewed as
    `[num_pages, page_size / S, S, Hkv, D]` read through `table` (int32 `[B,
    pages_per_seq]`, ids in [0, num_pages)); scalars int32 `[3]`: the keys in use (whole
    stride groups, at most k_cols x S), the first reshaped query row of this call (a
    row step; 0 for all rows) divided by COLUMN_TILE, and its first query head (a head
    step; 0 for all heads); tail: None (scalars[0] is then k_cols x S, and the kernel
    takes it as a constant) or the key tile holding the last key in use, `[B, Hkv,
    block_k, S, D]` in k's dtype, with every key past the count zero (read instead of
    k's tile); scale = log2(e) / (sqrt(D) S norm); step: the call's row step (an index
    of `estimate_plan.step_first_rows`, int32, maybe traced; 0 for a call of whole
    rows), whose listed items a listed grid walks. Returns float32 `plan.stats_shape`:
    `[B, heads, key_tiles, stat_planes, rows_per_call]`, or with `plan.fold` the folded
    statistics (`estimate_plan.folded_place`); entries of tiles no row of a row tile
    sees (`estimate_plan.visible_tiles`) are not written. Jitted, so that a call running
    the kernel in several loops (`EstimatePlan.epilogue_loops`) lowers it once."""
    out_type = jax.ShapeDtypeStruct(plan.stats_shape, jnp.float32)
    body = functools.partial(_kernel_body, plan=plan, causal=causal, scale=scale,
                             keys_in_use=tail is not None)
    cells = ((jnp.asarray(walked_cells(plan), jnp.int32),) if plan.compacted(causal)
             else ())
    listed = ((jnp.asarray(items_table(plan))[step],) if plan.listed(causal) else ())
    operands = ((q, k) + ((table,) if plan.page_size else ())
                + ((tail,) if tail is not None else ()) + cells + listed + (scalars,))
    grid = _grid(plan, causal)
    return plgpu.kernel(
        body,
        out_type=out_type,
        scratch_types=_scratch_types(plan, q.dtype),
        grid=tuple(grid.values()),
        grid_names=tuple(grid),
        cluster=(plan.cluster,),  # the last grid axis: consecutive row tiles
        cluster_names=(CLUSTER_AXIS,),
        num_threads=CONSUMERS + 1,
        thread_name=WG_AXIS,
        compiler_params=plgpu.CompilerParams(approx_math=True,
                                             unsafe_no_auto_barriers=not AUTO_BARRIERS),
    )(*operands)
