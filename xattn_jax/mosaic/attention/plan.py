"""The static plan of one block-sparse attention call on Hopper: tile sizes and pipeline depth.

A CTA (one program) holds `COMPUTE_WARPGROUPS` consumer warpgroups of `block_q` query rows
each, plus one producer warpgroup that streams key/value tiles of `block_kv` keys through
`stages` shared-memory slots with TMA. All rows of a CTA share one list of key tiles, so a
CTA's rows must lie inside one row of the block mask: `block_size` must be a multiple of
`rows_per_cta` (and of `block_kv`, so that a mask block is a whole number of key tiles).

The numbers below follow the FlashAttention-3 design on H100/H200; the key tile and
the stages were measured on the H200 with `python -m bench.mosaic_attention_check`
(docs/tuning.md: attention-key-tile-and-stages, attention-query-rows).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from xattn_jax.mosaic import SUPPORTED_DTYPES
from xattn_jax.mosaic.smem import SMEM_BYTES, smem_bytes

COMPUTE_WARPGROUPS = 2  # consumers whose softmax overlaps the other one's matmuls
BLOCK_Q = 64  # query rows per consumer warpgroup (one wgmma M tile)
BLOCK_KV_BY_HEAD_DIM = {64: 128, 128: 128, 256: 64}  # keys per tile (timed at D 128)
STAGES = 2  # key/value tiles in flight


@dataclasses.dataclass(frozen=True)
class AttentionPlan:
    """Tiles of one call. `block_q` rows per consumer warpgroup, `block_kv` keys per tile,
    `stages` key/value tiles buffered in shared memory."""

    head_dim: int
    block_q: int
    block_kv: int
    stages: int
    compute_warpgroups: int = COMPUTE_WARPGROUPS

    @property
    def rows_per_cta(self) -> int:
        return self.block_q * self.compute_warpgroups

    def smem_bytes(self, itemsize: int, with_lse: bool) -> int:
        """Shared memory of one CTA as Mosaic GPU counts it: q/out tiles, key and value
        slots, log-sum-exp rows, barriers (`kernel.attention_call`'s scratch)."""
        q_tiles = self.compute_warpgroups * self.block_q * self.head_dim * itemsize
        kv_slots = self.stages * self.block_kv * self.head_dim * itemsize
        lse_rows = self.compute_warpgroups * self.block_q * 4 if with_lse else 0
        buffers = [q_tiles, kv_slots, kv_slots] + [lse_rows] * with_lse
        return smem_bytes(buffers, barriers=self.compute_warpgroups + 4 * self.stages + 1)


def unsupported_reason(head_dim: int, value_dim: int, dtype, block_size: int,
                       page_size: int | None = None) -> str | None:
    """Why the Mosaic kernel cannot run these arguments (None if it can); `page_size`: the
    tokens per page of a paged cache (None: contiguous k and v). "auto" falls back to the
    reference implementation when this is not None; "mosaic" raises it as a ValueError."""
    dtype = jnp.dtype(dtype)
    if dtype not in SUPPORTED_DTYPES:
        return f"impl='mosaic' needs q, k, v in bfloat16 or float16; got {dtype}"
    if head_dim not in BLOCK_KV_BY_HEAD_DIM:
        return (f"impl='mosaic' needs head_dim in {sorted(BLOCK_KV_BY_HEAD_DIM)}; "
                f"got {head_dim}")
    if value_dim != head_dim:
        return f"impl='mosaic' needs v's head dim equal to q's ({head_dim}); got {value_dim}"
    rows = BLOCK_Q * COMPUTE_WARPGROUPS
    if block_size % rows or block_size % BLOCK_KV_BY_HEAD_DIM[head_dim]:
        return (f"impl='mosaic' needs block_size a multiple of {rows} "
                f"(query rows per CTA) and of {BLOCK_KV_BY_HEAD_DIM[head_dim]} "
                f"(keys per tile); got {block_size}")
    block_kv = BLOCK_KV_BY_HEAD_DIM[head_dim]
    if page_size is not None and page_size % block_kv:
        return (f"impl='mosaic' reads paged caches whose pages hold a multiple of its key "
                f"tile of {block_kv} tokens (head_dim {head_dim}); got page_size "
                f"{page_size}")
    return None


def attention_plan(head_dim: int, value_dim: int, dtype, block_size: int, *,
                   with_lse: bool, page_size: int | None = None, block_kv: int | None = None,
                   stages: int | None = None) -> AttentionPlan:
    """The plan for q `[.., D=head_dim]` in `dtype` on masks of `block_size` (and pages of
    `page_size` tokens, None for contiguous k and v). `block_kv` and `stages` override the
    tuned values (for tuning runs). Raises ValueError when the kernel cannot run these
    arguments (see `unsupported_reason`) or the override does not fit."""
    reason = unsupported_reason(head_dim, value_dim, dtype, block_size, page_size)
    if reason is not None:
        raise ValueError(reason)
    plan = AttentionPlan(
        head_dim=head_dim, block_q=BLOCK_Q,
        block_kv=BLOCK_KV_BY_HEAD_DIM[head_dim] if block_kv is None else block_kv,
        stages=STAGES if stages is None else stages)
    if plan.block_kv % 64 or block_size % plan.block_kv or (page_size or 0) % plan.block_kv:
        raise ValueError(f"block_kv must be a multiple of 64 dividing block_size="
                         f"{block_size} (and page_size={page_size}); got {plan.block_kv}")
    if plan.stages < 2:
        raise ValueError(f"stages must be at least 2; got {plan.stages}")
    smem = plan.smem_bytes(jnp.dtype(dtype).itemsize, with_lse)
    if smem > SMEM_BYTES:
        raise ValueError(f"plan {plan} needs {smem} bytes of shared memory; "
                         f"the limit is {SMEM_BYTES}")
    return plan
