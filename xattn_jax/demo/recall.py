"""How well a block mask covers the exact attention: recall and density, per query head.

recall: for every query token, the exact softmax attention over the key tokens at full
resolution, softmax(q.k / sqrt(D)) under the causal mask (no stride, no `norm`), summed
over the key blocks that the mask selects for the token's query block; averaged over the
query tokens (and the batch). 1.0 means block-sparse attention with this mask would see
all of the attention mass.

density: the share of the blocks that a query block may attend to (all of them, or with
`causal` those up to its diagonal block) that the mask selects.

The exact attention runs in chunks of query rows inside one `jax.jit`, so its memory stays
near `chunk_bytes` however long the sequence is.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from xattn_jax.geometry import cdiv
from xattn_jax.reference import forced_and_allowed


class Coverage(NamedTuple):
    """float64 `[Hq]` each, per query head; `.mean()` of either is the overall value."""

    recall: np.ndarray
    density: np.ndarray


def coverage(q: jax.Array, k: jax.Array, mask: jax.Array, *, block_size: int,
             causal: bool = True, chunk_bytes: int = 1 << 26) -> Coverage:
    """Recall and density of `mask` for q `[B, Hq, Lq, D]` and k `[B, Hkv, Lk, D]`.

    mask: bool `[B, Hq, ceil(Lq/block_size), ceil(Lk/block_size)]`, as from
    `xattn_estimate` with the same q, k, block_size and causal. q, k: any float dtype
    (computed in float32). Query head h reads key head h // (Hq // Hkv).
    """
    _check(q, k, mask, block_size)
    b, hq, lq, _ = q.shape
    lk_pad = mask.shape[-1] * block_size
    rows = max(1, min(lq, chunk_bytes // (4 * b * hq * lk_pad)))
    mass = _selected_mass(q, k, mask, block_size=block_size, causal=bool(causal), rows=rows)
    recall = np.asarray(mass, np.float64)[:, :, :lq].mean(axis=(0, 2))
    return Coverage(recall, density(mask, causal=causal))


def density(mask: jax.Array, *, causal: bool = True) -> np.ndarray:
    """float64 `[Hq]`: selected allowed blocks / allowed blocks, for mask bool `[B, Hq, qb, kb]`."""
    _, allowed = forced_and_allowed(*mask.shape[-2:], causal=causal, keep_sink=False,
                                    keep_recent=False)
    allowed = np.asarray(allowed)
    selected = (np.asarray(mask) & allowed).sum(axis=(0, 2, 3))
    return selected / (mask.shape[0] * allowed.sum())


def _check(q, k, mask, block_size: int) -> None:
    if any(getattr(x, "ndim", None) != 4 for x in (q, k, mask)):
        raise ValueError(f"q, k and mask must have rank 4, got shapes "
                         f"{[getattr(x, 'shape', None) for x in (q, k, mask)]}")
    (b, hq, lq, d), (bk, hkv, lk, dk) = q.shape, k.shape
    if b != bk or d != dk or hq % hkv or lq > lk:
        raise ValueError(f"q {q.shape} and k {k.shape} do not fit together "
                         f"(need the same batch and head_dim, Hq % Hkv == 0, Lq <= Lk)")
    expected = (b, hq, math.ceil(lq / block_size), math.ceil(lk / block_size))
    if tuple(mask.shape) != expected:
        raise ValueError(f"mask must have shape {expected} for q {q.shape}, k {k.shape} and "
                         f"block_size {block_size}, got {tuple(mask.shape)}")


@functools.partial(jax.jit, static_argnames=("block_size", "causal", "rows"))
def _selected_mass(q, k, mask, *, block_size: int, causal: bool, rows: int) -> jax.Array:
    """float32 `[B, Hq, Lq_pad]`: each query token's attention mass in its selected blocks.

    Lq_pad is Lq rounded up to a multiple of `rows`, the query rows per chunk; padded rows
    give 0.
    """
    b, hq, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    qb, kb = mask.shape[-2:]
    chunks = cdiv(lq, rows)
    q = jnp.pad(q.astype(jnp.float32), ((0, 0), (0, 0), (0, chunks * rows - lq), (0, 0)))
    q = q.reshape(b, hkv, hq // hkv, chunks, rows, d).transpose(3, 0, 1, 2, 4, 5)
    k = jnp.pad(k.astype(jnp.float32), ((0, 0), (0, 0), (0, kb * block_size - lk), (0, 0)))
    keys = jnp.arange(kb * block_size)

    def one_chunk(args):
        q_chunk, first = args  # [B, Hkv, group, rows, D], index of the chunk's first row
        pos = first + jnp.arange(rows)  # query rows
        logits = jnp.einsum("bhgrd,bhkd->bhgrk", q_chunk, k,
                            precision=jax.lax.Precision.HIGHEST) / math.sqrt(d)
        seen = keys[None, :] < lk
        if causal:
            seen = seen & (keys[None, :] <= pos[:, None] + (lk - lq))
        p = jax.nn.softmax(jnp.where(seen, logits, -jnp.inf), axis=-1)
        per_block = p.reshape(b, hq, rows, kb, block_size).sum(axis=-1)
        selected = mask[:, :, jnp.minimum(pos // block_size, qb - 1)]  # [B, Hq, rows, kb]
        mass = jnp.where(selected, per_block, 0.0).sum(axis=-1)
        return jnp.where(pos < lq, mass, 0.0)

    mass = jax.lax.map(one_chunk, (q, jnp.arange(chunks) * rows))  # [chunks, B, Hq, rows]
    return mass.transpose(1, 2, 0, 3).reshape(b, hq, chunks * rows)
