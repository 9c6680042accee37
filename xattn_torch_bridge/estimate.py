"""`xattn_jax.xattn_estimate` for torch tensors, over the zero-copy hand-off of `dlpack`.

q and k go to JAX without a copy, with one stream-order step for both
(`dlpack.views_for_one_computation`: q's view carries it, and the estimate reads both in
one computation); the estimate runs where they live through `xattn_jax.xattn_estimate`,
whose jitted function is compiled once per shape, dtype, device and static argument and
reused after that; its two results come back as torch tensors without a copy, ordered
before later work on torch's current stream.
"""

from __future__ import annotations

import jax
import torch
import xattn_jax
from xattn_jax.checks import check_flag

from xattn_torch_bridge.dlpack import (FLOAT_DTYPES, place_of, to_torch,
                                      views_for_one_computation)


def _detached(x):
    return x.detach() if isinstance(x, torch.Tensor) and x.requires_grad else x


def _impl_for_cpu(impl: str) -> str:
    """CPU tensors run on JAX's CPU device. Where JAX's default backend is a GPU, xattn_jax
    would compile its Pallas kernels for the GPU, so "auto" means the reference there."""
    if jax.default_backend() == "cpu":
        return impl
    if impl == "pallas":
        raise ValueError(
            "impl='pallas' needs q and k on a CUDA device when JAX's default backend is "
            f"{jax.default_backend()!r}: move them to CUDA, or use impl='auto' or "
            "'reference' for CPU tensors")
    return "reference" if impl == "auto" else impl


def xattn_estimate(q: torch.Tensor, k: torch.Tensor, *, copy: bool = False,
                   **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """The XAttention estimate (ESTIMATE.md sections 1-4) of torch tensors.

    Takes the keyword arguments of `xattn_jax.xattn_estimate` (block_size, stride,
    threshold, causal, norm, keep_sink, keep_recent, impl, max_scratch_bytes) with the same
    defaults and meaning, and returns its results as torch tensors. Differences:

    Args:
      q: `[B, Hq, Lq, D]`, k: `[B, Hkv, Lk, D]`, float32, bfloat16 or float16 torch
        tensors, both on the CPU or both on one CUDA device. Tensors that require grad are
        detached (the estimate has no gradient).
      copy: False refuses a q or k that is not contiguous or not aligned (ValueError);
        True copies both into fresh contiguous tensors first.
      threshold: may also be a torch tensor of `Hq` values, read to the host (as
        `xattn_jax` reads every threshold, to check it).
      impl: for CPU tensors where JAX's default backend is a GPU, "auto" runs the
        reference and "pallas" is refused.

    Returns:
      `(block_sums, mask)`: float32 and bool torch tensors `[B, Hq, ceil(Lq/block_size),
      ceil(Lk/block_size)]` on q's device, sharing memory with JAX's results.
    """
    copy = check_flag("copy", copy)
    q, place = place_of(_detached(q), "q", copy, FLOAT_DTYPES)
    k, k_place = place_of(_detached(k), "k", copy, FLOAT_DTYPES)
    if k_place is not place:
        raise ValueError(f"q and k must be on the same device, got {q.device} and {k.device}")
    if isinstance(kwargs.get("threshold"), torch.Tensor):
        kwargs["threshold"] = kwargs["threshold"].tolist()
    if place.index is None:
        kwargs["impl"] = _impl_for_cpu(kwargs.get("impl", "auto"))
    sums, mask = xattn_jax.xattn_estimate(*views_for_one_computation(place, q, k), **kwargs)
    return to_torch(sums), to_torch(mask)
