"""Sections 2-3 as one Pallas kernel: softmax and block sums over score tiles never stored.

Each program owns `tile` reshaped query rows of one (batch, query head) and walks the
visible key tiles twice:

1. row statistics: the running maximum m and the sum l of exp(A - m) per row (online
   softmax), over every visible column;
2. block sums: exp(A - m) / l per element, summed over `fine x fine` squares and stored.

`fine` = gcd(block_rows, tile) is the internal block: block sums at `block_size` are sums
of (block_rows / fine)^2 fine blocks (ESTIMATE.md section 3, hierarchical sums). So the
kernel's work per element is the same for every block size from 64 to 4096 tokens; only
the cheap final sum changes. Causal programs stop at their last visible key tile and write
zeros beyond it.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from xattn_jax.geometry import Geometry
from xattn_jax.pallas.strided_scores import qk_specs, score_tile


def fine_rows(geom: Geometry, tile: int) -> int:
    """The internal block in reshaped rows: the largest divisor of block_rows within a tile."""
    return math.gcd(geom.block_rows, tile)


def _block_sums_kernel(q_ref, k_ref, out_ref, *, geom: Geometry, causal: bool, norm: float,
                       tile: int):
    fine = fine_rows(geom, tile)
    per_tile = tile // fine
    out_rows = geom.q_blocks * (geom.block_rows // fine)
    out_cols = geom.k_blocks * (geom.block_rows // fine)
    row_tile = pl.program_id(2)
    row0 = row_tile * tile
    row_ids = row0 + jnp.arange(tile)
    row_real = row_ids < geom.q_rows

    if causal:
        last_row = jnp.minimum(row0 + tile, geom.q_rows) - 1
        last_col = jnp.minimum(last_row + geom.row_offset, geom.k_cols - 1)
        visible_tiles = last_col // tile + 1
    else:
        visible_tiles = pl.cdiv(geom.k_cols, tile)
    visible_tiles = jnp.where(row0 < geom.q_rows, visible_tiles, 0)  # all-padding row tile
    all_tiles = pl.cdiv(geom.k_blocks * geom.block_rows, tile)

    def masked_scores(col_tile):
        col0 = col_tile * tile
        a = score_tile(q_ref, k_ref, row0, col0, rows=tile, cols=tile, geom=geom, norm=norm)
        col_ids = col0 + jnp.arange(tile)
        seen = (col_ids < geom.k_cols)[None, :]
        if causal:
            seen = seen & (col_ids[None, :] <= row_ids[:, None] + geom.row_offset)
        return jnp.where(seen, a, -jnp.inf)

    def row_stats(col_tile, carry):
        m, l = carry
        a = masked_scores(col_tile)
        m_new = jnp.maximum(m, a.max(axis=1))
        l = l * jnp.exp(m - m_new) + jnp.exp(a - m_new[:, None]).sum(axis=1)
        return m_new, l

    m, l = jax.lax.fori_loop(
        0, visible_tiles, row_stats,
        (jnp.full((tile,), -jnp.inf, jnp.float32), jnp.zeros((tile,), jnp.float32)))
    inv_l = 1.0 / l

    out_row0 = row_tile * per_tile
    out_row_real = (out_row0 + jnp.arange(per_tile)) < out_rows

    def store(col_tile, sums):
        out_col0 = col_tile * per_tile
        mask = out_row_real[:, None] & ((out_col0 + jnp.arange(per_tile)) < out_cols)[None, :]
        plgpu.store(out_ref.at[pl.ds(out_row0, per_tile), pl.ds(out_col0, per_tile)], sums,
                    mask=mask)

    def write_sums(col_tile, carry):
        p = jnp.exp(masked_scores(col_tile) - m[:, None]) * inv_l[:, None]
        p = jnp.where(row_real[:, None], p, 0.0)  # padded query rows add nothing
        store(col_tile, p.reshape(per_tile, fine, per_tile, fine).sum(axis=(1, 3)))
        return carry

    def write_zeros(col_tile, carry):
        store(col_tile, jnp.zeros((per_tile, per_tile), jnp.float32))
        return carry

    jax.lax.fori_loop(0, visible_tiles, write_sums, None)
    jax.lax.fori_loop(visible_tiles, all_tiles, write_zeros, None)


@functools.partial(jax.jit, static_argnames=("geom", "causal", "norm", "tile", "num_warps",
                                             "num_stages", "interpret"))
def block_sums(q: jax.Array, k: jax.Array, *, geom: Geometry, causal: bool, norm: float,
               tile: int = 64, num_warps: int = 4, num_stages: int = 2,
               interpret: bool = False) -> jax.Array:
    """Pallas sections 1-3: float32 block sums `[B, Hq, ceil(Lq/bs), ceil(Lk/bs)]`.

    q: `[B, Hq, Lq, D]`, k: `[B, Hkv, Lk, D]`, same dtype (float32, bfloat16, float16).
    `tile` (a power of two, >= 16 on GPU) is the program's square of reshaped rows and
    columns. Extra memory: the fine block sums only, never the score matrix.
    """
    fine = fine_rows(geom, tile)
    per_block = geom.block_rows // fine
    out_shape = (geom.batch, geom.q_heads, geom.q_blocks * per_block,
                 geom.k_blocks * per_block)
    grid = (geom.batch, geom.q_heads, pl.cdiv(geom.q_blocks * geom.block_rows, tile))
    kernel = functools.partial(_block_sums_kernel, geom=geom, causal=causal, norm=norm,
                               tile=tile)
    sums = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=qk_specs(geom),
        out_specs=pl.BlockSpec((None, None) + out_shape[2:], lambda b, h, *_: (b, h, 0, 0)),
        out_shape=jax.ShapeDtypeStruct(out_shape, jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
    )(q, k)
    if per_block == 1:
        return sums
    b, h = sums.shape[:2]
    return sums.reshape(b, h, geom.q_blocks, per_block, geom.k_blocks, per_block).sum((3, 5))
