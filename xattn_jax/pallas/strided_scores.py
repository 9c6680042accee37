"""Section 1 as a Pallas kernel: strided antidiagonal scores, tile by tile.

`score_tile` is the one place the strided product is written; the standalone
`strided_scores` kernel below stores its tiles, and the fused block-sum kernel
(`block_sums.py`) consumes them without ever writing the score matrix.

q and k are read in place in their `[B, H, L, D]` layout: a reshaped row is `S` token rows
of the original tensor, gathered by index inside the kernel, so there is no padded,
reshaped or head-repeated copy. GQA picks the key head in the BlockSpec index map.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from xattn_jax.geometry import Geometry, next_pow2
from xattn_jax.pallas.tiling import default_tiling


def _load_tokens(ref, tokens: jax.Array, length: int, head_dim: int) -> jax.Array:
    """Loads token rows `tokens` (int32 `[n]`) of a `[length, head_dim]` ref as `[n, D_pad]`.

    Rows at or past `length` (padding) and columns past `head_dim` read as zeros. With a
    power-of-two head_dim the column index is a plain range and the mask is constant along
    a row, which lets Triton vectorize the loads (a clamped or masked column index costs
    several times the kernel's time).
    """
    rows = jnp.minimum(tokens, length - 1)[:, None]
    mask = (tokens < length)[:, None]
    dims = jnp.arange(next_pow2(head_dim))
    if dims.shape[0] == head_dim:
        cols = dims[None, :]
    else:
        cols = jnp.minimum(dims, head_dim - 1)[None, :]
        mask = mask & (dims < head_dim)[None, :]
    return plgpu.load(ref.at[rows, cols], mask=mask, other=0)


def score_tile(q_ref, k_ref, row0, col0, *, rows: int, cols: int, geom: Geometry,
               scale: float, k_len) -> jax.Array:
    """Scores for reshaped rows [row0, row0+rows) and columns [col0, col0+cols).

    q_ref: `[Lq, D]` (one batch and query head); k_ref: `[Lk, D]` (its key head), of which
    the first `k_len` tokens (an int or a traced int32) are real keys. Returns float32
    `[rows, cols]`: the strided products times `scale` (A is scale = 1 / (sqrt(D) * S *
    norm)); rows and columns past the real tokens see zeros.
    """
    s = geom.stride
    row_ids = row0 + jnp.arange(rows)
    col_ids = col0 + jnp.arange(cols)
    precision = (jax.lax.Precision.HIGHEST if q_ref.dtype == jnp.float32
                 else jax.lax.Precision.DEFAULT)

    def add_member(member, acc):  # query group read in reverse, key group forward
        q_part = _load_tokens(q_ref, row_ids * s + (s - 1 - member), geom.q_len, geom.head_dim)
        k_part = _load_tokens(k_ref, col_ids * s + member, k_len, geom.head_dim)
        return acc + plgpu.dot(q_part, k_part, trans_b=True, precision=precision)

    acc = jax.lax.fori_loop(0, s, add_member, jnp.zeros((rows, cols), jnp.float32))
    return acc * jnp.float32(scale)


def qk_specs(geom: Geometry) -> list[pl.BlockSpec]:
    """BlockSpecs handing one (batch, query head)'s q and its key head's k to a program.

    The grid is (batch, query head, ...); query head h reads key head h // group.
    """
    g = geom.group
    return [
        pl.BlockSpec((None, None, geom.q_len, geom.head_dim), lambda b, h, *_: (b, h, 0, 0)),
        pl.BlockSpec((None, None, geom.k_len, geom.head_dim),
                     lambda b, h, *_: (b, h // g, 0, 0)),
    ]


def _strided_scores_kernel(q_ref, k_ref, out_ref, *, geom: Geometry, norm: float, tile: int):
    row0 = pl.program_id(2) * tile
    col0 = pl.program_id(3) * tile
    a = score_tile(q_ref, k_ref, row0, col0, rows=tile, cols=tile, geom=geom,
                   scale=geom.scale / norm, k_len=geom.k_len)
    mask = ((row0 + jnp.arange(tile)) < geom.q_rows)[:, None] \
        & ((col0 + jnp.arange(tile)) < geom.k_cols)[None, :]
    plgpu.store(out_ref.at[pl.ds(row0, tile), pl.ds(col0, tile)], a, mask=mask)


@functools.partial(jax.jit, static_argnames=("geom", "norm", "tile", "interpret"))
def strided_scores(q: jax.Array, k: jax.Array, *, geom: Geometry, norm: float,
                   tile: int | None = None, interpret: bool = False) -> jax.Array:
    """Pallas section 1: float32 scores `[B, Hq, ceil(Lq/S), ceil(Lk/S)]`.

    q: `[B, Hq, Lq, D]`, k: `[B, Hkv, Lk, D]` (float32, bfloat16 or float16). This writes
    the whole score matrix, O((L/S)^2) memory: use it to inspect scores, not inside the
    estimate, which fuses it away.
    """
    tile = tile or min(64, default_tiling(geom, q.dtype).rows)
    grid = (geom.batch, geom.q_heads, pl.cdiv(geom.q_rows, tile), pl.cdiv(geom.k_cols, tile))
    kernel = functools.partial(_strided_scores_kernel, geom=geom, norm=norm, tile=tile)
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=qk_specs(geom),
        out_specs=pl.BlockSpec((None, None, geom.q_rows, geom.k_cols),
                               lambda b, h, *_: (b, h, 0, 0)),
        out_shape=jax.ShapeDtypeStruct(
            (geom.batch, geom.q_heads, geom.q_rows, geom.k_cols), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
    )(q, k)
