"""docs/estimate.md section 5: chunked-prefill scores and selection over KV-cache blocks.

A serving engine prefills a chunk of queries against the keys cached before it, held in
a buffer padded to a capacity. `kv_block_scores` gives, per KV-cache block, the softmax
mass the chunk's queries put on it: block sums at a small `estimate_block_size` (where the
kernel is fast), summed over the chunk's query blocks and up to `kv_block_size`
(hierarchical sums, equal to the direct computation). The number of cached keys `k_len`
is data, so one compiled function serves every chunk of a growing context.
`select_kv_blocks` picks the blocks to load from those scores.

Several devices: `kv_block_scores` partitions as `xattn_jax.api` says (a paged cache
shards over its KV-head axis 2, the block table like the batch, and no page moves);
`select_kv_blocks` is plain XLA ops, which XLA partitions itself, with small all-reduces
of `[B, n]` across head shards (the blocks holding no key in any head; over all heads,
the heads' mean).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from xattn_jax import fp8, impls, partitioning, reference
from xattn_jax.backend import Backend
from xattn_jax.checks import (CheckedCalls, cached_keys, check_choice, check_flag,
                              check_float_array, check_kv_sizes, check_norm, check_qk,
                              key_len, kv_groups, scalar_threshold, valid_counts)
from xattn_jax.defaults import (ESTIMATE_BLOCK_SIZE, ESTIMATES, KV_BLOCK_SIZE, KV_THRESHOLD,
                                NORM, STRIDE)
from xattn_jax.geometry import Geometry, cdiv
from xattn_jax.sampled_geometry import SampledGeometry

RULES = ("score", "vote")
EMPTY_BLOCK = -1.0  # the score of a KV block that holds no key (a real share is >= 0)
# Up to this many KV blocks the selection ranks them by comparing every pair (one fusion
# of n x n comparisons per row, `_take_ranked_by_pairs`); beyond, by sorting
# (`reference.take_descending`: two argsorts, a cumulative sum and gathers, several small
# kernels): fewer kernels after the Mosaic one, the whole chunk call within the spread
# on the H200. 256 blocks (a 1M-token context in blocks of 4096) is a bound on the n x n
# work, not a measured break-even (docs/tuning.md: kv-rank-by-pairs).
RANK_BY_PAIRS_MAX_BLOCKS = 256
_KV_SCORE_CALLS = CheckedCalls()  # kv_block_scores' prepared calls (no block table)
_KV_SELECT_CALLS = CheckedCalls()  # select_kv_blocks' prepared calls


def _sum_groups(x: jax.Array, axis: int, size: int) -> jax.Array:
    """Sums consecutive groups of `size` along `axis`, zero-padding the last group."""
    groups = cdiv(x.shape[axis], size)
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, groups * size - x.shape[axis])
    x = jnp.pad(x, pad)
    return x.reshape(*x.shape[:axis], groups, size, *x.shape[axis + 1:]).sum(axis=axis + 1)




@functools.partial(jax.jit, static_argnames=("geom", "norm", "per_kv_block",
                                             "per_query_block", "impl", "estimate"))
def _kv_scores(q, k, key_len, block_table, *, geom: Geometry, norm: float, per_kv_block: int,
               per_query_block: bool, impl: Backend, estimate: str):
    key_len = jnp.asarray(key_len, jnp.int32)
    if block_table is not None:
        block_table = block_table.astype(jnp.int32)
    cache = dict(causal=False, key_len=key_len, block_table=block_table)
    if estimate == "sampled-rows":  # every S-th query: the antidiagonal's q.k products
        sampled = SampledGeometry.of(geom, geom.block_rows, geom.head_dim ** -0.5 / norm)
        sums = impl.sampled_block_mass(q, k, geom=sampled, **cache)
    else:
        sums = impl.block_sums(q, k, geom=geom, norm=norm, **cache)
    rows = _sum_groups(sums, 2, per_kv_block) if per_query_block else sums.sum(axis=2)
    scores = _sum_groups(rows, rows.ndim - 1, per_kv_block)
    first_key = jnp.arange(scores.shape[-1]) * (per_kv_block * geom.block_size)
    return jnp.where(first_key < key_len, scores, EMPTY_BLOCK)


def kv_block_scores(q: jax.Array, k: jax.Array, *, kv_block_size: int = KV_BLOCK_SIZE,
                    estimate_block_size: int = ESTIMATE_BLOCK_SIZE, stride: int = STRIDE,
                    norm: float = NORM,
                    k_len=None, block_table=None, per_query_block: bool = False,
                    impl: str = "auto", estimate: str = "antidiagonal") -> jax.Array:
    """Softmax mass of a chunk's queries in each KV-cache block: float32 `[B, Hq, n]`.

    q: the chunk `[B, Hq, Lq, D]`, all of it after every cached key (no causal mask).
    k: the cached keys `[B, Hkv, capacity, D]`, Lq <= capacity; only the first `k_len`
      hold keys (an int in [1, capacity], or an int32 scalar jax.Array, maybe traced: new
      values do not recompile). Or, with `block_table` (int32 `[B, pages_per_seq]`), a
      paged cache `[num_pages, page_size, Hkv, D]` (the layout of vLLM and nano-vllm),
      whose sequence b is the pages block_table[b] in order (capacity = pages_per_seq *
      page_size); the kernel reads the pages through the table, with no gathered copy.
      Page ids must lie in [0, num_pages): a table given as numpy or lists, or as a
      jax.Array on the CPU, is checked (ValueError); a traced table or one on a GPU is not
      read (that would wait for the device). Or keys in fp8 (`xattn_jax.fp8.Fp8Keys`,
      contiguous, or paged with `block_table`): the scores of their dequantized keys in
      q's dtype, gathered through the table into a contiguous copy first
      (docs/estimate.md, "Keys in fp8").
    n = ceil(capacity / kv_block_size). A block that holds no key (it starts at or past
    k_len) scores `EMPTY_BLOCK` (-1; no share is negative), which `select_kv_blocks` never
    selects. A head's scores over the other blocks sum to ceil(Lq / stride): each reshaped
    query row's softmax sums to 1. estimate_block_size must be a multiple of stride and
    divide kv_block_size; the result equals the direct computation at kv_block_size.
    per_query_block keeps the chunk's query blocks (of kv_block_size tokens):
    `[B, Hq, ceil(Lq / kv_block_size), n]`, the rows of the "vote" rule of
    `select_kv_blocks`.
    estimate: the softmax mass summed (one of `defaults.ESTIMATES`): "antidiagonal",
    that of the reshaped rows of sections 1-2; "sampled-rows", the exact attention (scale
    1 / (sqrt(D) norm)) of the chunk's sampled rows, estimate_block_size / stride per
    query block of estimate_block_size (every stride-th query where the chunk fills its
    blocks: the antidiagonal's q.k products), whose scores sum to that many rows per
    query block (docs/estimate.md section 5).

    Unchecked values (a jax.Array k_len or block_table; `xattn_jax.checked` checks them):
    k_len below 1 makes every block EMPTY_BLOCK; k_len past the capacity counts as the
    capacity; page ids outside [0, num_pages) are clamped into it (page 0 or the last page).
    """
    if isinstance(k, fp8.Fp8Keys):  # dequantized, then read as contiguous keys
        k, block_table = fp8.keys_for_estimate(q, k, block_table), None
    options = dict(kv_block_size=kv_block_size, estimate_block_size=estimate_block_size,
                   stride=stride, norm=norm, per_query_block=per_query_block, impl=impl,
                   estimate=estimate)

    def prepare():
        check_kv_sizes(kv_block_size, estimate_block_size, stride)
        keys, table = cached_keys(q, k, block_table)
        geom = check_qk(q, keys, stride=stride, block_size=estimate_block_size, causal=False)
        layouts = ("B H ...", "B K ..." if table is None else ". . K .", "", "B ...")
        run = partitioning.on_shards(
            _kv_scores, layouts, name="kv_block_scores", geom=geom, norm=check_norm(norm),
            per_kv_block=kv_block_size // estimate_block_size,
            per_query_block=check_flag("per_query_block", per_query_block),
            impl=impls.resolve(impl, q, k), estimate=check_choice("estimate", estimate,
                                                                   ESTIMATES))
        return run, geom.k_len, table

    # a block table's page ids are checked on every call: no signature with one
    key = None if block_table is not None else _KV_SCORE_CALLS.signature((q, k), options)
    run, capacity, table = _KV_SCORE_CALLS.prepared(key, prepare)
    return run(q, k, key_len(k_len, capacity), table)


def _take_ranked_by_pairs(values: jax.Array, candidate: jax.Array,
                          target: jax.Array) -> jax.Array:
    """`reference.take_descending`'s rule with base 0 for a short last axis, without a
    sort: candidate j is taken while the candidates ranked before it (a larger value, or
    an equal one at a lower index) sum to less than target. values float32 `[..., n]`
    (finite and >= 0 where candidate), candidate bool `[..., n]`, target `[..., 1]`;
    returns bool `[..., n]`. The sums before each block add the same values as the
    sorted running sum, in another order (float32 rounding may differ at the target)."""
    n = values.shape[-1]
    v = jnp.where(candidate, values, 0.0)
    other, this = v[..., :, None], v[..., None, :]  # [..., n (ranked before?), n]
    lower = jnp.arange(n)[:, None] < jnp.arange(n)[None, :]
    ahead = candidate[..., :, None] & ((other > this) | ((other == this) & lower))
    before = jnp.where(ahead, other, 0.0).sum(axis=-2)
    return candidate & (before < target)


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
    empty = (scores < 0).any(axis=tuple(range(1, scores.ndim - 1)))  # [B, n]: EMPTY_BLOCK
    valid = ((j < counts[:, None]) & ~empty)[:, None, :]  # [B, 1, n]
    if rule == "score":
        mass, ok = groups.mean(axis=2), valid
    else:
        mass, ok = groups, valid[:, :, None, None, :]
    mass = jnp.where(ok, mass, 0.0)
    total = mass.sum(axis=-1, keepdims=True)
    if scores.shape[-1] <= RANK_BY_PAIRS_MAX_BLOCKS:
        take = _take_ranked_by_pairs(mass, ok, threshold * total)
    else:
        take = reference.take_descending(mass, ok, jnp.zeros_like(total), threshold * total)
    take = jnp.where(jnp.isfinite(total) & (total > 0), take, ok)
    if rule == "vote":  # strict majority of the group's rows (query heads x query blocks)
        take = take.sum(axis=(2, 3)) * 2 > take.shape[2] * take.shape[3]
    last = jnp.where(valid, j, -1).max(axis=-1, keepdims=True)
    keep = ((j == 0) & keep_first) | ((j == last) & keep_last)
    mask = (take | keep) & valid
    return mask if per_kv_head else mask[:, 0]


def select_kv_blocks(scores: jax.Array, *, threshold: float = KV_THRESHOLD,
                     keep_first: bool = True,
                     keep_last: bool = True, per_kv_head: bool = False, kv_heads=None,
                     num_valid=None, rule: str = "score", impl: str = "auto") -> jax.Array:
    """KV-cache blocks to load for a chunk: bool `[B, n]`, or `[B, Hkv, n]` per KV head.

    scores: `[B, Hq, n]` from `kv_block_scores` (rule "score"), or per query block
      `[B, Hq, R, n]` (rule "vote": block sums of the chunk's R query blocks).
    threshold: share of the mass to keep, in (0, 1]: a float, or a float32 scalar
      jax.Array (maybe traced).
    per_kv_head: select once per KV head (`kv_heads` of them) from its query heads, the
      union a KV head's attention needs; otherwise once for all heads.
    kv_heads: the KV heads Hkv of the scores' query heads, needed with per_kv_head; when
      given (with per_kv_head or not) it must divide Hq.
    num_valid: KV blocks in use, an int in [1, n] or `[B]` such ints (a jax.Array may be
      traced; default n). Later blocks are never selected.
    A block that holds no key (a negative score in any head: `EMPTY_BLOCK` from
    `kv_block_scores`) is never selected, whatever num_valid says.
    rule "score": average over the group's heads, take blocks in descending order (ties:
      lower index first) until the cumulative share of the valid mass reaches threshold.
    rule "vote" (the engine's earlier rule, kept for comparison): each row (query head,
      query block) keeps its smallest set reaching the threshold; a block is selected by a
      strict majority of the group's rows.
    keep_first / keep_last then add block 0 (attention sink) and the last block that holds
    keys within num_valid (most recent context), when they hold keys; they do not count
    towards the threshold. A group or row whose mass is not finite or not positive keeps
    every valid block.

    Unchecked values (jax.Array threshold or num_valid; `xattn_jax.checked` checks them):
    a threshold of 0 or below, or NaN, selects only the keep_first / keep_last blocks; one
    above 1 selects every valid block. num_valid below 1 selects nothing; past n it counts
    as n.
    impl: checked like every function's (`xattn_jax.impls`); the selection is plain JAX,
    the same for every implementation (it is small: no kernel gains).
    """
    options = dict(threshold=threshold, keep_first=keep_first, keep_last=keep_last,
                   per_kv_head=per_kv_head, kv_heads=kv_heads, num_valid=num_valid,
                   rule=rule, impl=impl)

    def prepare():
        impls.resolve(impl, scores)
        check_choice("rule", rule, RULES)
        check_float_array("scores", scores,
                          "[B, Hq, n] (rule 'score')" if rule == "score" else
                          "[B, Hq, R, n] (rule 'vote')")
        batch, blocks = scores.shape[0], scores.shape[-1]
        per_head = check_flag("per_kv_head", per_kv_head)
        run = functools.partial(
            _select_kv, rule=rule, groups=kv_groups(scores.shape[1], per_head, kv_heads),
            keep_first=check_flag("keep_first", keep_first),
            keep_last=check_flag("keep_last", keep_last), per_kv_head=per_head)
        return run, valid_counts(num_valid, batch, blocks), scalar_threshold(threshold)

    run, counts, threshold = _KV_SELECT_CALLS.prepared(
        _KV_SELECT_CALLS.signature((scores,), options), prepare)
    return run(scores, counts, threshold)
