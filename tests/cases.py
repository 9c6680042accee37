"""Test helper: the q/k shape cases of the block-sum and the estimate suites, in the one
format of `bench.cases`."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

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
