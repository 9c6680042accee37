"""Plain-JAX reference of the estimate: the source of truth for every kernel.

One function per section of docs/estimate.md, float32 throughout, written for reading rather
than speed. It pads only to a whole stride group (never to a whole block), so it shows
directly that block padding changes nothing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from xattn_jax.geometry import Geometry

_HIGHEST = jax.lax.Precision.HIGHEST


def _pad_to_stride(x: jax.Array, stride: int) -> jax.Array:
    pad = -x.shape[2] % stride
    return jnp.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0)))


def strided_scores(q: jax.Array, k: jax.Array, geom: Geometry, norm: float) -> jax.Array:
    """Section 1: antidiagonal scores A, float32 `[B, Hq, q_rows, k_cols]`.

    A[i, j] = sum_s q[i*S + (S-1-s)] . k[j*S + s] / (sqrt(D) * S * norm); a partly filled
    last stride group reads zeros for its missing tokens.
    """
    s, g = geom.stride, geom.group
    q = _pad_to_stride(q, s)
    k = _pad_to_stride(k, s)
    b, hq, lq, d = q.shape
    # One antidiagonal per S x S tile: query group forward, key group read in reverse
    # (the same pairs as the query group reversed; q, the larger, is only reshaped).
    q_rows = q.reshape(b, geom.kv_heads, g, lq // s, s * d)
    k_cols = k.reshape(b, geom.kv_heads, k.shape[2] // s, s, d)[:, :, :, ::-1, :]
    k_cols = k_cols.reshape(b, geom.kv_heads, k.shape[2] // s, s * d)
    # 4-byte inputs need HIGHEST; 2-byte inputs' products are exact in float32 anyway
    precision = _HIGHEST if q.dtype.itemsize >= 4 else None
    a = jnp.einsum("bhgid,bhjd->bhgij", q_rows, k_cols,
                   preferred_element_type=jnp.float32, precision=precision)
    return a.reshape(b, hq, lq // s, -1) * jnp.float32(geom.scale / norm)


def visible(geom: Geometry, causal: bool, key_cols=None, row_offset=None) -> jax.Array:
    """Section 2: bool `[q_rows, k_cols]`, which key columns each query row may see.

    key_cols: the columns holding real keys (a traced int allowed), default all.
    row_offset: the key column of query row 0 (a traced int allowed), default
    `geom.row_offset`: (Lk - Lq) / S.
    """
    i = jnp.arange(geom.q_rows)[:, None]
    j = jnp.arange(geom.k_cols)[None, :]
    seen = j < (geom.k_cols if key_cols is None else key_cols)
    offset = geom.row_offset if row_offset is None else row_offset
    return seen & (j <= i + offset) if causal else seen


def softmax_block_sums(scores: jax.Array, geom: Geometry, causal: bool,
                       key_cols=None, row_offset=None, real_rows=None) -> jax.Array:
    """Sections 2-3: row softmax over the visible columns, summed per block.

    scores: float32 `[B, Hq, q_rows, k_cols]`. Returns float32
    `[B, Hq, q_blocks, k_blocks]`; each full query block's row sums to block_size / S.
    key_cols, row_offset: as in `visible`. real_rows: bool `[q_rows]`, the rows holding a
    query (default all): the others add nothing.
    """
    p = jax.nn.softmax(jnp.where(visible(geom, causal, key_cols, row_offset), scores,
                                 -jnp.inf), axis=-1)
    if real_rows is not None:
        p = jnp.where(real_rows[:, None], p, 0.0)
    n = geom.block_rows
    pad_rows = geom.q_blocks * n - geom.q_rows
    pad_cols = geom.k_blocks * n - geom.k_cols
    p = jnp.pad(p, ((0, 0), (0, 0), (0, pad_rows), (0, pad_cols)))
    b, h = p.shape[:2]
    return p.reshape(b, h, geom.q_blocks, n, geom.k_blocks, n).sum(axis=(3, 5))


def forced_and_allowed(q_blocks: int, k_blocks: int, *, causal: bool, keep_sink: bool,
                       keep_recent: bool, diagonal=None) -> tuple[jax.Array, jax.Array]:
    """Section 4's fixed rules, bool `[q_blocks, k_blocks]` each.

    forced: always selected (key block 0 and the diagonal block I + kb - qb, in causal mode
    or when asked for). allowed: may be selected at all (causal: not after the diagonal).
    diagonal: int `[q_blocks]`, each row's diagonal key block where it is not
    I + kb - qb (the rows of a ragged step, "Ragged steps").
    """
    j = jnp.arange(k_blocks)[None, :]
    if diagonal is None:
        diagonal = jnp.arange(q_blocks) + (k_blocks - q_blocks)
    diagonal = diagonal[:, None]
    forced = ((j == 0) & (causal or keep_sink)) | ((j == diagonal) & (causal or keep_recent))
    allowed = (j <= diagonal) if causal else jnp.ones_like(forced)
    return forced, allowed


def take_descending(values: jax.Array, candidate: jax.Array, base: jax.Array,
                    target: jax.Array) -> jax.Array:
    """The threshold rule along the last axis: bool, the shape of `values`.

    Candidates are taken in descending order of value (ties: lower index first) while
    `base` + the value taken before them is below `target` (base and target broadcast
    against values[..., :1]).
    """
    candidate = jnp.broadcast_to(candidate, values.shape)
    order = jnp.argsort(-jnp.where(candidate, values, -1.0), axis=-1, stable=True)
    ranked = jnp.take_along_axis(jnp.where(candidate, values, 0.0), order, axis=-1)
    running = jnp.cumsum(ranked, axis=-1)
    before = jnp.concatenate([jnp.zeros_like(running[..., :1]), running[..., :-1]], axis=-1)
    take_ranked = jnp.take_along_axis(candidate, order, axis=-1) & (base + before < target)
    return jnp.take_along_axis(take_ranked, jnp.argsort(order, axis=-1), axis=-1)


def select_blocks(block_sums: jax.Array, threshold: jax.Array, *, causal: bool,
                  keep_sink: bool = False, keep_recent: bool = False,
                  diagonal=None) -> jax.Array:
    """Section 4: the smallest set of key blocks per row reaching `threshold` of the mass.

    block_sums: float32 `[B, Hq, qb, kb]`; threshold: float32 `[Hq]`. Returns bool
    `[B, Hq, qb, kb]`. Forced blocks count towards the threshold; the others are taken in
    descending order (ties: lower index first) while the selected total is below
    threshold * row total. A threshold of 1 or more, and a row whose total is not finite
    (NaN or inf in q or k), select every allowed block, so nothing is dropped silently.
    diagonal: as in `forced_and_allowed`.
    """
    qb, kb = block_sums.shape[-2:]
    forced, allowed = forced_and_allowed(qb, kb, causal=causal, keep_sink=keep_sink,
                                         keep_recent=keep_recent, diagonal=diagonal)
    total = block_sums.sum(axis=-1, keepdims=True)
    forced_mass = jnp.where(forced, block_sums, 0.0).sum(axis=-1, keepdims=True)
    take = take_descending(block_sums, allowed & ~forced, forced_mass,
                           threshold[None, :, None, None] * total)
    keep_all = ~jnp.isfinite(total) | (threshold[None, :, None, None] >= 1)
    return jnp.where(keep_all, allowed, forced | take)


def widen(mask: jax.Array, block_sums: jax.Array, *, causal: bool, min_blocks: int,
          dense_last: int, diagonal=None) -> jax.Array:
    """Section 4's widening of a selected mask: bool `[B, Hq, qb, kb]`, at least `mask`.

    Each row also keeps its `min_blocks` highest-scoring allowed blocks (`block_sums`,
    float32 `[B, Hq, qb, kb]`; equal sums: lower index first), and the rows of the last
    `dense_last` query blocks keep every allowed block. diagonal: as in
    `forced_and_allowed`.
    """
    qb, kb = block_sums.shape[-2:]
    _, allowed = forced_and_allowed(qb, kb, causal=causal, keep_sink=False,
                                    keep_recent=False, diagonal=diagonal)
    count = min(min_blocks, kb)
    if count:
        scores = jnp.where(allowed, jnp.nan_to_num(block_sums, nan=0.0), -1.0)
        _, top = jax.lax.top_k(scores, count)  # [B, Hq, qb, count]
        picked = (top[..., None] == jnp.arange(kb)).any(axis=-2)
        mask = mask | (picked & allowed)
    if dense_last:
        mask = mask | (allowed & (jnp.arange(qb)[:, None] >= qb - dense_last))
    return mask


def block_sums(q: jax.Array, k: jax.Array, geom: Geometry, *, causal: bool,
               norm: float, key_len=None) -> jax.Array:
    """Sections 1-3 for q `[B, Hq, Lq, D]`, k `[B, Hkv, Lk, D]`: float32 block sums.

    key_len: the keys in use when k is a buffer padded to a capacity (a traced int
    allowed; default all): later tokens act as padding.
    """
    if key_len is None:
        return softmax_block_sums(strided_scores(q, k, geom, norm), geom, causal)
    k = jnp.where(jnp.arange(geom.k_len)[:, None] < key_len, k, 0)
    key_cols = (key_len + geom.stride - 1) // geom.stride
    return softmax_block_sums(strided_scores(q, k, geom, norm), geom, causal, key_cols)
