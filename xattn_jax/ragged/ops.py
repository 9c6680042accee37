"""The implementations of a ragged step's three stages: the estimate's block sums, the
selection, the attention.

- "reference": plain JAX (`xattn_jax.reference.ragged`), any device.
- "triton": the block sums as a Pallas Triton-backend kernel (NVIDIA GPUs; Pallas'
  interpret mode elsewhere, for tests); attention: the reference.
- "mosaic": the attention as a Pallas Mosaic GPU kernel (Hopper); the block sums as
  "triton".
- "auto": on a GPU the kernels that run there, else the reference.
"""

from __future__ import annotations

import dataclasses

import jax

from xattn_jax import impls
from xattn_jax.ragged.geometry import RaggedGeometry
from xattn_jax.reference import ragged as reference_ragged
from xattn_jax.reference.estimate import select_blocks as reference_select


def local_geometry(geom: RaggedGeometry, q: jax.Array, k: jax.Array) -> RaggedGeometry:
    """`geom` with the heads of the arrays at hand (one shard's, under partitioning)."""
    kv_heads = k.shape[2] // 2 if geom.fused else k.shape[2]
    return dataclasses.replace(geom, q_heads=q.shape[1], kv_heads=kv_heads)


@dataclasses.dataclass(frozen=True)
class RaggedOps:
    """A resolved implementation of the three stages; hashable (a static jit argument).
    estimate / attention: the backend of each ("reference", "triton", "mosaic")."""

    estimate: str = "reference"
    attention_backend: str = "reference"
    interpret: bool = False

    def block_sums(self, q, k, page_indices, blocks, geom: RaggedGeometry, *,
                   norm: float) -> jax.Array:
        """float32 `[Hq, QB, KB]`, valid in the rows of estimated sequences
        (`reference.ragged.block_sums`)."""
        if self.estimate == "triton":
            from xattn_jax.triton import ragged_block_sums as triton_ragged
            plan = triton_ragged.plan_ragged(geom, q.dtype, interpret=self.interpret)
            return triton_ragged.ragged_block_sums(q, k, page_indices, blocks, plan=plan,
                                                   norm=norm)
        keys = k if not geom.fused else k[:, :, :, 0]
        return reference_ragged.block_sums(q, keys, page_indices, blocks, geom, norm=norm)

    def select(self, sums, threshold, *, diagonal) -> jax.Array:
        """Section 4 with per-row diagonals: bool, the shape of sums `[1, Hq, QB, KB]`."""
        if self.estimate == "triton" and sums.shape[-1] <= impls.TRITON_MAX_KEY_BLOCKS:
            from xattn_jax.triton import select_blocks as triton_select
            from xattn_jax.triton.plan import plan_select_blocks
            plan = plan_select_blocks(sums.shape, causal=False, interpret=self.interpret)
            return triton_select.select_blocks(sums, threshold, plan=plan, causal=True,
                                               diagonal=diagonal)
        return reference_select(sums, threshold, causal=True, diagonal=diagonal)

    def attention(self, q, k, v, page_indices, mask, blocks, geom: RaggedGeometry, *,
                  scale: float) -> jax.Array:
        """`[T, Hq, Dv]` (`reference.ragged.attention`)."""
        keys, values = reference_ragged.split_cache(k, v)
        return reference_ragged.attention(q, keys, values, page_indices, mask, blocks,
                                          geom, scale=scale)


def resolve(impl: str, q, geom: RaggedGeometry) -> RaggedOps:
    """The stages' implementations that `impl` names for q's device (a ValueError for a
    name not in `impls.IMPLS`)."""
    if impl not in impls.IMPLS:
        raise ValueError(f"impl must be one of {impls.IMPLS}, got {impl!r}")
    on_gpu = impls.device_of(q) is not None and impls.device_of(q).platform == "gpu" \
        or impls.device_of(q) is None and jax.default_backend() == "gpu"
    if impl == "reference" or (impl == "auto" and not on_gpu):
        return RaggedOps()
    from xattn_jax.triton.ragged_block_sums import unsupported_reason
    reason = unsupported_reason(geom)
    if reason is not None:
        if impl == "auto":
            return RaggedOps()
        raise ValueError(reason)
    return RaggedOps(estimate="triton", interpret=not on_gpu)
