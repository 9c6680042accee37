"""Where each sequence of a ragged step sits (docs/estimate.md, "Ragged steps"), computed
on the device from the step's offsets: no value is read on the host, so new lengths do
not recompile.

Sequence s owns the query rows `cu_q_lens[s] .. cu_q_lens[s+1] - 1` of q; they are the
last q_len of its kv_len keys, at key positions `kv_len - q_len .. kv_len - 1`. Blocks
are counted in key positions from 0, so a chunk that starts inside a block has a partial
first query block. The step's query blocks are the rows of its mask: sequence s's
occupy rows `cu_q_blocks[s] .. cu_q_blocks[s+1] - 1`, row `cu_q_blocks[s] + i` being
absolute query block `first_block[s] + i`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from xattn_jax.ragged.geometry import RaggedGeometry


class RaggedBlocks(NamedTuple):
    """One step's layout, int32 (bool where said) device arrays.

    Per sequence `[S]`: q_lens and kv_lens (0 for slots from num_seqs on), q_starts (its
    first row of q), first_block (absolute query block of its first query), estimated
    (bool: its blocks are selected by the estimate; else every allowed block is kept);
    cu_q_blocks `[S + 1]`. Per mask row `[QB]`: row_seq (its sequence; S - 1 for rows
    past the step's blocks), row_block (absolute query block), row_live (bool).
    """

    q_lens: jax.Array
    kv_lens: jax.Array
    q_starts: jax.Array
    first_block: jax.Array
    estimated: jax.Array
    cu_q_blocks: jax.Array
    row_seq: jax.Array
    row_block: jax.Array
    row_live: jax.Array

    @property
    def first_position(self) -> jax.Array:
        """`[S]`: key position of each sequence's first query, kv_len - q_len."""
        return self.kv_lens - self.q_lens

    def token_of(self, seq, position):
        """Row of q holding sequence `seq`'s query at key `position` (maybe outside q)."""
        return self.q_starts[seq] + position - self.first_position[seq]


def ragged_blocks(cu_q_lens: jax.Array, kv_lens: jax.Array, num_seqs, decode_seqs,
                  geom: RaggedGeometry) -> RaggedBlocks:
    """The layout of a step: cu_q_lens int32 `[S + 1]`, kv_lens int32 `[S]`, num_seqs and
    decode_seqs int32 scalars (decode_seqs: leading sequences of one query each, never
    estimated).

    Values outside the rules (checked in checked mode) are clamped so that nothing is
    read out of bounds: rows from num_seqs on and negative lengths count as empty, and a
    sequence with more queries than keys as having as many keys as queries.
    """
    seqs, bs = geom.seqs, geom.block_size
    slot = jnp.arange(seqs, dtype=jnp.int32)
    live = slot < num_seqs
    starts = jnp.clip(cu_q_lens.astype(jnp.int32), 0, geom.tokens)
    q_lens = jnp.where(live, jnp.maximum(starts[1:] - starts[:-1], 0), 0)
    kv = jnp.where(live, jnp.maximum(kv_lens.astype(jnp.int32), q_lens), 0)
    first_block = jax.lax.div(kv - q_lens, jnp.int32(bs))
    last_block = jax.lax.div(jnp.maximum(kv - 1, 0), jnp.int32(bs))
    blocks = jnp.where(q_lens > 0, last_block - first_block + 1, 0)
    cu_q_blocks = jnp.concatenate([jnp.zeros((1,), jnp.int32),
                                   jnp.cumsum(blocks, dtype=jnp.int32)])
    row = jnp.arange(geom.q_block_rows, dtype=jnp.int32)
    row_seq = jnp.minimum(jnp.searchsorted(cu_q_blocks[1:], row, side="right"),
                          seqs - 1).astype(jnp.int32)
    # rows packed in sequence order from 0 (as cu_q_lens says, where it keeps the rules)
    q_starts = jnp.cumsum(q_lens, dtype=jnp.int32) - q_lens
    return RaggedBlocks(
        q_lens=q_lens, kv_lens=kv, q_starts=q_starts, first_block=first_block,
        estimated=(q_lens >= bs) & (slot >= decode_seqs), cu_q_blocks=cu_q_blocks,
        row_seq=row_seq, row_block=first_block[row_seq] + row - cu_q_blocks[row_seq],
        row_live=row < cu_q_blocks[seqs])
