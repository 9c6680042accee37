"""Sections 1-3 fused: the Triton-backend block sums, computed tile by tile on the tensor
cores and never storing the score matrix. The plan (`plan.plan_block_sums`) picks one of
two kernels:

- `one_pass`: every score once; stores two small row statistics per row and key tile
  and combines them exactly afterwards. Its scratch is bounded: a call whose whole
  scratch is large covers the heads, and if need be each head's rows, in several kernel
  calls, one after another (`Plan.call_heads`, `Plan.call_rows`);
- `two_pass`: every score twice (row statistics, then block sums); no scratch. Used only
  where not even one row step of one head of the one-pass kernel fits in the bound.
"""

from __future__ import annotations

import functools

import jax

from xattn_jax.triton.one_pass import one_pass_block_sums
from xattn_jax.triton.plan import ONE_PASS, Plan
from xattn_jax.triton.two_pass import two_pass_block_sums


@functools.partial(jax.jit, static_argnames=("plan", "causal", "norm"))
def block_sums(q: jax.Array, k: jax.Array, *, plan: Plan, causal: bool, norm: float,
               key_len: jax.Array | None = None,
               block_table: jax.Array | None = None) -> jax.Array:
    """Triton-backend sections 1-3: float32 block sums `[B, Hq, ceil(Lq/bs), ceil(Lk/bs)]`.

    q: `[B, Hq, Lq, D]`, k: `[B, Hkv, Lk, D]`, same dtype (float32, bfloat16, float16).
    plan: from `plan.plan_block_sums` for this geometry, dtype and causal flag.
    key_len: int32 `[1]`, the keys in use when k is a buffer padded to a capacity
    (non-causal only; the default is all Lk; more than Lk counts as Lk): later keys are
    never visible, whatever the buffer holds there, and one compiled kernel serves every
    key_len. block_table: int32 `[B, pages_per_seq]` when k is a paged cache
    `[num_pages, page_size, Hkv, D]` (Lk = pages_per_seq * page_size): the kernel reads
    each sequence's pages through the table, no gathered copy; entries past key_len's
    pages may hold anything (page ids are clamped into the cache).
    """
    kernel = one_pass_block_sums if plan.kernel == ONE_PASS else two_pass_block_sums
    return kernel(q, k, plan=plan, causal=causal, norm=norm, key_len=key_len,
                  block_table=block_table)
