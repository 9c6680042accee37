"""The derived sizes of one estimate call (docs/estimate.md, Notation).

The argument checks that build a `Geometry` are in `xattn_jax.checks`.
"""

from __future__ import annotations

import dataclasses
import math


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for positive ints."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (Triton tiles must have power-of-two sizes)."""
    return 1 << max(0, (n - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Static sizes of one call. Hashable, so it can be a static jit argument.

    Token lengths are `q_len` (Lq) and `k_len` (Lk); "rows" and "cols" are positions in
    the strided (reshaped) space, where one row or column is a group of `stride` tokens.
    """

    batch: int
    q_heads: int
    kv_heads: int
    q_len: int
    k_len: int
    head_dim: int
    stride: int
    block_size: int

    @property
    def group(self) -> int:
        """Query heads per key head (GQA): query head h reads key head h // group."""
        return self.q_heads // self.kv_heads

    @property
    def q_rows(self) -> int:
        """Reshaped query rows that hold at least one real token: ceil(Lq / S)."""
        return cdiv(self.q_len, self.stride)

    @property
    def k_cols(self) -> int:
        """Reshaped key columns that hold at least one real token: ceil(Lk / S)."""
        return cdiv(self.k_len, self.stride)

    @property
    def block_rows(self) -> int:
        """A query block's rows in the reshaped space: block_size / S."""
        return self.block_size // self.stride

    @property
    def block_cols(self) -> int:
        """A key block's columns in the reshaped space: block_size / S, as its rows."""
        return self.block_rows

    @property
    def q_blocks(self) -> int:
        return cdiv(self.q_len, self.block_size)

    @property
    def k_blocks(self) -> int:
        return cdiv(self.k_len, self.block_size)

    @property
    def row_offset(self) -> int:
        """Reshaped key column of the first query row: (Lk - Lq) / S (causal calls only)."""
        return (self.k_len - self.q_len) // self.stride

    @property
    def scale(self) -> float:
        """1 / (sqrt(D) * S * norm) without norm; callers divide by norm."""
        return 1.0 / (math.sqrt(self.head_dim) * self.stride)

    def query_position(self, rows):
        """The reshaped column at the query position of reshaped rows `rows` (ints, maybe
        traced), counted from the first query: row i's causal diagonal is column
        query_position(i) + row_offset, and its stride group starts at query token
        query_position(i) * S. Row i itself: the stride group of tokens iS .. iS + S-1
        (`SampledGeometry` places sampled rows instead)."""
        return rows

    def query_tokens_end(self, row_extent: int) -> int:
        """An upper bound on one past the last query token that reshaped rows below
        `row_extent` read: row_extent * S."""
        return row_extent * self.stride
