"""Sections 2-3 as one Pallas kernel: softmax and block sums over score tiles never stored.

Each program owns `tiling.rows` reshaped query rows of one (batch, query head) and walks
the visible key tiles (`tiling.cols` columns each) twice:

1. row statistics: the running maximum m and the sum l of 2^(A' - m) per row (online
   softmax in base 2: A' = A * log2(e), the factor folded into the score scale);
2. block sums: 2^(A' - m) / l per element, summed over `fine x fine` squares and stored.

`fine` = gcd(block_rows, rows, cols) is the internal block: block sums at `block_size` are
sums of (block_rows / fine)^2 fine blocks (ESTIMATE.md section 3, hierarchical sums), so the
kernel's work per element is the same for every block size from 64 to 4096 tokens; only
the cheap final sum changes. Causal programs stop at their last visible key tile and write
zeros beyond it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from xattn_jax.geometry import Geometry
from xattn_jax.pallas.strided_scores import (load_paged_tokens, load_tokens, qk_specs,
                                             score_tile)
from xattn_jax.pallas.tiling import Tiling, default_tiling

LOG2_E = 1.4426950408889634


def _block_sums_kernel(q_ref, k_ref, *refs, geom: Geometry, causal: bool, norm: float,
                       tiling: Tiling, paged: bool):
    """refs: (block table, key count, out) for a paged cache, else (key count, out)."""
    table_ref, key_len_ref, out_ref = refs if paged else (None, *refs)
    rows, cols = tiling.rows, tiling.cols
    fine = tiling.fine(geom)
    per_block = geom.block_rows // fine
    out_rows, out_cols = geom.q_blocks * per_block, geom.k_blocks * per_block
    row0 = pl.program_id(2) * rows
    row_ids = row0 + jnp.arange(rows)
    row_real = row_ids < geom.q_rows
    k_len = key_len_ref[0]  # real keys: geom.k_len, or fewer in a padded cache buffer
    k_cols = (k_len + geom.stride - 1) // geom.stride
    if paged:
        load_keys = functools.partial(load_paged_tokens, k_ref, table_ref,
                                      pl.program_id(1) // geom.group, length=k_len,
                                      head_dim=geom.head_dim)
    else:
        load_keys = functools.partial(load_tokens, k_ref, length=k_len, head_dim=geom.head_dim)

    if causal:
        last_row = jnp.minimum(row0 + rows, geom.q_rows) - 1
        last_col = jnp.minimum(last_row + geom.row_offset, k_cols - 1)
        visible_tiles = last_col // cols + 1
    else:
        visible_tiles = (k_cols + cols - 1) // cols
    # A row tile made only of padding sees nothing.
    visible_tiles = jax.lax.select(row0 < geom.q_rows, visible_tiles, jnp.int32(0))
    all_tiles = pl.cdiv(out_cols * fine, cols)

    def masked_scores(col_tile):  # A * log2(e), -inf where not visible
        col0 = col_tile * cols
        a = score_tile(q_ref, load_keys, row0, col0, rows=rows, cols=cols, geom=geom,
                       scale=geom.scale / norm * LOG2_E)
        col_ids = col0 + jnp.arange(cols)
        seen = (col_ids < k_cols)[None, :]
        if causal:
            seen = seen & (col_ids[None, :] <= row_ids[:, None] + geom.row_offset)
        return jnp.where(seen, a, -jnp.inf)

    def row_stats(col_tile, carry):
        m, l = carry
        a = masked_scores(col_tile)
        m_new = jnp.maximum(m, a.max(axis=1))
        l = l * jnp.exp2(m - m_new) + jnp.exp2(a - m_new[:, None]).sum(axis=1)
        return m_new, l

    m, l = jax.lax.fori_loop(
        0, visible_tiles, row_stats,
        (jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32)))
    weight = jnp.where(row_real, 1.0 / l, 0.0)  # padded query rows add nothing

    out_row0 = pl.program_id(2) * (rows // fine)
    out_row_real = (out_row0 + jnp.arange(rows // fine)) < out_rows

    def store(col_tile, sums):
        out_col0 = col_tile * (cols // fine)
        mask = out_row_real[:, None] \
            & ((out_col0 + jnp.arange(cols // fine)) < out_cols)[None, :]
        plgpu.store(out_ref.at[pl.ds(out_row0, rows // fine), pl.ds(out_col0, cols // fine)],
                    sums, mask=mask)

    def write_sums(col_tile, carry):
        p = jnp.exp2(masked_scores(col_tile) - m[:, None]) * weight[:, None]
        p = jnp.where(row_real[:, None], p, 0.0)
        store(col_tile, p.reshape(rows // fine, fine, cols // fine, fine).sum(axis=(1, 3)))
        return carry

    def write_zeros(i, carry):  # loops from 0: a traced lower bound trips jax 0.11.2
        store(visible_tiles + i, jnp.zeros((rows // fine, cols // fine), jnp.float32))
        return carry

    jax.lax.fori_loop(0, visible_tiles, write_sums, None)
    jax.lax.fori_loop(0, all_tiles - visible_tiles, write_zeros, None)


@functools.partial(jax.jit, static_argnames=("geom", "causal", "norm", "tiling", "interpret"))
def block_sums(q: jax.Array, k: jax.Array, *, geom: Geometry, causal: bool, norm: float,
               key_len: jax.Array | None = None, block_table: jax.Array | None = None,
               tiling: Tiling | None = None, interpret: bool = False) -> jax.Array:
    """Pallas sections 1-3: float32 block sums `[B, Hq, ceil(Lq/bs), ceil(Lk/bs)]`.

    q: `[B, Hq, Lq, D]`, k: `[B, Hkv, Lk, D]`, same dtype (float32, bfloat16, float16).
    key_len: int32 `[1]`, the keys in use when k is a buffer padded to a capacity
    (non-causal only; the default is all Lk): later keys are never visible, and one
    compiled kernel serves every key_len. block_table: int32 `[B, pages_per_seq]` when k
    is a paged cache `[num_pages, page_size, Hkv, D]` (Lk = pages_per_seq * page_size):
    the kernel reads each sequence's pages through the table, no gathered copy.
    `tiling` defaults to the measured `default_tiling`. Extra memory: the fine block sums
    only, never the score matrix.
    """
    tiling = tiling or default_tiling(geom, q.dtype)
    if key_len is None:
        key_len = jnp.full((1,), geom.k_len, jnp.int32)
    fine = tiling.fine(geom)
    per_block = geom.block_rows // fine
    out_shape = (geom.batch, geom.q_heads, geom.q_blocks * per_block,
                 geom.k_blocks * per_block)
    grid = (geom.batch, geom.q_heads, pl.cdiv(out_shape[2] * fine, tiling.rows))
    paged = block_table is not None
    kernel = functools.partial(_block_sums_kernel, geom=geom, causal=causal, norm=norm,
                               tiling=tiling, paged=paged)
    if paged:
        pages = pl.BlockSpec(k.shape, lambda *_: (0,) * k.ndim)
        table = pl.BlockSpec((None, block_table.shape[1]), lambda b, *_: (b, 0))
        in_specs = [qk_specs(geom)[0], pages, table]
        operands = (q, k, block_table.astype(jnp.int32))
    else:
        in_specs, operands = qk_specs(geom), (q, k)
    sums = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs + [pl.BlockSpec((1,), lambda *_: (0,))],
        out_specs=pl.BlockSpec((None, None) + out_shape[2:], lambda b, h, *_: (b, h, 0, 0)),
        out_shape=jax.ShapeDtypeStruct(out_shape, jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=tiling.num_warps,
                                             num_stages=tiling.num_stages),
        interpret=interpret,
    )(*operands, key_len.astype(jnp.int32).reshape(1))
    if per_block == 1:
        return sums
    b, h = sums.shape[:2]
    return sums.reshape(b, h, geom.q_blocks, per_block, geom.k_blocks, per_block).sum((3, 5))
