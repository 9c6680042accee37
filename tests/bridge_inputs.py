"""Test helper: torch inputs of the bridge tests, for shapes of `cases` (the one format of
`bench.cases`), independent JAX copies of them, and the mark of the tests that need CUDA."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
import torch

import xattn_torch_bridge as bridge
from bench.cases import Shape

needs_cuda = pytest.mark.skipif(not bridge.cuda_available(),
                                reason="needs torch CUDA and JAX's CUDA backend")


def qk(rand, shape: Shape, dtype=torch.float32, device="cpu"):
    """Random q `[B, Hq, Lq, D]` and k `[B, Hkv, Lk, D]` of `shape` in the torch `dtype`
    (the shape's own dtype is the JAX tests'), with standard deviation 2 (scores of
    standard deviation 4 / sqrt(stride): peaked, not degenerate softmax rows)."""
    q = torch.from_numpy(rand.rng.standard_normal(shape.q_shape) * 2.0).to(dtype)
    k = torch.from_numpy(rand.rng.standard_normal(shape.k_shape) * 2.0).to(dtype)
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
