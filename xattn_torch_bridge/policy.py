"""XAttention's block selection for chunked prefill over a `PagedKVCache` (docs/estimate.md
section 5), computed by `xattn_jax` on the cache's own pages through the zero-copy bridge.

For one chunk of queries, `XAttentionPolicy.select_blocks` scores the sequence's cached
blocks with `xattn_jax.kv_block_scores`, reading `cache.keys` in place through a block
table of device pages, and picks blocks with `xattn_jax.select_kv_blocks`.

Offloaded blocks: their keys are copied into the cache's staging pages first
(`PagedKVCache.stage_keys`: a side stream and an event on CUDA, a plain copy on the CPU)
and the estimate reads them there. The softmax normalizes over all the context's keys,
so the estimate is one pass over the whole context: it waits for every staging copy, and
a context may hold at most `cache.staging_slots` offloaded blocks (more is a ValueError;
load some blocks first). The copies overlap the work queued on torch's current stream
before the call, not the estimate itself.

Compilation: the block table is padded to a power of two of pages, at least the
context's blocks and the chunk's length (the padding pages repeat the first block and
are masked by the key count, which is data), so a growing context compiles once per
power of two, not once per block.
"""

from __future__ import annotations

import numpy as np
import torch
import xattn_jax
from xattn_jax.checks import (check_choice, check_estimate_block_size, check_flag, check_norm,
                              check_share)
from xattn_jax.impls import IMPLS
from xattn_jax.kv_blocks import RULES

from xattn_torch_bridge.dlpack import place_of, views_for_one_computation
from xattn_torch_bridge.kv_cache import PagedKVCache


class XAttentionPolicy:
    """Chooses the KV-cache blocks a prefill chunk attends to.

    Args:
      threshold: share of the chunk's attention mass to keep, in (0, 1].
      stride: the estimate's antidiagonal stride.
      estimate_block_size: block size of the estimate's block sums; a multiple of stride
        that divides the cache's block_size.
      rule: "score" (average over heads, then threshold) or "vote" (the engine's earlier
        majority vote of query heads and query blocks); see `xattn_jax.select_kv_blocks`.
      keep_first / keep_last: always select the first block (attention sink) and the last
        block (most recent context).
      per_kv_head: select per KV head and return the union (a block is loaded whole).
      norm, impl: as in `xattn_jax.kv_block_scores` (impl resolved for the device the
        cache lives on: `xattn_jax.impls`).
    """

    def __init__(self, threshold: float = 0.95, stride: int = 8,
                 estimate_block_size: int = 1024, *, rule: str = "score",
                 keep_first: bool = True, keep_last: bool = True, per_kv_head: bool = False,
                 norm: float = 1.0, impl: str = "auto"):
        self.threshold = check_share("threshold", threshold)
        self.estimate_block_size = check_estimate_block_size(estimate_block_size, stride)
        self.stride = int(stride)
        self.rule = check_choice("rule", rule, RULES)
        self.keep_first = check_flag("keep_first", keep_first)
        self.keep_last = check_flag("keep_last", keep_last)
        self.per_kv_head = check_flag("per_kv_head", per_kv_head)
        self.norm, self.impl = check_norm(norm), check_choice("impl", impl, IMPLS)

    def select_blocks(self, q: torch.Tensor, cache: PagedKVCache, block_ids) -> list[int]:
        """The ids of the blocks in `block_ids` that the chunk `q` attends to.

        q: the chunk's queries `[Hq, Lq, D]` or `[1, Hq, Lq, D]`, all after the cached
          context; the cache's dtype and device, Hq a multiple of the cache's Hkv,
          contiguous and aligned (the rules of `to_jax`); any length.
        block_ids: the sequence's cached blocks in order (the chunk excluded), all full
          but the last, which holds at least one token.
        Returns the selected ids in context order. Blocks must not change during the
        call; it returns after the estimate has finished (the selection is read to the
        host), so the staging pages are free again.
        """
        if not isinstance(cache, PagedKVCache):
            raise TypeError(f"cache must be a PagedKVCache, got {type(cache).__name__}")
        q, place = place_of(self._check_q(q, cache), "q", False)
        if cache.block_size % self.estimate_block_size:
            raise ValueError(f"estimate_block_size ({self.estimate_block_size}) must divide "
                             f"the cache's block_size ({cache.block_size})")
        k_len = cache.sequence_length(block_ids)
        ids = list(block_ids)
        pages, ready = cache.stage_keys(ids)
        n = len(ids)  # the table's width also covers the chunk, which JAX requires
        width = 1 << (max(n, -(-q.shape[2] // cache.block_size)) - 1).bit_length()
        table = torch.tensor([pages + pages[:1] * (width - n)], dtype=torch.int32,
                             device=cache.device)
        if ready is not None:
            torch.cuda.current_stream(cache.device).wait_event(ready)
        keys, _ = place_of(cache.keys, "cache.keys", False)
        table, _ = place_of(table, "block table", False)
        q_view, keys_view, table_view = views_for_one_computation(place, q, keys, table)
        scores = xattn_jax.kv_block_scores(
            q_view, keys_view, block_table=table_view, k_len=k_len,
            kv_block_size=cache.block_size, estimate_block_size=self.estimate_block_size,
            stride=self.stride, norm=self.norm, per_query_block=self.rule == "vote",
            impl=self.impl)
        mask = xattn_jax.select_kv_blocks(
            scores, threshold=self.threshold, keep_first=self.keep_first,
            keep_last=self.keep_last, per_kv_head=self.per_kv_head, kv_heads=cache.kv_heads,
            num_valid=n, rule=self.rule)
        chosen = np.asarray(mask).reshape(-1, width).any(axis=0)[:n]
        return [ids[j] for j in np.flatnonzero(chosen)]

    @staticmethod
    def _check_q(q, cache: PagedKVCache) -> torch.Tensor:
        """q as `[1, Hq, Lq, D]`, detached, or a ValueError naming the rule."""
        if not isinstance(q, torch.Tensor):
            raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
        if q.ndim == 3:
            q = q[None]
        if q.ndim != 4 or q.shape[0] != 1:
            raise ValueError(f"q must be [Hq, Lq, D] or [1, Hq, Lq, D], got shape "
                             f"{tuple(q.shape)}")
        _, heads, length, dim = q.shape
        if dim != cache.head_dim or heads % cache.kv_heads or not heads or not length:
            raise ValueError(f"q must have head_dim {cache.head_dim}, a positive multiple of "
                             f"the cache's {cache.kv_heads} KV heads and a positive length, "
                             f"got shape {tuple(q.shape)}")
        if q.dtype != cache.dtype or q.device != cache.device:
            raise ValueError(f"q must have the cache's dtype and device ({cache.dtype} on "
                             f"{cache.device}), got {q.dtype} on {q.device}")
        return q.detach()
