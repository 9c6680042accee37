"""A paged KV cache read as contiguous keys (a copy: for the reference and for tests)."""

from __future__ import annotations

import jax


def gather_pages(pages: jax.Array, block_table: jax.Array) -> jax.Array:
    """A paged cache `[num_pages, page_size, Hkv, D]` read through `block_table`
    (int32 `[B, pages_per_seq]`) as contiguous keys `[B, Hkv, pages_per_seq * page_size,
    D]`. Page ids are clamped into `[0, num_pages)`, as the kernels clamp them."""
    b, per_seq = block_table.shape
    # [B, pages_per_seq, page_size, Hkv, D]
    keys = pages[block_table.clip(0, pages.shape[0] - 1)]
    keys = keys.reshape(b, per_seq * pages.shape[1], *pages.shape[2:])
    return keys.transpose(0, 2, 1, 3)
