"""The warp-specialized Mosaic GPU kernel of block-sparse attention (FlashAttention-3 style).

One CTA = `plan.compute_warpgroups` consumer warpgroups of `plan.block_q` query rows each
(consecutive rows of one head) + one producer warpgroup. The CTA reads its entry of the
key-tile lists (`block_sparse_attention.key_tile_lists`): `counts[0]` selected key tiles whose indices
are `tiles[0:counts[0]]`, ascending; `counts[1 + w]` of them need no per-element mask for
consumer w. Skipped tiles cost nothing: the producer copies only listed tiles (TMA, into
`plan.stages` shared-memory slots) and the consumers multiply only those.

Producer: fills the slots, then for each later step waits until both consumers released
the slot's key tile (after q.k^T) and copies the next one, then the same for the value tile
(released after p.v), so the next keys load while the current values are still in use;
at the end it waits for the releases of the last tiles, so that every completed barrier
phase has been observed when the CTA exits.
With a paged cache (pages of a multiple of `block_kv` keys, so that a tile lies in one
page) the producer finds each tile's page in the block table and copies the tile's rows of
its KV head out of the page in place: the same TMA copy with another source.

Consumers: per step, s = q.k^T (wgmma), online softmax in float32, acc += p.v (wgmma). A
two-arrival barrier (`mma_turn`) makes the consumers take turns: while one warpgroup runs
its softmax, the other one's matmuls run on the tensor cores. Warpgroup 1 takes one turn
before its loop and warpgroup 0 one after, so both walk the same list in alternation.
Tiles that cross the causal diagonal of a warpgroup (or, without causal, hold keys >= n,
the keys in use: Lk unless given)
come last in the list and are the only ones masked per element.

The warpgroups' code (`run_cta`) asks a `CtaWork` where its CTA's query rows, key tiles
and output rows are: `BatchedCta` for this module's batched call, `ragged_kernel.RaggedCta`
for a ragged serving step.

Softmax: m is kept in log2 units (scores times scale*log2(e)) and starts at a finite
`_M_START`, so a row with no visible key so far gets p = 2^(-inf) = 0 and never NaN; at the
end, rows with l = 0 (no visible key) give acc / max(l, 1) = 0 and lse = m ln2 + ln 0 = -inf
(every other row has l >= 1, as its maximal score contributes 2^0).
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from xattn_jax.mosaic.common import (CONSUMER_REGISTERS, PRODUCER_REGISTERS, WG_AXIS,
                                     tile_transforms)
from xattn_jax.mosaic.attention.plan import AttentionPlan
from xattn_jax.row_statistics import LOG2_E

LN_2 = math.log(2.0)
_M_START = -1e30  # running max before any visible key (log2 units); finite on purpose


class Barriers(NamedTuple):
    """The kernel's barriers (`scratch_types`): q_ready [W], k_ready / v_ready [stages]
    (one arrival per copy of a tile), k_free / v_free [stages] and mma_turn (W arrivals
    each)."""

    q_ready: Any
    k_ready: Any
    v_ready: Any
    k_free: Any
    v_free: Any
    mma_turn: Any


class CtaWork(Protocol):
    """One CTA's share of a call, as `run_cta`'s warpgroups read it: where its query rows,
    key tiles and output rows are. Implemented by `BatchedCta` (the batched call) and
    `ragged_kernel.RaggedCta`. Only `key_tile`, `locate` and the copies run per key tile;
    the rest runs once per warpgroup."""

    num_steps: jax.Array  # int32: the key tiles the CTA visits

    def load_queries(self, wg, q_tile, ready) -> None:
        """Starts the copy of warpgroup wg's query rows into q_tile `[block_q, D]`."""

    def await_queries(self, wg, q_tile, ready) -> None:
        """Returns once q_tile holds wg's query rows, visible to wgmma."""

    def num_unmasked(self, wg) -> jax.Array:
        """How many leading listed tiles need no per-element mask for warpgroup wg."""

    def key_bound(self, wg, causal: bool) -> jax.Array:
        """causal: the key position of wg's first query row; else the first hidden key."""

    def key_tile(self, index) -> jax.Array:
        """The key tile (of `block_kv` keys) of step `index`."""

    def locate(self, index) -> Any:
        """Where step `index`'s key tile lies, read before the producer waits for a slot."""

    def copy_keys(self, source, dst, barrier) -> None:
        """TMA copies of the keys at `source` into the slot `dst`, arriving on `barrier`."""

    def copy_values(self, source, dst, barrier) -> None:
        """The same for the values."""

    def store(self, wg, q_tile, out: jax.Array, m: jax.Array, l: jax.Array) -> None:
        """Writes wg's finished rows: out `[block_q, Dv]` float32 (normalized), m and l the
        rows' running max (log2 units) and sum; q_tile (wg's query tile) is free."""


def run_cta(cta: CtaWork, q_smem, k_smem, v_smem, barriers: Barriers, *,
            plan: AttentionPlan, causal: bool, scale: float):
    """The warpgroups of one CTA: consumers 0 .. W-1 (`plan.block_q` query rows each),
    then the producer. q_smem `[W, block_q, D]`, k_smem / v_smem `[stages, block_kv, D]`."""
    q_ready, k_ready, v_ready, k_free, v_free, mma_turn = barriers
    wg = lax.axis_index(WG_AXIS)
    num_steps = cta.num_steps
    bq, bkv, stages = plan.block_q, plan.block_kv, plan.stages

    def take_turn():
        plgpu.barrier_arrive(mma_turn)
        plgpu.barrier_wait(mma_turn)

    @pl.when(wg < plan.compute_warpgroups)
    def _consumer():
        plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
        q_tile = q_smem.at[wg]
        cta.load_queries(wg, q_tile, q_ready.at[wg])
        num_unmasked = cta.num_unmasked(wg)
        key_bound = cta.key_bound(wg, causal)
        cta.await_queries(wg, q_tile, q_ready.at[wg])
        scale_log2 = scale * LOG2_E

        def step(index, carry, *, masked: bool):
            acc, m, l = carry
            slot = lax.rem(index, jnp.int32(stages))
            if masked:  # read before the product, so that its latency overlaps
                key0 = cta.key_tile(index) * bkv

            def qk_product(acc_ref):
                plgpu.wgmma(acc_ref, q_tile, k_smem.at[slot].transpose((1, 0)))
                take_turn()
                return acc_ref[...]

            s = pl.run_scoped(qk_product, plgpu.ACC((bq, bkv), jnp.float32))
            plgpu.barrier_arrive(k_free.at[slot])
            if masked:
                rows = plgpu.broadcasted_iota(jnp.int32, (bq, bkv), 0,
                                              layout=plgpu.Layout.WGMMA)
                cols = plgpu.broadcasted_iota(jnp.int32, (bq, bkv), 1,
                                              layout=plgpu.Layout.WGMMA)
                if causal:  # key key0 + c visible to row r (at key_bound + r) iff c <= ..
                    visible = (rows + (key_bound - key0)) >= cols
                else:  # only the keys from n on are hidden
                    visible = (cols + key0) < key_bound
                s = jnp.where(visible, s, -jnp.inf)
            m_new = jnp.maximum(m, s.max(axis=1) * scale_log2)
            alpha = jnp.exp2(m - m_new)
            p = jnp.exp2(s * scale_log2 - lax.broadcast_in_dim(m_new, s.shape, [0]))
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            l = l * alpha
            p_low = p.astype(q_tile.dtype)

            def finish_softmax_turn():
                plgpu.barrier_arrive(mma_turn)  # softmax done: the other may multiply
                plgpu.barrier_wait(v_ready.at[slot])
                plgpu.barrier_wait(mma_turn)  # the tensor cores are ours again

            # Order as in FlashAttention-3 on Hopper: with small heads the row sums fit
            # before the turn, with large ones they overlap the other warpgroup's work.
            if plan.head_dim <= 128:
                l = l + p.sum(axis=1)
                acc, l, m_new, p_low = lax.optimization_barrier((acc, l, m_new, p_low))
                finish_softmax_turn()
            else:
                finish_softmax_turn()
                l = l + p.sum(axis=1)

            def pv_product(acc_ref):
                plgpu.wgmma(acc_ref, p_low, v_smem.at[slot])
                following = index + 1

                @pl.when(following < num_steps)
                def _():
                    plgpu.barrier_wait(k_ready.at[lax.rem(following, jnp.int32(stages))])

            acc = pl.run_state(pv_product)(plgpu.ACC.init(acc))
            plgpu.barrier_arrive(v_free.at[slot])
            return acc, m_new, l

        acc = plgpu.layout_cast(jnp.zeros((bq, plan.head_dim), jnp.float32),
                                plgpu.Layout.WGMMA)
        m = plgpu.layout_cast(jnp.full((bq,), _M_START, jnp.float32),
                              plgpu.Layout.WGMMA.reduce(1))
        l = plgpu.layout_cast(jnp.zeros((bq,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))

        @pl.when(num_steps > 0)
        def _():
            plgpu.barrier_wait(k_ready.at[0])

        pl.when(wg == 1)(take_turn)
        carry = lax.fori_loop(0, num_unmasked, functools.partial(step, masked=False),
                              (acc, m, l))
        acc, m, l = lax.fori_loop(num_unmasked, num_steps,
                                  functools.partial(step, masked=True), carry)
        pl.when(wg == 0)(take_turn)

        out = acc / lax.broadcast_in_dim(jnp.maximum(l, 1.0), acc.shape, [0])
        cta.store(wg, q_tile, out, m, l)

    @pl.when(wg == plan.compute_warpgroups)
    def _producer():
        plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")

        for first in range(stages):
            @pl.when(first < num_steps)
            def _():
                source = cta.locate(first)
                cta.copy_keys(source, k_smem.at[first], k_ready.at[first])
                cta.copy_values(source, v_smem.at[first], v_ready.at[first])

        @pl.loop(stages, num_steps)
        def _(index):
            slot = lax.rem(index, jnp.int32(stages))
            source = cta.locate(index)  # read the index before waiting: its latency overlaps
            plgpu.barrier_wait(k_free.at[slot])
            cta.copy_keys(source, k_smem.at[slot], k_ready.at[slot])
            plgpu.barrier_wait(v_free.at[slot])
            cta.copy_values(source, v_smem.at[slot], v_ready.at[slot])

        # Observe the releases of the last tiles too, so every completed phase of the
        # free barriers has been waited for when the CTA ends.
        @pl.loop(jnp.maximum(num_steps - stages, 0), num_steps)
        def _(index):
            slot = lax.rem(index, jnp.int32(stages))
            plgpu.barrier_wait(k_free.at[slot])
            plgpu.barrier_wait(v_free.at[slot])


class BatchedCta:
    """A CTA of the batched call: query tile `cta` (of `plan.rows_per_cta` rows) of one
    (batch, query head), its key tiles read from k/v `[B, Hkv, Lk_pad, D]` or through the
    block table from pages of a whole number of key tiles."""

    def __init__(self, q_ref, k_ref, v_ref, tiles_ref, counts_ref, bounds_ref, table_ref,
                 out_ref, lse_ref, lse_smem, *, plan: AttentionPlan, num_ctas: int,
                 group: int, page_size: int | None):
        self.q_ref, self.k_ref, self.v_ref, self.table_ref = q_ref, k_ref, v_ref, table_ref
        self.tiles_ref, self.counts_ref, self.bounds_ref = tiles_ref, counts_ref, bounds_ref
        self.out_ref, self.lse_ref, self.lse_smem = out_ref, lse_ref, lse_smem
        self.plan, self.page_size = plan, page_size
        self.batch = lax.axis_index("batch")
        self.head = lax.axis_index("heads")
        # heavy (late) query tiles start first
        self.cta = num_ctas - 1 - lax.axis_index("q_ctas")
        self.kv_head = lax.div(self.head, jnp.int32(group))
        self.num_steps = counts_ref[self.batch, self.head, self.cta, 0]

    def _row0(self, wg):
        return self.cta * self.plan.rows_per_cta + wg * self.plan.block_q

    def load_queries(self, wg, q_tile, ready):
        rows = self.q_ref.at[self.batch, self.head, pl.ds(self._row0(wg), self.plan.block_q)]
        plgpu.copy_gmem_to_smem(rows, q_tile, ready)

    def await_queries(self, wg, q_tile, ready):
        plgpu.barrier_wait(ready)

    def num_unmasked(self, wg):
        return self.counts_ref[self.batch, self.head, self.cta, 1 + wg]

    def key_bound(self, wg, causal: bool):
        # bounds: (n - Lq, n); query row i sits at key position i + n - Lq
        return self._row0(wg) + self.bounds_ref[0] if causal else self.bounds_ref[1]

    def key_tile(self, index):
        return self.tiles_ref[self.batch, self.head, self.cta, index]

    def locate(self, index):
        bkv, tile = self.plan.block_kv, self.key_tile(index)
        if self.table_ref is None:
            return (self.batch, self.kv_head, pl.ds(tile * bkv, bkv))
        tiles_per_page = jnp.int32(self.page_size // bkv)  # a tile never crosses a page
        page = self.table_ref[self.batch, lax.div(tile, tiles_per_page)]
        return (page, pl.ds(lax.rem(tile, tiles_per_page) * bkv, bkv), self.kv_head)

    def copy_keys(self, source, dst, barrier):
        plgpu.copy_gmem_to_smem(self.k_ref.at[source], dst, barrier)

    def copy_values(self, source, dst, barrier):
        plgpu.copy_gmem_to_smem(self.v_ref.at[source], dst, barrier)

    def store(self, wg, q_tile, out, m, l):
        q_tile[...] = out.astype(q_tile.dtype)  # q is no longer needed: reuse its tile
        rows = (self.batch, self.head, pl.ds(self._row0(wg), self.plan.block_q))
        if self.lse_ref is not None:
            self.lse_smem.at[wg][...] = m * LN_2 + jnp.log(l)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_tile, self.out_ref.at[rows])
        if self.lse_ref is not None:
            plgpu.copy_smem_to_gmem(self.lse_smem.at[wg], self.lse_ref.at[rows])
        plgpu.wait_smem_to_gmem(0)


def _kernel_body(q_ref, k_ref, v_ref, tiles_ref, counts_ref, bounds_ref, *refs,
                 plan: AttentionPlan, num_ctas: int, group: int, causal: bool,
                 scale: float, page_size: int | None):
    """Refs: q/out [B, Hq, Lq_pad, D], k/v [B, Hkv, Lk_pad, D] (or, with `page_size`, paged
    [num_pages, page_size, Hkv, D] followed by the block table [B, pages_per_seq] int32,
    ids in range), tiles [B, Hq, nq, nt], counts [B, Hq, nq, 1 + W] and bounds [2] =
    (n - Lq, n) int32 (n keys in use: query row i sits at key position i + n - Lq), lse
    [B, Hq, Lq_pad] f32 or None."""
    table_ref = refs[0] if page_size is not None else None
    out_ref, lse_ref, buffers, *barriers = refs[page_size is not None:]
    q_smem, k_smem, v_smem, lse_smem = buffers
    cta = BatchedCta(q_ref, k_ref, v_ref, tiles_ref, counts_ref, bounds_ref, table_ref,
                     out_ref, lse_ref, lse_smem, plan=plan, num_ctas=num_ctas, group=group,
                     page_size=page_size)
    run_cta(cta, q_smem, k_smem, v_smem, Barriers(*barriers), plan=plan, causal=causal,
            scale=scale)


def key_value_slots(plan: AttentionPlan, dtype) -> tuple:
    """The key and the value slots `[stages, block_kv, D]` (wgmma tiles)."""
    slots = plgpu.SMEM((plan.stages, plan.block_kv, plan.head_dim), dtype,
                       transforms=tile_transforms(dtype))
    return slots, slots


def barrier_types(plan: AttentionPlan, copies_per_tile: int = 1) -> tuple:
    """The scratch of `Barriers`; a key (value) tile arrives in `copies_per_tile` copies."""
    warpgroups = plan.compute_warpgroups
    return (
        plgpu.Barrier(num_barriers=warpgroups),  # q_ready
        plgpu.Barrier(num_arrivals=copies_per_tile, num_barriers=plan.stages),  # k_ready
        plgpu.Barrier(num_arrivals=copies_per_tile, num_barriers=plan.stages),  # v_ready
        plgpu.Barrier(num_arrivals=warpgroups, num_barriers=plan.stages),  # k_free
        plgpu.Barrier(num_arrivals=warpgroups, num_barriers=plan.stages),  # v_free
        plgpu.Barrier(num_arrivals=warpgroups),  # mma_turn
    )


def attention_call(q, k, v, tiles, counts, bounds, block_table=None, *, plan: AttentionPlan,
                   causal: bool, scale: float, return_lse: bool):
    """Runs the kernel on padded operands: q [B, Hq, Lq_pad, D] with Lq_pad a multiple of
    `plan.rows_per_cta`, k/v [B, Hkv, Lk_pad, D] with Lk_pad a multiple of `plan.block_kv`
    (or paged caches [num_pages, page_size, Hkv, D] with page_size a multiple of
    `plan.block_kv` and `block_table` int32 [B, pages_per_seq] holding ids in
    [0, num_pages)), tiles/counts/bounds from `key_tile_lists`. Returns out
    [B, Hq, Lq_pad, D] in q's dtype and lse [B, Hq, Lq_pad] float32 (None unless
    `return_lse`)."""
    batch, q_heads, q_rows, head_dim = q.shape
    page_size = None if block_table is None else k.shape[1]
    kv_heads = k.shape[1] if block_table is None else k.shape[2]
    num_ctas = q_rows // plan.rows_per_cta
    warpgroups = plan.compute_warpgroups
    out_type = [jax.ShapeDtypeStruct(q.shape, q.dtype),
                jax.ShapeDtypeStruct((batch, q_heads, q_rows), jnp.float32)
                if return_lse else None]
    buffers = (
        plgpu.SMEM((warpgroups, plan.block_q, head_dim), q.dtype,
                   transforms=tile_transforms(q.dtype)),
        *key_value_slots(plan, k.dtype),
        plgpu.SMEM((warpgroups, plan.block_q), jnp.float32) if return_lse else None,
    )
    body = functools.partial(
        _kernel_body, plan=plan, num_ctas=num_ctas, group=q_heads // kv_heads,
        causal=causal, scale=scale, page_size=page_size)
    operands = (q, k, v, tiles, counts, bounds) + (() if block_table is None
                                                   else (block_table,))
    out, lse = plgpu.kernel(
        body,
        out_type=out_type,
        scratch_types=(buffers, *barrier_types(plan)),
        grid=(q_heads, num_ctas, batch),
        grid_names=("heads", "q_ctas", "batch"),
        num_threads=warpgroups + 1,
        thread_name=WG_AXIS,
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(*operands)
    return out, lse
