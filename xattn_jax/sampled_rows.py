"""Block scores from sampled query rows: the exact attention of a few rows per query block
(docs/estimate.md, "Sampled rows").

The antidiagonal estimate scores every query row, each from a stride group's mean
product; this scores `rows` evenly spaced rows of each query block, each from its exact
softmax over the keys it may see. A key block's score is the sum of those rows'
probabilities over its keys: the true block mass of the sampled rows, where the
antidiagonal's mean flattens the single high scores that hold most of a row's mass. Both
do the same matrix-product FLOPs at `rows = block_size / stride` (16 at block 128,
stride 8); on a real model this one's selections are close to the exact block mass's
(docs/tuning.md: sampled-rows).

The backends compute it (`impl`): the Triton backend with its one-pass block-sum kernel
on the sampled rows' geometry (`xattn_jax.sampled_geometry`), the Mosaic backend through
that companion, the reference in plain JAX (`xattn_jax.reference.sampled_rows`).
"""

from __future__ import annotations

import functools

import jax

from xattn_jax import impls, partitioning
from xattn_jax.api import QK_LAYOUTS
from xattn_jax.backend import Backend
from xattn_jax.checks import check_flag, check_int, check_qk, check_scale
from xattn_jax.defaults import BLOCK_SIZE, SAMPLED_ROWS
from xattn_jax.sampled_geometry import SampledGeometry, sampled_positions

__all__ = ["sampled_block_mass", "sampled_positions"]


def sampled_block_mass(q: jax.Array, k: jax.Array, *, block_size: int = BLOCK_SIZE,
                       rows: int = SAMPLED_ROWS, causal: bool = True, scale: float | None = None,
                       impl: str = "auto") -> jax.Array:
    """Each (query block, key block)'s attention mass over `rows` sampled query rows.

    Args:
      q: `[B, Hq, Lq, D]`, the last Lq positions of the key sequence; k: `[B, Hkv, Lk, D]`,
        q's dtype (float32, bfloat16 or float16), Hq % Hkv == 0 (GQA read in place).
      block_size: tokens per block, on both axes; rows: sampled rows per query block, in
        [1, block_size]; causal: a query sees the keys up to its own position; scale: the
        softmax's q.k multiplier, default 1 / sqrt(D) (the attention's).
      impl: "auto", "reference", "triton" or "mosaic" (`xattn_jax.impls`; "mosaic" runs
        its Triton companion's kernel).

    Returns float32 `[B, Hq, ceil(Lq/block_size), ceil(Lk/block_size)]`: each row sums
    to `rows` (every sampled row's probabilities sum to 1). With causal=True, blocks past
    a query block's diagonal are 0, and Lk - Lq must be a multiple of block_size (as for
    `xattn_estimate`). The products are exact in float32 (accumulated in float32). The
    Triton kernel's scratch stays within `row_statistics.DEFAULT_SCRATCH_BYTES` per kernel
    call (docs/tuning.md: workspace-bound).

    Raises TypeError or ValueError naming the argument for inputs that break these rules.
    """
    geom = check_qk(q, k, stride=1, block_size=block_size, causal=causal)
    rows = check_int("rows", rows, 1)
    if rows > geom.block_size:
        raise ValueError(f"rows must be at most block_size {geom.block_size}, got {rows}")
    run = partitioning.on_shards(_block_mass, QK_LAYOUTS, name="sampled_block_mass",
                                 geom=SampledGeometry.of(geom, rows, check_scale(scale)),
                                 causal=check_flag("causal", causal),
                                 impl=impls.resolve(impl, q, k))
    return run(q, k)


@functools.partial(jax.jit, static_argnames=("geom", "causal", "impl"))
def _block_mass(q, k, *, geom: SampledGeometry, causal: bool, impl: Backend):
    return impl.sampled_block_mass(q, k, geom=geom, causal=causal)
