"""Sections 2-3 in two passes over the key tiles; nothing but the block sums is stored.

Each program owns `plan.block_q` reshaped query rows (`RowTile`) and walks the key tiles it
sees twice:

1. row statistics: the running maximum m and the sum l of 2^(A' - m) per row (online
   softmax in base 2: A' = A * log2(e), the factor folded into the score scale);
2. block sums: 2^(A' - m) / l per element, summed over `fine x fine` squares and stored.

`fine` = gcd(block_rows, block_cols, block_q, block_k) (`Plan.fine`) is the internal
block: block sums at `block_size` are sums of (block_rows / fine) x (block_cols / fine)
fine blocks (docs/estimate.md section 3, hierarchical sums), so the work per element is
the same for every block size.
Causal programs stop at their last visible key tile and write zeros beyond it. It
computes every score twice, but needs no memory beyond its output: the fallback of
`one_pass` when that one's scratch is too big.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from xattn_jax.triton.common import ROW_AXIS, head_spec, kernel_grid
from xattn_jax.triton.row_tile import RowTile, key_operands, row_tile_refs
from xattn_jax.partitioning import kernel_output
from xattn_jax.triton.plan import Plan


def _two_pass_kernel(q_ref, k_ref, *refs, plan: Plan, causal: bool, norm: float,
                     paged: bool, row_extent: int, whole_groups: bool):
    table_ref, scalars_ref, (out_ref,) = row_tile_refs(refs, paged)
    tile = RowTile(q_ref, k_ref, table_ref, scalars_ref, plan=plan, causal=causal,
                   norm=norm, row_extent=row_extent, whole_groups=whole_groups)
    geom, rows, cols, fine = plan.geom, plan.block_q, plan.block_k, plan.fine
    out_rows = geom.q_blocks * (geom.block_rows // fine)
    out_cols = geom.k_blocks * (geom.block_cols // fine)
    visible_tiles = tile.visible_tiles

    def row_stats(col_tile, carry):
        m, l = carry
        a = tile.scores(col_tile)
        m_new = jnp.maximum(m, a.max(axis=1))
        l = l * jnp.exp2(m - m_new) + jnp.exp2(a - m_new[:, None]).sum(axis=1)
        return m_new, l

    m, l = jax.lax.fori_loop(
        0, visible_tiles, row_stats,
        (jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32)))
    weight = jnp.where(tile.row_real, 1.0 / l, 0.0)  # padded query rows add nothing

    out_row0 = pl.program_id(ROW_AXIS) * (rows // fine)
    out_row_real = (out_row0 + jnp.arange(rows // fine)) < out_rows

    def store(col_tile, sums):
        out_col0 = col_tile * (cols // fine)
        mask = out_row_real[:, None] \
            & ((out_col0 + jnp.arange(cols // fine)) < out_cols)[None, :]
        plgpu.store(out_ref.at[pl.ds(out_row0, rows // fine), pl.ds(out_col0, cols // fine)],
                    sums, mask=mask)

    def write_sums(col_tile, carry):
        p = jnp.exp2(tile.scores(col_tile) - m[:, None]) * weight[:, None]
        p = jnp.where(tile.row_real[:, None], p, 0.0)
        store(col_tile, p.reshape(rows // fine, fine, cols // fine, fine).sum(axis=(1, 3)))
        return carry

    def write_zeros(i, carry):  # loops from 0: a traced lower bound trips jax 0.11.2
        store(visible_tiles + i, jnp.zeros((rows // fine, cols // fine), jnp.float32))
        return carry

    all_tiles = pl.cdiv(out_cols * fine, cols)
    jax.lax.fori_loop(0, visible_tiles, write_sums, None)
    jax.lax.fori_loop(0, all_tiles - visible_tiles, write_zeros, None)


def two_pass_block_sums(q, k, *, plan: Plan, causal: bool, norm: float, key_len,
                        block_table) -> jax.Array:
    """Block sums `[B, Hq, qb, kb]` (arguments as `block_sums.block_sums`)."""
    geom, fine = plan.geom, plan.fine
    per_row_block, per_col_block = geom.block_rows // fine, geom.block_cols // fine
    out_shape = (geom.batch, geom.q_heads, geom.q_blocks * per_row_block,
                 geom.k_blocks * per_col_block)
    in_specs, operands = key_operands(q, k, key_len, block_table, plan)
    row_tiles = pl.cdiv(out_shape[2] * fine, plan.block_q)
    kernel = functools.partial(_two_pass_kernel, plan=plan, causal=causal, norm=norm,
                               paged=block_table is not None,
                               row_extent=row_tiles * plan.block_q,
                               whole_groups=key_len is None)
    sums = pl.pallas_call(
        kernel,
        grid=kernel_grid(plan, row_tiles),
        in_specs=in_specs,
        out_specs=head_spec(out_shape[2:]),
        out_shape=kernel_output(out_shape, jnp.float32, q, k),
        compiler_params=plgpu.CompilerParams(num_warps=plan.num_warps,
                                             num_stages=plan.num_stages),
        interpret=plan.interpret,
    )(*operands)
    if per_row_block == per_col_block == 1:
        return sums
    b, h = sums.shape[:2]
    return sums.reshape(b, h, geom.q_blocks, per_row_block, geom.k_blocks,
                        per_col_block).sum((3, 5))
