"""Test helper: the torch inputs the bridge suites share (the same shapes, so that each
compiles once in a session)."""

from __future__ import annotations

import jax
import pytest
import torch

# (B, Hq, Hkv, Lq, Lk, D), keyword arguments
CASES = {
    "causal-gqa": ((1, 4, 2, 256, 256, 32), dict(block_size=32, stride=8, causal=True)),
    "causal-chunk": ((2, 2, 2, 96, 224, 16), dict(block_size=64, stride=8, causal=True)),
    "ragged-noncausal": ((1, 2, 1, 100, 200, 16),
                         dict(block_size=16, stride=4, causal=False, keep_sink=True,
                              keep_recent=True, threshold=0.8)),
}


def qk(rand, shape, dtype=torch.float32, device="cpu"):
    """Random q `[B, Hq, Lq, D]` and k `[B, Hkv, Lk, D]` with standard deviation 2 (scores
    of standard deviation 4 / sqrt(stride): peaked, not degenerate softmax rows)."""
    b, hq, hkv, lq, lk, d = shape
    q = torch.from_numpy(rand.rng.standard_normal((b, hq, lq, d)) * 2.0).to(dtype)
    k = torch.from_numpy(rand.rng.standard_normal((b, hkv, lk, d)) * 2.0).to(dtype)
    return q.to(device), k.to(device)


def skip_pallas_off_cpu_backend():
    """Pallas on CPU tensors means interpret mode, which xattn_jax picks only where JAX's
    default backend is the CPU (the gpu tests run the kernels on CUDA tensors)."""
    if jax.default_backend() != "cpu":
        pytest.skip("impl='pallas' on CPU tensors needs JAX's CPU backend")
