"""The static sizes of one ragged serving step (docs/estimate.md, "Ragged steps").

An engine pads the packed token count T, the sequence count S and the page-table width
to buckets; these and the cache's shape are the only static sizes of a step, so every
other change (lengths, pages, live sequences) runs the same compiled computation.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from xattn_jax.geometry import cdiv
from xattn_jax.sampled_geometry import part_end


@dataclasses.dataclass(frozen=True)
class RaggedGeometry:
    """Sizes of one `ragged_xattention` call. Hashable: a static jit argument.

    tokens: T, the packed query rows; seqs: S, the sequence slots (live or not);
    pages_per_seq: the page table's width; num_pages, page_size: the cache's pages;
    fused: K and V in one cache `[num_pages, page_size, 2 Hkv, D]`.
    """

    tokens: int
    seqs: int
    q_heads: int
    kv_heads: int
    head_dim: int
    value_dim: int
    num_pages: int
    page_size: int
    pages_per_seq: int
    block_size: int
    stride: int
    fused: bool

    @property
    def group(self) -> int:
        """Query heads per KV head: query head h reads KV head h // group."""
        return self.q_heads // self.kv_heads

    @property
    def capacity(self) -> int:
        """Keys one sequence's page table can address."""
        return self.pages_per_seq * self.page_size

    @property
    def k_blocks(self) -> int:
        """KB: key blocks of the widest sequence, the mask's last axis."""
        return cdiv(self.capacity, self.block_size)

    @property
    def q_block_rows(self) -> int:
        """QB: mask rows, a bound on the step's query blocks. A chunk of n queries that
        starts anywhere in a block spans fewer than n / block_size + 2 blocks, so S
        sequences of T queries together span at most T // block_size + 2 S."""
        return self.tokens // self.block_size + 2 * self.seqs

    @property
    def block_rows(self) -> int:
        """The estimate's rows per query block: block_size / S reshaped rows."""
        return self.block_size // self.stride

    @property
    def block_cols(self) -> int:
        """The estimate's columns per key block: block_size / S reshaped columns."""
        return self.block_size // self.stride

    def score_scale(self, norm: float) -> float:
        """The estimate's q.k multiplier: 1 / (sqrt(D) * S * norm)."""
        return 1.0 / (self.head_dim ** 0.5 * self.stride * norm)

    def query_position(self, rows):
        """The query group of each reshaped row (`triton.common.step_product`): the
        row itself, rows being groups at their absolute key positions."""
        return rows

    def local(self, q, k) -> RaggedGeometry:
        """This geometry with the heads of q `[T, Hq, D]` and the cache k at hand (one
        shard's, under partitioning; a fused cache's head axis holds 2 Hkv)."""
        kv_heads = k.shape[2] // 2 if self.fused else k.shape[2]
        return dataclasses.replace(self, q_heads=q.shape[1], kv_heads=kv_heads)


@dataclasses.dataclass(frozen=True)
class RaggedSampledGeometry(RaggedGeometry):
    """A step's sizes for the sampled-rows estimate (docs/estimate.md, "Sampled rows" and
    "Ragged steps"): stride 1, `rows` sampled query tokens per query block, scored with
    `softmax_scale`. Build it with `of`; `sampled_position` places the rows."""

    rows: int = 0
    softmax_scale: float = 1.0

    @classmethod
    def of(cls, geom: RaggedGeometry, rows: int, scale: float) -> RaggedSampledGeometry:
        return cls(**{**dataclasses.asdict(geom), "stride": 1}, rows=rows,
                   softmax_scale=scale)

    @property
    def block_rows(self) -> int:
        return self.rows

    def score_scale(self, norm: float) -> float:
        """The sampled rows' q.k multiplier: the softmax scale (norm unused)."""
        del norm
        return self.softmax_scale

    def sampled_position(self, rows, first_position, kv_len):
        """The key position of sampled rows `rows` (int32, maybe traced; in a kernel too)
        of a sequence whose chunk holds positions first_position .. kv_len - 1: row r is
        part r % rows + 1 of absolute query block r // rows, and a block's rows are the
        last of `rows` equal parts of its positions inside the chunk (where a chunk
        starts on a block boundary, `sampled_positions`' rows of that block)."""
        per_block = jnp.int32(self.rows)
        # lax.div/rem: rows >= 0, and jnp's floor division lowers to i1 selects on GPU
        block, part = jax.lax.div(rows, per_block), jax.lax.rem(rows, per_block) + 1
        low = jnp.maximum(block * self.block_size, first_position)
        return part_end(low, jnp.minimum((block + 1) * self.block_size, kv_len) - low, part,
                        self.rows)
