"""An independent float64 numpy model of docs/estimate.md section 6 (block-sparse attention).

Written from the spec, not from `xattn_jax.reference.attention`, and unlike it: the whole
`[Lq, Lk]` matrix of allowed pairs is built at once (the mask repeated to tokens), key
heads are repeated for GQA, and the softmax is an ordinary dense one in float64.
"""

from __future__ import annotations

import numpy as np

from np_reference import f64


def allowed_pairs(mask, *, q_len: int, k_len: int, block_size: int, causal: bool,
                  n_keys: int | None = None) -> np.ndarray:
    """bool `[B, Hq, Lq, Lk]`: query row i may attend to key j (mask None: every block)."""
    n = k_len if n_keys is None else n_keys
    i = np.arange(q_len)[:, None]
    j = np.arange(k_len)[None, :]
    ok = j < n
    if causal:
        ok = ok & (j <= i + n - q_len)
    if mask is None:
        return ok[None, None]
    tokens = np.repeat(np.repeat(np.asarray(mask), block_size, axis=2), block_size, axis=3)
    return tokens[:, :, :q_len, :k_len] & ok


def attention(q, k, v, mask, *, block_size: int, causal: bool, scale: float | None = None,
              n_keys: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(out float64 `[B, Hq, Lq, Dv]`, lse float64 `[B, Hq, Lq]`); rows with no allowed
    key give zeros and -inf."""
    q, k, v = f64(q), f64(k), f64(v)
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    ok = allowed_pairs(mask, q_len=q.shape[2], k_len=k.shape[2], block_size=block_size,
                       causal=causal, n_keys=n_keys)
    return masked_softmax_attention(np.einsum("bhqd,bhkd->bhqk", q, k) * scale, ok, v)


def masked_softmax_attention(scores, allowed, v) -> tuple[np.ndarray, np.ndarray]:
    """(out, lse) of the softmax over the allowed entries of float64 `scores` `[.., rows,
    keys]` applied to v `[.., keys, Dv]`; rows with nothing allowed give zeros and -inf."""
    scores = np.where(allowed, scores, -np.inf)
    top = scores.max(axis=-1, keepdims=True, initial=-np.inf)
    weights = np.exp(scores - np.where(np.isfinite(top), top, 0.0))
    total = weights.sum(axis=-1, keepdims=True)
    out = (weights / np.where(total > 0, total, 1.0)) @ v
    with np.errstate(divide="ignore"):
        lse = (np.log(total) + top)[..., 0]
    return out, lse


def random_mask(rng: np.random.Generator, shape, *, density: float,
                empty_rows: float = 0.0) -> np.ndarray:
    """bool `shape` with about `density` of blocks true and about `empty_rows` of the
    query-block rows all false."""
    mask = rng.random(shape) < density
    empty = rng.random(shape[:3]) < empty_rows
    return mask & ~empty[..., None]
