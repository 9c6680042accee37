"""Test helper: torch inputs of the bridge tests and independent JAX copies of them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

# (B, Hq, Hkv, Lq, Lk, D), keyword arguments of the estimate
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


def jax_of(t: torch.Tensor) -> jax.Array:
    """An independent JAX copy of a torch tensor, through numpy, committed to the JAX
    device of the tensor's device as the bridge's arrays are (so both calls compute in the
    same place and share one compiled function: jit compiles committed and uncommitted
    arguments separately)."""
    values = t.cpu().float().numpy().astype(jnp.dtype(str(t.dtype).removeprefix("torch.")))
    if t.device.type == "cpu":
        return jax.device_put(values, jax.devices("cpu")[0])
    return jax.device_put(values, next(d for d in jax.devices("cuda")
                                       if d.local_hardware_id == t.device.index))
