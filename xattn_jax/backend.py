"""What every backend is: a small frozen object that runs the ops (`xattn_jax/reference/`,
`xattn_jax/triton/`, `xattn_jax/mosaic/`, each in its `backend.py`) and says where it
runs; `xattn_jax.impls` holds them by name and resolves each call's `impl` to one.

Backends are hashable values, static arguments of the jitted cores. An op a backend has
no kernel for raises `not_supported`'s ValueError, so adding an op means adding its
method here (raising that) and to each backend that runs it.
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple

import jax

from xattn_jax.geometry import Geometry
from xattn_jax.sampled_geometry import SampledGeometry

OPS = ("strided_scores", "block_sums", "select_blocks", "block_sparse_attention",
       "sampled_block_mass", "ragged_block_sums", "ragged_attention")


class AttentionCall(NamedTuple):
    """What a backend reads of an attention call to say whether its kernel takes it."""

    head_dim: int
    value_dim: int
    dtype: object
    block_size: int
    page_size: int | None  # tokens per page of a paged cache; None: contiguous k and v


def platform_of(device: jax.Device | None) -> str:
    """The platform of `device` ("cpu", "gpu", ...); None: JAX's default backend's."""
    return device.platform if device is not None else jax.default_backend()


class Backend:
    """The ops of docs/estimate.md, each raising `not_supported` unless a backend runs it.

    name: the backend's `impl` name; runs_on: where it runs, in words.
    """

    name: ClassVar[str]
    runs_on: ClassVar[str]

    def unavailable(self, device: jax.Device | None, *, compiled: bool) -> str | None:
        """Why this backend cannot run on `device` (None: JAX's default one), or None.
        compiled: as "auto" asks, with compiled kernels only (no Pallas interpret mode)."""
        del device, compiled
        return None

    def attention_backend(self, call: AttentionCall) -> Backend:
        """The backend that runs this attention call: this one, unless it hands the calls
        its kernel does not take to another (a ValueError where it hands them to none)."""
        del call
        return self

    def ragged_unsupported(self, op: str, geom, dtype) -> str | None:
        """Why this backend's `op` (ragged_block_sums or ragged_attention) cannot run a
        step of `geom` (a `ragged.geometry.RaggedGeometry`) in `dtype`, or None."""
        del op, geom, dtype
        return None

    def has(self, op: str) -> bool:
        """Whether this backend runs `op` (one of OPS)."""
        return getattr(type(self), op) is not getattr(Backend, op)

    def not_supported(self, op: str, alternatives: str = "impl='auto'") -> ValueError:
        """The refusal of an op this backend does not run; alternatives: what to use."""
        return ValueError(f"impl={self.name!r} ({self.runs_on}) has no {op} kernel; use "
                          f"{alternatives}")

    def strided_scores(self, q: jax.Array, k: jax.Array, *, geom: Geometry,
                       norm: float) -> jax.Array:
        """Section 1: q `[B, Hq, Lq, D]`, k `[B, Hkv, Lk, D]` -> float32
        `[B, Hq, ceil(Lq/S), ceil(Lk/S)]`."""
        raise self.not_supported("strided_scores")

    def sampled_block_mass(self, q: jax.Array, k: jax.Array, *, geom: SampledGeometry,
                           causal: bool, key_len: jax.Array | None = None,
                           block_table: jax.Array | None = None,
                           max_scratch_bytes: int | None = None) -> jax.Array:
        """The sampled rows' block scores (docs/estimate.md, "Sampled rows"): float32
        `[B, Hq, qb, kb]` for geom's rows per query block and softmax scale. key_len,
        block_table and max_scratch_bytes: as in `block_sums` (key_len, block_table:
        non-causal calls, section 5's keys)."""
        raise self.not_supported("sampled_block_mass")

    def block_sums(self, q: jax.Array, k: jax.Array, *, geom: Geometry, causal: bool,
                   norm: float, key_len: jax.Array | None = None,
                   block_table: jax.Array | None = None,
                   max_scratch_bytes: int | None = None) -> jax.Array:
        """Sections 1-3: float32 `[B, Hq, qb, kb]`. key_len: int32 `[]`, the keys in use
        of a padded buffer (None: all); block_table: int32 `[B, pages_per_seq]` when k is
        a paged cache `[num_pages, page_size, Hkv, D]`; max_scratch_bytes: the kernels'
        scratch bound per kernel call (None: `row_statistics.DEFAULT_SCRATCH_BYTES`)."""
        raise self.not_supported("block_sums")

    def select_blocks(self, sums: jax.Array, threshold: jax.Array, *, causal: bool,
                      keep_sink: bool, keep_recent: bool,
                      diagonal: jax.Array | None = None) -> jax.Array:
        """Section 4's threshold rule: float32 sums `[B, Hq, qb, kb]`, threshold float32
        `[Hq]` -> bool mask `[B, Hq, qb, kb]`. diagonal: int32 `[qb]`, each row's diagonal
        block where it is not i + kb - qb (a ragged step's rows)."""
        raise self.not_supported("select_blocks")

    def block_sparse_attention(self, q: jax.Array, k: jax.Array, v: jax.Array,
                               mask: jax.Array, *, block_size: int, causal: bool,
                               scale: float | None, return_lse: bool, k_len=None,
                               block_table=None):
        """Section 6 (the arguments of `reference.block_sparse_attention`): out
        `[B, Hq, Lq, Dv]` in q's dtype, and with return_lse float32 lse `[B, Hq, Lq]`."""
        raise self.not_supported("block_sparse_attention")

    def ragged_block_sums(self, q: jax.Array, k: jax.Array, page_indices: jax.Array,
                          blocks, geom, *, norm: float) -> jax.Array:
        """Sections 1-3 of a ragged step (docs/estimate.md, "Ragged steps"): q `[T, Hq,
        D]`, k a paged cache `[num_pages, page_size, Hkv, D]` or a fused one viewed
        `[num_pages, page_size, Hkv, 2, D]`, page_indices int32 `[S, pages_per_seq]`,
        blocks a `ragged.layout.RaggedBlocks`, geom a `ragged.geometry.RaggedGeometry` ->
        float32 `[Hq, QB, KB]`, valid in the rows of estimated sequences."""
        raise self.not_supported("ragged_block_sums")

    def ragged_attention(self, q: jax.Array, k: jax.Array, v: jax.Array | None,
                         page_indices: jax.Array, mask: jax.Array, blocks, geom, *,
                         scale: float) -> jax.Array:
        """Section 6 of a ragged step: q `[T, Hq, D]`, k and v paged caches (or v None and
        k a fused cache's view, as in `ragged_block_sums`), mask bool `[Hq, QB, KB]` ->
        `[T, Hq, Dv]` in q's dtype, zero in rows of no live sequence."""
        raise self.not_supported("ragged_attention")
