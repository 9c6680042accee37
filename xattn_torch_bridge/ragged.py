"""`xattn_jax.ragged_xattention` as a vLLM attention backend calls its varlen kernel.

The call takes the names and meanings of the varlen call vLLM's FlashAttention backend
makes (`flash_attn_varlen_func` of vLLM's flash-attn fork, paged: `block_table` and
`seqused_k`), plus XAttention's settings (threshold, block_size, stride, min_blocks,
dense_last). The step's sizes change every step; the bridge pads them to buckets (the
queries to `token_bucket(T)` rows, the requests and the table's width to powers of two,
with empty requests), so one compiled computation serves every step of a bucket. The
caches are handed to JAX in place (`dlpack`; their views made once per cache tensor),
ordered on torch's current stream; the offsets go over in one small tensor.

CUDA graphs: the JAX computation cannot be captured into a torch CUDA graph. A backend
runs this call outside graph capture (vLLM's piecewise graphs leave attention out of the
graphs) and keeps decode-only steps in its graphs with its own kernel, or runs them here
too: decode rows attend densely.

Forward only: an input that requires grad is refused while torch's grad mode is on
(`dlpack.forward_only`).
"""

from __future__ import annotations

import functools

import jax
import torch
import torch.nn.functional as F
import xattn_jax
from xattn_jax import impls
from xattn_jax.defaults import BLOCK_SIZE, DENSE_LAST, ESTIMATES, MIN_BLOCKS, STRIDE, \
    THRESHOLD
from xattn_jax.checks import check_choice, check_int, threshold_per_head
from xattn_jax.geometry import next_pow2

from xattn_torch_bridge.dlpack import (FLOAT_DTYPES, forward_only, place_of, to_torch,
                                       views_for_one_computation)

MIN_TOKEN_BUCKET = 16  # the smallest padded query count (4 buckets an octave above it)
# options of the flash-attn call that XAttention cannot honour: their accepted values
_REFUSED = {"window_size": (None, (-1, -1), [-1, -1]), "softcap": (None, 0, 0.0),
            "alibi_slopes": (None,), "s_aux": (None,), "q_descale": (None,),
            "k_descale": (None,), "v_descale": (None,), "cu_seqlens_k": (None,),
            "dropout_p": (0, 0.0), "return_softmax_lse": (False,), "q_v": (None,)}
# flash-attn tuning options with no meaning here: accepted and ignored
IGNORED = ("scheduler_metadata", "num_splits", "fa_version", "deterministic")


def token_bucket(tokens: int) -> int:
    """The padded query count for `tokens`: the least of 2^k x (1, 1.25, 1.5, 1.75), at
    least MIN_TOKEN_BUCKET, that holds them (at most a quarter of the rows padding)."""
    size = MIN_TOKEN_BUCKET
    while size < tokens:
        octave = 1 << (size.bit_length() - 1)
        size += octave // 4
    return size


def _check_options(causal, options: dict) -> None:
    if causal is not True:
        raise ValueError(f"causal must be True (XAttention's chunks are causal over their "
                         f"keys), got {causal!r}")
    for name, value in options.items():
        if name in IGNORED:
            continue
        if name not in _REFUSED:
            raise TypeError(f"ragged_xattention got an unexpected keyword argument {name!r}")
        if not any(value is ok or (type(value) is type(ok) and value == ok)
                   for ok in _REFUSED[name]):
            raise ValueError(f"{name}={value!r} is not supported: ragged_xattention takes "
                             f"{name}={_REFUSED[name][-1]!r} only")


def ragged_xattention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                      cu_seqlens_q: torch.Tensor, max_seqlen_q: int,
                      seqused_k: torch.Tensor, max_seqlen_k: int,
                      block_table: torch.Tensor, out: torch.Tensor | None = None,
                      softmax_scale: float | None = None, causal: bool = True,
                      threshold=THRESHOLD, block_size: int = BLOCK_SIZE,
                      stride: int = STRIDE,
                      min_blocks: int = MIN_BLOCKS, dense_last: int = DENSE_LAST,
                      impl: str = "auto", estimate: str = "antidiagonal",
                      **flash_attn_options) -> torch.Tensor:
    """XAttention for one serving step of torch tensors, in flash-attn's varlen terms.

    Args:
      q: `[T, Hq, D]`, float32, bfloat16 or float16: request s owns rows
        `cu_seqlens_q[s] .. cu_seqlens_q[s+1] - 1`.
      k, v: the paged caches `[num_blocks, block_size, Hkv, D]` (as unbound from vLLM's
        `[2, num_blocks, block_size, Hkv, D]`), q's dtype, read in place; each must be
        contiguous (a view of a contiguous cache along its first axes is), else a
        ValueError names it. k may hold more pages than v (a `PagedKVCache`'s staging
        pages): only v's pages are read.
      cu_seqlens_q: int32 `[S + 1]`; seqused_k: int32 `[S]`, each request's keys (its
        chunk's included, written to the cache before the call); block_table: int32
        `[S, max_blocks]`, each request's pages. All on q's device.
      max_seqlen_q, max_seqlen_k: ints, flash-attn's bounds (checked to be ints; the
        call needs no bound).
      out: `[T, Hq, D]` in q's dtype on q's device, written with the result when given.
      softmax_scale: default 1 / sqrt(D). causal: must be True.
      threshold, block_size, stride, min_blocks, dense_last, impl, estimate: as in
        `xattn_jax.ragged_xattention` (block_size: XAttention's block, in tokens).
      flash_attn_options: `scheduler_metadata`, `num_splits`, `fa_version` and
        `deterministic` are accepted and ignored; `window_size`, `softcap`,
        `alibi_slopes`, `s_aux` (sinks), the fp8 descales, `cu_seqlens_k`, `dropout_p`,
        `return_softmax_lse` and `q_v` are refused (ValueError naming the option) unless
        left at their defaults.

    Returns `[T, Hq, D]` in q's dtype on q's device (`out` itself when given).
    """
    _check_options(causal, flash_attn_options)
    check_choice("estimate", estimate, ESTIMATES)
    for name, bound in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        check_int(name, bound, 0)
    if v.ndim == 4 and k.ndim == 4 and k.shape[0] > v.shape[0]:
        k = k[:v.shape[0]]
    tensors = dict(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, seqused_k=seqused_k,
                   block_table=block_table)
    checked = {}
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch tensor, got {type(tensor).__name__}")
        if name in ("q", "k", "v"):
            checked[name] = place_of(forward_only(tensor, name), name, False, FLOAT_DTYPES)
        elif tensor.dtype != torch.int32:
            raise ValueError(f"{name} must have dtype int32, got {tensor.dtype}")
    places = {place for _, place in checked.values()}
    devices = {t.device for t in tensors.values()}
    if len(places) > 1 or len(devices) > 1:
        raise ValueError(f"q, k, v and the step's tensors must be on one device, got "
                         + ", ".join(f"{n} on {t.device}" for n, t in tensors.items()))
    if q.ndim != 3 or cu_seqlens_q.ndim != 1 or seqused_k.ndim != 1 or block_table.ndim != 2:
        raise ValueError(f"q must be [T, Hq, D], cu_seqlens_q [S + 1], seqused_k [S] and "
                         f"block_table [S, max_blocks]; got shapes {tuple(q.shape)}, "
                         f"{tuple(cu_seqlens_q.shape)}, {tuple(seqused_k.shape)}, "
                         f"{tuple(block_table.shape)}")
    requests = seqused_k.shape[0]
    if cu_seqlens_q.shape[0] != requests + 1 or block_table.shape[0] != requests:
        raise ValueError(f"cu_seqlens_q must hold S + 1 and block_table S rows for the S = "
                         f"{requests} requests of seqused_k, got {cu_seqlens_q.shape[0]} "
                         f"and {block_table.shape[0]}")
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype
                            or out.device != q.device):
        raise ValueError(f"out must be q's shape {tuple(q.shape)}, dtype {q.dtype} and "
                         f"device {q.device}, got {tuple(out.shape)} {out.dtype} {out.device}")
    place = next(iter(places))
    slots = next_pow2(requests)
    queries, meta = _padded_step(checked["q"][0], cu_seqlens_q, seqused_k, block_table, slots)
    meta = place_of(meta, "the step's offsets", False, (torch.int32,))[0]
    views = views_for_one_computation(place, queries, meta,
                                      persistent=(checked["k"][0], checked["v"][0]))
    run = _compiled(softmax_scale, block_size, stride, min_blocks, dense_last, estimate,
                    impls.resolve_ragged(impl, device=place.jax_device), slots)
    result = to_torch(run(views[0], *views[2:], views[1], _threshold(threshold, q.shape[1],
                                                                     place)))
    result = result[:q.shape[0]]
    if out is None:
        return result
    return out.copy_(result)


def _threshold(threshold, q_heads: int, place):
    """The threshold as float32 `[Hq]` on the step's device: a float's is made once."""
    if isinstance(threshold, float):
        return _device_threshold(threshold, q_heads, place.jax_device)
    t = threshold.tolist() if isinstance(threshold, torch.Tensor) else threshold
    return jax.device_put(threshold_per_head(t, q_heads), place.jax_device)


@functools.lru_cache(maxsize=64)
def _device_threshold(threshold: float, q_heads: int, device):
    return jax.device_put(threshold_per_head(threshold, q_heads), device)


def _padded_step(q, cu_seqlens_q, seqused_k, block_table, slots: int):
    """The step padded to its bucket, on its device: q to `token_bucket(T)` rows (the
    padding rows belong to no request; q itself where it fills its bucket), and the
    offsets in one int32 tensor (a fresh one): cu_seqlens_q `[slots + 1]`, seqused_k
    `[slots]` and the table `[slots, W']` flattened, the requests padded to `slots` with
    empty ones, the table's width to W' (a power of two)."""
    tokens, requests, width = q.shape[0], seqused_k.shape[0], block_table.shape[1]
    columns = next_pow2(width)
    if token_bucket(tokens) > tokens:
        q = F.pad(q, (0, 0, 0, 0, 0, token_bucket(tokens) - tokens))
    table = F.pad(block_table, (0, columns - width, 0, slots - requests))
    meta = torch.cat([cu_seqlens_q, cu_seqlens_q[-1:].expand(slots - requests),
                      F.pad(seqused_k, (0, slots - requests)), table.reshape(-1)])
    return q, meta


@functools.lru_cache(maxsize=64)
def _compiled(scale, block_size, stride, min_blocks, dense_last, estimate, impl,
              slots: int):
    """`xattn_jax.ragged_xattention` jitted over (q, k, v, the packed offsets of
    `_padded_step` for `slots` requests, threshold), for one set of options and the
    backends resolved for the tensors' device (every slot of the padded step is a live
    request, the padded ones empty)."""
    def call(q, k, v, meta, threshold):
        cu, kv_lens = meta[:slots + 1], meta[slots + 1:2 * slots + 1]
        table = meta[2 * slots + 1:].reshape(slots, -1)
        return xattn_jax.ragged_xattention(
            q, k, v, kv_lens, table, cu, slots, threshold=threshold,
            block_size=block_size, stride=stride, min_blocks=min_blocks,
            dense_last=dense_last, scale=scale, impl=impl, estimate=estimate)
    return jax.jit(call)
