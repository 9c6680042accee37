"""`xattn_jax.block_sparse_attention` and `xattn_jax.xattention` for torch tensors.

As `estimate` does for the estimate: the tensors go to JAX without a copy, with one
stream-order step for all of them (`dlpack.views_for_one_computation`), the jitted JAX
function runs where they live (compiled once per shape, dtype, device and static argument),
and the results come back as torch tensors without a copy, ordered before later work on
torch's current stream. Forward only: a tensor that requires grad is refused (ValueError)
while torch's grad mode is on; under torch.no_grad() or torch.inference_mode() it is read
as it is.

Host time per `xattention` call (as `estimate` does for the estimate): its keyword
arguments but the threshold are fixed per compiled function (`compiled_xattention`,
`xattn_jax.xattention` jitted over q, k, v and the threshold), so a repeated call runs
none of xattn_jax's Python checks (they ran when it was traced) and reaches the compiled
computation through jax.jit's C++ path. A call repeating an earlier call's options and
float threshold reuses what that call prepared (`_prepared`): the compiled function and the
checked threshold on the tensors' device.
"""

from __future__ import annotations

import functools

import jax
import torch
import xattn_jax
from xattn_jax import impls
from xattn_jax.checks import CheckedCalls, check_flag, threshold_per_head
from xattn_jax.defaults import THRESHOLD

from xattn_torch_bridge.dlpack import (FLOAT_DTYPES, Place, forward_only, place_of,
                                       to_torch, views_for_one_computation)

_prepared_calls = CheckedCalls()  # `_prepared`'s argument sets

# the dtypes each tensor argument takes (the messages list only these)
_DTYPES = {"q": FLOAT_DTYPES, "k": FLOAT_DTYPES, "v": FLOAT_DTYPES, "mask": (torch.bool,),
           "block_table": (torch.int32,), "k_len": (torch.int32,)}


def _views(copy, **tensors: torch.Tensor):
    """JAX views of the named tensors (None entries skipped), which must share a device,
    and that device's Place."""
    copy = check_flag("copy", copy)
    named = {name: t for name, t in tensors.items() if t is not None}
    checked = [place_of(forward_only(t, name), name, copy, _DTYPES[name])
               for name, t in named.items()]
    place = checked[0][1]
    if any(other is not place for _, other in checked):
        devices = ", ".join(f"{name} on {t.device}" for name, t in named.items())
        raise ValueError(f"{', '.join(named)} must be on one device, got {devices}")
    views = views_for_one_computation(place, *(t for t, _ in checked))
    return dict(zip(named, views)), place


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
    views, _ = _views(copy, q=q, k=k, v=v, mask=mask, block_table=block_table,
                      k_len=cache_len)
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
    threshold = kwargs.pop("threshold", THRESHOLD)
    if isinstance(threshold, torch.Tensor):
        threshold = threshold.tolist()
    views, place = _views(copy, q=q, k=k, v=v)
    q, k, v = views["q"], views["k"], views["v"]
    if _hashable(kwargs):
        run, threshold = _prepared(place, q.shape, threshold, kwargs)
        result = run(q, k, v, threshold)
    else:  # an option no compiled call can hold: xattn_jax refuses it, with its message
        result = xattn_jax.xattention(q, k, v, threshold=threshold, **kwargs)
    if isinstance(result, tuple):
        return tuple(to_torch(x) for x in result)
    return to_torch(result)


def _hashable(options: dict) -> bool:
    try:
        hash(tuple(options.values()))
    except TypeError:
        return False
    return True


def _prepared(place: Place, q_shape: tuple, threshold, options: dict):
    """The compiled xattention for `options` on place's device, and the threshold checked
    (float32 `[Hq]` on that device). Remembered for a float threshold, keyed by the
    options' values and types: a call repeating an earlier one's arguments skips the
    option handling and the threshold's check (which passed)."""
    key = None
    if isinstance(threshold, float):
        key = (place.jax_device, q_shape[1] if len(q_shape) == 4 else None, threshold,
               *options.items(), *map(type, options.values()))

    def prepare():
        checked = threshold
        if len(q_shape) == 4:  # else the traced call names the wrong rank
            checked = jax.device_put(threshold_per_head(threshold, q_shape[1]),
                                     place.jax_device)
        return compiled_xattention(traced_options(place, options)), checked

    return _prepared_calls.prepared(key, prepare)


def traced_options(place: Place, options: dict) -> tuple:
    """`xattn_jax.xattention`'s keyword arguments for a call traced for place's device,
    as a key of `compiled_xattention`: (name, type, value) triples, sorted.

    Inside a jitted function the inputs have no device, so impl is resolved here for
    place's device (a ValueError for one that cannot run there) and handed over as the
    backends it names (`impls.resolve_xattention`)."""
    backends = impls.resolve_xattention(options.get("impl", "auto"), device=place.jax_device)
    return tuple(sorted((name, type(value), value)
                        for name, value in dict(options, impl=backends).items()))


@functools.lru_cache(maxsize=256)
def compiled_xattention(options: tuple) -> jax.stages.Wrapped:
    """`xattn_jax.xattention(q, k, v, threshold=t, **options)` jitted over (q, k, v, t),
    one per `traced_options` key. xattn_jax's checks run when it is traced: a bad option
    raises on the first call."""
    return jax.jit(functools.partial(xattention_traced, options=options))


def xattention_traced(q, k, v, threshold, *, options: tuple):
    """`xattn_jax.xattention` with the options of a `traced_options` key."""
    return xattn_jax.xattention(q, k, v, threshold=threshold,
                                **{name: value for name, _, value in options})
