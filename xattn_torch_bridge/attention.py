"""`xattn_jax.block_sparse_attention` and `xattn_jax.xattention` for torch tensors.

As `estimate` does for the estimate: the tensors go to JAX without a copy, with one
stream-order step for all of them (`dlpack.views_for_one_computation`), the jitted JAX
function runs where they live (compiled once per shape, dtype, device and static argument),
and the results come back as torch tensors without a copy, ordered before later work on
torch's current stream. Forward only: tensors that require grad are detached.
"""

from __future__ import annotations

import torch
import xattn_jax
from xattn_jax.checks import check_flag

from xattn_torch_bridge.dlpack import (FLOAT_DTYPES, place_of, to_torch,
                                       views_for_one_computation)
from xattn_torch_bridge.estimate import _detached

# the dtypes each tensor argument takes (the messages list only these)
_DTYPES = {"q": FLOAT_DTYPES, "k": FLOAT_DTYPES, "v": FLOAT_DTYPES, "mask": (torch.bool,),
           "block_table": (torch.int32,), "k_len": (torch.int32,)}


def _views(copy, **tensors: torch.Tensor):
    """JAX views of the named tensors (None entries skipped), which must share a device."""
    copy = check_flag("copy", copy)
    named = {name: t for name, t in tensors.items() if t is not None}
    checked = [place_of(_detached(t), name, copy, _DTYPES[name]) for name, t in named.items()]
    place = checked[0][1]
    if any(other is not place for _, other in checked):
        devices = ", ".join(f"{name} on {t.device}" for name, t in named.items())
        raise ValueError(f"{', '.join(named)} must be on one device, got {devices}")
    return dict(zip(named, views_for_one_computation(place, *(t for t, _ in checked))))


def block_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           mask: torch.Tensor, *, copy: bool = False, block_table=None,
                           k_len=None, **kwargs):
    """Block-sparse attention (docs/estimate.md section 6) of torch tensors.

    Takes the arguments of `xattn_jax.block_sparse_attention` (block_size, causal, scale,
    return_lse, k_len, block_table, impl) with the same defaults and meaning.

    Args:
      q, k, v: float32, bfloat16 or float16 torch tensors `[B, Hq, Lq, D]`,
        `[B, Hkv, Lk, D]`, `[B, Hkv, Lk, Dv]` (or, with block_table, paged caches
        `[num_pages, page_size, Hkv, D]` and `[num_pages, page_size, Hkv, Dv]`).
      mask: bool `[B, Hq, ceil(Lq/block_size), ceil(Lk/block_size)]`, e.g. the mask of
        `xattn_torch_bridge.xattn_estimate`.
      block_table: int32 torch tensor `[B, pages_per_seq]`, or None.
      k_len: None, an int, or an int32 torch tensor of shape [] (handed over without a
        copy or a wait; new values do not recompile).
      copy: False refuses tensors that are not contiguous or not aligned (ValueError);
        True copies them into fresh contiguous tensors first.
      All tensors on the CPU or all on one CUDA device. CPU tensors run on JAX's CPU
      device, where impl="auto" means the reference.

    Returns:
      out `[B, Hq, Lq, Dv]` in q's dtype, or `(out, lse)` with return_lse (lse float32
      `[B, Hq, Lq]`): torch tensors on q's device sharing memory with JAX's results.
    """
    cache_len = k_len if isinstance(k_len, torch.Tensor) else None
    views = _views(copy, q=q, k=k, v=v, mask=mask, block_table=block_table, k_len=cache_len)
    result = xattn_jax.block_sparse_attention(
        views["q"], views["k"], views["v"], views["mask"],
        block_table=views.get("block_table"), k_len=views.get("k_len", k_len), **kwargs)
    if isinstance(result, tuple):
        return tuple(to_torch(x) for x in result)
    return to_torch(result)


def xattention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, copy: bool = False,
               **kwargs):
    """XAttention (the estimate, then block-sparse attention on its mask) of torch tensors.

    Takes the keyword arguments of `xattn_jax.xattention` (threshold, block_size, stride,
    causal, norm, scale, return_mask, impl) with the same defaults and meaning; threshold
    may also be a torch tensor of Hq values, read to the host (as `xattn_estimate` reads
    it). q, k, v and copy as in `block_sparse_attention`.

    Returns out `[B, Hq, Lq, Dv]` in q's dtype, or `(out, mask)` with return_mask: torch
    tensors on q's device sharing memory with JAX's results.
    """
    if isinstance(kwargs.get("threshold"), torch.Tensor):
        kwargs["threshold"] = kwargs["threshold"].tolist()
    views = _views(copy, q=q, k=k, v=v)
    result = xattn_jax.xattention(views["q"], views["k"], views["v"], **kwargs)
    if isinstance(result, tuple):
        return tuple(to_torch(x) for x in result)
    return to_torch(result)
