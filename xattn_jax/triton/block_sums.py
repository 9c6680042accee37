"""Sections 1-3 fused: the Pallas block sums, computed tile by tile on the tensor cores and
never storing the score matrix. Two kernels do it:

- `one_pass`: every score once; stores two small row statistics per row and key tile
  and combines them exactly afterwards. Its scratch is bounded (`scratch_bound`): a call
  whose whole scratch is large covers the heads, and if need be each head's rows, in
  several kernel calls, one after another (`one_pass.call_shape`);
- `two_pass`: every score twice (row statistics, then block sums); no scratch. Used only
  where not even one row step of one head of the one-pass kernel fits in the bound.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from xattn_jax.geometry import Geometry
from xattn_jax.triton.one_pass import (CallShape, call_shape, one_pass_block_sums,
                                       padded_rows, scratch_bytes)
from xattn_jax.triton.tiling import Tiling, default_tiling
from xattn_jax.triton.two_pass import two_pass_block_sums

ONE_PASS_WHOLE_CALL_BYTES = 3 << 29  # 1.5 GiB: a call whose whole scratch fits takes one step
ONE_PASS_STEP_BYTES = 48 << 20  # else steps: keeps the 128K causal call within 64 MiB
SCRATCH_PER_RESULT = 16  # very long calls may use 1/16 of their result's size instead


def scratch_bound(geom: Geometry, tiling: Tiling) -> int:
    """The one-pass kernel's default scratch bound for a call.

    A call whose whole scratch is at most 1.5 GiB runs in one kernel call: at 64K tokens
    and 32 heads that is 0.06-1.06 GiB for blocks of 4096 down to 64, and there row steps
    of 48 MiB measured 6-17% slower (tuning.md, note 19). Larger calls step within
    48 MiB, or within 1/16 of the float32 block sums they return where that is more (at
    1M tokens x 32 heads the result is 8 GiB, and 512 MiB hold 13K rows of one head per
    call where 48 MiB would hold 1.3K).
    """
    whole = scratch_bytes(geom, tiling, CallShape(geom.q_heads, padded_rows(geom, tiling)))
    if whole <= ONE_PASS_WHOLE_CALL_BYTES:
        return whole
    result = (geom.batch * geom.q_heads * geom.q_blocks * geom.k_blocks
              * jnp.dtype(jnp.float32).itemsize)
    return max(ONE_PASS_STEP_BYTES, result // SCRATCH_PER_RESULT)


def passes_for(geom: Geometry, tiling: Tiling, max_scratch_bytes: int | None = None) -> int:
    """1 or 2: the kernel `block_sums` picks by default for this call (the one-pass kernel
    if one row step of one head fits in `max_scratch_bytes`, default `scratch_bound`)."""
    bound = max_scratch_bytes or scratch_bound(geom, tiling)
    return 1 if call_shape(geom, tiling, bound) else 2


@functools.partial(jax.jit, static_argnames=("geom", "causal", "norm", "tiling", "passes",
                                             "max_scratch_bytes", "interpret"))
def block_sums(q: jax.Array, k: jax.Array, *, geom: Geometry, causal: bool, norm: float,
               key_len: jax.Array | None = None, block_table: jax.Array | None = None,
               tiling: Tiling | None = None, passes: int | None = None,
               max_scratch_bytes: int | None = None,
               interpret: bool = False) -> jax.Array:
    """Pallas sections 1-3: float32 block sums `[B, Hq, ceil(Lq/bs), ceil(Lk/bs)]`.

    q: `[B, Hq, Lq, D]`, k: `[B, Hkv, Lk, D]`, same dtype (float32, bfloat16, float16).
    key_len: int32 `[1]`, the keys in use when k is a buffer padded to a capacity
    (non-causal only; the default is all Lk; more than Lk counts as Lk): later keys are
    never visible, whatever the buffer holds there, and one compiled kernel serves every
    key_len. block_table: int32 `[B, pages_per_seq]` when k is a paged cache
    `[num_pages, page_size, Hkv, D]` (Lk = pages_per_seq * page_size): the kernel reads
    each sequence's pages through the table, no gathered copy; entries past key_len's
    pages may hold anything.
    `tiling` defaults to the measured `default_tiling`; `passes` (1 or 2) to the
    one-pass kernel if one row step of one head fits in `max_scratch_bytes` of scratch
    (default `scratch_bound`).
    """
    tiling = tiling or default_tiling(geom, q.dtype, causal)
    max_scratch_bytes = max_scratch_bytes or scratch_bound(geom, tiling)
    passes = passes or passes_for(geom, tiling, max_scratch_bytes)
    if passes not in (1, 2):
        raise ValueError(f"passes must be 1 or 2, got {passes}")
    args = dict(geom=geom, causal=causal, norm=norm, key_len=key_len,
                block_table=block_table, tiling=tiling, interpret=interpret)
    if passes == 2:
        return two_pass_block_sums(q, k, **args)
    call = call_shape(geom, tiling, max_scratch_bytes)
    if call is None:
        raise ValueError(f"passes=1 needs more than max_scratch_bytes={max_scratch_bytes} "
                         f"bytes of scratch for one row step of one head of {geom}: use "
                         f"passes=2")
    return one_pass_block_sums(q, k, call=call, **args)
