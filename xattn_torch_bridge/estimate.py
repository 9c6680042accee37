"""`xattn_jax.xattn_estimate` for torch tensors, over the zero-copy hand-off of `dlpack`.

q and k go to JAX without a copy, with one stream-order step for both
(`dlpack.views_for_one_computation`: q's view carries it, and the estimate reads both in
one computation; k's view is reused while the same k tensor is passed again); the
estimate runs where they live; its two results come back as torch
tensors without a copy, ordered before later work on torch's current stream.

Host time per call. The keyword arguments but the threshold are fixed per compiled
function: `xattn_jax.xattn_estimate` with them is jitted once per set of arguments
(`_compiled`) and called with q, k and the threshold as data, so a repeated call runs
none of xattn_jax's Python checks (they ran when it was traced, and depend on shapes and
those arguments only) and reaches the compiled computation through jax.jit's C++ path.
The threshold is checked on the host here (as xattn_jax does for floats) and its device
array is reused across calls (`xattn_jax.checks.threshold_per_head`). A call repeating
an earlier call's options and float threshold (values and types) reuses what that call
prepared: the compiled function, the resolved implementation, the checked threshold.

torch.compile: `xattn_estimate` inside a compiled region calls the custom op
`torch.ops.xattn.estimate` (with a fake implementation giving the result shapes), so a
model compiled with `fullgraph=True` calls the estimate without a graph break; eagerly
it calls the implementation directly (the dispatcher's overhead is not paid).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence

import jax
import torch
import xattn_jax
from xattn_jax import impls
from xattn_jax.checks import CheckedCalls, check_flag, threshold_per_head
from xattn_jax.defaults import ORIGINAL_THRESHOLD
from xattn_jax.geometry import cdiv

from xattn_torch_bridge.dlpack import (FLOAT_DTYPES, forward_only, persistent_view, place_of,
                                       to_torch, view_in_jax, views_for_one_computation)

_prepared_calls = CheckedCalls()  # `_prepared`'s argument sets


def compiled_estimate(options: dict) -> jax.stages.Wrapped:
    """`xattn_jax.xattn_estimate(q, k, threshold=t, **options)`, jitted over (q, k, t), one
    per set of options. The options' types are part of the key: 16.0 and 16, or 1 and
    True, are different calls (the first of each is refused by the estimate's checks,
    which run when the function is traced)."""
    return _compiled(tuple(sorted((name, type(value), value)
                                  for name, value in options.items())))


@functools.lru_cache(maxsize=256)
def _compiled(options: tuple) -> jax.stages.Wrapped:
    return jax.jit(functools.partial(_estimate_with, options=options))


def _estimate_with(q, k, threshold, *, options: tuple):
    return xattn_jax.xattn_estimate(q, k, threshold=threshold,
                                    **{name: value for name, _, value in options})


def k_view(k: torch.Tensor, place, copy: bool) -> jax.Array:
    """k's unordered view: reused while the same tensor object is passed again (a cache's
    keys: `dlpack.persistent_view`), fresh for a copy. The estimate's computation is
    ordered by q's view, so it sees every write queued on torch's stream before the call."""
    return view_in_jax(k, place, ordered=False) if copy else persistent_view(k, place)


def xattn_estimate(q: torch.Tensor, k: torch.Tensor, *, copy: bool = False,
                   **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """The XAttention estimate (docs/estimate.md sections 1-4) of torch tensors.

    Takes the keyword arguments of `xattn_jax.xattn_estimate` (block_size, stride,
    threshold, causal, norm, keep_sink, keep_recent, min_blocks, dense_last, impl,
    max_scratch_bytes) with the same defaults and meaning, and returns its results as
    torch tensors. Differences:

    Args:
      q: `[B, Hq, Lq, D]`, k: `[B, Hkv, Lk, D]`, float32, bfloat16 or float16 torch
        tensors, both on the CPU or both on one CUDA device. Forward only: a tensor that
        requires grad is refused (ValueError) while torch's grad mode is on; call it
        under torch.no_grad() or torch.inference_mode().
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
    if torch.compiler.is_compiling():
        return _call_op(q, k, copy, kwargs)
    copy = check_flag("copy", copy)
    q, place = place_of(forward_only(q, "q"), "q", copy, FLOAT_DTYPES)
    k, k_place = place_of(forward_only(k, "k"), "k", copy, FLOAT_DTYPES)
    if k_place is not place:
        raise ValueError(f"q and k must be on the same device, got {q.device} and {k.device}")
    estimate, threshold = _prepared(place, q, kwargs.pop("threshold", ORIGINAL_THRESHOLD),
                                    kwargs)
    sums, mask = estimate(*views_for_one_computation(place, q), k_view(k, place, copy),
                          threshold)
    return to_torch(sums), to_torch(mask)


def _prepared(place, q: torch.Tensor, threshold, options: dict):
    """The compiled estimate for `options` on place's device, and the threshold checked
    (float32 `[Hq]` on the device). Remembered for a float threshold, keyed by the
    options' values and types as `compiled_estimate` is: a call repeating an earlier one's
    arguments skips the option handling and the threshold's check (which passed)."""
    key = None
    if isinstance(threshold, float):
        key = (place.jax_device, q.shape[1] if q.ndim == 4 else None, threshold,
               *options.items(), *map(type, options.values()))

    def prepare():
        checked = threshold.tolist() if isinstance(threshold, torch.Tensor) else threshold
        if q.ndim == 4:  # else the traced call names the wrong rank
            checked = threshold_per_head(checked, q.shape[1])
        # resolved here, for the device q lives on: inside the jitted call it has none yet
        resolved = dict(options, impl=impls.resolve(options.get("impl", "auto"),
                                                    device=place.jax_device))
        return compiled_estimate(resolved), checked

    return _prepared_calls.prepared(key, prepare)


# --- torch.compile ----------------------------------------------------------------------

# xattn_jax.xattn_estimate's keyword arguments and defaults, in the op's order
_OPTIONS = {name: p.default for name, p in
            inspect.signature(xattn_jax.xattn_estimate).parameters.items()
            if p.kind is inspect.Parameter.KEYWORD_ONLY and name != "threshold"}


def _call_op(q, k, copy: bool, kwargs: dict):
    threshold = kwargs.pop("threshold", ORIGINAL_THRESHOLD)
    unknown = set(kwargs) - set(_OPTIONS)
    if unknown:
        raise TypeError(f"xattn_estimate got unexpected keyword arguments {sorted(unknown)}")
    per_head = [float(t) for t in threshold] if isinstance(threshold, Sequence) \
        else [float(threshold)]
    options = {**_OPTIONS, **kwargs}
    return estimate_op(q, k, per_head, *options.values(), copy)


@torch.library.custom_op("xattn::estimate", mutates_args=())
def estimate_op(q: torch.Tensor, k: torch.Tensor, threshold: list[float], block_size: int,
                stride: int, causal: bool, norm: float, keep_sink: bool, keep_recent: bool,
                min_blocks: int, dense_last: int, impl: str, max_scratch_bytes: int | None,
                copy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`xattn_estimate` as a torch custom op (threshold: one value, or one per query head;
    the other arguments in the order of `xattn_jax.xattn_estimate`)."""
    return xattn_estimate(q, k, threshold=threshold[0] if len(threshold) == 1 else threshold,
                          block_size=block_size, stride=stride, causal=causal, norm=norm,
                          keep_sink=keep_sink, keep_recent=keep_recent,
                          min_blocks=min_blocks, dense_last=dense_last, impl=impl,
                          max_scratch_bytes=max_scratch_bytes, copy=copy)


@estimate_op.register_fake
def _estimate_shapes(q, k, threshold, block_size, stride, causal, norm, keep_sink,
                     keep_recent, min_blocks, dense_last, impl, max_scratch_bytes, copy):
    batch, heads, q_len, _ = q.shape
    shape = (batch, heads, cdiv(q_len, block_size), cdiv(k.shape[2], block_size))
    return q.new_empty(shape, dtype=torch.float32), q.new_empty(shape, dtype=torch.bool)
