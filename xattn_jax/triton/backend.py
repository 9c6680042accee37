"""The Triton backend: the estimate's ops as Pallas kernels on the Triton backend, for
NVIDIA GPUs and, elsewhere, in Pallas' interpret mode (slow: for tests): the block sums,
and on their kernels the sampled rows' block scores. It has no attention kernel."""

from __future__ import annotations

import dataclasses

import jax

from xattn_jax import reference
from xattn_jax.backend import Backend, platform_of
from xattn_jax.geometry import Geometry
from xattn_jax.sampled_geometry import SampledGeometry
from xattn_jax.triton import block_sums as block_sums_kernel
from xattn_jax.triton import ragged_block_sums as ragged_kernel
from xattn_jax.triton import select_blocks as select_kernel
from xattn_jax.triton import strided_scores as scores_kernel
from xattn_jax.triton.plan import plan_block_sums, plan_select_blocks, plan_strided_scores

# wider rows select with the reference, an XLA sort
# (docs/tuning.md: select-reference-above-16384)
MAX_KEY_BLOCKS = 16384


@dataclasses.dataclass(frozen=True)
class TritonBackend(Backend):
    """impl="triton" (the ops' arguments: `xattn_jax.backend.Backend`). interpret: run
    the kernels in Pallas' interpret mode (off a GPU). Each op builds its plan
    (`triton.plan`) at trace time."""

    interpret: bool = False
    name = "triton"
    runs_on = "NVIDIA GPUs; elsewhere Pallas' interpret mode"

    @classmethod
    def for_device(cls, device: jax.Device | None) -> TritonBackend:
        """The kernels compiled for a GPU, interpreted elsewhere."""
        return cls(interpret=platform_of(device) != "gpu")

    def unavailable(self, device, *, compiled: bool) -> str | None:
        platform = platform_of(device)
        if compiled and platform != "gpu":
            return f"impl='triton' compiles for NVIDIA GPUs; found {platform}"
        return None

    def strided_scores(self, q, k, *, geom: Geometry, norm: float) -> jax.Array:
        plan = plan_strided_scores(geom, q.dtype, interpret=self.interpret)
        return scores_kernel.strided_scores(q, k, plan=plan, norm=norm)

    def block_sums(self, q, k, *, geom: Geometry, causal: bool, norm: float, key_len=None,
                   block_table=None, max_scratch_bytes: int | None = None) -> jax.Array:
        plan = plan_block_sums(geom, q.dtype, causal, interpret=self.interpret,
                               max_scratch_bytes=max_scratch_bytes)
        return block_sums_kernel.block_sums(
            q, k, plan=plan, causal=causal, norm=norm,
            key_len=None if key_len is None else key_len.reshape(1), block_table=block_table)

    def sampled_block_mass(self, q, k, *, geom: SampledGeometry, causal: bool,
                           key_len=None, block_table=None,
                           max_scratch_bytes: int | None = None) -> jax.Array:
        # the block-sum kernels on the sampled rows' geometry: single query tokens at the
        # sampled positions against single keys, at the attention's scale
        return self.block_sums(q, k, geom=geom, causal=causal, norm=1.0, key_len=key_len,
                               block_table=block_table, max_scratch_bytes=max_scratch_bytes)

    def select_blocks(self, sums, threshold, *, causal: bool, keep_sink: bool,
                      keep_recent: bool, diagonal=None) -> jax.Array:
        rules = dict(causal=causal, keep_sink=keep_sink, keep_recent=keep_recent,
                     diagonal=diagonal)
        if sums.shape[-1] > MAX_KEY_BLOCKS:
            return reference.select_blocks(sums, threshold, **rules)
        # rows with their own diagonals: one call at the whole width
        plan = plan_select_blocks(sums.shape, causal=causal and diagonal is None,
                                  interpret=self.interpret)
        return select_kernel.select_blocks(sums, threshold, plan=plan, **rules)

    def ragged_unsupported(self, op: str, geom, dtype) -> str | None:
        return ragged_kernel.unsupported_reason(geom, dtype)

    def ragged_block_sums(self, q, k, page_indices, blocks, geom, *, norm: float):
        plan = ragged_kernel.plan_ragged(geom, q.dtype, interpret=self.interpret)
        return ragged_kernel.ragged_block_sums(q, k, page_indices, blocks, plan=plan,
                                               norm=norm)
