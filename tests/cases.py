"""Test helper: the shape cases of the tests, in the one format of `bench.cases`: the case
classes of the block-sum, estimate and attention suites, and the shapes the bridge and
paged-cache tests share (torch-free, like every module the xattn_jax tests import)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

import np_attention
from bench.cases import Shape

# float32 results, relative to the largest reference value: 1e-5 on CPU (the contract),
# a little looser on a GPU (approximate exp2, other summation orders)
GPU_SLACK = 1.0 if jax.default_backend() == "cpu" else 5.0
F32_RTOL = 1e-5 * GPU_SLACK
LOW_RTOL = 2e-3  # bfloat16/float16 inputs, against float64 on the same rounded inputs


@dataclasses.dataclass(frozen=True)
class QKCase(Shape):
    """A `bench.cases.Shape` with seeded test inputs and its tolerance."""

    def inputs(self, rand):
        return rand.qk(self.batch, self.q_heads, self.kv_heads, self.q_len, self.k_len,
                       self.head_dim, stride=self.stride, dtype=self.dtype)

    @property
    def rtol(self) -> float:
        return F32_RTOL if self.dtype == jnp.float32 else LOW_RTOL


@dataclasses.dataclass(frozen=True)
class EstimateCase(QKCase):
    """A `QKCase` with the estimate's selection rules and a threshold for the tests that
    use a fixed one (0.9, the estimate's default)."""

    keep_sink: bool = False
    keep_recent: bool = False
    threshold: float = 0.9

    @property
    def rules(self) -> dict:
        """The selection's keyword arguments: causal, keep_sink, keep_recent."""
        return dict(causal=self.causal, keep_sink=self.keep_sink, keep_recent=self.keep_recent)

    @property
    def options(self) -> dict:
        """The keyword arguments of `xattn_estimate` (xattn_jax's, the bridge's and the
        torch reference's) but the threshold: block_size, stride and the rules."""
        return dict(block_size=self.block_size, stride=self.stride, **self.rules)


@dataclasses.dataclass(frozen=True)
class AttentionCase(Shape):
    """A `bench.cases.Shape` for block-sparse attention, with the random block mask its
    tests draw.

    stride, block_size and causal default to `xattention`'s (8, 128, True), so that a case
    names only what it changes; density: the share of key blocks the mask keeps;
    empty_rows: the share of query-block rows it leaves without any; keys_in_use: the keys
    a call sees, its k_len (None: all k_len).
    """

    stride: int = 8
    block_size: int = 128
    causal: bool = True
    density: float = 0.5
    empty_rows: float = 0.0
    keys_in_use: int | None = None

    @property
    def mask_shape(self) -> tuple[int, int, int, int]:
        """`[batch, q_heads, ceil(q_len / block_size), ceil(k_len / block_size)]`"""
        return (self.batch, self.q_heads, -(-self.q_len // self.block_size),
                -(-self.k_len // self.block_size))

    @property
    def options(self) -> dict:
        """The keyword arguments of the attention that the case fixes: block_size, causal."""
        return dict(block_size=self.block_size, causal=self.causal)

    def qkv(self, rand, qk_scale: float = 1.0) -> tuple[jax.Array, jax.Array, jax.Array]:
        """q, k and v of this shape and dtype, standard normal, q and k times qk_scale."""
        return (rand.normal(self.q_shape, self.dtype, qk_scale),
                rand.normal(self.k_shape, self.dtype, qk_scale),
                rand.normal(self.v_shape, self.dtype))

    def mask(self, rand) -> jax.Array:
        """A random bool mask `mask_shape` of this case's density and empty rows."""
        return jnp.asarray(np_attention.random_mask(rand.rng, self.mask_shape,
                                                    density=self.density,
                                                    empty_rows=self.empty_rows))


# the estimate cases each checked through the bridge against xattn_jax and the torch
# reference (test_bridge_estimate.py, test_bridge_reference.py)
BRIDGE = {c.id: c for c in (
    EstimateCase("causal-gqa", 1, 4, 2, 256, 256, 32, 8, 32, True),
    EstimateCase("causal-chunk", 2, 2, 2, 96, 224, 16, 8, 64, True),
    EstimateCase("ragged-noncausal", 1, 2, 1, 100, 200, 16, 4, 16, False, keep_sink=True,
                 keep_recent=True, threshold=0.8),
)}

# the bridge's GPU tests: GQA 8:2 at 1k x 2k, and a small GQA 4:2 shape for the stream
# tests (v head dims for the attention)
GPU_GQA = EstimateCase("gpu-gqa-causal", 1, 8, 2, 1024, 2048, 64, 8, 128, True,
                       v_head_dim=64)
GPU_SMALL = EstimateCase("gpu-gqa-512", 1, 4, 2, 512, 512, 64, 8, 64, True, v_head_dim=64)

PAGE_SIZE = 64  # tokens per page of the paged-cache tests' caches
# the paged-cache tests (test_kv_cache, test_policy, test_bridge_bad_inputs,
# test_bridge_compile): a chunk of 48 queries in 4 heads over a context of 5 pages and 17
# tokens (a partial last page), 2 KV heads of 16, scored with stride 8 at estimate blocks
# of 32; tests vary the lengths (and test_bridge_compile the page size)
PAGED = EstimateCase("paged-chunk", 1, 4, 2, 48, 5 * PAGE_SIZE + 17, 16, 8, 32, False)
