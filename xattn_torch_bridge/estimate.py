"""`xattn_jax.xattn_estimate` for torch tensors, over the zero-copy hand-off of `dlpack`.

q and k go to JAX without a copy, with one stream-order step for both
(`dlpack.views_for_one_computation`: q's view carries it, and the estimate reads both in
one computation); the estimate runs where they live through `xattn_jax.xattn_estimate`,
whose jitted function is compiled once per shape, dtype, device and static argument and
reused after that; its two results come back as torch tensors without a copy, ordered
before later work on torch's current stream.
"""

from __future__ import annotations

import torch
import xattn_jax
from xattn_jax.checks import check_flag

from xattn_torch_bridge.dlpack import (FLOAT_DTYPES, place_of, to_torch,
                                      views_for_one_computation)


def _detached(x):
    return x.detach() if isinstance(x, torch.Tensor) and x.requires_grad else x


def xattn_estimate(q: torch.Tensor, k: torch.Tensor, *, copy: bool = False,
                   **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """The XAttention estimate (docs/estimate.md sections 1-4) of torch tensors.

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
      impl: resolved for the device q and k live on (`xattn_jax.impls`): for CPU
        tensors "auto" is the reference and "triton" runs in interpret mode.

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
    sums, mask = xattn_jax.xattn_estimate(*views_for_one_computation(place, q, k), **kwargs)
    return to_torch(sums), to_torch(mask)
