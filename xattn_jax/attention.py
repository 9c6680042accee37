"""Public block-sparse attention (docs/estimate.md section 6) and XAttention end to end.

`block_sparse_attention` runs attention over the key blocks of a block mask;
`xattention` is the estimate (`xattn_estimate`) and then that attention on its mask, in one
jitted call.

`impl` (`xattn_jax.impls`): "reference" is the plain-JAX reference
(`xattn_jax.reference.attention`, memory-lean, any GPU or the CPU); "mosaic" the Hopper
kernel `xattn_jax.mosaic.attention`; "auto" the Mosaic kernel where it can run on the
inputs' device and takes the call, else the reference. There is no Triton-backend attention kernel.

Several devices: both partition over batch and heads as `xattn_jax.api` says (a paged
cache over its KV-head axis 2; `xattn_jax.partitioning`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from xattn_jax import impls, partitioning
from xattn_jax.api import _estimate, _select
from xattn_jax.backend import Backend
from xattn_jax.checks import (cached_keys, check_estimate, check_flag, check_int, check_norm,
                              check_qk, check_scale, check_traced, threshold_per_head)
from xattn_jax.defaults import (BLOCK_SIZE, DENSE_LAST, MIN_BLOCKS, NORM, SAMPLED_ROWS,
                                STRIDE, THRESHOLD)
from xattn_jax.geometry import Geometry, cdiv
from xattn_jax.sampled_geometry import SampledGeometry

_CACHE_ARGS = ("k_len", "block_table")  # what a paged or padded cache adds to a call

# --- argument checks -------------------------------------------------------------------

def _check_block_size(block_size) -> int:
    if not isinstance(block_size, (int, np.integer)) or isinstance(block_size, bool) \
            or block_size < 1:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    return int(block_size)


def check_v(v, k, block_table) -> None:
    """v: k's layout (contiguous `[B, Hkv, Lk, Dv]` or paged `[num_pages, page_size, Hkv,
    Dv]`) and dtype; only its last dimension may differ from k's."""
    if getattr(v, "ndim", None) != 4:
        layout = "[num_pages, page_size, Hkv, Dv]" if block_table is not None \
            else "[batch, kv_heads, length, Dv]"
        raise ValueError(f"v must have rank 4 {layout}, got shape {getattr(v, 'shape', None)}")
    if v.dtype != k.dtype:
        raise ValueError(f"v must have k's dtype {k.dtype}, got {v.dtype}")
    if v.shape[:3] != k.shape[:3] or v.shape[3] < 1:
        what = "pages, page size and heads" if block_table is not None \
            else "batch, heads and length"
        raise ValueError(f"v must have k's {what} {tuple(k.shape[:3])} (only its last "
                         f"dimension Dv may differ), got shape {tuple(v.shape)}")


def _check_mask(mask, geom: Geometry, block_size: int) -> None:
    want = (geom.batch, geom.q_heads, cdiv(geom.q_len, block_size),
            cdiv(geom.k_len, block_size))
    if getattr(mask, "dtype", None) != jnp.bool_:
        raise ValueError(f"mask must be bool, got {getattr(mask, 'dtype', type(mask))}")
    if tuple(mask.shape) != want:
        raise ValueError(f"mask must have shape [B, Hq, ceil(Lq/block_size), "
                         f"ceil(Lk/block_size)] = {want}, got {tuple(mask.shape)}")


def _key_count(k_len, geom: Geometry):
    """k_len as None or an int32 scalar; an int must lie in [Lq, Lk], a jax.Array (maybe
    traced) against the same range in checked mode only."""
    if k_len is None:
        return None
    rule = (f"k_len must lie in [Lq, Lk] = [{geom.q_len}, {geom.k_len}] (the queries are "
            f"the last Lq of the k_len keys)")
    if isinstance(k_len, (int, np.integer)) and not isinstance(k_len, bool):
        if not geom.q_len <= k_len <= geom.k_len:
            raise ValueError(f"{rule}, got {k_len}")
    elif not isinstance(k_len, jax.Array) or k_len.ndim or \
            not jnp.issubdtype(k_len.dtype, jnp.integer):
        raise ValueError(f"k_len must be None, an int or an integer scalar jax.Array, got "
                         f"{k_len!r}")
    count = jnp.asarray(k_len, jnp.int32)
    check_traced(lambda n: (n >= geom.q_len) & (n <= geom.k_len), rule + ", got {}", count)
    return count


def _check_attention(q, k, v, block_size, block_table) -> Geometry:
    """Checks q, k, v (and the block table); the geometry with k's contiguous length."""
    block_size = _check_block_size(block_size)
    keys, _ = cached_keys(q, k, block_table)
    # stride 1 and causal=False: the attention has neither a stride nor an alignment rule
    geom = check_qk(q, keys, stride=1, block_size=block_size, causal=False)
    check_v(v, k, block_table)
    return geom


# --- entry points ----------------------------------------------------------------------

@functools.partial(jax.jit, static_argnames=("impl", "block_size", "causal", "scale",
                                             "return_lse"))
def _attention(q, k, v, mask, key_count, block_table, *, impl: Backend, block_size: int,
               causal: bool, scale: float | None, return_lse: bool):
    cache = {name: x for name, x in zip(_CACHE_ARGS, (key_count, block_table))
             if x is not None}
    return impl.block_sparse_attention(q, k, v, mask, block_size=block_size, causal=causal,
                                       scale=scale, return_lse=return_lse, **cache)


def block_sparse_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, *,
                           block_size: int, causal: bool = True, scale: float | None = None,
                           return_lse: bool = False, k_len=None, block_table=None,
                           impl: str = "auto"):
    """Softmax attention over the key blocks `mask` allows (docs/estimate.md section 6), jitted.

    Args:
      q: queries `[B, Hq, Lq, D]`: query row i sits at key position `n - Lq + i`, n being
        the number of keys in use (`k_len`, default Lk): the chunk of queries at the end of
        the keys.
      k, v: keys `[B, Hkv, Lk, D]` and values `[B, Hkv, Lk, Dv]`, q's dtype (float32,
        bfloat16 or float16), Lq <= Lk, Hq % Hkv == 0: query head h reads key head
        h // (Hq // Hkv), without copies. Or, with `block_table`, paged caches.
      mask: bool `[B, Hq, ceil(Lq / block_size), ceil(Lk / block_size)]`, as
        `xattn_estimate` returns it: row i may attend to key j iff
        mask[b, h, i // block_size, j // block_size], j < n and, if `causal`,
        j <= i + n - Lq. Any lengths: blocks need not line up with the chunk.
      block_size: tokens per mask block.
      scale: multiplies q.k before the softmax; default 1 / sqrt(D).
      return_lse: also return the float32 `[B, Hq, Lq]` log-sum-exp (natural log).
      k_len: keys in use, Lq <= k_len <= Lk, for a padded or paged cache: None (all), an
        int, or an int32 scalar jax.Array (traced values do not recompile; their range is
        checked in checked mode only, `xattn_jax.checked`). Keys from k_len on are never
        visible.
      block_table: int32 `[B, pages_per_seq]`: k and v are then paged caches
        `[num_pages, page_size, Hkv, D]` / `[num_pages, page_size, Hkv, Dv]` (the layout
        `kv_block_scores` takes), sequence b being the pages block_table[b] in order, so
        Lk = pages_per_seq * page_size. Read in place, no gathered copy. The causal rule
        is the same: the chunk's queries are the last Lq of the n cached keys (the chunk's
        own keys written to the cache's end); causal=False lets each query see every key
        in use, the usual reading for a chunk that follows its context.
      impl: "auto", "reference", "mosaic" or "triton" (module docstring). The Mosaic
        kernel reads paged caches whose pages hold a multiple of its key tile (128 tokens
        at D 64 and 128, 64 at D 256): "mosaic" refuses other pages with a ValueError that
        says so, and "auto" uses the reference for them.

    Returns:
      out `[B, Hq, Lq, Dv]` in q's dtype, or `(out, lse)` with `return_lse`. Softmax in
      float32. A row with no allowed key gives zeros (lse -inf). With an all-true mask
      this is dense (causal) attention.

    Non-finite inputs: a key a row may not attend to never reaches it (masked keys are
    replaced, not multiplied by 0). A NaN in q, in an allowed key's k, or a score of +inf
    makes the row NaN; a score of -inf gives that key weight 0; a NaN or inf in an
    allowed key's v makes the row's output NaN.

    Raises TypeError or ValueError, before any work, for inputs that break these rules
    (causal and return_lse must be True or False).
    """
    geom = _check_attention(q, k, v, block_size, block_table)
    _check_mask(mask, geom, block_size)
    causal, return_lse = check_flag("causal", causal), check_flag("return_lse", return_lse)
    table = None if block_table is None else jnp.asarray(block_table, jnp.int32)
    key_count = _key_count(k_len, geom)
    kv = "B K ..." if table is None else ". . K ."
    run = partitioning.on_shards(_attention, ("B H ...", kv, kv, "B H ...", "", "B ..."),
                                 name="block_sparse_attention",
                                 impl=impls.resolve(impl, q, ops=impls.ATTENTION),
                                 block_size=geom.block_size,
                                 causal=causal, scale=check_scale(scale),
                                 return_lse=return_lse)
    return run(q, k, v, mask, key_count, table)


@functools.partial(jax.jit, static_argnames=("geom", "backends", "estimate", "causal",
                                             "norm", "min_blocks", "dense_last", "scale",
                                             "return_mask"))
def _xattention(q, k, v, threshold, *, geom: Geometry,
                backends: impls.XAttentionBackends, estimate: str, causal: bool,
                norm: float, min_blocks: int, dense_last: int, scale: float | None,
                return_mask: bool):
    widening = dict(causal=causal, keep_sink=False, keep_recent=False,
                    min_blocks=min_blocks, dense_last=dense_last, impl=backends.estimate)
    if estimate == "antidiagonal":
        _, mask = _estimate(q, k, threshold, geom=geom, norm=norm, max_scratch_bytes=None,
                            **widening)
    else:
        sums = backends.estimate.sampled_block_mass(
            q, k, geom=SampledGeometry.of(geom, SAMPLED_ROWS, scale), causal=causal)
        mask = _select(sums, threshold, **widening)
    out = backends.attention.block_sparse_attention(
        q, k, v, mask, block_size=geom.block_size, causal=causal, scale=scale,
        return_lse=False)
    return (out, mask) if return_mask else out


def xattention(q: jax.Array, k: jax.Array, v: jax.Array, *, threshold=THRESHOLD,
               block_size: int = BLOCK_SIZE, stride: int = STRIDE, causal: bool = True,
               norm: float = NORM, min_blocks: int = MIN_BLOCKS, dense_last: int = DENSE_LAST,
               scale: float | None = None, return_mask: bool = False, impl: str = "auto",
               estimate: str = "antidiagonal"):
    """XAttention (docs/estimate.md sections 1-4, then 6): the estimate's block mask, then
    attention over it, as one jitted call.

    Args:
      q, k, v: `[B, Hq, Lq, D]`, `[B, Hkv, Lk, D]`, `[B, Hkv, Lk, Dv]`, one dtype (float32,
        bfloat16 or float16), Lq <= Lk, Hq % Hkv == 0; with causal=True and Lq < Lk,
        Lk - Lq must be a multiple of block_size (the estimate's rule).
      threshold: the estimate's share of each row's mass to keep, in (0, 1] (1: dense): a
        float or `[Hq]` floats (one row of a `xattn_jax.calibrate` table). Data: changing
        it does not recompile.
      block_size, stride, causal, norm, min_blocks, dense_last: as in `xattn_estimate`
        (norm tempers the estimate only); the attention uses the same block_size and
        causal. The defaults of threshold, min_blocks and dense_last are chosen for a real
        model's quality, where `xattn_estimate`'s are the original XAttention's
        (`xattn_jax.defaults`; docs/tuning.md: selection-defaults).
      scale: the attention's q.k multiplier, default 1 / sqrt(D).
      return_mask: also return the mask (True or False).
      impl: the attention's implementation, as in `block_sparse_attention`. The estimate
        runs its "reference" for impl="reference" or inputs off a GPU, else its "auto"
        (`impls.resolve_xattention`, whose pair may also be passed here).
      estimate: the block scores the threshold rule selects on (one of `defaults.ESTIMATES`):
        "antidiagonal", XAttention's estimate (`xattn_estimate`, with stride and norm);
        "sampled-rows", the exact attention mass of 16 sampled rows per query block
        (`xattn_jax.sampled_block_mass`, with scale; stride and norm unused; block_size
        at least 16), closer to the exact block mass on a real model (docs/tuning.md:
        sampled-rows).

    Returns:
      out `[B, Hq, Lq, Dv]` in q's dtype, or `(out, mask)` with mask bool
      `[B, Hq, ceil(Lq/block_size), ceil(Lk/block_size)]`: with the antidiagonal estimate
      exactly `xattn_estimate`'s.
    """
    geom = check_qk(q, k, stride=stride, block_size=block_size, causal=causal)
    check_v(v, k, None)
    return_mask = check_flag("return_mask", return_mask)
    estimate = check_estimate(estimate, geom.block_size)
    t = threshold_per_head(threshold, geom.q_heads)
    run = partitioning.on_shards(
        _xattention, ("B H ...", "B K ...", "B K ...", "H"), name="xattention", geom=geom,
        backends=impls.resolve_xattention(impl, q), estimate=estimate, causal=causal,
        norm=check_norm(norm), min_blocks=check_int("min_blocks", min_blocks, 0),
        dense_last=check_int("dense_last", dense_last, 0), scale=check_scale(scale),
        return_mask=return_mask)
    return run(q, k, v, t)
