"""The warp-specialized Mosaic GPU kernel of the estimate's row statistics per key tile
(docs/estimate.md sections 1-3; the statistics of `xattn_jax.triton.one_pass`).

One CTA = `ROWS` reshaped query rows of one (batch, query head) + two consumer
warpgroups + one producer warpgroup. Section 1 as one product with K = S x D: with q
viewed as `[B, Hq, rows, S, D]` and k as `[B, Hkv, cols, S, D]` (free reshapes),

    A[r, c] = sum_s q[r, S-1-s, :] . k[c, s, :] * scale

so that stride member s of a key tile is a `[block_k, D]` box of k with a row stride of
S x D, which TMA loads directly.

Producer: loads the CTA's queries once (S x head_parts chunks of `[ROWS, block_d]`, one
barrier), then streams the key chunks of every visible key tile, in tile order, step by
step (stride member s, head-dim part), through a ring of `plan.stages` slots. Each chunk
signals the ready barrier of the consumer that owns its tile (tile t: consumer t mod 2),
so each consumer waits on every phase of its own barriers and never on the other's; a
slot is refilled once its consumer released it.

Consumers: consumer w computes key tiles t = w, w + 2, ...: per step one wgmma into a
float32 `[ROWS, block_k]` accumulator (the previous step's slot is released once at most
one wgmma is in flight), then the statistics of the tile, in log2 units:

- m[r] = max over the tile's columns of A'[r, c] (A' = A * log2(e), -inf where not seen),
- x[u, r] = sum over the columns c of unit u of 2^(A'[r, c] - m[r]) (a row that sees no
  column of the tile gets x = 0),
- with several units, their total,

stored to `stats[b, h, t, :, rows]` (planes: m, x_0 .. x_{P-1}[, total]) through a shared
memory buffer and TMA. Because the ring hands the tiles out in order, consumer 0's
statistics run while consumer 1 multiplies the next tile, and the other way round.
Only tiles holding a column some row does not see (past the keys, or after the first
row's causal diagonal) come last and are masked per element. Tiles no row sees are
neither computed nor stored (`estimate_plan.visible_tiles`: the caller fills them).

`plan.leave_out` (timing only) skips the consumers' products or their statistics past
the maxima; the pipeline and the stores stay.

Clusters (`plan.cluster` = c > 1): the CTAs of c consecutive row tiles walk the same key
tiles (those the last one sees; earlier ones mask their extra tiles whole) and each key
chunk is multicast to all, each CTA's producer loading 1/c of it; the ring's release
barrier then counts the owning consumer of every CTA in the cluster. A CTA's producer
waits for the last releases of all, so no CTA exits while another may still write to
its shared memory or arrive on its barriers.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from xattn_jax.mosaic.estimate_plan import (CONSUMERS, ROWS, EstimatePlan, unmasked_tiles,
                                            visible_tiles)
from xattn_jax.mosaic.kernel import (CONSUMER_REGISTERS, PRODUCER_REGISTERS, WG_AXIS,
                                     _tile_transforms)

CLUSTER_AXIS = "cluster"


def _kernel_body(q_ref, k_ref, stats_ref, q_smem, k_smem, stats_smem, q_ready, k_ready,
                 k_free, *, plan: EstimatePlan, causal: bool, scale: float):
    """Refs: q [B, Hq, padded_rows, S, D], k [B, Hkv, padded_cols, S, D], stats float32
    [B, Hq, key_tiles, stat_planes, padded_rows]; scale: A' = product x scale."""
    geom = plan.geom
    bk, bd, stages, parts = plan.block_k, plan.block_d, plan.stages, plan.head_parts
    steps, unit, units = plan.steps_per_tile, plan.unit, plan.units_per_tile
    batch = lax.axis_index("batch")
    head = lax.axis_index("heads")
    groups = plan.row_tiles // plan.cluster
    first_tile = (groups - 1 - lax.axis_index("row_groups")) * plan.cluster  # long first
    row0 = (first_tile + lax.axis_index(CLUSTER_AXIS)) * ROWS
    wg = lax.axis_index(WG_AXIS)
    # The cluster's CTAs share the key chunks: all walk the tiles its last row tile sees.
    num_tiles = visible_tiles(plan, causal, (first_tile + plan.cluster - 1) * ROWS)
    multicast = CLUSTER_AXIS if plan.cluster > 1 else None
    multiply = plan.leave_out != "product"

    @pl.when(wg < CONSUMERS)
    def _consumer():
        plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
        own_tiles = lax.div(num_tiles - wg + 1, jnp.int32(CONSUMERS))
        plain = jnp.clip(lax.div(unmasked_tiles(plan, causal, row0) - wg + 1,
                                 jnp.int32(CONSUMERS)), 0, own_tiles)
        out = stats_smem.at[wg]
        plgpu.barrier_wait(q_ready)

        def one_tile(n, carry, *, masked: bool):
            tile = wg + n * CONSUMERS
            first_step = tile * steps

            def product(acc_ref):
                for step in range(steps):  # static: member and part index q_smem
                    member, part = divmod(step, parts)
                    slot = lax.rem(first_step + step, jnp.int32(stages))
                    plgpu.barrier_wait(k_ready.at[wg * stages + slot])
                    if multiply:
                        plgpu.wgmma(acc_ref,
                                    q_smem.at[(geom.stride - 1 - member) * parts + part],
                                    k_smem.at[slot].transpose((1, 0)))
                    if step:  # the step before has finished reading its slot
                        if multiply:
                            plgpu.wgmma_wait(1)
                        plgpu.barrier_arrive(
                            k_free.at[lax.rem(first_step + step - 1, jnp.int32(stages))])
                if multiply:
                    plgpu.wgmma_wait(0)
                plgpu.barrier_arrive(
                    k_free.at[lax.rem(first_step + steps - 1, jnp.int32(stages))])
                return acc_ref[...] if multiply else None

            if multiply:
                a = pl.run_scoped(product, plgpu.ACC((ROWS, bk), jnp.float32))
            else:  # the chunks are waited for and released all the same
                product(None)
                a = plgpu.layout_cast(jnp.zeros((ROWS, bk), jnp.float32),
                                      plgpu.Layout.WGMMA)
            a = a * jnp.float32(scale)
            if masked:
                rows = plgpu.broadcasted_iota(jnp.int32, (ROWS, bk), 0,
                                              layout=plgpu.Layout.WGMMA)
                cols = plgpu.broadcasted_iota(jnp.int32, (ROWS, bk), 1,
                                              layout=plgpu.Layout.WGMMA)
                cols = cols + tile * bk
                seen = cols < geom.k_cols
                if causal:  # column j seen by row i iff j <= i + (Lk - Lq) / S
                    seen = seen & (cols <= rows + (row0 + geom.row_offset))
                a = jnp.where(seen, a, -jnp.inf)
            m = a.max(axis=1)
            sums = []
            if plan.leave_out != "statistics":
                shift = jnp.where(m == -jnp.inf, 0.0, m)  # a row seeing nothing here: x = 0
                p = jnp.exp2(a - lax.broadcast_in_dim(shift, a.shape, [0]))
                sums = [p[:, u * unit:(u + 1) * unit].sum(axis=1) for u in range(units)]
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's copy read it
            out.at[0][...] = m
            for u, x in enumerate(sums):
                out.at[1 + u][...] = x
            if len(sums) > 1:
                out.at[1 + units][...] = functools.reduce(jnp.add, sums)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out, stats_ref.at[batch, head, tile, :,
                                                      pl.ds(row0, ROWS)])
            return carry

        lax.fori_loop(0, plain, functools.partial(one_tile, masked=False), None)
        lax.fori_loop(plain, own_tiles, functools.partial(one_tile, masked=True), None)
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == CONSUMERS)
    def _producer():
        plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")
        for member in range(geom.stride):
            for part in range(parts):
                plgpu.copy_gmem_to_smem(
                    q_ref.at[batch, head, pl.ds(row0, ROWS), member, pl.ds(part * bd, bd)],
                    q_smem.at[member * parts + part], q_ready)
        kv_head = lax.div(head, jnp.int32(geom.group))
        total = num_tiles * steps

        @pl.loop(0, total)
        def _(index):
            tile = lax.div(index, jnp.int32(steps))
            step = lax.rem(index, jnp.int32(steps))
            member = lax.div(step, jnp.int32(parts))
            part = lax.rem(step, jnp.int32(parts))
            slot = lax.rem(index, jnp.int32(stages))
            owner = lax.rem(tile, jnp.int32(CONSUMERS))

            @pl.when(index >= stages)
            def _():
                plgpu.barrier_wait(k_free.at[slot])

            plgpu.copy_gmem_to_smem(
                k_ref.at[batch, kv_head, pl.ds(tile * bk, bk), member, pl.ds(part * bd, bd)],
                k_smem.at[slot], k_ready.at[owner * stages + slot],
                collective_axes=multicast)

        # Observe the last releases too: every completed phase of k_free is waited for.
        @pl.loop(jnp.maximum(total - stages, 0), total)
        def _(index):
            plgpu.barrier_wait(k_free.at[lax.rem(index, jnp.int32(stages))])


def tile_stats(q: jax.Array, k: jax.Array, *, plan: EstimatePlan, causal: bool,
               scale: float) -> jax.Array:
    """Runs the kernel: q `[B, Hq, padded_rows, S, D]`, k `[B, Hkv, padded_cols, S, D]`
    (bfloat16 or float16, zero-padded), scale = log2(e) / (sqrt(D) S norm). Returns float32
    `[B, Hq, key_tiles, stat_planes, padded_rows]`; entries of tiles no row of a row tile
    sees (`estimate_plan.visible_tiles`) are not written."""
    geom = plan.geom
    transforms = _tile_transforms(q.dtype)
    chunks = geom.stride * plan.head_parts
    out_type = jax.ShapeDtypeStruct(
        (geom.batch, geom.q_heads, plan.key_tiles, plan.stat_planes, plan.padded_rows),
        jnp.float32)
    scratch_types = (
        plgpu.SMEM((chunks, ROWS, plan.block_d), q.dtype, transforms=transforms),
        plgpu.SMEM((plan.stages, plan.block_k, plan.block_d), k.dtype,
                   transforms=transforms),
        plgpu.SMEM((CONSUMERS, plan.stat_planes, ROWS), jnp.float32),
        plgpu.Barrier(num_arrivals=chunks),  # q_ready: every query chunk landed
        plgpu.Barrier(num_barriers=CONSUMERS * plan.stages),  # k_ready, per consumer
        # k_free: a slot is refilled once its consumer in every CTA of the cluster is done
        plgpu.ClusterBarrier(collective_axes=(CLUSTER_AXIS,), num_barriers=plan.stages)
        if plan.cluster > 1 else plgpu.Barrier(num_barriers=plan.stages),
    )
    body = functools.partial(_kernel_body, plan=plan, causal=causal, scale=scale)
    return plgpu.kernel(
        body,
        out_type=out_type,
        scratch_types=scratch_types,
        grid=(geom.q_heads, geom.batch, plan.row_tiles // plan.cluster),
        grid_names=("heads", "batch", "row_groups"),
        cluster=(plan.cluster,),  # the last grid axis: consecutive row tiles
        cluster_names=(CLUSTER_AXIS,),
        num_threads=CONSUMERS + 1,
        thread_name=WG_AXIS,
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(q, k)
