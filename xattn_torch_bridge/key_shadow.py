"""A resident fp8 copy of a paged cache's keys, for estimates that read no offloaded page.

`PagedKVCache(..., key_shadow="fp8")` keeps one `KeyShadow`: every live block has a
shadow page on the cache's device, whether the block itself is resident or offloaded.
The page holds the block's keys as `xattn_jax.quantize_keys` makes them (docs/estimate.md,
"Keys in fp8"): float8_e4m3fn values (stored as their bits, uint8) with a scale and an
offset per group of `group` tokens and KV head. `append` rewrites the shadow of every
page it writes to, from the page's device keys; `offload` and `load` leave it as it is.

Memory per shadow page: page_size * Hkv * (D + 4 (D + 1) / group) bytes: the values, a
quarter of the bytes of K and V in bf16, plus the scales and offsets (D = 128, groups of
16: 160 bytes per token and KV head, 31% of the 512 bytes of its K and V).

The quantization is `xattn_jax`'s, run through the zero-copy bridge in one jitted call per
append (the pages' keys read in place, on torch's current stream's order); its results
are copied into the shadow pages on torch's current stream.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import torch
from xattn_jax import fp8
from xattn_jax.geometry import next_pow2

from xattn_torch_bridge.dlpack import place_of, to_torch, views_for_one_computation

CHOICES = ("fp8",)  # the shadows a PagedKVCache can keep


def group_for(page_size: int) -> int:
    """Tokens per scale and offset of a shadow page: `fp8.GROUP` where it divides the
    page, else the whole page (pages of 8 or 7 tokens: one group each; docs/tuning.md:
    fp8-key-groups)."""
    return fp8.GROUP if page_size % fp8.GROUP == 0 else page_size


@functools.partial(jax.jit, static_argnames="group")
def _quantized_pages(rows, pool, *, group: int):
    """rows int32 `[2, n]` (device slots of pool, tokens in use), pool `[P, page, Hkv, D]`
    -> the pages' values (uint8 bits), scales and offsets, `n` of each."""
    keys = fp8.quantize_keys(pool[rows[0]], group=group, paged=True, tokens=rows[1])
    return jax.lax.bitcast_convert_type(keys.values, jnp.uint8), keys.scales, keys.offsets


class KeyShadow:
    """fp8 copies of up to `pages` blocks' keys on `device` (one page per live block).

    values: uint8 `[pages, page_size, Hkv, D]` (float8_e4m3fn bits); scales: float32
    `[pages, page_size / group, Hkv]`; offsets: float32 `[pages, page_size / group, Hkv,
    D]`: the paged layout of `xattn_jax.fp8.Fp8Keys`.
    """

    def __init__(self, pages: int, page_size: int, kv_heads: int, head_dim: int,
                 device: torch.device):
        self.group = group_for(page_size)
        groups = page_size // self.group
        self.values = torch.zeros(pages, page_size, kv_heads, head_dim, dtype=torch.uint8,
                                  device=device)
        self.scales = torch.ones(pages, groups, kv_heads, dtype=torch.float32, device=device)
        self.offsets = torch.zeros(pages, groups, kv_heads, head_dim, dtype=torch.float32,
                                   device=device)
        self._free = list(range(pages - 1, -1, -1))  # pop() -> the lowest

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def take(self) -> int:
        """A free shadow page for a new block (the cache checked that one is free)."""
        return self._free.pop()

    def release(self, page: int) -> None:
        self._free.append(page)

    def write(self, pool: torch.Tensor, slots: list[int], tokens: list[int],
              pages: list[int]) -> None:
        """Quantizes the keys of device pages `slots` of `pool` (`tokens` in use in each)
        into shadow pages `pages`. The count is padded to a power of two (repeating the
        first page), so appends of a few pages compile a few times only."""
        n = len(slots)
        width = next_pow2(n)
        rows = torch.tensor([slots + slots[:1] * (width - n), tokens + tokens[:1] * (width - n)],
                            dtype=torch.int32, device=pool.device)
        rows, place = place_of(rows, "rows", False)
        values, scales, offsets = _quantized_pages(
            *views_for_one_computation(place, rows, persistent=(pool,)), group=self.group)
        index = torch.as_tensor(np.asarray(pages), device=pool.device)
        self.values[index] = to_torch(values)[:n]
        self.scales[index] = to_torch(scales)[:n]
        self.offsets[index] = to_torch(offsets)[:n]
