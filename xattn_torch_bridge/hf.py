"""XAttention as a transformers attention implementation (needs the `models` extra).

    import torch
    from transformers import AutoModelForCausalLM
    from xattn_torch_bridge import hf

    xattn = hf.register("xattention")  # xattention's defaults, or a calibrated table:
    # xattn = hf.register(threshold=hf.calibrate(model, sample_ids, target_density=0.3))
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="xattention")
    # or, on a loaded model: model.set_attn_implementation("xattention")
    with torch.no_grad():
        logits = model(input_ids).logits
    xattn.last_density        # share of the causally visible blocks computed, e.g. 0.41
    xattn.layer_densities     # {layer: share}; xattn.head_densities: {layer: [Hq]}
    xattn.fallback_counts     # {"decode": 30, ...}: calls that went to sdpa, by reason

`register` adds the name to transformers' `AttentionInterface` (the attention function)
and `AttentionMaskInterface` (its mask). A model calls the function once per layer with
q `[B, Hq, Lq, D]` and k, v `[B, Hkv, Lk, D]` (the KV heads not repeated) and the mask.

What goes through the bridge: causal prefill calls, the queries being the last Lq of the
Lk keys (a whole prompt, or a chunk after a cache whose length is a multiple of
block_size), without a padding mask, of at least `min_length` queries, in inference
(no dropout, no gradient). They run `xattn_jax.xattention` on the tensors' device and
torch's current stream, without copies: q, k and v are read in the layout the model made
them in (`[B, H, L, D]`, or `[B, L, H, D]` seen through a transpose, as transformers'
projections make them), and the output comes back as `[B, Lq, Hq, D]`, the layout
transformers takes, from the same computation.

What goes to transformers' sdpa, counted by reason (`FALLBACK_REASONS`): decode steps
(Lq 1), calls shorter than `min_length`, a chunk after a cache that is not block-aligned,
a padding mask or any other mask than the plain causal one (sliding windows, packed
sequences, static caches), a non-causal layer, training (dropout or gradients), and
arguments the bridge has no equivalent of (softcap, attention sinks, position biases).
The mask function registered with the name returns None for the plain causal mask
(whatever the cache length) and the materialized mask otherwise.

Density: each bridged call also counts, on the device, the blocks the estimate kept among
those causally visible, per head; `last_density` and its kin read the counts of the
last forward that went through the bridge once, when read (no host wait per layer). What
the calls measured is read as properties, the counts and the densities alike.

Host cost per layer: the compiled function is looked up once per layer call by a
dictionary key, the threshold of each layer is a device array made once, and the call
reaches `jax.jit`'s C++ path with three views of the torch tensors (as the bridged
`xattention` does: `attention.compiled_xattention`).
"""

from __future__ import annotations

import collections
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import torch
import xattn_jax
from xattn_jax.calibrate import check_calibration
from xattn_jax.checks import check_int, check_shares, check_tokens, real_host_array
from xattn_jax.defaults import BLOCK_SIZE, STRIDE, TARGET_DENSITY, THRESHOLD
from xattn_jax.geometry import cdiv

from xattn_torch_bridge import attention
from xattn_torch_bridge.dlpack import (CPU_ALIGN, CUDA_ALIGN, FLOAT_DTYPES, place_of,
                                       to_jax, to_torch, views_for_one_computation)

try:
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import (AttentionMaskInterface, causal_mask_function,
                                            sdpa_mask)
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError("xattn_torch_bridge.hf needs transformers: pip install "
                      "'xattn-jax[models]'") from error

FALLBACK_REASONS = ("decode", "short", "unaligned", "mask", "not_causal", "training",
                    "unsupported")
# keyword arguments of transformers' attention call that change its result and that
# xattention has no equivalent of: a call with one of them set goes to sdpa
UNSUPPORTED_KWARGS = ("softcap", "sliding_window", "s_aux", "sinks", "position_bias")
# arguments of the bridged xattention that the layer call sets itself
RESERVED_OPTIONS = ("causal", "scale", "return_mask", "copy", "threshold")
_registered: dict[str, AttentionHandle] = {}
_CALIBRATION = "xattention-calibration"  # `calibrate`'s capturing implementation


def register(name: str = "xattention", *, threshold=THRESHOLD, stride: int = STRIDE,
             block_size: int = BLOCK_SIZE,
             min_length: int | None = None, **options) -> AttentionHandle:
    """Makes XAttention the transformers attention implementation `name`.

    Args:
      name: the name to pass as `attn_implementation` (`from_pretrained(...,
        attn_implementation=name)` or `model.set_attn_implementation(name)`). Registering
        a name again replaces its settings; transformers' own names are refused.
      threshold: a float in (0, 1] for every layer and head, `[Hq]` floats (one per query
        head, every layer), or `[num_layers, Hq]` floats (a calibration's table): a list,
        numpy array or torch tensor, read once here. Every value in (0, 1].
      stride, block_size: the estimate's, as in `xattn_jax.xattention`.
      min_length: the fewest queries a call needs to go through the bridge (default
        block_size: a shorter call fills less than one query block).
      options: any other keyword argument of `xattn_jax.xattention` (norm, impl, and the
        selection options it has), passed to it unchanged and checked by it at the first
        bridged call. Not causal, scale, return_mask, threshold: the layer call sets them.

    Returns the `AttentionHandle` that transformers calls and that reports densities and
    fallbacks. Raises TypeError or ValueError naming the argument before registering.
    """
    handle = AttentionHandle(_checked_name(name),
                             Settings.checked(threshold, stride, block_size, min_length,
                                              options))
    AttentionInterface.register(name, handle)
    AttentionMaskInterface.register(name, plain_causal_or_materialized)
    _registered[name] = handle
    return handle


def calibrate(model: torch.nn.Module, input_ids: torch.Tensor, *,
              target_density: float = TARGET_DENSITY, stride: int = STRIDE,
              block_size: int = BLOCK_SIZE, **settings) -> np.ndarray:
    """Per-head thresholds for `model` at a mean density of `target_density`: float32
    numpy `[num_layers, Hq]`, to pass to `register(threshold=...)` with the same stride,
    block_size and settings.

    Runs one dense forward (transformers' sdpa) over `input_ids` (integer `[B, L]` on the
    model's device, token ids below its vocabulary size: a few thousand tokens of sample
    text of the kind the model will read), copies each layer's q, k and v to JAX, and
    calibrates them with `xattn_jax.calibrate` (settings: its thresholds, norm,
    min_blocks, dense_last, impl, estimate). The model's attention implementation is
    restored after the forward, also when it fails.

    Raises TypeError or ValueError naming the argument before the forward: a model that
    is not a transformers model, input_ids of another type, dtype, rank or range, and
    `xattn_jax.calibrate`'s refusals of the other arguments. A target the sparsest
    thresholds cannot reach gives their table and a `DensityNotReachedWarning`
    (`xattn_jax.calibrate`'s) with the density they keep.
    """
    check_calibration(target_density=target_density, stride=stride, block_size=block_size,
                      **settings)
    _check_model_and_ids(model, input_ids)
    captured = {}

    def capture(module, query, key, value, attention_mask, **kwargs):
        captured[module.layer_idx] = tuple(to_jax(t.detach().contiguous(), copy=True)
                                           for t in (query, key, value))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(_CALIBRATION, capture)
    AttentionMaskInterface.register(_CALIBRATION, sdpa_mask)
    previous = model.config._attn_implementation
    model.set_attn_implementation(_CALIBRATION)
    try:
        with torch.no_grad():
            model(input_ids)
    finally:
        model.set_attn_implementation(previous)
    return xattn_jax.calibrate([captured[i] for i in sorted(captured)],
                               target_density=target_density, stride=stride,
                               block_size=block_size, **settings)


def _check_model_and_ids(model, input_ids) -> None:
    """`calibrate`'s model (a transformers model) and input_ids (its token ids)."""
    if not (isinstance(model, torch.nn.Module) and hasattr(model, "set_attn_implementation")
            and hasattr(getattr(model, "config", None), "_attn_implementation")):
        raise TypeError(f"model must be a loaded transformers model (a torch.nn.Module "
                        f"with set_attn_implementation and a config), got {model!r} "
                        f"({type(model).__name__})")
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"input_ids must be a torch.Tensor of token ids [B, L], got "
                        f"{type(input_ids).__name__}")
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex \
            or input_ids.dtype == torch.bool:
        raise ValueError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    if input_ids.ndim != 2 or 0 in input_ids.shape:
        raise ValueError(f"input_ids must be non-empty token ids [B, L], got shape "
                         f"{tuple(input_ids.shape)}")
    parameter = next(model.parameters(), None)
    if parameter is not None and input_ids.device != parameter.device:
        raise ValueError(f"input_ids must be on the model's device {parameter.device}, got "
                         f"{input_ids.device}")
    vocab = getattr(model.config, "vocab_size", None)
    low, high = int(input_ids.min()), int(input_ids.max())
    if low < 0 or (vocab is not None and high >= vocab):
        bound = ">= 0" if vocab is None else f"in [0, {vocab}) (the model's vocab_size)"
        raise ValueError(f"input_ids must be token ids {bound}, got values in "
                         f"[{low}, {high}]")


def _checked_name(name) -> str:
    if not isinstance(name, str):
        raise TypeError(f"name must be a string, got {name!r} ({type(name).__name__})")
    if not name or any(c in name for c in "/|:"):
        raise ValueError(f"name must be a non-empty string without '/', '|' or ':', got "
                         f"{name!r}")
    builtin = {"eager", *AttentionInterface._global_mapping,
               *AttentionMaskInterface._global_mapping} - set(_registered)
    if name in builtin:
        raise ValueError(f"name {name!r} is one of transformers' attention "
                         f"implementations; choose another")
    return name


@dataclasses.dataclass(frozen=True)
class Settings:
    """A registration's settings, checked. threshold: float32 `[Hq]` or `[num_layers,
    Hq]` (None for one float, kept in `share`)."""

    share: float | None
    table: np.ndarray | None
    stride: int
    block_size: int
    min_length: int
    options: tuple  # (name, value) pairs, sorted

    @classmethod
    def checked(cls, threshold, stride, block_size, min_length, options: dict) -> Settings:
        stride = check_tokens("stride", stride)
        block_size = check_tokens("block_size", block_size, stride, "stride")
        min_length = block_size if min_length is None else check_int("min_length",
                                                                      min_length)
        share, table = _checked_threshold(threshold)
        reserved = sorted(set(options) & set(RESERVED_OPTIONS))
        if reserved:
            raise TypeError(f"register sets {reserved} itself for each layer call; pass "
                            "the other options of xattn_jax.xattention")
        for option, value in options.items():
            try:
                hash(value)
            except TypeError:
                raise TypeError(f"{option} must be hashable (a number, string, bool or "
                                f"tuple): it is fixed in the compiled call, got "
                                f"{type(value).__name__}") from None
        return cls(share, table, stride, block_size, min_length,
                   tuple(sorted(options.items())))


def _checked_threshold(threshold) -> tuple[float | None, np.ndarray | None]:
    if isinstance(threshold, torch.Tensor):
        threshold = threshold.detach().cpu().numpy()
    values = real_host_array("threshold", threshold)
    if values.ndim > 2:
        raise ValueError(f"threshold must be a float, [Hq] or [num_layers, Hq] floats, got "
                         f"shape {values.shape}")
    if 0 in values.shape:
        raise ValueError(f"threshold must not be empty, got shape {values.shape}")
    check_shares("threshold", values, threshold)
    return (float(values), None) if values.ndim == 0 else (None, values)


def plain_causal_or_materialized(batch_size: int, q_length: int, kv_length: int,
                                 q_offset=0, kv_offset=0,
                                 mask_function=causal_mask_function,
                                 attention_mask: torch.Tensor | None = None,
                                 local_size=None, **kwargs) -> torch.Tensor | None:
    """The mask function of a registered name (transformers' mask interface): None for the
    plain causal mask with the queries the last q_length of the kv_length keys, which the
    bridge takes; else sdpa's materialized bool mask `[B, 1, q_length, kv_length]`, which
    sends the call to sdpa. attention_mask: the 2D padding mask `[B, keys]`, or None."""
    plain = (mask_function is causal_mask_function and local_size is None
             and kv_offset == 0 and isinstance(q_offset, int)
             and q_offset + q_length == kv_length
             and (attention_mask is None or (attention_mask.shape[-1] >= kv_length
                                             and bool(attention_mask[:, :kv_length].all()))))
    if plain:
        return None
    # never None here: the layer call reads None as the plain causal mask
    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length,
                     q_offset=q_offset, kv_offset=kv_offset, mask_function=mask_function,
                     attention_mask=attention_mask, local_size=local_size, **kwargs)


class AttentionHandle:
    """A registered XAttention: the attention function transformers calls, and what its
    calls measured (densities of the last bridged forward, fallbacks since the last
    `reset`)."""

    def __init__(self, name: str, settings: Settings):
        self.name = name
        self.settings = settings
        self._counts = collections.Counter()
        self._forward: dict[int, tuple[jax.Array, int]] = {}  # layer -> (counts, visible)
        self._thresholds: dict[tuple, jax.Array] = {}  # (layer or None, device) -> [Hq]
        self._calls: dict[tuple, jax.stages.Wrapped] = {}  # `_compiled`'s

    def __repr__(self) -> str:
        return f"AttentionHandle({self.name!r}, {self.settings})"

    # --- what the calls measured -------------------------------------------------------

    @property
    def fallback_counts(self) -> dict[str, int]:
        """Calls sent to sdpa since the last `reset`, by reason (`FALLBACK_REASONS`)."""
        return {reason: self._counts[reason] for reason in FALLBACK_REASONS}

    @property
    def fallbacks(self) -> int:
        """Calls sent to sdpa since the last `reset`."""
        return sum(self._counts[reason] for reason in FALLBACK_REASONS)

    @property
    def bridged_calls(self) -> int:
        """Calls that went through the bridge since the last `reset`."""
        return self._counts["bridged"]

    def reset(self) -> None:
        """Forgets the counts and the last forward's densities."""
        self._counts.clear()
        self._forward = {}

    @property
    def head_densities(self) -> dict[int, np.ndarray]:
        """For each layer of the last forward that went through the bridge: float64 `[Hq]`,
        the share of each head's causally visible blocks that the estimate kept (over the
        batch). Reading it reads the device counts (one wait)."""
        layers = sorted(self._forward)
        counts = jax.device_get([self._forward[layer][0] for layer in layers])
        return {layer: np.asarray(c, np.float64) / self._forward[layer][1]
                for layer, c in zip(layers, counts)}

    @property
    def layer_densities(self) -> dict[int, float]:
        """For each layer of the last bridged forward: the share of its causally visible
        blocks (all heads, the batch) that were computed."""
        return {layer: float(d.mean()) for layer, d in self.head_densities.items()}

    @property
    def last_density(self) -> float | None:
        """The share of causally visible blocks computed in the last forward that went
        through the bridge, over its layers and heads; None before any such forward."""
        densities = self.head_densities
        if not densities:
            return None
        return float(np.mean(np.concatenate(list(densities.values()))))

    # --- the attention function --------------------------------------------------------

    def __call__(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor, attention_mask: torch.Tensor | None,
                 dropout: float = 0.0, scaling: float | None = None,
                 is_causal: bool | None = None, **kwargs):
        """transformers' attention call: q `[B, Hq, Lq, D]`, k, v `[B, Hkv, Lk, D]` ->
        `(out [B, Lq, Hq, D] contiguous, None)`."""
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        reason = self._fallback_reason(query, key, value, attention_mask, dropout, causal,
                                       kwargs)
        if reason is not None:
            self._counts[reason] += 1
            if causal and attention_mask is None and 1 < query.shape[2] < key.shape[2]:
                # sdpa reads a missing mask of a longer key sequence as an empty static
                # cache's; the queries here are the last ones
                attention_mask = torch.ones(query.shape[2], key.shape[2], dtype=torch.bool,
                                            device=query.device).tril(
                                                key.shape[2] - query.shape[2])
            return sdpa_attention_forward(module, query, key, value, attention_mask,
                                          dropout=dropout, scaling=scaling,
                                          is_causal=is_causal, **kwargs)
        out = self._bridged(module, query, key, value, scaling)
        self._counts["bridged"] += 1
        return out, None

    def _fallback_reason(self, query, key, value, attention_mask, dropout, causal,
                         kwargs) -> str | None:
        q_len, k_len = query.shape[2], key.shape[2]
        if not causal:
            return "not_causal"
        if dropout or (torch.is_grad_enabled()
                       and (query.requires_grad or key.requires_grad or value.requires_grad)):
            return "training"
        if any(kwargs.get(name) is not None for name in UNSUPPORTED_KWARGS) \
                or query.dtype not in FLOAT_DTYPES or query.device.type not in ("cpu", "cuda"):
            return "unsupported"
        if attention_mask is not None:
            return "mask"
        if q_len == 1:
            return "decode"
        if q_len < self.settings.min_length:
            return "short"
        if (k_len - q_len) % self.settings.block_size:
            return "unaligned"
        return None

    def _bridged(self, module, query, key, value, scaling) -> torch.Tensor:
        layer = getattr(module, "layer_idx", None)
        if not isinstance(layer, int):
            raise ValueError(f"the attention module {type(module).__name__} has no integer "
                             f"layer_idx, which {self.name!r} needs, got {layer!r}")
        tensors, layouts = zip(*(_stored_layout(t) for t in (query, key, value)))
        checked = [place_of(t, name, False, FLOAT_DTYPES)
                   for t, name in zip(tensors, ("query", "key", "value"))]
        place = checked[0][1]
        run = self._compiled(place, layouts, scaling)
        threshold = self._threshold(module, layer, query.shape[1], place)
        out, kept = run(*views_for_one_computation(place, *(t for t, _ in checked)),
                        threshold)
        if layer in self._forward:  # a layer seen again: a new forward
            self._forward = {}
        self._forward[layer] = (kept, query.shape[0] * visible_blocks(
            query.shape[2], key.shape[2], self.settings.block_size))
        return to_torch(out)

    def _compiled(self, place, layouts: tuple[bool, ...], scaling) -> jax.stages.Wrapped:
        """The layer function for these layouts and scale on place's device (looked up
        by one dictionary key after the first call)."""
        key = (place.jax_device, layouts, scaling, type(scaling))
        found = self._calls.get(key)
        if found is None:
            s = self.settings
            options = dict(s.options, stride=s.stride, block_size=s.block_size,
                           causal=True, scale=scaling, return_mask=True)
            found = self._calls[key] = layer_function(
                attention.traced_options(place, options), layouts)
        return found

    def _threshold(self, module, layer: int, q_heads: int, place) -> jax.Array:
        """The layer's threshold, float32 `[Hq]` on place's device (made once)."""
        s = self.settings
        key = (None if s.table is None or s.table.ndim == 1 else layer, place.jax_device)
        found = self._thresholds.get(key)
        if found is None:
            values = np.full(q_heads, s.share, np.float32) if s.table is None \
                else _table_row(s.table, layer, q_heads, module)
            found = self._thresholds[key] = jax.device_put(values, place.jax_device)
        return found


def _table_row(table: np.ndarray, layer: int, q_heads: int, module) -> np.ndarray:
    """The thresholds of `layer` from a `[Hq]` or `[num_layers, Hq]` table, checked
    against the model (its query heads, its layer count where its config says)."""
    if table.shape[-1] != q_heads:
        raise ValueError(f"threshold must have one value per query head: the model has "
                         f"{q_heads}, the threshold's shape is {table.shape}")
    if table.ndim == 1:
        return table
    layers = getattr(getattr(module, "config", None), "num_hidden_layers", None)
    if (layers is not None and table.shape[0] != layers) or layer >= table.shape[0]:
        raise ValueError(f"threshold must have one row per layer: the model has "
                         f"{layers if layers is not None else f'layer {layer}'}, the "
                         f"threshold's shape is {table.shape}")
    return table[layer]


def _stored_layout(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """`[B, H, L, D]` t as a contiguous, aligned tensor, and whether it is `[B, L, H, D]`
    (t a transposed view of it, as transformers' projections make q, k and v): the
    transpose is then XLA's, inside the compiled call. Otherwise a copy."""
    if not t.is_contiguous():
        swapped = t.transpose(1, 2)
        if swapped.is_contiguous() and _aligned(swapped):
            return swapped, True
        t = t.contiguous()
    return (t, False) if _aligned(t) else (t.clone(), False)


def _aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % (CUDA_ALIGN if t.device.type == "cuda" else CPU_ALIGN) == 0


def visible_blocks(q_len: int, k_len: int, block_size: int) -> int:
    """Causally visible blocks of one head: query block i (of ceil(Lq / block_size))
    sees the (Lk - Lq) / block_size key blocks before the chunk and i + 1 of its own."""
    rows, before = cdiv(q_len, block_size), (k_len - q_len) // block_size
    return rows * before + rows * (rows + 1) // 2


@functools.lru_cache(maxsize=64)
def layer_function(options: tuple, layouts: tuple[bool, ...]) -> jax.stages.Wrapped:
    """One layer's call, jitted: `(q, k, v, threshold [Hq]) -> (out [B, Lq, Hq, D],
    kept [Hq] int32)`. q, k, v are `[B, H, L, D]`, or `[B, L, H, D]` where `layouts`
    says; options: an `attention.traced_options` key with return_mask=True. kept counts
    each head's causally visible blocks the estimate kept, over the batch."""

    def call(q, k, v, threshold):
        q, k, v = (jnp.swapaxes(x, 1, 2) if swapped else x
                   for x, swapped in zip((q, k, v), layouts))
        out, mask = attention.xattention_traced(q, k, v, threshold, options=options)
        # the mask holds no block the causal rule hides (docs/estimate.md section 4)
        return jnp.swapaxes(out, 1, 2), jnp.sum(mask, axis=(0, 2, 3), dtype=jnp.int32)

    return jax.jit(call)
