"""The attention of a ragged serving step (`reference.ragged.attention`'s semantics) with
the Mosaic GPU kernel (Hopper, sm_90): `ragged_attention`.

The work table and the key-tile lists are built on the device in plain JAX
(`ragged_work`), then `ragged_kernel` runs one CTA per (query head, slot): 128 query rows
of one query block of one sequence. q, the caches and the output are used in place:
nothing is padded or copied but q when it has fewer rows than one warpgroup's box. The
kernel module is imported on first call only, so this module imports with any jax;
`unsupported_reason(geom, dtype)` (from `ragged_plan`) says whether the kernel takes a
step's shapes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from xattn_jax.mosaic.attention.ragged_plan import ragged_plan, unsupported_reason
from xattn_jax.mosaic.attention.ragged_work import kernel_rows, ragged_work
from xattn_jax.ragged.geometry import RaggedGeometry
from xattn_jax.ragged.layout import RaggedBlocks

__all__ = ["ragged_attention", "unsupported_reason"]


@functools.partial(jax.jit, static_argnames=("geom", "scale"))
def ragged_attention(q: jax.Array, k: jax.Array, v: jax.Array | None,
                     page_indices: jax.Array, mask: jax.Array, blocks: RaggedBlocks,
                     geom: RaggedGeometry, *, scale: float) -> jax.Array:
    """`reference.ragged.attention` on the kernel: out `[T, Hq, Dv]` in q's dtype, zero in
    rows of no live sequence.

    q `[T, Hq, D]` bfloat16 or float16; k, v paged caches `[num_pages, page_size, Hkv,
    D]`, or v None and k one fused cache `[num_pages, page_size, Hkv, 2, D]` (K of KV
    head h at [..., h, 0, :], V at [..., h, 1, :]); page_indices int32 `[S,
    pages_per_seq]` (ids clamped into the cache); mask bool `[Hq, QB, KB]`; blocks the
    step's `RaggedBlocks`; geom its `RaggedGeometry`; scale the q.k multiplier (> 0).
    Query row t of sequence s, at key position p, attends to key j iff j <= p and
    mask[h, row of p's block, j // bs].

    A sequence's pages are read up to the page of its last key only (later page-table
    entries are never read). Within the key tiles a CTA visits, the values of keys a row
    does not see (the rest of a sequence's last page, keys past the row's position) get
    a weight of 0: a NaN or inf among them makes the row NaN. Raises ValueError where
    `unsupported_reason` says why.
    """
    plan = ragged_plan(geom, q.dtype)
    from xattn_jax.mosaic.attention import ragged_kernel  # imports Mosaic GPU: only where it can run

    lists = ragged_work(mask, blocks, geom, plan)
    rows = kernel_rows(geom, plan)
    if rows > geom.tokens:  # fewer rows than one box: pad q (tiny)
        q = jnp.pad(q, ((0, rows - geom.tokens), (0, 0), (0, 0)))
    table = jnp.clip(page_indices.astype(jnp.int32), 0, geom.num_pages - 1)
    out = ragged_kernel.ragged_attention_call(q, k, v, lists.tiles, lists.counts,
                                              lists.slots, table, plan=plan, scale=scale)
    return out[:geom.tokens]
