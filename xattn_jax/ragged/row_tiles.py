"""The estimate's units of work in a ragged step: row tiles of the estimated sequences,
longest first (docs/estimate.md, "Ragged steps").

A row tile is `rows` of the estimate's query rows of one sequence, a whole number of its
query blocks at their absolute positions (`rows / geom.block_rows` mask rows; a
sequence's last tile may hold fewer). Rows and columns are the antidiagonal estimate's
reshaped ones, or sampled query tokens and single keys (`RaggedSampledGeometry`). The
kernels walk (row tile, query head) pairs; sorting the tiles by the key tiles their rows
see puts the long ones first, so that programs walking the list end together.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from xattn_jax.geometry import cdiv
from xattn_jax.ragged.geometry import RaggedGeometry
from xattn_jax.ragged.layout import RaggedBlocks

FIELDS = ("seq", "first_mask_row", "mask_rows", "first_row", "key_tiles")


class RowTiles(NamedTuple):
    """int32, longest first. count `[]`: live tiles; table `[NT, len(FIELDS)]`, per tile:
    its sequence, first mask row, mask rows (query blocks), first absolute reshaped row,
    and the key tiles of `block_k` columns its rows see (0 past `count`)."""

    count: jax.Array
    table: jax.Array


def max_row_tiles(geom: RaggedGeometry, rows: int) -> int:
    """NT: a bound on the step's row tiles: a sequence's blocks in tiles of
    rows / block_rows, one partial tile at most per sequence."""
    return geom.q_block_rows // (rows // geom.block_rows) + geom.seqs


def row_tiles(blocks: RaggedBlocks, geom: RaggedGeometry, *, rows: int,
              block_k: int) -> RowTiles:
    """The row tiles of `blocks`' estimated sequences, `rows` rows each (a multiple of
    geom.block_rows), seeing key tiles of `block_k` columns."""
    s, n = geom.stride, geom.block_rows
    per_tile = rows // n  # mask rows per tile
    seq_blocks = jnp.where(blocks.estimated, blocks.cu_q_blocks[1:] - blocks.cu_q_blocks[:-1],
                           0)
    tiles = jax.lax.div(seq_blocks + (per_tile - 1), jnp.int32(per_tile))
    cu_tiles = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(tiles, dtype=jnp.int32)])
    count = cu_tiles[-1]
    tile = jnp.arange(max_row_tiles(geom, rows), dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(cu_tiles[1:], tile, side="right"),
                      geom.seqs - 1).astype(jnp.int32)
    local = (tile - cu_tiles[seq]) * per_tile  # the tile's first block in its sequence
    mask_rows = jnp.clip(seq_blocks[seq] - local, 0, per_tile)
    first_row = (blocks.first_block[seq] + local) * n
    cols = jax.lax.div(blocks.kv_lens[seq] + (s - 1), jnp.int32(s))
    # causal: up to its last block's end
    seen = jnp.minimum(cols, (blocks.first_block[seq] + local + mask_rows) * geom.block_cols)
    key_tiles = jnp.where(tile < count, jax.lax.div(seen + (block_k - 1), jnp.int32(block_k)),
                          0)
    order = jnp.argsort(-key_tiles, stable=True)
    table = jnp.stack([seq, blocks.cu_q_blocks[seq] + local, mask_rows, first_row,
                       key_tiles], axis=1)[order]
    return RowTiles(count, table.astype(jnp.int32))


def max_key_tiles(geom: RaggedGeometry, block_k: int) -> int:
    """Key tiles of `block_k` reshaped columns covering the page table's capacity."""
    return cdiv(cdiv(geom.capacity, geom.stride), block_k)
