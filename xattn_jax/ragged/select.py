"""Section 4 on a ragged step's block sums: each mask row selects as `xattention` does,
with its own diagonal (its absolute query block), then the widening, then the rows that
are not estimated keep every allowed block."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from xattn_jax.ragged.layout import RaggedBlocks
from xattn_jax.reference.estimate import widen


def allowed_blocks(blocks: RaggedBlocks, k_blocks: int) -> jax.Array:
    """bool `[QB, KB]`: the key blocks each mask row may attend to (up to its diagonal;
    none in rows that are not live)."""
    j = jnp.arange(k_blocks)[None, :]
    return (j <= blocks.row_block[:, None]) & blocks.row_live[:, None]


def dense_rows(blocks: RaggedBlocks, dense_last: int) -> jax.Array:
    """bool `[QB]`: rows that keep every allowed block: those of sequences that are not
    estimated, and each sequence's last `dense_last` query blocks."""
    seq = blocks.row_seq
    row = jnp.arange(seq.shape[0])
    return ~blocks.estimated[seq] | (row >= blocks.cu_q_blocks[seq + 1] - dense_last)


def select_ragged(sums: jax.Array, threshold: jax.Array, blocks: RaggedBlocks, *,
                  select, min_blocks: int, dense_last: int) -> jax.Array:
    """bool `[Hq, QB, KB]` from block sums float32 `[Hq, QB, KB]` and threshold float32
    `[Hq]`. select: the implementation's section-4 rule, called as
    `select(sums [1, Hq, QB, KB], threshold, diagonal=[QB])` -> bool `[1, Hq, QB, KB]`
    (causal: forced blocks 0 and the diagonal)."""
    diagonal = blocks.row_block
    mask = select(sums[None], threshold, diagonal=diagonal)
    mask = widen(mask, sums[None], causal=True, min_blocks=min_blocks, dense_last=0,
                 diagonal=diagonal)[0]
    allowed = allowed_blocks(blocks, sums.shape[-1])
    return jnp.where(dense_rows(blocks, dense_last)[:, None], allowed, mask & allowed)
