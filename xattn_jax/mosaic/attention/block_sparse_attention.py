"""Block-sparse attention on the estimate's mask (docs/estimate.md section 6) with the
Mosaic GPU kernel of `xattn_jax.mosaic.attention.kernel` (Hopper, sm_90).

`block_sparse_attention` builds, on the device and in plain JAX, one compact list of key
tiles per (batch, query head, CTA query tile) from the mask (`key_tile_lists`), pads q/k/v
to whole tiles where needed, runs the kernel and slices the padding away. The kernel module
is imported on first call only, so this module imports with any jax (also where Mosaic GPU
does not import); `available()` (from `xattn_jax.mosaic`) says whether the kernel can run
on a device, `unsupported_reason(D, Dv, dtype, block_size)` whether it takes the arguments:
a caller choosing an implementation ("auto") falls back to the reference when either is
not None, as `block_sparse_attention` raises ValueError for such arguments.

Paged caches (`block_table`) are read in place; their pages must hold a multiple of
`plan.block_kv` tokens. Padding cost: when Lq is not a multiple of `plan.rows_per_cta`
(128) or a contiguous Lk not a multiple of `plan.block_kv`, q (resp. k and v) are copied
once into padded arrays (jnp.pad) and the output slice is one more copy: a memory pass
over q, k, v and out, small next to the attention itself at the lengths this kernel is
for. Padded keys are masked in the kernel; padded query rows are computed and dropped.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from xattn_jax.geometry import cdiv
from xattn_jax.mosaic import available
from xattn_jax.mosaic.attention.plan import (AttentionPlan, attention_plan,
                                            unsupported_reason)

__all__ = ["AttentionPlan", "KeyTileLists", "attention_plan", "available",
           "block_sparse_attention", "key_tile_lists", "unsupported_reason"]


class KeyTileLists(NamedTuple):
    """Per (batch b, query head h, CTA query tile c) of `plan.rows_per_cta` rows:

    - tiles int32 [B, Hq, nq, nt]: the key tiles (of `plan.block_kv` keys) the CTA visits,
      ascending, first in each row; the entries past `counts[..., 0]` are never read;
    - counts int32 [B, Hq, nq, 1 + W]: [number of tiles to visit, then per consumer
      warpgroup w the number of leading ones that need no per-element mask];
    - bounds int32 [2]: (n - Lq, n), n the keys in use: query row i sits at key position
      i + n - Lq, and keys from n on are hidden.

    nq = ceil(Lq / rows_per_cta), nt = ceil(Lk / block_kv), W = compute warpgroups.
    """

    tiles: jax.Array
    counts: jax.Array
    bounds: jax.Array


def key_tile_lists(mask: jax.Array, *, q_len: int, k_len: int, block_size: int,
                   causal: bool, plan: AttentionPlan, keys_in_use=None) -> KeyTileLists:
    """The kernel's walk over `mask` bool [B, Hq, ceil(Lq/bs), ceil(Lk/bs)].

    `keys_in_use` n: None (n = Lk) or an int32 scalar (may be traced), Lq <= n <= Lk. A CTA
    visits key tile t iff its mask block (row c*rows//bs, column t*block_kv//bs) is set,
    the tile starts before n and, with `causal`, at or before the key position of the
    CTA's last row (query row i sits at key i + n - Lq). A visited tile needs no
    per-element mask for warpgroup w iff every key of it is visible to every row of w:
    with `causal`, it ends at or before the key position of w's first row; without, it
    ends at or before n.
    """
    rows, block_q, block_kv = plan.rows_per_cta, plan.block_q, plan.block_kv
    num_ctas = cdiv(q_len, rows)
    num_tiles = cdiv(k_len, block_kv)
    keys_in_use = jnp.asarray(k_len if keys_in_use is None else keys_in_use, jnp.int32)
    offset = keys_in_use - q_len
    cta_row = jnp.arange(num_ctas, dtype=jnp.int32) * rows
    tile_key = jnp.arange(num_tiles, dtype=jnp.int32) * block_kv
    visit = mask.astype(bool)[:, :, cta_row // block_size]
    visit = visit[:, :, :, tile_key // block_size] & (tile_key < keys_in_use)
    if causal:
        last_position = cta_row + (rows - 1) + offset
        visit = visit & (tile_key[None, :] <= last_position[:, None])
    tiles = jnp.argsort(~visit, axis=-1, stable=True).astype(jnp.int32)
    warpgroup_row = (cta_row[:, None]
                     + jnp.arange(plan.compute_warpgroups, dtype=jnp.int32) * block_q)
    if causal:  # tiles below this index end at or before the warpgroup's first position
        unmasked_below = jnp.floor_divide(warpgroup_row + offset + 1, block_kv)
    else:
        unmasked_below = jnp.broadcast_to(keys_in_use // block_kv, warpgroup_row.shape)
    tile_index = jnp.arange(num_tiles, dtype=jnp.int32)
    unmasked = visit[..., None, :] & (tile_index < unmasked_below[..., None])
    counts = jnp.concatenate(
        [visit.sum(-1, dtype=jnp.int32)[..., None], unmasked.sum(-1, dtype=jnp.int32)],
        axis=-1)
    return KeyTileLists(tiles=tiles, counts=counts, bounds=jnp.stack([offset, keys_in_use]))


def _pad_axis(x: jax.Array, axis: int, length: int) -> jax.Array:
    """x zero-padded along `axis` to `length` (x itself when already that long)."""
    if x.shape[axis] == length:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, length - x.shape[axis])
    return jnp.pad(x, widths)


@functools.partial(jax.jit, static_argnames=("block_size", "causal", "scale", "return_lse",
                                             "block_kv", "stages"))
def block_sparse_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, *,
                           block_size: int, causal: bool, scale: float | None = None,
                           return_lse: bool = False, k_len=None, block_table=None,
                           block_kv: int | None = None, stages: int | None = None):
    """out[b, h, i] = softmax over allowed j of (scale q[b,h,i].k[b,g(h),j]) applied to v.

    q [B, Hq, Lq, D], k and v [B, Hkv, Lk, D] (bfloat16 or float16, one dtype), or paged
    caches [num_pages, page_size, Hkv, D] with `block_table` int32 [B, pages_per_seq]
    (Lk = pages_per_seq * page_size; ids outside [0, num_pages) are clamped into it; read
    in place), mask bool
    [B, Hq, ceil(Lq/block_size), ceil(Lk/block_size)]; g(h) = h // (Hq/Hkv). Key j is
    allowed for query row i iff mask[b, h, i//bs, j//bs], j < n and, with `causal`,
    j <= i + n - Lq, n = `k_len` the keys in use: None (n = Lk) or an int or int32 scalar
    (may be traced: no recompilation), Lq <= n <= Lk (the caller's part). Softmax in
    float32; `scale` defaults to 1/sqrt(D) and must be > 0.
    Returns out [B, Hq, Lq, D] in q's dtype, and with `return_lse` also lse float32
    [B, Hq, Lq] (natural log; -inf where a row has no allowed key, whose out is 0).

    Arguments are assumed checked by the public entry point (shapes, dtypes, mask). Raises
    ValueError when the kernel does not support them (`unsupported_reason`: dtype, head
    dim, block_size not a multiple of 128, pages not a multiple of the key tile); the
    public `xattn_jax.block_sparse_attention` then falls back to the reference ("auto") or
    raises it ("mosaic"). `block_kv`/`stages` override the plan (tuning only).
    """
    batch, q_heads, q_len, head_dim = q.shape
    page_size = None if block_table is None else k.shape[1]
    keys_in_use = k_len
    k_len = k.shape[2] if block_table is None else block_table.shape[1] * page_size
    plan = attention_plan(head_dim, v.shape[-1], q.dtype, block_size, with_lse=return_lse,
                          page_size=page_size, block_kv=block_kv, stages=stages)
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    from xattn_jax.mosaic.attention import kernel  # imports Mosaic GPU: only where it runs

    lists = key_tile_lists(mask, q_len=q_len, k_len=k_len, block_size=block_size,
                           causal=causal, plan=plan, keys_in_use=keys_in_use)
    q_rows = lists.tiles.shape[2] * plan.rows_per_cta
    k_rows = lists.tiles.shape[3] * plan.block_kv
    if block_table is None:
        k, v = _pad_axis(k, 2, k_rows), _pad_axis(v, 2, k_rows)
    else:  # whole pages of whole tiles: nothing to pad
        block_table = jnp.clip(block_table.astype(jnp.int32), 0, k.shape[0] - 1)
    out, lse = kernel.attention_call(
        _pad_axis(q, 2, q_rows), k, v, lists.tiles, lists.counts, lists.bounds,
        block_table, plan=plan, causal=causal, scale=float(scale), return_lse=return_lse)
    out = out[:, :, :q_len]
    if return_lse:
        return out, lse[:, :, :q_len]
    return out
