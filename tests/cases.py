"""Test helper: a q/k shape case shared by the block-sum and the estimate suites."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from xattn_jax.geometry import Geometry

# float32 results, relative to the largest reference value: 1e-5 on CPU (the contract),
# a little looser on a GPU (approximate exp2, other summation orders)
GPU_SLACK = 1.0 if jax.default_backend() == "cpu" else 5.0
F32_RTOL = 1e-5 * GPU_SLACK
LOW_RTOL = 2e-3  # bfloat16/float16 inputs, against float64 on the same rounded inputs


@dataclasses.dataclass(frozen=True)
class QKCase:
    """q `[batch, q_heads, q_len, head_dim]`, k `[batch, kv_heads, k_len, head_dim]` and
    the estimate's layout."""

    id: str
    batch: int
    q_heads: int
    kv_heads: int
    q_len: int
    k_len: int
    head_dim: int
    stride: int
    block_size: int
    causal: bool
    dtype: object = jnp.float32

    def geom(self) -> Geometry:
        return Geometry(self.batch, self.q_heads, self.kv_heads, self.q_len, self.k_len,
                        self.head_dim, self.stride, self.block_size)

    def inputs(self, rand):
        return rand.qk(self.batch, self.q_heads, self.kv_heads, self.q_len, self.k_len,
                       self.head_dim, stride=self.stride, dtype=self.dtype)

    @property
    def rtol(self) -> float:
        return F32_RTOL if self.dtype == jnp.float32 else LOW_RTOL
