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

The implementation is plain JAX, in steps of query blocks whose float32 scores take at
most `SCORE_STEP_BYTES`. There is no Pallas kernel for it yet.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from xattn_jax.checks import check_flag, check_int, check_qk, check_scale
from xattn_jax.defaults import BLOCK_SIZE
from xattn_jax.geometry import cdiv

# sampled rows per query block (docs/tuning.md: sampled-rows)
ROWS = 16
SCORE_STEP_BYTES = 256 * 2**20  # bound on one step's float32 scores [B, Hq, rows, Lk]


def sampled_positions(q_len: int, block_size: int, rows: int) -> np.ndarray:
    """int32 `[qb, rows]`: the query rows scored in each block, the last row of each of
    `rows` equal parts of the block (a short last block repeats rows where it has fewer
    than `rows`)."""
    starts = np.arange(0, q_len, block_size)
    lengths = np.minimum(block_size, q_len - starts)
    parts = np.arange(1, rows + 1)
    offsets = np.maximum(parts[None, :] * lengths[:, None] // rows - 1, 0)
    return (starts[:, None] + offsets).astype(np.int32)


def sampled_block_mass(q: jax.Array, k: jax.Array, *, block_size: int = BLOCK_SIZE,
                       rows: int = ROWS, causal: bool = True,
                       scale: float | None = None) -> jax.Array:
    """Each (query block, key block)'s attention mass over `rows` sampled query rows.

    Args:
      q: `[B, Hq, Lq, D]`, the last Lq positions of the key sequence; k: `[B, Hkv, Lk, D]`,
        q's dtype (float32, bfloat16 or float16), Hq % Hkv == 0 (GQA read in place).
      block_size: tokens per block, on both axes; rows: sampled rows per query block, in
        [1, block_size]; causal: a query sees the keys up to its own position; scale: the
        softmax's q.k multiplier, default 1 / sqrt(D) (the attention's).

    Returns float32 `[B, Hq, ceil(Lq/block_size), ceil(Lk/block_size)]`: each row sums
    to `rows` (every sampled row's probabilities sum to 1). With causal=True, blocks past
    a query block's diagonal are 0, and Lk - Lq must be a multiple of block_size (as for
    `xattn_estimate`). The products are exact in float32 (accumulated in float32).

    Raises TypeError or ValueError naming the argument for inputs that break these rules.
    """
    geom = check_qk(q, k, stride=1, block_size=block_size, causal=causal)
    rows = check_int("rows", rows, 1)
    if rows > geom.block_size:
        raise ValueError(f"rows must be at most block_size {geom.block_size}, got {rows}")
    scale = check_scale(scale)
    return _block_mass(q, k, block_size=geom.block_size, rows=rows,
                       causal=check_flag("causal", causal),
                       scale=q.shape[-1] ** -0.5 if scale is None else scale)


@functools.partial(jax.jit, static_argnames=("block_size", "rows", "causal", "scale"))
def _block_mass(q, k, *, block_size: int, rows: int, causal: bool, scale: float):
    b, hq, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    qb, kb = cdiv(lq, block_size), cdiv(lk, block_size)
    per_step = max(1, min(qb, SCORE_STEP_BYTES // (4 * b * hq * rows * kb * block_size)))
    steps = cdiv(qb, per_step)
    positions = sampled_positions(lq, block_size, rows)
    padding = np.zeros((steps * per_step - qb, rows), np.int32)  # steps past the end
    positions = np.concatenate([positions, padding])
    k = jnp.pad(k, ((0, 0), (0, 0), (0, kb * block_size - lk), (0, 0)))
    keys = jnp.arange(kb * block_size)
    # 4-byte inputs need HIGHEST (not TF32); 2-byte inputs' products are exact in float32
    precision = jax.lax.Precision.HIGHEST if q.dtype.itemsize >= 4 else None

    def step(rows_of_step):  # int32 [per_step, rows] -> float32 [B, Hq, per_step, kb]
        flat = rows_of_step.reshape(-1)
        qg = q[:, :, flat].reshape(b, hkv, hq // hkv, flat.size, d)
        s = jnp.einsum("bkgnd,bkjd->bkgnj", qg, k, preferred_element_type=jnp.float32,
                       precision=precision)
        visible = keys[None, :] < lk
        if causal:
            visible &= keys[None, :] <= flat[:, None] + (lk - lq)
        p = jax.nn.softmax(jnp.where(visible, s * scale, -jnp.inf), axis=-1)
        return p.reshape(b, hq, per_step, rows, kb, block_size).sum(axis=(3, 5))

    mass = jax.lax.map(step, jnp.asarray(positions).reshape(steps, per_step, rows))
    return mass.transpose(1, 2, 0, 3, 4).reshape(b, hq, steps * per_step, kb)[:, :, :qb]
