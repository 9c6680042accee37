"""The reference backend: the plain-JAX source of truth, on any device, for every op."""

from __future__ import annotations

import dataclasses

import jax

from xattn_jax.backend import Backend
from xattn_jax.geometry import Geometry
from xattn_jax.reference import attention, estimate, ragged
from xattn_jax.reference.paged import gather_pages
from xattn_jax.reference.sampled_rows import block_mass as sampled_block_mass
from xattn_jax.sampled_geometry import SampledGeometry

_strided_scores = jax.jit(estimate.strided_scores, static_argnums=(2, 3))


@dataclasses.dataclass(frozen=True)
class ReferenceBackend(Backend):
    """impl="reference" (the ops' arguments: `xattn_jax.backend.Backend`)."""

    name = "reference"
    runs_on = "any device"

    def strided_scores(self, q, k, *, geom: Geometry, norm: float) -> jax.Array:
        return _strided_scores(q, k, geom, norm)

    def sampled_block_mass(self, q, k, *, geom: SampledGeometry, causal: bool,
                           key_len=None, block_table=None,
                           max_scratch_bytes: int | None = None) -> jax.Array:
        del max_scratch_bytes  # no scratch: the reference materializes a step's scores
        keys = k if block_table is None else gather_pages(k, block_table)
        return sampled_block_mass(q, keys, key_len, geom=geom, causal=causal)

    def block_sums(self, q, k, *, geom: Geometry, causal: bool, norm: float, key_len=None,
                   block_table=None, max_scratch_bytes: int | None = None) -> jax.Array:
        del max_scratch_bytes  # no scratch: the reference materializes the scores
        keys = k if block_table is None else gather_pages(k, block_table)
        return estimate.block_sums(q, keys, geom, causal=causal, norm=norm, key_len=key_len)

    def select_blocks(self, sums, threshold, *, causal: bool, keep_sink: bool,
                      keep_recent: bool, diagonal=None) -> jax.Array:
        return estimate.select_blocks(sums, threshold, causal=causal, keep_sink=keep_sink,
                                      keep_recent=keep_recent, diagonal=diagonal)

    def block_sparse_attention(self, q, k, v, mask, **kwargs):
        return attention.block_sparse_attention(q, k, v, mask, **kwargs)

    def ragged_block_sums(self, q, k, page_indices, blocks, geom, *, norm: float):
        keys, _ = ragged.split_cache(k, None if geom.fused else k)
        return ragged.block_sums(q, keys, page_indices, blocks, geom, norm=norm)

    def ragged_attention(self, q, k, v, page_indices, mask, blocks, geom, *, scale: float):
        keys, values = ragged.split_cache(k, v)
        return ragged.attention(q, keys, values, page_indices, mask, blocks, geom,
                                scale=scale)
