"""The ragged step's attention on the warp-specialized kernel of `kernel` (Hopper):
`kernel.run_cta` with a `RaggedCta`, one CTA per (query head, slot of
`ragged_work.RaggedWork`). Imports Mosaic GPU.

What differs from the batched call, all outside the loops over key tiles or static:
- Query rows: warpgroup w's box of `block_q` rows of q `[T, Hq, D]` (one head's rows,
  a strided box read in place) starts at any row, so it is copied into the warpgroup's
  plain staging buffer (`ragged_plan`) and from there, through registers, into its
  swizzled query tile. The key position of the box's first row is the causal bound
  (`key_bound`).
- Keys: through the page table row of the slot's sequence, its entries clamped to the
  sequence's last page in use. Pages of a whole number of key tiles give one TMA copy
  per tile, as the batched call's; smaller pages (a whole number per tile) one copy per
  page onto the same barrier (its arrivals: the copies of a tile). A fused cache
  `[num_pages, page_size, Hkv, 2, D]` is read in place: K and V of a KV head are two
  strided boxes of the same pages.
- Output: other CTAs write the rows next to a warpgroup's, so it stores only its real
  rows: the finished tile goes to the staging buffer, then log2(block_q) + 1 predicated
  TMA stores of 2^k rows (64, 32, .., 1) cover the rows `[begin, begin + count)`.
- Slots whose `ACTIVE` field is 0 exit at once.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from xattn_jax.mosaic.attention import ragged_work as work
from xattn_jax.mosaic.common import WG_AXIS, tile_transforms
from xattn_jax.mosaic.attention.kernel import Barriers, barrier_types, key_value_slots, run_cta
from xattn_jax.mosaic.attention.plan import AttentionPlan
from xattn_jax.mosaic.attention.ragged_plan import stage_columns


def store_chunks(block_q: int) -> tuple[int, ...]:
    """The row counts of the predicated stores: the powers of two from block_q down."""
    return tuple(1 << k for k in reversed(range(block_q.bit_length())))


def store_plain(stage, rows: jax.Array) -> None:
    """rows `[block_q, columns]` (WGMMA layout) into the plain buffer `stage`. Pallas
    stores into shared memory only without bank conflicts (Mosaic GPU's layout
    inference would tile the buffer): this store takes them, once per warpgroup.
    Mosaic GPU's own store where Pallas has no unoptimized one (jax 0.11)."""
    if hasattr(plgpu, "store"):
        plgpu.store(stage, rows, optimized=False)
        return

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType()))
    def store(ctx, value, ref):
        del ctx
        value.store_untiled(ref, optimized=False)

    store(rows, stage)


class RaggedCta:
    """A CTA of the ragged call: slot `slots` of query head `heads` (grid axes)."""

    def __init__(self, q_ref, k_ref, v_ref, tiles_ref, counts_ref, slots_ref, table_ref,
                 out_ref, stage_smem, *, plan: AttentionPlan, group: int, page_size: int):
        self.q_ref, self.k_ref, self.v_ref = q_ref, k_ref, v_ref
        self.tiles_ref, self.counts_ref, self.slots_ref = tiles_ref, counts_ref, slots_ref
        self.table_ref, self.out_ref, self.stage_smem = table_ref, out_ref, stage_smem
        self.plan, self.page_size = plan, page_size
        self.columns = stage_columns(plan)
        self.head = lax.axis_index("heads")
        self.slot = lax.axis_index("slots")
        self.kv_head = lax.div(self.head, jnp.int32(group))
        self.seq = slots_ref[self.slot, work.SEQ]
        self.last_entry = slots_ref[self.slot, work.LAST_ENTRY]
        self.num_steps = counts_ref[self.head, self.slot, 0]

    def _field(self, wg, field: int):
        return self.slots_ref[self.slot, work.SLOT_FIELDS + wg * work.WG_FIELDS + field]

    def _parts(self):
        """The column ranges staged one after the other."""
        return [pl.ds(start, self.columns)
                for start in range(0, self.plan.head_dim, self.columns)]

    def _rows(self, ref, first, count: int, columns):
        """Rows [first, first + count) of head `heads` of q or out, `columns` of them."""
        return ref.at[pl.ds(first, count), self.head, columns]

    def load_queries(self, wg, q_tile, ready):
        load = self._field(wg, work.LOAD)
        plgpu.copy_gmem_to_smem(self._rows(self.q_ref, load, self.plan.block_q,
                                           self._parts()[0]),
                                self.stage_smem.at[wg], ready)

    def await_queries(self, wg, q_tile, ready):
        stage, parts = self.stage_smem.at[wg], self._parts()
        for index, columns in enumerate(parts):
            plgpu.barrier_wait(ready)
            rows = plgpu.load(stage, layout=plgpu.Layout.WGMMA, optimized=False)
            if index + 1 < len(parts):  # stage the next columns while these are stored
                plgpu.commit_smem()
                load = self._field(wg, work.LOAD)
                plgpu.copy_gmem_to_smem(self._rows(self.q_ref, load, self.plan.block_q,
                                                   parts[index + 1]), stage, ready)
            q_tile.at[:, columns][...] = rows
        plgpu.commit_smem()  # the tile's rows visible to wgmma

    def num_unmasked(self, wg):
        return self.counts_ref[self.head, self.slot, 1 + wg]

    def key_bound(self, wg, causal: bool):
        assert causal, "a ragged step is causal"
        return self._field(wg, work.POSITION)

    def key_tile(self, index):
        return self.tiles_ref[self.head, self.slot, index]

    def locate(self, index):
        """((page, rows in the page), ..): the copies of step `index`'s key tile."""
        bkv, page_size, tile = self.plan.block_kv, self.page_size, self.key_tile(index)

        def page(entry):
            return self.table_ref[self.seq, jnp.minimum(entry, self.last_entry)]

        if page_size >= bkv:  # a tile lies in one page
            tiles_per_page = jnp.int32(page_size // bkv)
            rows = pl.ds(lax.rem(tile, tiles_per_page) * bkv, bkv)
            return ((page(lax.div(tile, tiles_per_page)), rows),)
        pages_per_tile = bkv // page_size
        return tuple((page(tile * pages_per_tile + j), pl.ds(0, page_size))
                     for j in range(pages_per_tile))

    def _copy(self, source, dst, barrier, part: int):
        """Copies part 0 (keys) or 1 (values) of the pages at `source` into `dst`."""
        for j, (page, rows) in enumerate(source):
            where = (page, rows, self.kv_head)
            src = self.k_ref.at[where + (part,)] if self.v_ref is None else \
                (self.k_ref, self.v_ref)[part].at[where]
            part_dst = dst if len(source) == 1 else \
                dst.at[pl.ds(j * self.page_size, self.page_size)]
            plgpu.copy_gmem_to_smem(src, part_dst, barrier)

    def copy_keys(self, source, dst, barrier):
        self._copy(source, dst, barrier, 0)

    def copy_values(self, source, dst, barrier):
        self._copy(source, dst, barrier, 1)

    def store(self, wg, q_tile, out, m, l):
        del q_tile, m, l
        stage, parts = self.stage_smem.at[wg], self._parts()
        load, begin = self._field(wg, work.LOAD), self._field(wg, work.BEGIN)
        count = self._field(wg, work.COUNT)
        for index, columns in enumerate(parts):
            if index:  # the previous columns have left the stage
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            part = out if len(parts) == 1 else \
                out[:, columns.start:columns.start + self.columns]
            store_plain(stage, part.astype(stage.dtype))
            plgpu.commit_smem()
            for rows in store_chunks(self.plan.block_q):
                first = begin + lax.bitwise_and(count, jnp.int32(-2 * rows))  # after
                plgpu.copy_smem_to_gmem(     # the larger chunks
                    stage.at[pl.ds(first, rows)],
                    self._rows(self.out_ref, load + first, rows, columns),
                    predicate=lax.bitwise_and(count, jnp.int32(rows)) != 0)
        plgpu.wait_smem_to_gmem(0)


def _ragged_body(q_ref, k_ref, *refs, plan: AttentionPlan, group: int, page_size: int,
                 fused: bool, scale: float):
    """Refs: q [T_k, Hq, D]; k, v [num_pages, page_size, Hkv, D] (fused: k alone,
    [num_pages, page_size, Hkv, 2, D]); tiles, counts, slots (`ragged_work`); the page
    table [S, pages_per_seq] int32, ids in range; out [T_k, Hq, D]; scratch."""
    v_ref = None if fused else refs[0]
    (tiles_ref, counts_ref, slots_ref, table_ref, out_ref, buffers,
     *barriers) = refs[0 if fused else 1:]
    q_smem, stage_smem, k_smem, v_smem = buffers

    @pl.when(slots_ref[lax.axis_index("slots"), work.ACTIVE] != 0)
    def _():
        cta = RaggedCta(q_ref, k_ref, v_ref, tiles_ref, counts_ref, slots_ref, table_ref,
                        out_ref, stage_smem, plan=plan, group=group, page_size=page_size)
        run_cta(cta, q_smem, k_smem, v_smem, Barriers(*barriers), plan=plan, causal=True,
                scale=scale)


def ragged_attention_call(q, k, v, tiles, counts, slots, page_table, *,
                          plan: AttentionPlan, scale: float) -> jax.Array:
    """Runs the kernel: q `[T_k, Hq, D]` (T_k >= plan.block_q); k, v paged caches
    `[num_pages, page_size, Hkv, D]`, or v None and k fused `[num_pages, page_size, Hkv,
    2, D]` (pages of a whole number of key tiles, or a whole number of pages per tile);
    tiles, counts, slots from `ragged_work.ragged_work`; page_table int32 `[S,
    pages_per_seq]` holding ids in [0, num_pages). Returns out `[T_k, Hq, D]` in q's
    dtype, written in the real rows of the slots' warpgroups only."""
    q_heads, head_dim = q.shape[1:]
    page_size, kv_heads = k.shape[1], k.shape[2]
    warpgroups = plan.compute_warpgroups
    buffers = (
        plgpu.SMEM((warpgroups, plan.block_q, head_dim), q.dtype,
                   transforms=tile_transforms(q.dtype)),
        plgpu.SMEM((warpgroups, plan.block_q, stage_columns(plan)), q.dtype),
        *key_value_slots(plan, k.dtype),
    )
    copies_per_tile = max(1, plan.block_kv // page_size)
    body = functools.partial(_ragged_body, plan=plan, group=q_heads // kv_heads,
                             page_size=page_size, fused=v is None, scale=scale)
    operands = (q, k) + (() if v is None else (v,)) + (tiles, counts, slots, page_table)
    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct(q.shape, q.dtype),
        scratch_types=(buffers, *barrier_types(plan, copies_per_tile)),
        grid=(q_heads, slots.shape[0]),
        grid_names=("heads", "slots"),
        num_threads=warpgroups + 1,
        thread_name=WG_AXIS,
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(*operands)
