"""`ragged_xattention`: XAttention for one serving step, many sequences packed in one call
(docs/estimate.md, "Ragged steps").

A step packs prefill chunks and decode rows of several sequences into one query array
and reads their keys and values through one paged cache, as vLLM and the JAX serving
stacks lay them out. Every length, page and count is data: an engine that pads the
token count, the sequence slots and the page-table width to buckets compiles once per
bucket.
"""

from __future__ import annotations

from typing import NamedTuple

import jax

from xattn_jax import impls, partitioning
from xattn_jax.backend import Backend
from xattn_jax.defaults import BLOCK_SIZE, DENSE_LAST, MIN_BLOCKS, NORM, SAMPLED_ROWS, \
    STRIDE, THRESHOLD
from xattn_jax.checks import check_estimate, check_flag, check_int, check_norm, check_scale, \
    threshold_per_head
from xattn_jax.ragged.checks import check_step
from xattn_jax.ragged.geometry import RaggedGeometry, RaggedSampledGeometry
from xattn_jax.ragged.layout import ragged_blocks
from xattn_jax.ragged.select import select_ragged


class RaggedMask(NamedTuple):
    """The key blocks a ragged step attended to.

    blocks: bool `[Hq, QB, KB]`; row `cu_q_blocks[s] + i` is the key-block mask of
      sequence s's absolute query block `first_block[s] + i` (the block of key positions
      `(first_block[s] + i) * block_size ..`); key block J covers key positions
      `J * block_size .. (J + 1) * block_size - 1`. Rows from `cu_q_blocks[num_seqs]` on
      are all False. QB = T // block_size + 2 S, KB = ceil(pages_per_seq * page_size /
      block_size).
    cu_q_blocks: int32 `[S + 1]`; first_block: int32 `[S]`, (kv_len - q_len) //
      block_size.
    """

    blocks: jax.Array
    cu_q_blocks: jax.Array
    first_block: jax.Array


def _fused_pairs(k: jax.Array) -> jax.Array:
    """A fused cache `[P, page, 2 Hkv, D]` viewed as `[P, page, Hkv, 2, D]` (free)."""
    return k.reshape(*k.shape[:2], k.shape[2] // 2, 2, k.shape[3])


def ragged_mask(q, k, page_indices, blocks, threshold, geom: RaggedGeometry, *,
                estimate: Backend, norm: float, min_blocks: int,
                dense_last: int) -> jax.Array:
    """The step's estimate: block sums on `estimate` (the sampled rows' on a
    `RaggedSampledGeometry`), then the selection (bool `[Hq, QB, KB]`); k as the backends
    take it (a fused cache viewed `[.., Hkv, 2, D]`)."""
    sums = estimate.ragged_block_sums(q, k, page_indices, blocks, geom, norm=norm)

    def select(sums, threshold, *, diagonal):
        return estimate.select_blocks(sums, threshold, causal=True, keep_sink=False,
                                      keep_recent=False, diagonal=diagonal)

    return select_ragged(sums, threshold, blocks, select=select, min_blocks=min_blocks,
                         dense_last=dense_last)


def estimate_geometry(geom: RaggedGeometry, estimate: str, scale: float) -> RaggedGeometry:
    """The sizes the estimate runs on: geom itself for the antidiagonal estimate, its
    `RaggedSampledGeometry` (at the attention's q.k multiplier `scale`) for sampled rows."""
    if estimate == "sampled-rows":
        return RaggedSampledGeometry.of(geom, SAMPLED_ROWS, scale)
    return geom


def _ragged_core(q, k, v, kv_lens, page_indices, cu_q_lens, num_seqs, decode_seqs,
                 threshold, *, step: RaggedGeometry, impl: impls.RaggedBackends,
                 estimate: str, norm: float, scale: float | None, min_blocks: int,
                 dense_last: int, return_mask: bool):
    geom = step.local(q, k)  # a shard's heads under partitioning
    scale = geom.head_dim ** -0.5 if scale is None else scale
    scores = estimate_geometry(geom, estimate, scale)
    impl = impl.for_step(geom, q.dtype, estimate_geom=scores)
    if geom.fused:
        k = _fused_pairs(k)
    blocks = ragged_blocks(cu_q_lens, kv_lens, num_seqs, decode_seqs, geom)
    mask = ragged_mask(q, k, page_indices, blocks, threshold, scores,
                       estimate=impl.estimate, norm=norm, min_blocks=min_blocks,
                       dense_last=dense_last)
    out = impl.attention.ragged_attention(q, k, v, page_indices, mask, blocks, geom,
                                          scale=scale)
    if return_mask:
        return out, RaggedMask(mask, blocks.cu_q_blocks, blocks.first_block)
    return out


def ragged_xattention(q: jax.Array, k: jax.Array, v: jax.Array | None, kv_lens,
                      page_indices, cu_q_lens, num_seqs, *, threshold=THRESHOLD,
                      block_size: int = BLOCK_SIZE, stride: int = STRIDE,
                      norm: float = NORM,
                      min_blocks: int = MIN_BLOCKS, dense_last: int = DENSE_LAST,
                      scale: float | None = None, decode_seqs=None,
                      return_mask: bool = False, impl: str = "auto",
                      estimate: str = "antidiagonal"):
    """XAttention over a ragged, paged serving step, as one jitted call.

    Args:
      q: the step's queries `[T, Hq, D]`, float32, bfloat16 or float16: sequence s owns
        rows `cu_q_lens[s] .. cu_q_lens[s+1] - 1`, the last q_len of its kv_len keys (the
        engine writes the step's keys and values into the cache before the call).
      k, v: paged caches `[num_pages, page_size, Hkv, D]` and `[.., Hkv, Dv]` in q's
        dtype, any page size; or v=None and k one fused cache `[num_pages, page_size,
        2 Hkv, D]`, K head h at 2h and V head h at 2h + 1. Read in place. Hq % Hkv == 0.
      kv_lens: int32 `[S]`, each sequence's keys in use, its chunk's included.
      page_indices: int32 `[S, pages_per_seq]`, each sequence's pages in order: key
        position p of sequence s is row p % page_size of page
        `page_indices[s, p // page_size]`.
      cu_q_lens: int32 `[S + 1]`, starting at 0, not decreasing, at most T.
      num_seqs: the live sequences, an int or an int32 scalar (maybe traced); the slots
        from num_seqs on are ignored and their rows of the output are zero.
      threshold: the estimate's share of each row's mass to keep, in (0, 1]: a float or
        `[Hq]` floats (a row of a `calibrate` table). Data: does not recompile.
      block_size, stride, norm, min_blocks, dense_last: as in `xattention`; blocks are
        counted in key positions from 0, so a chunk that starts inside a block has a
        partial first query block (docs/estimate.md, "Ragged steps").
      scale: the attention's q.k multiplier, default 1 / sqrt(D).
      decode_seqs: optional hint, as JAX serving stacks pass it: the first decode_seqs
        sequences have one query each (an int or an int32 scalar).
      return_mask: also return the `RaggedMask` (True or False).
      impl: "auto", "reference", "triton" or "mosaic" (`xattn_jax.impls.resolve_ragged`:
        a name runs each stage it has a kernel for, the reference the rest; a stage
        whose kernel does not take the step raises a ValueError saying why, or under
        "auto" runs on the reference).
      estimate: the block scores the threshold rule selects on, as in `xattention`:
        "antidiagonal" or "sampled-rows" (16 rows of each query block, spread over its
        queries inside the chunk: docs/estimate.md, "Ragged steps"; block_size at least
        16; stride and norm unused).

    Sequences with at least block_size queries are estimated: each query block keeps
    the key blocks `xattention`'s rule selects over the sequence's own keys. Shorter
    ones (decode rows, short chunks) attend densely to their keys. Where a chunk starts
    on a block boundary, its rows equal `xattention` on that sequence alone.

    Only T, S, pages_per_seq and the cache's shape are static: other changes of lengths,
    pages or counts do not recompile. Offsets and pages given on the host (numpy, lists,
    CPU arrays) are checked before any work; device arrays only in checked mode
    (`xattn_jax.checked`). Unchecked, values outside the rules give unspecified rows but
    read nothing outside the arrays.

    Several devices: under `jax.jit` the call partitions over the query and KV heads
    (`xattn_jax.partitioning`); inside `shard_map` it runs on the local shards.

    Returns:
      out `[T, Hq, Dv]` in q's dtype (zero in rows of no live sequence), or
      `(out, RaggedMask)` with return_mask.
    """
    geom, kv_lens, page_indices, cu_q_lens, num_seqs, decode_seqs = check_step(
        q, k, v, kv_lens, page_indices, cu_q_lens, num_seqs, decode_seqs,
        block_size=block_size, stride=stride)
    return_mask = check_flag("return_mask", return_mask)
    estimate = check_estimate(estimate, geom.block_size)
    t = threshold_per_head(threshold, geom.q_heads)
    kv = ". . F ." if geom.fused else ". . K ."
    run = partitioning.on_shards(
        _ragged_core, (". H .", kv, kv, ".", ". .", ".", "", "", "H"),
        results=(". H .", "H . .", ".", ".") if return_mask else ". H .",
        name="ragged_xattention", step=geom, impl=impls.resolve_ragged(impl, q),
        estimate=estimate, norm=check_norm(norm), scale=check_scale(scale),
        min_blocks=check_int("min_blocks", min_blocks, 0),
        dense_last=check_int("dense_last", dense_last, 0), return_mask=return_mask)
    return run(q, k, v, kv_lens, page_indices, cu_q_lens, num_seqs, decode_seqs, t)
