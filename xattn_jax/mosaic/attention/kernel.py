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

Softmax: m is kept in log2 units (scores times scale*log2(e)) and starts at a finite
`_M_START`, so a row with no visible key so far gets p = 2^(-inf) = 0 and never NaN; at the
end, rows with l = 0 (no visible key) give acc / max(l, 1) = 0 and lse = m ln2 + ln 0 = -inf
(every other row has l >= 1, as its maximal score contributes 2^0).
"""

from __future__ import annotations

import functools
import math

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


def _kernel_body(q_ref, k_ref, v_ref, tiles_ref, counts_ref, bounds_ref, *refs,
                 plan: AttentionPlan, num_ctas: int, group: int, causal: bool,
                 scale: float, page_size: int | None):
    """Refs: q/out [B, Hq, Lq_pad, D], k/v [B, Hkv, Lk_pad, D] (or, with `page_size`, paged
    [num_pages, page_size, Hkv, D] followed by the block table [B, pages_per_seq] int32,
    ids in range), tiles [B, Hq, nq, nt], counts [B, Hq, nq, 1 + W] and bounds [2] =
    (n - Lq, n) int32 (n keys in use: query row i sits at key position i + n - Lq), lse
    [B, Hq, Lq_pad] f32 or None."""
    table_ref = refs[0] if page_size is not None else None
    (out_ref, lse_ref, buffers,
     q_ready, k_ready, v_ready, k_free, v_free, mma_turn) = refs[page_size is not None:]
    q_smem, k_smem, v_smem, lse_smem = buffers
    batch = lax.axis_index("batch")
    head = lax.axis_index("heads")
    cta = num_ctas - 1 - lax.axis_index("q_ctas")  # heavy (late) query tiles start first
    wg = lax.axis_index(WG_AXIS)
    num_steps = counts_ref[batch, head, cta, 0]
    bq, bkv, stages = plan.block_q, plan.block_kv, plan.stages

    def take_turn():
        plgpu.barrier_arrive(mma_turn)
        plgpu.barrier_wait(mma_turn)

    @pl.when(wg < plan.compute_warpgroups)
    def _consumer():
        plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
        q_tile = q_smem.at[wg]
        row0 = cta * plan.rows_per_cta + wg * bq
        plgpu.copy_gmem_to_smem(q_ref.at[batch, head, pl.ds(row0, bq)], q_tile,
                                q_ready.at[wg])
        num_unmasked = counts_ref[batch, head, cta, 1 + wg]
        # causal: the key position of query row 0; else: the first hidden key
        key_bound = bounds_ref[0] if causal else bounds_ref[1]
        plgpu.barrier_wait(q_ready.at[wg])
        scale_log2 = scale * LOG2_E

        def step(index, carry, *, masked: bool):
            acc, m, l = carry
            slot = lax.rem(index, jnp.int32(stages))
            if masked:  # read before the product, so that its latency overlaps
                key0 = tiles_ref[batch, head, cta, index] * bkv

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
                if causal:  # key key0 + c visible to row row0 + r iff c <= r + pos - key0
                    visible = (rows + (row0 + key_bound - key0)) >= cols
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
        q_tile[...] = out.astype(q_tile.dtype)  # q is no longer needed: reuse its tile
        if lse_ref is not None:
            lse_smem.at[wg][...] = m * LN_2 + jnp.log(l)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_tile, out_ref.at[batch, head, pl.ds(row0, bq)])
        if lse_ref is not None:
            plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[batch, head, pl.ds(row0, bq)])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == plan.compute_warpgroups)
    def _producer():
        plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")
        kv_head = lax.div(head, jnp.int32(group))

        def key_rows(index):
            tile = tiles_ref[batch, head, cta, index]
            if table_ref is None:
                return (batch, kv_head, pl.ds(tile * bkv, bkv))
            tiles_per_page = jnp.int32(page_size // bkv)  # a tile never crosses a page
            page = table_ref[batch, lax.div(tile, tiles_per_page)]
            return (page, pl.ds(lax.rem(tile, tiles_per_page) * bkv, bkv), kv_head)

        for first in range(stages):
            @pl.when(first < num_steps)
            def _():
                rows = key_rows(first)
                plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[first], k_ready.at[first])
                plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[first], v_ready.at[first])

        @pl.loop(stages, num_steps)
        def _(index):
            slot = lax.rem(index, jnp.int32(stages))
            rows = key_rows(index)  # read the index before waiting: its latency overlaps
            plgpu.barrier_wait(k_free.at[slot])
            plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot], k_ready.at[slot])
            plgpu.barrier_wait(v_free.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[slot], v_ready.at[slot])

        # Observe the releases of the last tiles too, so every completed phase of the
        # free barriers has been waited for when the CTA ends.
        @pl.loop(jnp.maximum(num_steps - stages, 0), num_steps)
        def _(index):
            slot = lax.rem(index, jnp.int32(stages))
            plgpu.barrier_wait(k_free.at[slot])
            plgpu.barrier_wait(v_free.at[slot])


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
    tile_layout = tile_transforms(q.dtype)
    out_type = [jax.ShapeDtypeStruct(q.shape, q.dtype),
                jax.ShapeDtypeStruct((batch, q_heads, q_rows), jnp.float32)
                if return_lse else None]
    buffers = (
        plgpu.SMEM((warpgroups, plan.block_q, head_dim), q.dtype, transforms=tile_layout),
        plgpu.SMEM((plan.stages, plan.block_kv, head_dim), k.dtype, transforms=tile_layout),
        plgpu.SMEM((plan.stages, plan.block_kv, head_dim), v.dtype, transforms=tile_layout),
        plgpu.SMEM((warpgroups, plan.block_q), jnp.float32) if return_lse else None,
    )
    scratch_types = (
        buffers,
        plgpu.Barrier(num_barriers=warpgroups),  # q_ready
        plgpu.Barrier(num_barriers=plan.stages),  # k_ready
        plgpu.Barrier(num_barriers=plan.stages),  # v_ready
        plgpu.Barrier(num_arrivals=warpgroups, num_barriers=plan.stages),  # k_free
        plgpu.Barrier(num_arrivals=warpgroups, num_barriers=plan.stages),  # v_free
        plgpu.Barrier(num_arrivals=warpgroups),  # mma_turn
    )
    body = functools.partial(
        _kernel_body, plan=plan, num_ctas=num_ctas, group=q_heads // kv_heads,
        causal=causal, scale=scale, page_size=page_size)
    operands = (q, k, v, tiles, counts, bounds) + (() if block_table is None
                                                   else (block_table,))
    out, lse = plgpu.kernel(
        body,
        out_type=out_type,
        scratch_types=scratch_types,
        grid=(q_heads, num_ctas, batch),
        grid_names=("heads", "q_ctas", "batch"),
        num_threads=warpgroups + 1,
        thread_name=WG_AXIS,
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(*operands)
    return out, lse
