"""Keys in float8_e4m3fn for the estimate (docs/estimate.md, "Keys in fp8").

`quantize_keys` makes `Fp8Keys` from float32, bfloat16 or float16 keys, contiguous
`[B, Hkv, L, D]` or a page pool `[num_pages, page_size, Hkv, D]`; `xattn_estimate` and
`kv_block_scores` take them in place of k. The contract: the estimate of sections 1-5 on
`dequantize(keys, q.dtype)`. Every implementation dequantizes first (`keys_for_estimate`,
in the same jitted computation as the estimate) and runs its usual kernel on the result
(docs/estimate.md, "Keys in fp8", says what a kernel multiplying fp8 values would trade).

The scheme (bench/results/cpu_checks.md; docs/tuning.md: fp8-key-mean): the keys
of one KV head are cut into groups of `group` consecutive tokens. Each group's mean key
(per channel, over its tokens in use) is removed and kept as its offset; the rest is
divided by the group's scale and rounded to float8_e4m3fn (to nearest even, saturated at
+-448: e4m3fn has no infinity). The scale is the rest's largest magnitude / 448 rounded
up to 20 significant bits (1 for a group of zeros), so that the group's largest element
is kept almost exactly (docs/tuning.md: fp8-key-scales). Scales and offsets are float32;
the values take 1 byte per element, the scales and offsets 4 / group and 4 D / group
bytes per token and head.

    dequantize(keys) = float32(values) * scale + offset, rounded to the wanted dtype.

The product values * scale is exact in float32 (4 and 20 significant bits), so the
dequantized keys are the same whether a compiler fuses the multiply and the add or not.

Removing the mean is what keeps the selections: fp8 rounds every element to 3 mantissa
bits whatever its scale, so only a smaller magnitude gives a smaller error (on the real
model, 99.90% of the estimate's block choices as with bf16 keys, against 99.65% with one
scale per head and no mean). A group of
16 tokens is 2 stride groups of 8 (1 of 16): within a reshaped key column (section 1)
the scale and the offset are constant, so they factor out of the strided product, as an
fp8 kernel needs.

Non-finite keys: the statistics ignore them; a NaN key element stays NaN (as in bf16 keys,
its rows select every block), an infinite one saturates to +-448 * scale + offset.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from xattn_jax.checks import (SUPPORTED_DTYPES, cached_keys, check_array, check_int,
                              check_traced, readable_on_host)
from xattn_jax.geometry import cdiv, next_pow2

FP8 = jnp.dtype(jnp.float8_e4m3fn)
E4M3_MAX = 448.0  # the largest finite float8_e4m3fn
# tokens per scale and offset: of 16, 64 and 4096, the mean of 16 tokens removed kept
# the most selections, at 4 (D + 1) / 16 bytes per token and head beside the values
# (docs/tuning.md: fp8-key-groups)
GROUP = 16
# significant bits of a scale: fp8 values hold 4, so values * scale is exact in float32
# (docs/tuning.md: fp8-key-scales)
SCALE_BITS = 20


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=("values", "scales", "offsets"),
                   meta_fields=("group", "paged"))
@dataclasses.dataclass(frozen=True)
class Fp8Keys:
    """Keys quantized to float8_e4m3fn in groups of `group` tokens (a pytree: the arrays
    are its leaves, `group` and `paged` static), made by `quantize_keys`.

    Contiguous (paged=False), as k of the estimate:
      values float8_e4m3fn `[B, Hkv, L, D]`, scales float32 `[B, Hkv, G]`, offsets
      float32 `[B, Hkv, G, D]`, G = ceil(L / group): group g holds tokens
      g * group .. g * group + group - 1.
    Paged (paged=True), as a page pool read through a block table:
      values `[num_pages, page_size, Hkv, D]`, scales `[num_pages, n, Hkv]`, offsets
      `[num_pages, n, Hkv, D]`, n = page_size / group (group divides page_size).
    """

    values: jax.Array
    scales: jax.Array
    offsets: jax.Array
    group: int = GROUP
    paged: bool = False

    def stats_shape(self) -> tuple[int, ...]:
        """The shape `scales` must have for `values` (offsets: this and D)."""
        if self.paged:
            pages, page_size, kv_heads, _ = self.values.shape
            return pages, page_size // self.group, kv_heads
        batch, kv_heads, length, _ = self.values.shape
        return batch, kv_heads, cdiv(length, self.group)


def _round_up_to_scale_bits(x: jax.Array) -> jax.Array:
    """Positive finite float32 x rounded up to SCALE_BITS significant bits."""
    drop = (1 << (24 - SCALE_BITS)) - 1  # low bits of the 24-bit significand cleared
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jax.lax.bitcast_convert_type((bits + drop) & ~jnp.uint32(drop), jnp.float32)


def _pairwise_sum(x: jax.Array, axis: int) -> jax.Array:
    """The sum along `axis` (kept, size 1) in a fixed order: halves added pairwise. So
    the offsets, and every value, are the same bits however many groups one call
    quantizes (a reduction's order may change with the shape)."""
    x = jnp.pad(x, [(0, next_pow2(x.shape[axis]) - x.shape[axis]) if a == axis else (0, 0)
                    for a in range(x.ndim)])
    while x.shape[axis] > 1:
        half = x.shape[axis] // 2
        x = jax.lax.slice_in_dim(x, 0, half, axis=axis) + \
            jax.lax.slice_in_dim(x, half, 2 * half, axis=axis)
    return x


def _quantize_groups(x, in_use, tokens_axis: int):
    """float32 x with each group's tokens on `tokens_axis` and channels last; in_use bool,
    broadcastable to x: the tokens the statistics cover (the others are stored as 0).
    Returns (values float8_e4m3fn, scales, offsets) with keepdims statistics."""
    counted = in_use & jnp.isfinite(x)
    count = counted.sum(axis=tokens_axis, keepdims=True)
    offsets = _pairwise_sum(jnp.where(counted, x, 0.0), tokens_axis) / jnp.maximum(count, 1)
    rest = x - offsets
    amax = jnp.where(counted, jnp.abs(rest), 0.0).max(axis=(tokens_axis, x.ndim - 1),
                                                      keepdims=True)
    scales = jnp.where(amax > 0, _round_up_to_scale_bits(amax / E4M3_MAX), 1.0)
    values = jnp.where(in_use, jnp.clip(rest / scales, -E4M3_MAX, E4M3_MAX), 0.0)
    return values.astype(FP8), scales, offsets


@functools.partial(jax.jit, static_argnames=("group",))
def _quantize_contiguous(k, tokens, *, group: int):
    b, h, length, d = k.shape
    pad = -length % group
    x = jnp.pad(k.astype(jnp.float32), ((0, 0), (0, 0), (0, pad), (0, 0)))
    x = x.reshape(b, h, -1, group, d)  # [B, Hkv, G, group, D]
    position = jnp.arange(length + pad).reshape(-1, group)[:, :, None]
    values, scales, offsets = _quantize_groups(x, position < tokens, tokens_axis=3)
    values = values.reshape(b, h, -1, d)[:, :, :length]
    return Fp8Keys(values, scales[:, :, :, 0, 0], offsets[:, :, :, 0], group, False)


@functools.partial(jax.jit, static_argnames=("group",))
def _quantize_paged(pages, tokens, *, group: int):
    p, page_size, h, d = pages.shape
    x = pages.astype(jnp.float32).reshape(p, page_size // group, group, h, d)
    position = jnp.arange(page_size).reshape(page_size // group, group)
    in_use = (position < tokens[:, None, None])[..., None, None]  # [P, n, group, 1, 1]
    values, scales, offsets = _quantize_groups(x, in_use, tokens_axis=2)
    return Fp8Keys(values.reshape(pages.shape), scales[:, :, 0, :, 0], offsets[:, :, 0],
                   group, True)


def quantize_keys(k: jax.Array, *, group: int = GROUP, paged: bool = False,
                  tokens=None) -> Fp8Keys:
    """k as `Fp8Keys` (the module docstring's scheme).

    k: float32, bfloat16 or float16 keys, `[B, Hkv, L, D]`, or with paged=True a page
      pool `[num_pages, page_size, Hkv, D]`.
    group: tokens per scale and offset, a positive int; with paged=True it must divide
      page_size.
    tokens: the tokens in use, which the statistics cover; the others are stored as 0
      (they dequantize to the offset). Contiguous: an int, or an int32 scalar jax.Array
      (maybe traced), the first `tokens` of every sequence (default all). Paged: int32
      `[num_pages]`, the tokens of each page (default all).
    """
    check_int("group", group)
    paged = bool(paged)
    layout = "[num_pages, page_size, Hkv, D] (paged)" if paged else "[B, Hkv, L, D]"
    check_array("k", k, layout)
    if jnp.dtype(k.dtype) not in SUPPORTED_DTYPES:
        raise ValueError(f"k must be float32, bfloat16 or float16, got {k.dtype}")
    if not paged:
        return _quantize_contiguous(k, k.shape[2] if tokens is None else tokens,
                                    group=group)
    if k.shape[1] % group:
        raise ValueError(f"group must divide the page size {k.shape[1]}, got {group}")
    if tokens is None:
        tokens = np.full(k.shape[0], k.shape[1], np.int32)
    elif getattr(tokens, "shape", None) != (k.shape[0],):
        raise ValueError(f"tokens must be ints [num_pages] ({k.shape[0]},) with "
                         f"paged=True, got {tokens!r}")
    return _quantize_paged(k, jnp.asarray(tokens, jnp.int32), group=group)


def dequantize(keys: Fp8Keys, dtype=jnp.float32) -> jax.Array:
    """The keys `keys` stand for, in their layout: float32(values) * scale + offset,
    rounded to `dtype`."""
    v = keys.values.astype(jnp.float32)
    if keys.paged:
        p, page_size, h, d = v.shape
        v = v.reshape(p, page_size // keys.group, keys.group, h, d)
        x = v * keys.scales[:, :, None, :, None] + keys.offsets[:, :, None]
        return x.reshape(keys.values.shape).astype(dtype)
    b, h, length, d = v.shape
    pad = -length % keys.group
    v = jnp.pad(v, ((0, 0), (0, 0), (0, pad), (0, 0))).reshape(b, h, -1, keys.group, d)
    x = v * keys.scales[..., None, None] + keys.offsets[:, :, :, None]
    return x.reshape(b, h, -1, d)[:, :, :length].astype(dtype)


@functools.partial(jax.jit, static_argnames=("dtype",))
def _contiguous_keys(keys: Fp8Keys, block_table, dtype):
    """`[B, Hkv, capacity, D]` in dtype: the keys, read through the table if paged."""
    if block_table is None:
        return dequantize(keys, dtype)
    table = block_table.clip(0, keys.values.shape[0] - 1)
    picked = Fp8Keys(keys.values[table.reshape(-1)], keys.scales[table.reshape(-1)],
                     keys.offsets[table.reshape(-1)], keys.group, True)
    pages = dequantize(picked, dtype)  # [B * per_seq, page_size, Hkv, D]
    b, per_seq = block_table.shape
    return pages.reshape(b, per_seq * pages.shape[1], *pages.shape[2:]).transpose(0, 2, 1, 3)


def keys_for_estimate(q, keys: Fp8Keys, block_table=None) -> jax.Array:
    """The dequantized keys an estimate on q runs on, contiguous `[B, Hkv, capacity, D]`
    in q's dtype (paged keys read through `block_table`, int32 `[B, pages_per_seq]`),
    after `check_fp8_keys` and the block table's checks (`checks.cached_keys`)."""
    check_fp8_keys(keys, "k")
    if keys.paged != (block_table is not None):
        raise ValueError("k: paged Fp8Keys need a block_table, contiguous ones none (got "
                         f"paged={keys.paged} and block_table "
                         f"{'None' if block_table is None else 'given'})")
    check_array("q", q, "[batch, heads, length, head_dim]")
    if jnp.dtype(q.dtype) not in SUPPORTED_DTYPES:
        raise ValueError(f"q must be float32, bfloat16 or float16, got {q.dtype}")
    _, table = cached_keys(q, keys.values, block_table)
    return _contiguous_keys(keys, None if table is None else jnp.asarray(table),
                            jnp.dtype(q.dtype))


def check_fp8_keys(keys, name: str = "k") -> None:
    """Fp8Keys of consistent shapes and dtypes, or a TypeError / ValueError naming `name`.

    Scales must be positive and finite, offsets finite: checked on the host for values it
    can read without waiting for an accelerator (numpy, or jax.Arrays on the CPU), in
    checked mode (`xattn_jax.checked`) otherwise. Unchecked, a scale of 0 gives its group
    the offset for every key, a negative one flips the keys around it, and a NaN or
    infinite one (or offset) makes them NaN: their rows then select every block.
    """
    if not isinstance(keys, Fp8Keys):
        raise TypeError(f"{name} must be Fp8Keys, got {type(keys).__name__}")
    check_int(f"{name}.group", keys.group)
    layout = "[num_pages, page_size, Hkv, D] (paged)" if keys.paged else "[B, Hkv, L, D]"
    check_array(f"{name}.values", keys.values, layout)
    if jnp.dtype(keys.values.dtype) != FP8:
        raise ValueError(f"{name}.values must be float8_e4m3fn, got {keys.values.dtype}")
    if keys.paged and keys.values.shape[1] % keys.group:
        raise ValueError(f"{name}.group must divide the page size {keys.values.shape[1]}, "
                         f"got {keys.group}")
    shape = keys.stats_shape()
    for part, want in (("scales", shape), ("offsets", (*shape, keys.values.shape[-1]))):
        x = getattr(keys, part)
        if not isinstance(x, (jax.Array, np.ndarray)) or tuple(x.shape) != want \
                or jnp.dtype(x.dtype) != jnp.float32:
            got = f"{x.dtype} {tuple(x.shape)}" if hasattr(x, "shape") else type(x).__name__
            raise ValueError(f"{name}.{part} must be float32 {want} for values "
                             f"{tuple(keys.values.shape)} in groups of {keys.group}, "
                             f"got {got}")
    rules = ((f"{name}.scales must be positive and finite", keys.scales,
              lambda s: (s > 0) & jnp.isfinite(s)),
             (f"{name}.offsets must be finite", keys.offsets, jnp.isfinite))
    for rule, x, holds in rules:
        if readable_on_host(x):
            bad = ~np.asarray(holds(np.asarray(x)))
            if bad.any():
                raise ValueError(f"{rule}, got {np.asarray(x)[bad][:4].tolist()}")
        else:
            check_traced(holds, rule + ", got {}", x)
