"""The sizes of one sampled-rows call (docs/estimate.md, "Sampled rows"), in the terms of
the antidiagonal estimate's `Geometry`, so that the one-pass block-sum kernels and their
epilogue compute sampled rows too.

Sampled rows are the antidiagonal estimate at stride 1 with other rows: a key column is
one key, a row is one query token, but only `rows` of each query block's tokens are rows
(`sampled_positions`), each at its own position for the causal mask, and the scores take
the attention's scale. So a query block is `rows` rows and a key block `block_size`
columns, where the antidiagonal estimate has `block_size / S` of each.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from xattn_jax.geometry import Geometry

_POSITION_LIMIT = 2**31  # rows x block_size, the int32 products of `query_position`


def sampled_positions(q_len: int, block_size: int, rows: int) -> np.ndarray:
    """int32 `[qb, rows]`: the query rows scored in each block, the last row of each of
    `rows` equal parts of the block (a short last block repeats rows where it has fewer
    than `rows`)."""
    starts = np.arange(0, q_len, block_size)
    lengths = np.minimum(block_size, q_len - starts)
    parts = np.arange(1, rows + 1)
    offsets = np.maximum(parts[None, :] * lengths[:, None] // rows - 1, 0)
    return (starts[:, None] + offsets).astype(np.int32)


def part_end(start, length, part, rows):
    """The last position of part `part` (1 .. rows) of `rows` equal parts of the `length`
    positions from `start` (int32, maybe traced; in a kernel too): a span shorter than
    `rows` repeats positions, an empty one gives `start`. (`lax.div`: jnp's floor
    division lowers to i1 selects on GPU.)"""
    return start + jnp.maximum(jax.lax.div(part * length, jnp.int32(rows)) - 1, 0)


@dataclasses.dataclass(frozen=True)
class SampledGeometry(Geometry):
    """A `Geometry` at stride 1 whose rows are the sampled query tokens: `rows` per query
    block of `block_size` tokens, scored with `softmax_scale` (the attention's q.k
    multiplier). Hashable: a static jit argument. Build it with `of`."""

    rows: int
    softmax_scale: float

    def __post_init__(self):
        if self.stride != 1:
            raise ValueError(f"a SampledGeometry has stride 1, got {self.stride}")
        if not 1 <= self.rows <= self.block_size:
            raise ValueError(f"rows must lie in [1, block_size {self.block_size}], got "
                             f"{self.rows}")
        if self.rows * self.block_size >= _POSITION_LIMIT:
            raise ValueError(f"rows x block_size must be below 2^31 (int32 positions), got "
                             f"{self.rows} x {self.block_size}")

    @classmethod
    def of(cls, geom: Geometry, rows: int, scale: float | None) -> SampledGeometry:
        """The sampled rows of `geom`'s shapes and block size (its stride unused); scale
        None: 1 / sqrt(D)."""
        return cls(geom.batch, geom.q_heads, geom.kv_heads, geom.q_len, geom.k_len,
                   geom.head_dim, 1, geom.block_size, rows,
                   geom.head_dim ** -0.5 if scale is None else scale)

    @property
    def q_rows(self) -> int:
        """Sampled rows: `rows` per query block."""
        return self.q_blocks * self.rows

    @property
    def block_rows(self) -> int:
        """A query block's rows: the sampled ones."""
        return self.rows

    @property
    def block_cols(self) -> int:
        """A key block's columns: its keys."""
        return self.block_size

    @property
    def scale(self) -> float:
        return self.softmax_scale

    def query_position(self, rows):
        """The query token of sampled rows `rows` (int32, maybe traced; inside a kernel
        too): `sampled_positions` of row `rows % self.rows` of block `rows // self.rows`.
        Rows past the last (a tile's padding) read the last row's token, inside q."""
        rows = jnp.minimum(rows, self.q_rows - 1)
        per_block = jnp.int32(self.rows)
        # lax.div/rem: rows >= 0, and jnp's floor division lowers to i1 selects on GPU
        block, part = jax.lax.div(rows, per_block), jax.lax.rem(rows, per_block) + 1
        length = jnp.minimum(self.block_size, self.q_len - block * self.block_size)
        return part_end(block * self.block_size, length, part, self.rows)

    def query_tokens_end(self, row_extent: int) -> int:
        """Lq: every row's token lies in q (`query_position`)."""
        del row_extent
        return self.q_len
