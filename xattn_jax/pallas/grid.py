"""The grid every strided-score kernel shares: (column group, row tile, batch, query head).

Pallas' Triton backend folds the first two axes into CUDA's x, which the GPU launches
fastest, so the programs running at one time are the row tiles and key-column groups of
one head: they share that head's keys (and GQA's query heads one key head) in L2. With
batch and head first, the programs running together spanned every head, and the
one-pass kernel was 1.3x slower at 64K tokens (bench/results/tuning.md, note 10).
"""

from __future__ import annotations

from jax.experimental import pallas as pl

from xattn_jax.geometry import Geometry

COL_AXIS, ROW_AXIS, BATCH_AXIS, HEAD_AXIS = range(4)


def kernel_grid(geom: Geometry, row_tiles: int, col_groups: int = 1,
                heads: int | None = None) -> tuple[int, ...]:
    """The grid of a call covering `heads` query heads (default all)."""
    return (col_groups, row_tiles, geom.batch, heads or geom.q_heads)


def head_spec(shape: tuple[int, ...]) -> pl.BlockSpec:
    """One (batch, query head)'s whole slab of an array `[B, Hq, *shape]`."""
    return pl.BlockSpec((None, None) + tuple(shape),
                        lambda c, r, b, h: (b, h) + (0,) * len(shape))


def key_head_spec(geom: Geometry) -> pl.BlockSpec:
    """The keys `[B, Hkv, Lk, D]` query head h reads: key head h // group."""
    g = geom.group
    return pl.BlockSpec((None, None, geom.k_len, geom.head_dim),
                        lambda c, r, b, h: (b, h // g, 0, 0))


def batch_spec(shape: tuple[int, ...]) -> pl.BlockSpec:
    """One batch element's row of an array `[B, *shape]` (a block table)."""
    return pl.BlockSpec((None,) + tuple(shape), lambda c, r, b, h: (b,) + (0,) * len(shape))


def whole_spec(shape: tuple[int, ...]) -> pl.BlockSpec:
    """An array every program reads whole (a paged cache, scalars)."""
    return pl.BlockSpec(tuple(shape), lambda *_: (0,) * len(shape))
