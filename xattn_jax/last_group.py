"""A traced key count for the Triton one-pass block-sum kernel (`xattn_jax.triton.
one_pass`), which reads keys by whole stride groups (docs/estimate.md section 1: a
reshaped key column is S consecutive keys). (The Mosaic kernel instead reads the key
tile holding the count's end from a copy with the later keys zeroed,
`xattn_jax.mosaic.estimate.block_sums`.)

When the count of keys in use is data, it may end inside a stride group. The kernel
then takes the count rounded down to whole groups (`split_last_group`), so that no key
past the count ever enters one of its scores whatever the buffer holds there, and the
one column of the partly filled group is scored here in plain JAX (`column_scores`; its
keys past the count read as zeros) and merged into the kernel's statistics
(`merge_column`) before the epilogue (`row_statistics.combine`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from xattn_jax.geometry import Geometry
from xattn_jax.row_statistics import LOG2_E, fit


def column_scores(q, group, geom: Geometry, norm: float) -> jax.Array:
    """A * log2(e) of one reshaped key column, whose S tokens are `group` `[B, Hkv, S,
    D]`, for every reshaped query row: float32 `[B, Hq, q_rows]` (section 1 in plain JAX,
    for the one column the kernel leaves out; a partly filled last query group reads
    zeros)."""
    s = geom.stride
    q = jnp.pad(q, ((0, 0), (0, 0), (0, geom.q_rows * s - geom.q_len), (0, 0)))
    # member m pairs query token i*S + S-1-m with key token m of the group
    rows = q.reshape(geom.batch, geom.kv_heads, geom.group, geom.q_rows, s,
                     geom.head_dim)[:, :, :, :, ::-1]
    precision = jax.lax.Precision.HIGHEST if q.dtype.itemsize >= 4 else None
    a = jnp.einsum("bhgrsd,bhsd->bhgr", rows, group, preferred_element_type=jnp.float32,
                   precision=precision)
    return a.reshape(geom.batch, geom.q_heads, geom.q_rows) * jnp.float32(
        geom.scale / norm * LOG2_E)


def split_last_group(q, k, key_len, block_table, geom: Geometry, norm: float):
    """Splits the traced key count `key_len` (int32 `[1]`; more than Lk counts as Lk) of
    k `[B, Hkv, Lk, D]` (or a paged cache `[num_pages, page_size, Hkv, D]` read through
    `block_table` `[B, pages_per_seq]`) for a kernel reading whole stride groups.

    Returns the whole groups' tokens (int32 `[1]`, the kernel's count), the index of the
    column of the partly filled group after them, its scores A * log2(e) (float32
    `[B, Hq, q_rows]`, `column_scores`) and whether there is such a column.
    """
    s = geom.stride
    count = jnp.minimum(key_len[0], geom.k_len)
    whole = count - count % s
    # A count of whole groups may end at Lk: then no token of the group is real.
    tokens = jnp.minimum(whole, geom.k_len - s) + jnp.arange(s)
    if block_table is None:
        group = jax.lax.dynamic_slice_in_dim(k, tokens[0], s, axis=2)
    else:  # pages [num_pages, page_size, Hkv, D]; table entries past the keys: anything
        pages = jnp.clip(block_table[:, tokens // k.shape[1]], 0, k.shape[0] - 1)
        group = k[pages, tokens % k.shape[1]].transpose(0, 2, 1, 3)  # [B, Hkv, S, D]
    real = (tokens >= whole) & (tokens < count)
    group = jnp.where(real[:, None], group, jnp.zeros((), group.dtype))
    return whole.reshape(1), whole // s, column_scores(q, group, geom, norm), count != whole


def merge_column(maxes, sums, totals, last_group, *, first_head, first_row, row_extent: int,
                 block_k: int, unit: int):
    """The kernel's statistics of one call (maxes and totals `[B, h, T, R]`, sums
    `[B, h, T, R, P]`: h query heads from `first_head`, R reshaped query rows from
    `first_row`, key tiles of `block_k` columns, units of `unit`) with the column of
    `last_group` (`split_last_group`'s last three values) added where it is present.
    row_extent: the rows the column's scores are cut or zero-padded to before this
    call's are taken (at least first_row + R)."""
    column, scores, present = last_group
    heads, rows = maxes.shape[1], maxes.shape[3]
    scores = jax.lax.dynamic_slice_in_dim(scores, first_head, heads, axis=1)
    scores = jax.lax.dynamic_slice_in_dim(fit(scores, 2, row_extent), first_row, rows, axis=2)
    tile = column // block_k

    def at_tile(a):
        return jax.lax.dynamic_index_in_dim(a, tile, axis=2, keepdims=False)

    def update(a, new, old):
        return jax.lax.dynamic_update_index_in_dim(a, jnp.where(present, new, old), tile, 2)

    m, x, t = at_tile(maxes), at_tile(sums), at_tile(totals)
    m_new = jnp.maximum(m, scores)
    rescale, added = jnp.exp2(m - m_new), jnp.exp2(scores - m_new)
    own_unit = jnp.arange(sums.shape[-1]) == (column % block_k) // unit
    x_new = x * rescale[..., None] + jnp.where(own_unit, added[..., None], 0.0)
    return (update(maxes, m_new, m), update(sums, x_new, x),
            update(totals, t * rescale + added, t))
