"""docs/estimate.md section 6 in plain JAX: attention over the key blocks a block mask allows.

Memory-lean: the queries are taken in chunks of rows and the keys in tiles of whole blocks,
with an online softmax (running maximum, running sum and output accumulator per row), so
no array of size Lq x Lk exists; the largest temporary is one step's float32 scores
`[B, Hq, rows, keys]`, at most `SCORE_STEP_BYTES`. The block mask is expanded one key tile
at a time. Nothing is skipped: every (chunk, tile) pair is computed and the pairs the mask,
the causal rule or the key count exclude are replaced by -inf with `where` (never a
product), so their keys contribute exactly 0 whatever values they hold.

GQA reads the key heads in place: q is viewed as `[B, Hkv, G, Lq, D]`; k and v are never
repeated. The last query chunk and key tile are clamped to end at Lq and Lk (no padding
copies); keys a clamped tile reads twice are excluded in the second read.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from xattn_jax.geometry import cdiv

KEY_TILE = 512  # keys per online-softmax step, rounded to whole blocks
SCORE_STEP_BYTES = 256 * 2**20  # bound on one step's float32 scores [B, Hq, rows, keys]
MIN_QUERY_CHUNK = 8
_HIGHEST = jax.lax.Precision.HIGHEST


def key_tile(block_size: int, k_len: int) -> int:
    """Keys per step: the multiple of block_size nearest KEY_TILE (at least one block),
    or all of them when there are fewer."""
    return min(k_len, block_size * max(1, round(KEY_TILE / block_size)))


def query_chunk(batch: int, q_heads: int, q_len: int, tile: int) -> int:
    """Query rows per chunk: as many as keep one step's scores within SCORE_STEP_BYTES."""
    rows = SCORE_STEP_BYTES // (4 * batch * q_heads * tile)
    return min(q_len, max(MIN_QUERY_CHUNK, rows))


def _read_keys(x: jax.Array, start, size: int, block_table) -> jax.Array:
    """Key positions [start, start + size) of every sequence: `[B, Hkv, size, last]`.

    x: contiguous `[B, Hkv, L, last]`, or with `block_table` (int `[B, pages_per_seq]`) a
    paged cache `[num_pages, page_size, Hkv, last]` read through the table (any page size).
    """
    if block_table is None:
        return jax.lax.dynamic_slice_in_dim(x, start, size, axis=2)
    page_size = x.shape[1]
    pos = start + jnp.arange(size)
    pages = jnp.take(block_table, pos // page_size, axis=1)  # [B, size]
    return x[pages, (pos % page_size)[None, :]].transpose(0, 2, 1, 3)


def block_sparse_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, *,
                           block_size: int, causal: bool = True, scale: float | None = None,
                           return_lse: bool = False, k_len=None, block_table=None,
                           key_tile_size: int | None = None,
                           query_chunk_size: int | None = None):
    """Section 6: softmax attention over the keys allowed by a block mask.

    Arguments are not checked here (`xattn_jax.block_sparse_attention` checks them).

    Args:
      q: `[B, Hq, Lq, D]`; query row i sits at key position `n - Lq + i`, where n is the
        number of keys in use (`k_len`, default Lk).
      k, v: `[B, Hkv, Lk, D]` and `[B, Hkv, Lk, Dv]`, q's dtype; or, with `block_table`
        (int32 `[B, pages_per_seq]`), paged caches `[num_pages, page_size, Hkv, D]` and
        `[num_pages, page_size, Hkv, Dv]`, sequence b being the pages block_table[b] in
        order (Lk = pages_per_seq * page_size).
      mask: bool `[B, Hq, ceil(Lq / block_size), ceil(Lk / block_size)]`. Row i may attend
        to key j iff mask[b, h, i // block_size, j // block_size], j < n and, if causal,
        j <= i + n - Lq.
      scale: multiplies q.k (default 1 / sqrt(D)).
      k_len: keys in use, Lq <= k_len <= Lk: None (all), an int or an int32 scalar array
        (may be traced). Later keys are never visible, whatever they hold.
      key_tile_size / query_chunk_size: keys per step and query rows per chunk (default
        `key_tile` and `query_chunk`; at most Lk and Lq); they change no result beyond
        float rounding.

    Returns:
      out `[B, Hq, Lq, Dv]` in q's dtype, and with `return_lse` the float32 `[B, Hq, Lq]`
      natural log of each row's softmax denominator (of the scaled scores). A row with no
      allowed key gets zeros and -inf. Scores, softmax and accumulation are float32; the
      softmax weights are rounded to v's dtype before their product with v (as fused
      attention kernels do; nothing is rounded for float32 inputs).

    Non-finite inputs: only keys a row may attend to reach it. A NaN in q, a NaN in an
    allowed key's k, or a score of +inf makes the row NaN (out and lse); a score of -inf
    gives that key weight 0. A NaN or inf anywhere in an allowed key's v makes the row's
    whole output NaN (its lse stays).
    """
    batch, q_heads, q_len, head_dim = q.shape
    if block_table is None:
        kv_heads, capacity = k.shape[1], k.shape[2]
    else:
        kv_heads, capacity = k.shape[2], block_table.shape[1] * k.shape[1]
    group, v_dim = q_heads // kv_heads, v.shape[-1]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    n_keys = capacity if k_len is None else jnp.asarray(k_len, jnp.int32)
    tile = min(capacity, key_tile_size or key_tile(block_size, capacity))
    rows = min(q_len, query_chunk_size or query_chunk(batch, q_heads, q_len, tile))
    q = q.reshape(batch, kv_heads, group, q_len, head_dim)
    mask = mask.reshape(batch, kv_heads, group, *mask.shape[2:])
    lead = (batch, kv_heads, group, rows)
    # 4-byte inputs need HIGHEST (else TF32 on a GPU); 2-byte products are exact in float32
    precision = _HIGHEST if q.dtype.itemsize >= 4 else None
    q_blocks = mask.shape[3]
    chunk_blocks = min(q_blocks, (rows - 1) // block_size + 2)  # query blocks a chunk spans

    def attend_chunk(chunk, results):
        start = jnp.minimum(chunk * rows, q_len - rows)
        q_rows = jax.lax.dynamic_slice_in_dim(q, start, rows, axis=3)
        row = start + jnp.arange(rows)
        row_pos = n_keys - q_len + row  # key position of each query row
        first_block = jnp.minimum(start // block_size, q_blocks - chunk_blocks)
        chunk_mask = jax.lax.dynamic_slice_in_dim(mask, first_block, chunk_blocks, axis=3)
        row_block = row // block_size - first_block  # in chunk_mask

        def step(t, carry):
            run_max, run_sum, acc, bad = carry
            first = t * tile
            tile_start = jnp.minimum(first, capacity - tile)
            pos = tile_start + jnp.arange(tile)
            keys = _read_keys(k, tile_start, tile, block_table)
            values = _read_keys(v, tile_start, tile, block_table)
            allowed = jnp.take(jnp.take(chunk_mask, pos // block_size, axis=4), row_block,
                               axis=3)  # [B, Hkv, G, rows, tile]
            allowed &= ((pos >= first) & (pos < n_keys))[None, :]
            if causal:
                allowed &= pos[None, :] <= row_pos[:, None]
            s = jnp.einsum("bhgqd,bhkd->bhgqk", q_rows, keys, precision=precision,
                           preferred_element_type=jnp.float32)
            s = jnp.where(allowed, s * jnp.float32(scale), -jnp.inf)
            new_max = jnp.maximum(run_max, s.max(axis=-1))
            shift = jnp.where(new_max == -jnp.inf, 0.0, new_max)
            p = jnp.exp(s - shift[..., None])
            rescale = jnp.exp(run_max - shift)
            finite = jnp.isfinite(values)
            pv = jnp.einsum("bhgqk,bhkd->bhgqd", p.astype(v.dtype),
                            jnp.where(finite, values, 0), precision=precision,
                            preferred_element_type=jnp.float32)
            bad_key = ~finite.all(axis=-1)[:, :, None, None, :]  # [B, Hkv, 1, 1, tile]
            return (new_max, run_sum * rescale + p.sum(axis=-1),
                    acc * rescale[..., None] + pv, bad | (allowed & bad_key).any(axis=-1))

        init = (jnp.full(lead, -jnp.inf, jnp.float32), jnp.zeros(lead, jnp.float32),
                jnp.zeros((*lead, v_dim), jnp.float32), jnp.zeros(lead, jnp.bool_))
        run_max, run_sum, acc, bad = jax.lax.fori_loop(0, cdiv(capacity, tile), step, init)
        out = jnp.where(run_sum[..., None] == 0, 0.0, acc / run_sum[..., None])
        out = jnp.where(bad[..., None], jnp.nan, out).astype(results[0].dtype)
        lse = run_max + jnp.log(run_sum)
        return (jax.lax.dynamic_update_slice_in_dim(results[0], out, start, axis=3),
                jax.lax.dynamic_update_slice_in_dim(results[1], lse, start, axis=3))

    results = (jnp.zeros((batch, kv_heads, group, q_len, v_dim), q.dtype),
               jnp.zeros((batch, kv_heads, group, q_len), jnp.float32))
    out, lse = jax.lax.fori_loop(0, cdiv(q_len, rows), attend_chunk, results)
    out = out.reshape(batch, q_heads, q_len, v_dim)
    return (out, lse.reshape(batch, q_heads, q_len)) if return_lse else out
