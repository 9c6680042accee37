"""GPU-only checks at serving lengths: memory of the 128K causal call, and a 1M-token call.

Run on a GPU with `pytest -m gpu tests/test_gpu_large.py`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench.cases import ESTIMATE
from xattn_jax import xattn_estimate

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")]

MiB = 2**20
WORKSPACE_LIMIT = 64 * MiB


def _qk(heads: int, kv_heads: int, length: int, seed: int):
    kq, kk = jax.random.split(jax.random.PRNGKey(seed))
    q = jax.random.normal(kq, (1, heads, length, 128), jnp.bfloat16)
    k = jax.random.normal(kk, (1, kv_heads, length, 128), jnp.bfloat16)
    return q, k


def test_128k_causal_memory_beyond_inputs_and_outputs():
    """The 128K causal call allocates its outputs and at most 64 MiB of workspace: the
    score matrix (2 GiB per head group here) is never materialized."""
    shape = ESTIMATE["causal-128k"]
    q = jax.ShapeDtypeStruct((1, shape.q_heads, shape.q_len, shape.head_dim), shape.dtype)

    def call(q, k):
        return xattn_estimate(q, k, block_size=shape.block_size, stride=shape.stride,
                              causal=True, impl="triton")

    stats = jax.jit(call).lower(q, q).compile().memory_analysis()
    blocks = shape.q_len // shape.block_size
    outputs = shape.q_heads * blocks * blocks * (4 + 1)  # float32 block sums + bool mask
    # XLA adds the output tuple's table of pointers (16 bytes here) to the outputs.
    assert outputs <= stats.output_size_in_bytes < outputs + MiB
    assert stats.temp_size_in_bytes <= WORKSPACE_LIMIT, stats.temp_size_in_bytes / MiB


def test_one_million_tokens_causal():
    """1M tokens (64-bit offsets): every full query block's row sums to block_size / S,
    and the last query block equals a separate call on the last 128 queries only."""
    length, block = 1 << 20, 128
    q, k = _qk(1, 1, length, seed=np.random.default_rng().integers(2**31))
    sums, mask = xattn_estimate(q, k, block_size=block, stride=8, causal=True, impl="triton")
    rows = np.asarray(sums[0, 0].sum(axis=-1))
    np.testing.assert_allclose(rows, block // 8, rtol=1e-4)
    tail_sums, tail_mask = xattn_estimate(q[:, :, -block:], k, block_size=block, stride=8,
                                          causal=True, impl="triton")
    np.testing.assert_allclose(np.asarray(tail_sums[0, 0, 0]), np.asarray(sums[0, 0, -1]),
                               rtol=1e-5, atol=1e-9)
    assert bool(jnp.all(tail_mask[0, 0, 0] == mask[0, 0, -1]))
