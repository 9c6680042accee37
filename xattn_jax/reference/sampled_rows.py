"""The sampled rows' block scores in plain JAX (docs/estimate.md, "Sampled rows"): the
reference the Triton kernel is tested against, and the implementation off a GPU.

Each sampled row's exact softmax over the keys it may see, summed per key block, in steps
of query blocks whose float32 scores take at most `SCORE_STEP_BYTES`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from xattn_jax.geometry import cdiv
from xattn_jax.sampled_geometry import SampledGeometry, sampled_positions

SCORE_STEP_BYTES = 256 * 2**20  # bound on one step's float32 scores [B, Hq, rows, Lk]


@functools.partial(jax.jit, static_argnames=("geom", "causal"))
def block_mass(q: jax.Array, k: jax.Array, key_len: jax.Array | None = None, *,
               geom: SampledGeometry, causal: bool) -> jax.Array:
    """Sampled rows' block scores: float32 `[B, Hq, qb, kb]`.

    q `[B, Hq, Lq, D]`, k `[B, Hkv, Lk, D]` (q's dtype; GQA read in place), the sizes of
    `geom`. key_len: int32 `[]`, the keys in use of a buffer padded to Lk (None: all;
    more than Lk counts as Lk); later keys are never visible, and with none in use the
    rows add nothing. Products are exact in float32.
    """
    b, hq, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    block_size, rows = geom.block_size, geom.rows
    qb, kb = geom.q_blocks, geom.k_blocks
    per_step = max(1, min(qb, SCORE_STEP_BYTES // (4 * b * hq * rows * kb * block_size)))
    steps = cdiv(qb, per_step)
    positions = sampled_positions(lq, block_size, rows)
    padding = np.zeros((steps * per_step - qb, rows), np.int32)  # steps past the end
    positions = np.concatenate([positions, padding])
    k = jnp.pad(k, ((0, 0), (0, 0), (0, kb * block_size - lk), (0, 0)))
    keys = jnp.arange(kb * block_size)
    count = lk if key_len is None else jnp.minimum(key_len, lk)
    # 4-byte inputs need HIGHEST (not TF32); 2-byte inputs' products are exact in float32
    precision = jax.lax.Precision.HIGHEST if q.dtype.itemsize >= 4 else None

    def step(rows_of_step):  # int32 [per_step, rows] -> float32 [B, Hq, per_step, kb]
        flat = rows_of_step.reshape(-1)
        qg = q[:, :, flat].reshape(b, hkv, hq // hkv, flat.size, d)
        s = jnp.einsum("bkgnd,bkjd->bkgnj", qg, k, preferred_element_type=jnp.float32,
                       precision=precision)
        visible = keys[None, :] < count
        if causal:
            visible &= keys[None, :] <= flat[:, None] + (lk - lq)
        p = jax.nn.softmax(jnp.where(visible, s * geom.scale, -jnp.inf), axis=-1)
        p = jnp.where(visible.any(axis=-1, keepdims=True), p, 0.0)  # rows that see no key
        return p.reshape(b, hq, per_step, rows, kb, block_size).sum(axis=(3, 5))

    mass = jax.lax.map(step, jnp.asarray(positions).reshape(steps, per_step, rows))
    return mass.transpose(1, 2, 0, 3, 4).reshape(b, hq, steps * per_step, kb)[:, :, :qb]
