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


def _head_columns(head_dim: int) -> tuple[jax.Array, jax.Array | None]:
    """Column index `[1, D_pad]` and its mask (None for a power-of-two head_dim).

    With a power-of-two head_dim the column index is a plain range and the row mask is
    constant along a row, which lets Triton vectorize the loads (a clamped or masked
    column index costs several times the kernel's time).
    """
    dims = jnp.arange(next_pow2(head_dim))
    if dims.shape[0] == head_dim:
        return dims[None, :], None
    return jnp.minimum(dims, head_dim - 1)[None, :], (dims < head_dim)[None, :]


def load_tokens(ref, tokens: jax.Array, length, head_dim: int) -> jax.Array:
    """Token rows `tokens` (int32 `[n]`) of a `[L, head_dim]` ref as `[n, D_pad]`.

    Rows at or past `length` (padding; an int or a traced int32) and columns past
    head_dim read as zeros.
    """
    cols, col_mask = _head_columns(head_dim)
    mask = (tokens < length)[:, None]
    mask = mask if col_mask is None else mask & col_mask
    rows = jnp.minimum(tokens, length - 1)[:, None]
    return plgpu.load(ref.at[rows, cols], mask=mask, other=0)


def load_paged_tokens(pages_ref, table_ref, kv_head, tokens: jax.Array, length,
                      head_dim: int) -> jax.Array:
    """Token rows of one sequence in a paged cache, as `[n, D_pad]`, like `load_tokens`.

    pages_ref: `[num_pages, page_size, Hkv, D]`; table_ref: int32 `[pages_per_seq]`, the
    sequence's pages in order (token t lives in page table[t // page_size] at row
    t % page_size); kv_head: the key head to read.
    """
    page_size = pages_ref.shape[1]
    cols, col_mask = _head_columns(head_dim)
    mask = (tokens < length)[:, None]
    mask = mask if col_mask is None else mask & col_mask
    slots = jnp.minimum(tokens, length - 1)
    pages = plgpu.load(table_ref.at[slots // page_size])
    return plgpu.load(
        pages_ref.at[pages[:, None], (slots % page_size)[:, None], kv_head, cols],
        mask=mask, other=0)


def member_product(q_ref, load_keys, row0, col0, member, *, rows: int, cols: int,
                   geom: Geometry) -> jax.Array:
    """Stride member `member`'s share of the strided product: float32 `[rows, cols]`.

    Reshaped row i holds query tokens i*S + S-1, ..., i*S (its group read in reverse) and
    column j key tokens j*S, ..., j*S + S-1, so member m pairs query token i*S + S-1-m
    with key token j*S + m. q_ref: `[Lq, D]` (one batch and query head); load_keys(tokens)
    returns its key head's token rows as `[n, D_pad]` (`load_tokens` or
    `load_paged_tokens` with the real key count bound). Rows and columns past the real
    tokens read zeros.
    """
    s = geom.stride
    precision = (jax.lax.Precision.HIGHEST if q_ref.dtype == jnp.float32
                 else jax.lax.Precision.DEFAULT)
    q_part = load_tokens(q_ref, (row0 + jnp.arange(rows)) * s + (s - 1 - member), geom.q_len,
                         geom.head_dim)
    k_part = load_keys((col0 + jnp.arange(cols)) * s + member)
    return plgpu.dot(q_part, k_part, trans_b=True, precision=precision)


def score_tile(q_ref, load_keys, row0, col0, *, rows: int, cols: int, geom: Geometry,
               scale: float) -> jax.Array:
    """Scores for reshaped rows [row0, row0+rows) and columns [col0, col0+cols): float32
    `[rows, cols]`, the sum of the S member products times `scale` (A is scale =
    1 / (sqrt(D) * S * norm)). Arguments as `member_product`.
    """
    def add_member(member, acc):
        return acc + member_product(q_ref, load_keys, row0, col0, member, rows=rows,
                                    cols=cols, geom=geom)

    acc = jax.lax.fori_loop(0, geom.stride, add_member, jnp.zeros((rows, cols), jnp.float32))
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
    load_keys = functools.partial(load_tokens, k_ref, length=geom.k_len,
                                  head_dim=geom.head_dim)
    a = score_tile(q_ref, load_keys, row0, col0, rows=tile, cols=tile, geom=geom,
                   scale=geom.scale / norm)
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
