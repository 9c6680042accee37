"""The Mosaic backend: Pallas kernels on the Mosaic GPU backend for NVIDIA Hopper GPUs
(H100, H200): block-sparse attention (of a whole call, and of a ragged step), and the
estimate's fused block sums (sections 1-3,
and so the chunk scores of section 5: a count of keys in use, paged caches with pages of
a multiple of 64 x stride tokens). Its companion backend runs the estimate's other ops.

Importing this module never imports Mosaic GPU: the kernels' modules are imported when a
call runs (the plans are plain Python).
"""

from __future__ import annotations

import dataclasses

import jax

from xattn_jax.backend import AttentionCall, Backend
from xattn_jax.geometry import Geometry
from xattn_jax import mosaic
from xattn_jax.mosaic.attention import plan as attention_plan
from xattn_jax.mosaic.attention import ragged_plan
from xattn_jax.mosaic.estimate import heuristics
from xattn_jax.mosaic.estimate import plan as estimate_plan
from xattn_jax.reference.backend import ReferenceBackend
from xattn_jax.sampled_geometry import SampledGeometry


@dataclasses.dataclass(frozen=True)
class MosaicBackend(Backend):
    """impl="mosaic" (the ops' arguments: `xattn_jax.backend.Backend`).

    companion: the backend running the estimate's ops this one has no kernel for
      (strided_scores, select_blocks, sampled_block_mass) and, with `fallback`, the block sums it does not
      take (`xattn_jax.impls` gives it the Triton backend).
    fallback: as "auto" resolves on Hopper: block sums the Mosaic kernel does not take,
      or takes in fewer CTAs than `heuristics.auto_min_ctas` (docs/tuning.md:
      mosaic-auto-min-ctas), run on the companion, and attention calls the kernel does
      not take (dtype, head dim, block size, page size) on the reference, instead of
      raising.
    """

    companion: Backend
    fallback: bool = False
    name = "mosaic"
    runs_on = "NVIDIA Hopper GPUs"

    def unavailable(self, device, *, compiled: bool) -> str | None:
        del compiled  # never interpreted
        return mosaic.available(device)

    def attention_backend(self, call: AttentionCall) -> Backend:
        reason = attention_plan.unsupported_reason(*call)
        if reason is None:
            return self
        if self.fallback:
            return ReferenceBackend()
        raise ValueError(f"{reason}; impl='reference' or 'auto' take this call")

    def strided_scores(self, q, k, *, geom: Geometry, norm: float) -> jax.Array:
        return self.companion.strided_scores(q, k, geom=geom, norm=norm)

    def block_sums(self, q, k, *, geom: Geometry, causal: bool, norm: float, key_len=None,
                   block_table=None, max_scratch_bytes: int | None = None) -> jax.Array:
        page_size = None if block_table is None else k.shape[1]
        plan, reason = block_sums_plan(geom, q.dtype, causal, key_len is not None,
                                       page_size, max_scratch_bytes, auto=self.fallback)
        if plan is None:
            if not self.fallback:
                raise ValueError(reason)
            return self.companion.block_sums(q, k, geom=geom, causal=causal, norm=norm,
                                             key_len=key_len, block_table=block_table,
                                             max_scratch_bytes=max_scratch_bytes)
        from xattn_jax.mosaic.estimate import block_sums  # the kernel's call
        return block_sums.block_sums(q, k, plan=plan, norm=norm,
                                     key_len=None if key_len is None else key_len.reshape(1),
                                     block_table=block_table)

    def sampled_block_mass(self, q, k, *, geom: SampledGeometry, causal: bool,
                           key_len=None, block_table=None,
                           max_scratch_bytes: int | None = None) -> jax.Array:
        return self.companion.sampled_block_mass(q, k, geom=geom, causal=causal,
                                                 key_len=key_len, block_table=block_table,
                                                 max_scratch_bytes=max_scratch_bytes)

    def select_blocks(self, sums, threshold, *, causal: bool, keep_sink: bool,
                      keep_recent: bool, diagonal=None) -> jax.Array:
        return self.companion.select_blocks(sums, threshold, causal=causal,
                                            keep_sink=keep_sink, keep_recent=keep_recent,
                                            diagonal=diagonal)

    def ragged_unsupported(self, op: str, geom, dtype) -> str | None:
        if op == "ragged_attention":
            return ragged_plan.unsupported_reason(geom, dtype)
        return self.companion.ragged_unsupported(op, geom, dtype)

    def ragged_attention(self, q, k, v, page_indices, mask, blocks, geom, *, scale: float):
        from xattn_jax.mosaic.attention import ragged_attention  # the kernel's call
        return ragged_attention.ragged_attention(q, k, v, page_indices, mask, blocks, geom,
                                                 scale=scale)

    def ragged_block_sums(self, q, k, page_indices, blocks, geom, *, norm: float):
        return self.companion.ragged_block_sums(q, k, page_indices, blocks, geom, norm=norm)

    def block_sparse_attention(self, q, k, v, mask, **kwargs):
        page_size = None if kwargs.get("block_table") is None else k.shape[1]
        backend = self.attention_backend(AttentionCall(q.shape[-1], v.shape[-1], q.dtype,
                                                       kwargs["block_size"], page_size))
        if backend is not self:
            return backend.block_sparse_attention(q, k, v, mask, **kwargs)
        from xattn_jax.mosaic.attention import block_sparse_attention  # the kernel's call
        return block_sparse_attention.block_sparse_attention(q, k, v, mask, **kwargs)


def block_sums_plan(geom: Geometry, dtype, causal: bool, key_len: bool,
                    page_size: int | None, max_scratch_bytes: int | None, *, auto: bool):
    """`(plan, None)` of the Mosaic block sums for this call, or `(None, reason)` saying
    why they do not take it, or with `auto` (the choice "auto" makes) why the Triton
    kernel runs it faster: fewer than `heuristics.auto_min_ctas` CTAs."""
    reason = estimate_plan.unsupported_reason(geom, dtype, key_len=key_len, causal=causal,
                                              page_size=page_size,
                                              max_scratch_bytes=max_scratch_bytes)
    if reason is not None:
        return None, f"{reason}; impl='triton' or 'auto' take this call"
    plan = estimate_plan.estimate_plan(geom, dtype, causal=causal, page_size=page_size,
                                       max_scratch_bytes=max_scratch_bytes)
    if auto:
        minimum = heuristics.auto_min_ctas(plan.sms)
        if plan.ctas < minimum:
            return None, (f"{plan.ctas} CTAs, fewer than {minimum} (AUTO_MIN_FILL = "
                          f"{heuristics.AUTO_MIN_FILL} of the GPU's SMs)")
    return plan, None
