"""The static plan of the ragged step's attention kernel (`ragged_kernel`): the batched
kernel's tiles (`plan`) plus an unswizzled staging buffer per consumer warpgroup, and
which page sizes it reads.

The staging buffer holds plain rows, so that a box of q can start at any row and any of
a tile's rows can leave by TMA (Mosaic GPU copies into a tiled buffer only from rows
that start a tile, 8 rows, and slices one only at whole tiles). With D 256 it holds half
the columns, twice, to fit shared memory.
"""

from __future__ import annotations

import jax.numpy as jnp

from xattn_jax.mosaic.attention import plan as plans
from xattn_jax.mosaic.smem import SMEM_BYTES, smem_bytes
from xattn_jax.ragged.geometry import RaggedGeometry

# the fewest tokens of a page when a key tile spans several pages (vLLM's default page):
# each page is one TMA copy, so a tile of 128 keys takes at most 8
MIN_SPLIT_PAGE = 16
STAGE_COLUMNS = 128  # head-dim columns the staging buffer holds at once


def stage_columns(plan: plans.AttentionPlan) -> int:
    """Columns of the staging buffer `[block_q, stage_columns]` of each warpgroup."""
    return min(plan.head_dim, STAGE_COLUMNS)


def unsupported_reason(geom: RaggedGeometry, dtype) -> str | None:
    """Why the kernel cannot run a step of these sizes and dtype (None if it can): the
    batched kernel's rules on dtype, head dims and block size, and pages holding a whole
    number of key tiles, or a whole number of pages of at least MIN_SPLIT_PAGE tokens
    making a key tile."""
    reason = plans.unsupported_reason(geom.head_dim, geom.value_dim, dtype, geom.block_size)
    if reason is not None:
        return reason
    block_kv, page = plans.BLOCK_KV_BY_HEAD_DIM[geom.head_dim], geom.page_size
    if page % block_kv == 0 or (block_kv % page == 0 and page >= MIN_SPLIT_PAGE):
        return None
    return (f"impl='mosaic' reads paged caches whose pages hold a whole number of its key "
            f"tiles of {block_kv} tokens (head_dim {geom.head_dim}), or of which a whole "
            f"number, of at least {MIN_SPLIT_PAGE} tokens each, make a key tile; got "
            f"page_size {page}")


def smem_bytes_of(plan: plans.AttentionPlan, itemsize: int) -> int:
    """Shared memory of one CTA as Mosaic GPU counts it (`ragged_kernel`'s scratch):
    query tiles, staging buffers, key and value slots, barriers."""
    rows = plan.compute_warpgroups * plan.block_q
    slots = plan.stages * plan.block_kv * plan.head_dim * itemsize
    buffers = [rows * plan.head_dim * itemsize, rows * stage_columns(plan) * itemsize,
               slots, slots]
    return smem_bytes(buffers, barriers=plan.compute_warpgroups + 4 * plan.stages + 1)


def ragged_plan(geom: RaggedGeometry, dtype) -> plans.AttentionPlan:
    """The tiles of the ragged kernel: the batched kernel's (`plans.BLOCK_Q`,
    `BLOCK_KV_BY_HEAD_DIM`, `STAGES`). Raises ValueError where `unsupported_reason` says
    why, or if the scratch does not fit shared memory."""
    reason = unsupported_reason(geom, dtype)
    if reason is not None:
        raise ValueError(reason)
    plan = plans.AttentionPlan(head_dim=geom.head_dim, block_q=plans.BLOCK_Q,
                               block_kv=plans.BLOCK_KV_BY_HEAD_DIM[geom.head_dim],
                               stages=plans.STAGES)
    smem = smem_bytes_of(plan, jnp.dtype(dtype).itemsize)
    if smem > SMEM_BYTES:
        raise ValueError(f"plan {plan} needs {smem} bytes of shared memory with the "
                         f"ragged kernel's staging buffers; the limit is {SMEM_BYTES}")
    return plan
