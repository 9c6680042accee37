"""Argument checks of `ragged_xattention` (the rules of docs/estimate.md "Ragged steps").

As everywhere in xattn_jax (`xattn_jax.checks`): shapes, dtypes and Python values are
checked on the host before any work, each refusal naming the argument and the rule. The
step's offsets and page table are data: read on the host where that costs no wait (numpy,
lists, arrays on the CPU), otherwise checked only in checked mode (`xattn_jax.checked`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from xattn_jax.checks import (SUPPORTED_DTYPES, check_array, check_int, check_tokens,
                              check_traced, readable_on_host)
from xattn_jax.ragged.geometry import RaggedGeometry

Q_LAYOUT = "[tokens, q_heads, head_dim]"
CACHE_LAYOUT = "[num_pages, page_size, kv_heads, head_dim]"
FUSED_LAYOUT = "[num_pages, page_size, 2 * kv_heads, head_dim] (K head h at 2h, V at 2h + 1)"


def _int_array(name: str, x, layout: str, shape: tuple[int, ...] | None = None):
    """An integer array (jax, numpy or a list) of `layout`'s rank, as a jax.Array or a
    numpy int32 array."""
    if isinstance(x, (list, tuple)):
        try:
            x = np.asarray(x)
        except ValueError:
            raise TypeError(f"{name} must be integers {layout}, got a ragged list") from None
    check_array(name, x, layout)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(f"{name} must be integers {layout}, got dtype {x.dtype}")
    if shape is not None and tuple(x.shape) != shape:
        raise ValueError(f"{name} must have shape {shape} {layout}, got {tuple(x.shape)}")
    return x if isinstance(x, jax.Array) else np.asarray(x, np.int32)


def _count(name: str, value, limit: int, rule: str):
    """An int in [0, limit] (checked now; returned as numpy int32) or an integer scalar
    jax.Array (as int32, checked in checked mode)."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)):
        if not 0 <= value <= limit:
            raise ValueError(f"{name} must lie in [0, {limit}] ({rule}), got {value}")
        return np.int32(value)
    if not isinstance(value, jax.Array) or value.ndim or \
            not jnp.issubdtype(value.dtype, jnp.integer):
        raise TypeError(f"{name} must be an int or an integer scalar jax.Array, got "
                        f"{value!r} ({type(value).__name__})")
    value = value.astype(jnp.int32)
    check_traced(lambda n: (n >= 0) & (n <= limit),
                 f"{name} must lie in [0, {limit}] ({rule}), got {{}}", value)
    return value


def check_caches(q, k, v) -> tuple[int, int, int, int, bool]:
    """q `[T, Hq, D]` and the caches: separate k, v `[num_pages, page_size, Hkv, D/Dv]`,
    or (v None) one fused cache. Returns (Hkv, D, Dv, page_size, fused)."""
    check_array("q", q, Q_LAYOUT)
    if jnp.dtype(q.dtype) not in SUPPORTED_DTYPES:
        raise ValueError(f"q must be float32, bfloat16 or float16, got {q.dtype}")
    if 0 in q.shape:
        raise ValueError(f"q must be non-empty {Q_LAYOUT}, got shape {q.shape}")
    fused = v is None
    check_array("k", k, FUSED_LAYOUT if fused else CACHE_LAYOUT)
    caches = (("k", k),) if fused else (("k", k), ("v", v))
    if not fused:
        check_array("v", v, "[num_pages, page_size, kv_heads, value_dim]")
    for name, x in caches:
        if x.dtype != q.dtype:
            raise ValueError(f"{name} must have q's dtype {q.dtype}, got {x.dtype}")
        if 0 in x.shape:
            raise ValueError(f"{name} must be non-empty, got shape {x.shape}")
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k must have q's head_dim {q.shape[-1]}, got shape {k.shape}")
    if not fused and v.shape[:3] != k.shape[:3]:
        raise ValueError(f"v must have k's pages, page size and heads {k.shape[:3]} (only "
                         f"its last dimension may differ), got shape {v.shape}")
    heads = k.shape[2]
    if fused and heads % 2:
        raise ValueError(f"k, a fused cache {FUSED_LAYOUT} (v=None), must have an even "
                         f"head axis, got shape {k.shape}")
    kv_heads = heads // 2 if fused else heads
    if q.shape[1] % kv_heads:
        raise ValueError(f"the query heads of q ({q.shape[1]}) must be a multiple of the "
                         f"cache's KV heads ({kv_heads})")
    value_dim = k.shape[-1] if fused else v.shape[-1]
    return kv_heads, q.shape[-1], value_dim, k.shape[1], fused


def check_step(q, k, v, kv_lens, page_indices, cu_q_lens, num_seqs, decode_seqs, *,
               block_size, stride):
    """Every argument of a step. Returns (geometry, kv_lens, page_indices, cu_q_lens,
    num_seqs, decode_seqs), the last five as int32 arrays."""
    stride = check_tokens("stride", stride)
    block_size = check_tokens("block_size", block_size, stride, "stride")
    kv_heads, head_dim, value_dim, page_size, fused = check_caches(q, k, v)
    kv_lens = _int_array("kv_lens", kv_lens, "[seqs]")
    seqs = kv_lens.shape[0]
    if seqs < 1:
        raise ValueError("kv_lens must hold at least one sequence slot, got shape (0,)")
    page_indices = _int_array("page_indices", page_indices, "[seqs, pages_per_seq]")
    if page_indices.shape[0] != seqs or page_indices.shape[1] < 1:
        raise ValueError(f"page_indices must have one row per sequence slot ({seqs}) and "
                         f"at least one column, got shape {tuple(page_indices.shape)}")
    cu_q_lens = _int_array("cu_q_lens", cu_q_lens, "[seqs + 1]", (seqs + 1,))
    num_seqs = _count("num_seqs", num_seqs, seqs, "the sequence slots of kv_lens")
    decode_seqs = np.int32(0) if decode_seqs is None else _count(
        "decode_seqs", decode_seqs, seqs, "leading sequences of one query each")
    geom = RaggedGeometry(
        tokens=q.shape[0], seqs=seqs, q_heads=q.shape[1], kv_heads=kv_heads,
        head_dim=head_dim, value_dim=value_dim, num_pages=k.shape[0], page_size=page_size,
        pages_per_seq=page_indices.shape[1], block_size=block_size, stride=stride,
        fused=fused)
    arrays = (kv_lens, page_indices, cu_q_lens, num_seqs, decode_seqs)
    if all(isinstance(x, np.generic) or readable_on_host(x) for x in arrays):
        for message in _violations(*(np.asarray(x) for x in arrays), geom):
            raise ValueError(message)
    else:
        check_traced(lambda *xs: _step_holds(*xs, geom), _STEP_RULE,
                     *(jnp.asarray(x) for x in arrays))
    return (geom, *arrays)


_STEP_RULE = ("the step's offsets break the rules (cu_q_lens starts at 0, does not "
              "decrease, stays within q's rows; 0 <= q_len <= kv_len <= capacity; the "
              "pages in use lie in the cache; decode_seqs <= num_seqs, each of one query):"
              " kv_lens {}, page_indices {}, cu_q_lens {}, num_seqs {}, decode_seqs {}")


def _step_holds(kv_lens, page_indices, cu_q_lens, num_seqs, decode_seqs, geom):
    """Every rule of the step at once, on device arrays (checked mode)."""
    return ~_rule_failures(jnp, kv_lens, page_indices, cu_q_lens, num_seqs, decode_seqs,
                           geom).any()


def _rule_failures(xp, kv_lens, page_indices, cu_q_lens, num_seqs, decode_seqs, geom):
    """bool `[6]`: which rule fails, in the order of `_violations`' messages."""
    slot = xp.arange(geom.seqs)
    live = slot < num_seqs
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    kv_lens = kv_lens.astype(xp.int64 if xp is np else xp.int32)
    pages_in_use = (kv_lens[:, None] + geom.page_size - 1) // geom.page_size
    in_use = live[:, None] & (xp.arange(geom.pages_per_seq)[None, :] < pages_in_use)
    bad_page = in_use & ((page_indices < 0) | (page_indices >= geom.num_pages))
    return xp.stack([
        (cu_q_lens[0] != 0) | (live & (q_lens < 0)).any(),
        cu_q_lens[num_seqs] > geom.tokens,
        (live & (q_lens > kv_lens)).any(),
        (live & (kv_lens > geom.capacity)).any(),
        bad_page.any(),
        (decode_seqs > num_seqs) | ((slot < decode_seqs) & (q_lens != 1)).any(),
    ])


def _violations(kv_lens, page_indices, cu_q_lens, num_seqs, decode_seqs, geom):
    """The messages of the rules the host values break (empty when they keep them)."""
    failures = _rule_failures(np, kv_lens, page_indices, cu_q_lens, int(num_seqs),
                              int(decode_seqs), geom)
    n = int(num_seqs)
    messages = (
        f"cu_q_lens must start at 0 and not decrease over the {n} live sequences, got "
        f"{cu_q_lens.tolist()}",
        f"cu_q_lens[num_seqs] must be at most q's {geom.tokens} rows, got "
        f"{int(cu_q_lens[n])}",
        f"each live sequence's queries (cu_q_lens[s+1] - cu_q_lens[s]) must be at most its "
        f"kv_lens[s] (the queries are the last of its keys), got q_lens "
        f"{(cu_q_lens[1:n + 1] - cu_q_lens[:n]).tolist()} and kv_lens {kv_lens[:n].tolist()}",
        f"kv_lens must be at most the page table's capacity pages_per_seq * page_size = "
        f"{geom.capacity}, got {kv_lens[:n].tolist()}",
        f"page_indices must hold page ids in [0, {geom.num_pages}) (the cache's pages) for "
        f"every page a live sequence uses",
        f"decode_seqs must be at most num_seqs ({n}) and each of those sequences must have "
        f"one query, got decode_seqs {int(decode_seqs)}",
    )
    return [m for m, failed in zip(messages, failures) if failed]
