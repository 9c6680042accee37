"""ESTIMATE.md section 5: chunked-prefill scores and selection over KV-cache blocks.

A serving engine prefills a chunk of queries against the keys cached before it, held in
a buffer padded to a capacity. `kv_block_scores` gives, per KV-cache block, the softmax
mass the chunk's queries put on it: block sums at a small `estimate_block_size` (where the
kernel is fast), summed over the chunk's query blocks and up to `kv_block_size`
(hierarchical sums, equal to the direct computation). The number of cached keys `k_len`
is data, so one compiled function serves every chunk of a growing context.
`select_kv_blocks` picks the blocks to load from those scores.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from xattn_jax import reference
from xattn_jax.api import resolve_backend
from xattn_jax.geometry import Geometry, check_norm, check_qk
from xattn_jax.triton import block_sums as pallas_block_sums

RULES = ("score", "vote")


def _check_sizes(kv_block_size, estimate_block_size, stride) -> None:
    for name, value in (("kv_block_size", kv_block_size),
                        ("estimate_block_size", estimate_block_size)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if kv_block_size % estimate_block_size:
        raise ValueError(f"estimate_block_size ({estimate_block_size}) must divide "
                         f"kv_block_size ({kv_block_size})")


def _key_len(k_len, capacity: int):
    """k_len checked: a Python int (checked against the buffer's capacity) or a scalar
    jax.Array, passed to the jitted function as is (it casts to int32 there: converting
    on the host costs ~20 us per call)."""
    if k_len is None:
        return capacity
    if isinstance(k_len, (int, np.integer)) and not isinstance(k_len, bool):
        if not 1 <= k_len <= capacity:
            raise ValueError(f"k_len must lie in [1, {capacity}] (k's length), got {k_len}")
        return int(k_len)
    if not isinstance(k_len, jax.Array) or k_len.ndim:
        raise ValueError(f"k_len must be an int or a scalar jax.Array, got {k_len!r}")
    return k_len


def _sum_groups(x: jax.Array, axis: int, size: int) -> jax.Array:
    """Sums consecutive groups of `size` along `axis`, zero-padding the last group."""
    groups = -(-x.shape[axis] // size)
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, groups * size - x.shape[axis])
    x = jnp.pad(x, pad)
    return x.reshape(*x.shape[:axis], groups, size, *x.shape[axis + 1:]).sum(axis=axis + 1)


def gather_pages(pages: jax.Array, block_table: jax.Array) -> jax.Array:
    """A paged cache `[num_pages, page_size, Hkv, D]` read through `block_table`
    (int32 `[B, pages_per_seq]`) as contiguous keys `[B, Hkv, pages_per_seq * page_size, D]`
    (a copy: for the reference and for tests)."""
    b, per_seq = block_table.shape
    keys = pages[block_table]  # [B, pages_per_seq, page_size, Hkv, D]
    keys = keys.reshape(b, per_seq * pages.shape[1], *pages.shape[2:])
    return keys.transpose(0, 2, 1, 3)


def _paged_view(q, pages, block_table) -> jax.ShapeDtypeStruct:
    """Checks a paged cache and its block table; returns the contiguous keys' shape."""
    if getattr(pages, "ndim", None) != 4:
        raise ValueError(f"k must be a paged cache [num_pages, page_size, Hkv, D] when "
                         f"block_table is given, got shape {getattr(pages, 'shape', None)}")
    if getattr(block_table, "ndim", None) != 2 or not jnp.issubdtype(block_table.dtype,
                                                                     jnp.integer):
        raise ValueError(f"block_table must be integers [batch, pages_per_seq], got "
                         f"{getattr(block_table, 'dtype', None)} "
                         f"{getattr(block_table, 'shape', None)}")
    if block_table.shape[0] != q.shape[0]:
        raise ValueError(f"block_table must have one row per batch element ({q.shape[0]}), "
                         f"got {block_table.shape[0]}")
    _, page_size, kv_heads, head_dim = pages.shape
    return jax.ShapeDtypeStruct((q.shape[0], kv_heads, block_table.shape[1] * page_size,
                                 head_dim), pages.dtype)


@functools.partial(jax.jit, static_argnames=("geom", "norm", "per_kv_block",
                                             "per_query_block", "backend"))
def _kv_scores(q, k, key_len, block_table, *, geom: Geometry, norm: float, per_kv_block: int,
               per_query_block: bool, backend: str):
    key_len = jnp.asarray(key_len, jnp.int32)
    if block_table is not None:
        block_table = block_table.astype(jnp.int32)
    if backend == "reference":
        keys = k if block_table is None else gather_pages(k, block_table)
        sums = reference.block_sums(q, keys, geom, causal=False, norm=norm, key_len=key_len)
    else:
        sums = pallas_block_sums.block_sums(q, k, geom=geom, causal=False, norm=norm,
                                            key_len=key_len.reshape(1),
                                            block_table=block_table,
                                            interpret=backend == "interpret")
    rows = _sum_groups(sums, 2, per_kv_block) if per_query_block else sums.sum(axis=2)
    return _sum_groups(rows, rows.ndim - 1, per_kv_block)


def kv_block_scores(q: jax.Array, k: jax.Array, *, kv_block_size: int = 4096,
                    estimate_block_size: int = 1024, stride: int = 8, norm: float = 1.0,
                    k_len=None, block_table=None, per_query_block: bool = False,
                    impl: str = "auto") -> jax.Array:
    """Softmax mass of a chunk's queries in each KV-cache block: float32 `[B, Hq, n]`.

    q: the chunk `[B, Hq, Lq, D]`, all of it after every cached key (no causal mask).
    k: the cached keys `[B, Hkv, capacity, D]`, Lq <= capacity; only the first `k_len`
      hold keys (an int, or a traced int32 scalar: new values do not recompile). Or, with
      `block_table` (int32 `[B, pages_per_seq]`), a paged cache `[num_pages, page_size,
      Hkv, D]` (the layout of vLLM and nano-vllm), whose sequence b is the pages
      block_table[b] in order (capacity = pages_per_seq * page_size); the kernel reads
      the pages through the table, with no gathered copy.
    n = ceil(capacity / kv_block_size); blocks past k_len score 0. A head's scores sum to
    ceil(Lq / stride): each reshaped query row's softmax sums to 1. estimate_block_size
    must be a multiple of stride and divide kv_block_size; the result equals the direct
    computation at kv_block_size. per_query_block keeps the chunk's query blocks (of
    kv_block_size tokens): `[B, Hq, ceil(Lq / kv_block_size), n]`, the rows of the "vote"
    rule of `select_kv_blocks`.
    """
    _check_sizes(kv_block_size, estimate_block_size, stride)
    keys = k if block_table is None else _paged_view(q, k, block_table)
    geom = check_qk(q, keys, stride=stride, block_size=estimate_block_size, causal=False)
    return _kv_scores(q, k, _key_len(k_len, geom.k_len), block_table, geom=geom,
                      norm=check_norm(norm),
                      per_kv_block=kv_block_size // estimate_block_size,
                      per_query_block=bool(per_query_block), backend=resolve_backend(impl))


def _valid_counts(num_valid, batch: int, blocks: int):
    """Blocks in use (the first num_valid are), checked: a Python int, or ints of shape
    [] or [B], broadcast to int32 `[B]` inside the jitted function (no host conversion)."""
    if num_valid is None:
        return blocks
    if isinstance(num_valid, (int, np.integer)) and not isinstance(num_valid, bool):
        if not 1 <= num_valid <= blocks:
            raise ValueError(f"num_valid must lie in [1, {blocks}], got {num_valid}")
        return int(num_valid)
    if getattr(num_valid, "shape", None) not in ((), (batch,)):
        raise ValueError(f"num_valid must be an int, or ints of shape [] or [{batch}], got "
                         f"{num_valid!r}")
    return num_valid


def _check_groups(heads: int, per_kv_head: bool, kv_heads) -> int:
    """G: the selection's groups of query heads (kv_heads of them, or 1)."""
    if not per_kv_head:
        return 1
    if not isinstance(kv_heads, (int, np.integer)) or kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"per_kv_head=True needs kv_heads, a divisor of the {heads} query "
                         f"heads, got {kv_heads!r}")
    return int(kv_heads)


@functools.partial(jax.jit, static_argnames=("rule", "groups", "keep_first", "keep_last",
                                             "per_kv_head"))
def _select_kv(scores, counts, threshold, *, rule: str, groups: int, keep_first: bool,
               keep_last: bool, per_kv_head: bool):
    """scores `[B, Hq, n]` (score) or `[B, Hq, R, n]` (vote); counts ints `[]` or `[B]`.
    Returns bool `[B, G, n]` per KV head, else `[B, n]`."""
    counts = jnp.broadcast_to(jnp.asarray(counts, jnp.int32), scores.shape[:1])
    scores = scores.astype(jnp.float32)
    groups = scores.reshape(scores.shape[0], groups, -1, *scores.shape[2:])
    j = jnp.arange(scores.shape[-1])
    valid = j[None, None, :] < counts[:, None, None]  # [B, 1, n]
    if rule == "score":
        mass, ok = groups.mean(axis=2), valid
    else:
        mass, ok = groups, valid[:, :, None, None, :]
    mass = jnp.where(ok, mass, 0.0)
    total = mass.sum(axis=-1, keepdims=True)
    take = reference.take_descending(mass, ok, jnp.zeros_like(total), threshold * total)
    take = jnp.where(jnp.isfinite(total) & (total > 0), take, ok)
    if rule == "vote":  # strict majority of the group's rows (query heads x query blocks)
        take = take.sum(axis=(2, 3)) * 2 > take.shape[2] * take.shape[3]
    last = valid.sum(axis=-1, keepdims=True) - 1
    keep = ((j == 0) & keep_first) | ((j == last) & keep_last)
    mask = (take | keep) & valid
    return mask if per_kv_head else mask[:, 0]


def select_kv_blocks(scores: jax.Array, *, threshold: float = 0.95, keep_first: bool = True,
                     keep_last: bool = True, per_kv_head: bool = False, kv_heads=None,
                     num_valid=None, rule: str = "score") -> jax.Array:
    """KV-cache blocks to load for a chunk: bool `[B, n]`, or `[B, Hkv, n]` per KV head.

    scores: `[B, Hq, n]` from `kv_block_scores` (rule "score"), or per query block
      `[B, Hq, R, n]` (rule "vote": block sums of the chunk's R query blocks).
    threshold: share of the mass to keep, in (0, 1].
    per_kv_head: select once per KV head (`kv_heads` of them) from its query heads, the
      union a KV head's attention needs; otherwise once for all heads.
    num_valid: KV blocks in use, an int or `[B]` ints (may be traced; default n). Later
      blocks are never selected.
    rule "score": average over the group's heads, take blocks in descending order (ties:
      lower index first) until the cumulative share of the valid mass reaches threshold.
    rule "vote" (the engine's earlier rule, kept for comparison): each row (query head,
      query block) keeps its smallest set reaching the threshold; a block is selected by a
      strict majority of the group's rows.
    keep_first / keep_last then add block 0 (attention sink) and the last valid block
    (most recent context); they do not count towards the threshold. A group or row whose
    mass is not finite or not positive keeps every valid block.
    """
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    want = 3 if rule == "score" else 4
    if getattr(scores, "ndim", None) != want:
        raise ValueError(f"rule={rule!r} takes scores of rank {want}, got shape "
                         f"{getattr(scores, 'shape', None)}")
    if isinstance(threshold, bool) or not 0 < float(threshold) <= 1:
        raise ValueError(f"threshold must lie in (0, 1], got {threshold!r}")
    batch, blocks = scores.shape[0], scores.shape[-1]
    return _select_kv(scores, _valid_counts(num_valid, batch, blocks), np.float32(threshold),
                      rule=rule, groups=_check_groups(scores.shape[1], per_kv_head, kv_heads),
                      keep_first=bool(keep_first), keep_last=bool(keep_last),
                      per_kv_head=bool(per_kv_head))
