"""Public entry points. Each checks its arguments and picks an implementation.

`impl`: "reference" is the plain-JAX reference (`xattn_jax.reference`); "pallas" runs the
Pallas kernels (`xattn_jax.triton`), compiled through Triton on a GPU and in Pallas
interpret mode elsewhere (slow: for tests); "auto" is Pallas on a GPU, the reference
elsewhere.
"""

from __future__ import annotations

import functools

import jax

from xattn_jax import reference
from xattn_jax.geometry import (Geometry, check_impl, check_norm, check_qk, check_scratch_bytes,
                                threshold_per_head)
from xattn_jax.triton import block_sums as pallas_block_sums
from xattn_jax.triton import select_blocks as pallas_select
from xattn_jax.triton import strided_scores as pallas_scores

PALLAS_MAX_KEY_BLOCKS = 16384  # wider rows select with the reference (XLA sort)

_reference_scores = jax.jit(reference.strided_scores, static_argnums=(2, 3))


def resolve_backend(impl: str) -> str:
    """Resolves `impl` to "reference", "pallas" or "interpret" for the current backend."""
    on_gpu = jax.default_backend() == "gpu"
    if check_impl(impl) == "reference" or (impl == "auto" and not on_gpu):
        return "reference"
    return "pallas" if on_gpu else "interpret"


def strided_scores(q: jax.Array, k: jax.Array, *, stride: int = 8, norm: float = 1.0,
                   impl: str = "auto") -> jax.Array:
    """ESTIMATE.md section 1: the strided antidiagonal scores.

    q: `[B, Hq, Lq, D]`, k: `[B, Hkv, Lk, D]`, float32 / bfloat16 / float16.
    Returns float32 `[B, Hq, ceil(Lq/stride), ceil(Lk/stride)]`. This materializes the whole
    O((L/stride)^2) matrix; `xattn_estimate` never does.
    """
    geom = check_qk(q, k, stride=stride, block_size=stride, causal=False)
    norm = check_norm(norm)
    backend = resolve_backend(impl)
    if backend == "reference":
        return _reference_scores(q, k, geom, norm)
    return pallas_scores.strided_scores(q, k, geom=geom, norm=norm,
                                        interpret=backend == "interpret")


def select_blocks(block_sums: jax.Array, threshold=0.9, *, causal: bool = True,
                  keep_sink: bool = False, keep_recent: bool = False,
                  impl: str = "auto") -> jax.Array:
    """ESTIMATE.md section 4 on given block sums: float32 `[B, Hq, qb, kb]` -> bool mask.

    threshold: a float in (0, 1] or one value per query head, `[Hq]`.
    """
    if getattr(block_sums, "ndim", None) != 4:
        raise ValueError(f"block_sums must have rank 4 [B, Hq, qb, kb], got "
                         f"shape {getattr(block_sums, 'shape', None)}")
    if block_sums.shape[-2] > block_sums.shape[-1]:
        raise ValueError(f"block_sums may not have more query blocks than key blocks, "
                         f"got shape {block_sums.shape}")
    t = threshold_per_head(threshold, block_sums.shape[1])
    return _select_jit(block_sums, t, causal=bool(causal), keep_sink=bool(keep_sink),
                       keep_recent=bool(keep_recent), backend=resolve_backend(impl))


def _select(sums, threshold, *, causal, keep_sink, keep_recent, backend):
    sums = sums.astype("float32")
    rules = dict(causal=causal, keep_sink=keep_sink, keep_recent=keep_recent)
    if backend == "reference" or sums.shape[-1] > PALLAS_MAX_KEY_BLOCKS:
        return reference.select_blocks(sums, threshold, **rules)
    return pallas_select.select_blocks(sums, threshold, interpret=backend == "interpret",
                                       **rules)


# the public select_blocks as one compiled call, not the reference's ops one by one
_select_jit = jax.jit(_select, static_argnames=("causal", "keep_sink", "keep_recent",
                                                "backend"))


@functools.partial(jax.jit, static_argnames=("geom", "causal", "norm", "keep_sink",
                                             "keep_recent", "backend", "max_scratch_bytes"))
def _estimate(q, k, threshold, *, geom: Geometry, causal: bool, norm: float,
              keep_sink: bool, keep_recent: bool, backend: str, max_scratch_bytes: int | None):
    if backend == "reference":
        sums = reference.block_sums(q, k, geom, causal=causal, norm=norm)
    else:
        sums = pallas_block_sums.block_sums(q, k, geom=geom, causal=causal, norm=norm,
                                            max_scratch_bytes=max_scratch_bytes,
                                            interpret=backend == "interpret")
    mask = _select(sums, threshold, causal=causal, keep_sink=keep_sink,
                   keep_recent=keep_recent, backend=backend)
    return sums, mask


def xattn_estimate(q: jax.Array, k: jax.Array, *, block_size: int = 128, stride: int = 8,
                   threshold=0.9, causal: bool = True, norm: float = 1.0,
                   keep_sink: bool = False, keep_recent: bool = False,
                   impl: str = "auto",
                   max_scratch_bytes: int | None = None) -> tuple[jax.Array, jax.Array]:
    """The XAttention estimate (ESTIMATE.md sections 1-4) as one jitted call.

    Args:
      q: queries `[B, Hq, Lq, D]`, the last Lq positions of the key sequence.
      k: keys `[B, Hkv, Lk, D]`, Lq <= Lk, Hq % Hkv == 0 (GQA: query head h reads key head
        h // (Hq // Hkv)). float32, bfloat16 or float16, the same for both; any lengths.
      block_size: tokens per block, a positive multiple of `stride`.
      stride: S, tokens per antidiagonal group.
      threshold: share of each row's mass to keep, in (0, 1]: a float, or `[Hq]` floats.
        Passed as data, so changing it does not recompile.
      causal: causal masking; with Lq < Lk, Lk - Lq must be a multiple of block_size.
      norm: extra divisor of the scores (a softmax temperature).
      keep_sink / keep_recent: also always keep key block 0 / the diagonal block (these
        are always kept in causal mode).
      impl: "auto", "pallas" or "reference" (see the module docstring).
      max_scratch_bytes: bound on the Pallas kernel's scratch, in bytes. None: the whole
        scratch where it fits in 1.5 GiB (0.6 GiB at 64K tokens, 32 heads, block 128),
        else steps within 48 MiB (`pallas.block_sums.scratch_bound`): kernel calls over
        as many whole heads as fit, or over one head's rows in steps. A lower bound takes
        more steps (measured up to 17% slower at 64K); one below a single row step of one
        head runs the two-pass kernel (no scratch, each score computed twice). The
        reference ignores it.

    Returns:
      `(block_sums, mask)`: float32 and bool, both `[B, Hq, ceil(Lq/block_size),
      ceil(Lk/block_size)]`. Each full query block's row of block_sums sums to
      block_size / stride.

    Non-finite inputs: a NaN in q or k, or an inf in q, makes every softmax row that sees
    it NaN, so the block sums of its query block are NaN, and the mask of such a row keeps
    every block it may attend to (dense attention) instead of dropping blocks on garbage.
    An inf in k gives the rows that see it a score of +inf (the row becomes NaN, as above)
    or -inf (that key gets weight 0, like a masked key; the row stays finite), by the sign
    of the matching q entry.
    """
    geom = check_qk(q, k, stride=stride, block_size=block_size, causal=causal)
    t = threshold_per_head(threshold, geom.q_heads)
    return _estimate(q, k, t, geom=geom, causal=bool(causal), norm=check_norm(norm),
                     keep_sink=bool(keep_sink), keep_recent=bool(keep_recent),
                     backend=resolve_backend(impl),
                     max_scratch_bytes=check_scratch_bytes(max_scratch_bytes))
