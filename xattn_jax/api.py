"""Public entry points of the estimate (sections 1-4). Each checks its arguments and
runs the implementation `impl` names (`xattn_jax.impls`: "auto", "reference", "triton"
or "mosaic").

Several devices: under a caller's `jax.jit` over inputs sharded by batch and heads, each
function runs on every device's own shard with no communication; heads shard in whole KV
groups, or inside one group with k replicated; a sequence- or head-dim-sharded input is
all-gathered first (`xattn_jax.partitioning` has the whole rule).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from xattn_jax import fp8, impls, partitioning
from xattn_jax.backend import Backend
from xattn_jax.checks import (CheckedCalls, check_block_sums, check_flag, check_int,
                              check_norm, check_qk, check_scratch_bytes, threshold_per_head)
from xattn_jax.defaults import BLOCK_SIZE, NO_WIDENING, NORM, ORIGINAL_THRESHOLD, STRIDE
from xattn_jax.geometry import Geometry
from xattn_jax.reference.estimate import widen

QK_LAYOUTS = ("B H ...", "B K ...")  # q, k (`partitioning.on_shards`)
_ESTIMATE_CALLS = CheckedCalls()  # xattn_estimate's prepared calls
_SELECT_CALLS = CheckedCalls()  # select_blocks' prepared calls


def strided_scores(q: jax.Array, k: jax.Array, *, stride: int = STRIDE, norm: float = NORM,
                   impl: str = "auto") -> jax.Array:
    """docs/estimate.md section 1: the strided antidiagonal scores.

    q: `[B, Hq, Lq, D]`, k: `[B, Hkv, Lk, D]`, float32 / bfloat16 / float16.
    Returns float32 `[B, Hq, ceil(Lq/stride), ceil(Lk/stride)]`. This materializes the whole
    O((L/stride)^2) matrix; `xattn_estimate` never does. A stride longer than a sequence
    is allowed: its one partly filled group reads zeros for the missing tokens.
    """
    geom = check_qk(q, k, stride=stride, block_size=stride, causal=False)
    run = partitioning.on_shards(impls.resolve(impl, q, k).strided_scores, QK_LAYOUTS,
                                 name="strided_scores", geom=geom, norm=check_norm(norm))
    return run(q, k)


def select_blocks(block_sums: jax.Array, threshold=ORIGINAL_THRESHOLD, *,
                  causal: bool = True, keep_sink: bool = False, keep_recent: bool = False,
                  min_blocks: int = NO_WIDENING, dense_last: int = NO_WIDENING,
                  impl: str = "auto") -> jax.Array:
    """docs/estimate.md section 4 on given block sums: float32 `[B, Hq, qb, kb]` -> bool mask.

    block_sums: floats (any float dtype, computed in float32), no more query than key
      blocks. threshold: a float in (0, 1] or one value per query head, `[Hq]`.
      min_blocks / dense_last: the widening of section 4, as in `xattn_estimate`.
    Unchecked values (a jax.Array threshold, whose values are not read; `xattn_jax.checked`
    checks them): as in `xattn_estimate`.
    """
    options = dict(causal=causal, keep_sink=keep_sink, keep_recent=keep_recent,
                   min_blocks=min_blocks, dense_last=dense_last, impl=impl)

    def prepare():
        check_block_sums(block_sums)
        return partitioning.on_shards(_select, ("B H ...", "H"), name="select_blocks",
                                      causal=check_flag("causal", causal),
                                      keep_sink=check_flag("keep_sink", keep_sink),
                                      keep_recent=check_flag("keep_recent", keep_recent),
                                      min_blocks=check_int("min_blocks", min_blocks, 0),
                                      dense_last=check_int("dense_last", dense_last, 0),
                                      impl=impls.resolve(impl, block_sums))

    run = _SELECT_CALLS.prepared(_SELECT_CALLS.signature((block_sums,), options), prepare)
    return run(block_sums, threshold_per_head(threshold, block_sums.shape[1]))


@functools.partial(jax.jit, static_argnames=("causal", "keep_sink", "keep_recent",
                                             "min_blocks", "dense_last", "impl"))
def _select(sums, threshold, *, causal: bool, keep_sink: bool, keep_recent: bool,
            min_blocks: int, dense_last: int, impl: Backend):
    sums = sums.astype(jnp.float32)
    mask = impl.select_blocks(sums, threshold, causal=causal, keep_sink=keep_sink,
                              keep_recent=keep_recent)
    return widen(mask, sums, causal=causal, min_blocks=min_blocks, dense_last=dense_last)


@functools.partial(jax.jit, static_argnames=("geom", "causal", "norm", "keep_sink",
                                             "keep_recent", "min_blocks", "dense_last",
                                             "impl", "max_scratch_bytes"))
def _estimate(q, k, threshold, *, geom: Geometry, causal: bool, norm: float,
              keep_sink: bool, keep_recent: bool, min_blocks: int, dense_last: int,
              impl: Backend, max_scratch_bytes: int | None):
    sums = impl.block_sums(q, k, geom=geom, causal=causal, norm=norm,
                           max_scratch_bytes=max_scratch_bytes)
    mask = impl.select_blocks(sums, threshold, causal=causal, keep_sink=keep_sink,
                              keep_recent=keep_recent)
    return sums, widen(mask, sums, causal=causal, min_blocks=min_blocks,
                       dense_last=dense_last)


def xattn_estimate(q: jax.Array, k: jax.Array, *, block_size: int = BLOCK_SIZE,
                   stride: int = STRIDE, threshold=ORIGINAL_THRESHOLD, causal: bool = True,
                   norm: float = NORM, keep_sink: bool = False, keep_recent: bool = False,
                   min_blocks: int = NO_WIDENING, dense_last: int = NO_WIDENING,
                   impl: str = "auto",
                   max_scratch_bytes: int | None = None) -> tuple[jax.Array, jax.Array]:
    """The XAttention estimate (docs/estimate.md sections 1-4) as one jitted call.

    Args:
      q: queries `[B, Hq, Lq, D]`, the last Lq positions of the key sequence.
      k: keys `[B, Hkv, Lk, D]`, Lq <= Lk, Hq % Hkv == 0 (GQA: query head h reads key head
        h // (Hq // Hkv)). float32, bfloat16 or float16, the same for both; any lengths.
        k may also be keys in fp8 (`xattn_jax.fp8.Fp8Keys`, contiguous): the estimate of
        their dequantized keys in q's dtype (docs/estimate.md, "Keys in fp8").
      block_size: tokens per block, a positive multiple of `stride`.
      stride: S, tokens per antidiagonal group.
      threshold: share of each row's mass to keep, in (0, 1] (1: every block): a float,
        or `[Hq]` floats.
        Passed as data, so changing it does not recompile. Numbers, numpy values and
        lists are checked on the host; a jax.Array (maybe traced) only in checked mode
        (`xattn_jax.checked`). Unchecked, a jax.Array value of 0 or below, or NaN, keeps
        only the forced blocks of its rows (none without causal, keep_sink or
        keep_recent); one above 1 keeps every block a row may attend to.
      causal: causal masking; with Lq < Lk, Lk - Lq must be a multiple of block_size.
      norm: extra divisor of the scores (a softmax temperature).
      keep_sink / keep_recent: also always keep key block 0 / the diagonal block (these
        are always kept in causal mode).
      min_blocks: each row also keeps its min_blocks highest-scoring allowed blocks.
      dense_last: the rows of the last dense_last query blocks keep every allowed block.
        (Both widen the selection after the threshold rule: docs/estimate.md section 4.)
      impl: "auto", "reference", "triton" or "mosaic" (`xattn_jax.impls`).
      max_scratch_bytes: bound on the Pallas kernels' scratch per kernel call, in bytes.
        None: `row_statistics.DEFAULT_SCRATCH_BYTES` (48 MiB), so that the workspace
        stays within 64 MiB beyond the outputs at every length (docs/tuning.md:
        workspace-bound). A call whose scratch exceeds the bound runs as several kernel
        calls, one after another, over as many whole heads as fit or else in row steps
        (`triton.plan.plan_block_sums`, `mosaic.estimate.plan`; a causal call's Mosaic
        statistics are folded, about half its tiles' worth). A larger bound takes fewer
        steps, a lower one more (docs/tuning.md: workspace-bound). Where not even one row
        step of one head fits, the Triton backend runs its two-pass kernel (no scratch,
        each score computed twice), and "auto" gives the Triton backend the calls the
        Mosaic block sums cannot step. The reference ignores it.

    Returns:
      `(block_sums, mask)`: float32 and bool, both `[B, Hq, ceil(Lq/block_size),
      ceil(Lk/block_size)]`. Each full query block's row of block_sums sums to
      block_size / stride. A block size (or stride) longer than the sequences is allowed:
      one block covers them (`[B, Hq, 1, 1]`, its sum ceil(Lq/stride), always selected);
      padding never changes a result.

    Non-finite inputs: a NaN in q or k, or an inf in q, makes every softmax row that sees
    it NaN, so the block sums of its query block are NaN, and the mask of such a row keeps
    every block it may attend to (dense attention) instead of dropping blocks on garbage.
    An inf in k gives the rows that see it a score of +inf (the row becomes NaN, as above)
    or -inf (that key gets weight 0, like a masked key; the row stays finite), by the sign
    of the matching q entry.
    """
    if isinstance(k, fp8.Fp8Keys):  # dequantized to q's dtype first
        k = fp8.keys_for_estimate(q, k)
    options = dict(block_size=block_size, stride=stride, causal=causal, norm=norm,
                   keep_sink=keep_sink, keep_recent=keep_recent, min_blocks=min_blocks,
                   dense_last=dense_last, impl=impl, max_scratch_bytes=max_scratch_bytes)

    def prepare():
        geom = check_qk(q, k, stride=stride, block_size=block_size, causal=causal)
        return partitioning.on_shards(_estimate, QK_LAYOUTS + ("H",), name="xattn_estimate",
                                      geom=geom, causal=check_flag("causal", causal),
                                      norm=check_norm(norm),
                                      keep_sink=check_flag("keep_sink", keep_sink),
                                      keep_recent=check_flag("keep_recent", keep_recent),
                                      min_blocks=check_int("min_blocks", min_blocks, 0),
                                      dense_last=check_int("dense_last", dense_last, 0),
                                      impl=impls.resolve(impl, q, k),
                                      max_scratch_bytes=check_scratch_bytes(max_scratch_bytes))

    run = _ESTIMATE_CALLS.prepared(_ESTIMATE_CALLS.signature((q, k), options), prepare)
    return run(q, k, threshold_per_head(threshold, q.shape[1]))
