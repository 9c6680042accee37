"""XAttention's block selection for chunked prefill over a `PagedKVCache` (docs/estimate.md
section 5), computed by `xattn_jax` on the cache's own pages through the zero-copy bridge.

Pages and selection units. The cache's pages (`block_size` tokens: 16 in vLLM, 4096 in
the seed engine) are what it allocates and offloads; the selection unit is the group of
tokens the engine loads or skips together: one page, or several consecutive pages of a
sequence. The policy scores and selects units; `select_blocks` returns the ids of every
page of the chosen units. The unit must be a multiple of the page size and of the
estimate's block size; by default it is their least common multiple, so any page size
works with the default estimate block of 1024 tokens (pages of 16 to 1024 tokens: units
of 1024; pages of 4096: units of one page). The kernel reads the pages token by token
through the block table, whatever their size.

One call of `XAttentionPolicy.select_blocks`:
1. host checks (q against the cache; the block ids, vectorized in the cache); what
   depends only on the cache's layout (static settings, pages per unit) is derived once
   per layout;
2. `PagedKVCache.block_table`: the staging copies of offloaded keys are issued first, on
   the cache's side stream; the block table (pages, padding and the token count) is
   written into the cache's persistent pinned buffer and copied asynchronously into its
   persistent device buffer on torch's current stream, which then waits for the staging
   copies;
3. one jitted JAX computation (`_selection`): `xattn_jax.kv_block_scores` on the pages
   through the table, `xattn_jax.select_kv_blocks`, and the union over heads to one bool
   per unit, compiled once per power of two of units (and per chunk shape), or once per
   chunk shape with `max_context` (the table then always has its width): the token
   count is data, read from the table on the device. Its inputs: q's view, ordered after
   torch's current stream (`dlpack.views_for_one_computation`), and the unordered views
   of the cache's pages and table buffer, made once (`dlpack.persistent_view`);
4. exactly one device-to-host read (`dlpack.read_through_torch`): the units' bools, from which
   the ids are built.
Nothing else crosses between host and device, and nothing waits for the device but the
read in step 4.

With a key shadow (`PagedKVCache(..., key_shadow="fp8")`), step 2 writes the table of the
blocks' shadow pages (`PagedKVCache.shadow_table`) and stages nothing, and step 3 scores
the shadow's fp8 keys (`_shadow_selection`: `xattn_jax.kv_block_scores` on
`xattn_jax.fp8.Fp8Keys`, docs/estimate.md "Keys in fp8"): no page of an offloaded block
is copied before the selection, whatever their number; only the selected ones need
loading for the attention.

What overlaps. The staging copies overlap the host work of steps 2-3 (the table, the
dispatch) and whatever torch's current stream was running before the call. The scoring
cannot start before every staged key is there: the softmax of each query row normalizes
over all the context's keys, so the estimate is one pass over the whole context and
waits for the copies (their PCIe time is on the critical path, once). A context may hold
at most `cache.staging_slots` offloaded pages (more is a ValueError; load some first),
unless the cache keeps a key shadow.

torch.compile. `XAttentionPolicy.scores` and `XAttentionPolicy.selection` are the
scoring and the selection as torch custom ops (`torch.ops.xattn.policy_scores`,
`torch.ops.xattn.policy_selection`, with fake implementations) inside a compiled region:
a compiled model takes the table from `XAttentionPolicy.block_table` (host work, outside
the compiled region) and turns the units' bools into ids with `chosen_blocks` outside it.
These steps read the cache's bf16 keys (offloaded ones staged), not a key shadow.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math

import jax
import numpy as np
import torch
import xattn_jax
from xattn_jax import fp8, impls
from xattn_jax.backend import Backend
from xattn_jax.checks import (check_choice, check_estimate_block_size, check_flag, check_int,
                              check_norm, check_share)
from xattn_jax.defaults import ESTIMATE_BLOCK_SIZE, KV_THRESHOLD, NORM, STRIDE
from xattn_jax.geometry import cdiv, next_pow2
from xattn_jax.kv_blocks import RULES

from xattn_torch_bridge.dlpack import (place_of, read_through_torch, to_torch,
                                       views_for_one_computation)
from xattn_torch_bridge.kv_cache import PagedKVCache


@dataclasses.dataclass(frozen=True)
class Scoring:
    """Static settings of the scoring (hashable: a jit static argument). unit: tokens per
    selection unit; vote: per-query-block scores (the "vote" rule)."""

    unit: int
    estimate_block_size: int
    stride: int
    norm: float
    vote: bool
    impl: Backend


@dataclasses.dataclass(frozen=True)
class Choice:
    """Static settings of the selection. kv_heads: select per KV head (the cache's Hkv of
    them) and take the union; 0: once for all heads."""

    unit: int
    threshold: float
    keep_first: bool
    keep_last: bool
    kv_heads: int
    rule: str


def _unit_scores(q, pages, table, scoring: Scoring):
    """q `[1, Hq, Lq, D]`, pages `[P, page, Hkv, D]`, table int32 `[width + 1]` ->
    float32 `[1, Hq, units]` (or `[1, Hq, R, units]` with vote)."""
    width = table.shape[0] - 1
    return xattn_jax.kv_block_scores(
        q, pages, block_table=table[None, :width], k_len=table[width],
        kv_block_size=scoring.unit, estimate_block_size=scoring.estimate_block_size,
        stride=scoring.stride, norm=scoring.norm, per_query_block=scoring.vote,
        impl=scoring.impl)


def _unit_mask(scores, table, choice: Choice):
    """The units chosen from `_unit_scores`: bool `[units]` (the union over KV heads)."""
    units = (table[-1] + choice.unit - 1) // choice.unit  # units holding keys
    mask = xattn_jax.select_kv_blocks(
        scores, threshold=choice.threshold, keep_first=choice.keep_first,
        keep_last=choice.keep_last, per_kv_head=bool(choice.kv_heads),
        kv_heads=choice.kv_heads or None, num_valid=units, rule=choice.rule)
    return mask.reshape(-1, mask.shape[-1]).any(axis=0)


# pages per unit from which `_chosen` takes one slice of a list of ids per chosen unit
# rather than a step per page (docs/tuning.md: policy-id-slices)
_SLICES_FROM = 8


@dataclasses.dataclass(frozen=True)
class _Layout:
    """A policy's settings for one cache layout: the static settings, and the pages per
    selection unit."""

    scoring: Scoring
    choice: Choice
    per_unit: int


_scores = jax.jit(_unit_scores, static_argnames="scoring")
_mask = jax.jit(_unit_mask, static_argnames="choice")


@functools.partial(jax.jit, static_argnames=("scoring", "choice"))
def _selection(q, pages, table, scoring: Scoring, choice: Choice):
    """Scores and selection in one computation: bool `[units]`."""
    return _unit_mask(_unit_scores(q, pages, table, scoring), table, choice)


@functools.partial(jax.jit, static_argnames=("scoring", "choice", "group"))
def _shadow_selection(q, values, scales, offsets, table, scoring: Scoring, choice: Choice,
                      group: int):
    """`_selection` on a key shadow (`key_shadow.KeyShadow`): values uint8 `[P, page, Hkv,
    D]` (float8_e4m3fn bits), scales and offsets float32, in groups of `group` tokens."""
    keys = fp8.Fp8Keys(jax.lax.bitcast_convert_type(values, fp8.FP8), scales, offsets,
                       group, paged=True)
    return _unit_mask(_unit_scores(q, keys, table, scoring), table, choice)


class XAttentionPolicy:
    """Chooses the KV-cache pages a prefill chunk attends to.

    Args:
      threshold: share of the chunk's attention mass to keep, in (0, 1].
      stride: the estimate's antidiagonal stride.
      estimate_block_size: block size of the estimate's block sums; a multiple of stride.
      selection_unit: tokens selected or skipped together, a multiple of the cache's page
        size and of estimate_block_size; None: their least common multiple.
      rule: "score" (average over heads, then threshold) or "vote" (the engine's earlier
        majority vote of query heads and query blocks of one unit); see
        `xattn_jax.select_kv_blocks`.
      keep_first / keep_last: always select the first unit (attention sink) and the last
        unit (most recent context).
      per_kv_head: select per KV head and return the union (a page is loaded whole).
      norm, impl: as in `xattn_jax.kv_block_scores` (impl resolved for the device the
        cache lives on: `xattn_jax.impls`).
      max_context: None, or the most tokens a call's context (its pages, page_size
        tokens each) or chunk holds: every block table is then that wide, so the
        selection compiles once per chunk shape for every context up to it (the kernels
        skip the padding: the token count is data). None: the table covers a power of two
        of units, one compilation per power of two. A longer call is a ValueError.
    """

    def __init__(self, threshold: float = KV_THRESHOLD, stride: int = STRIDE,
                 estimate_block_size: int = ESTIMATE_BLOCK_SIZE, *,
                 selection_unit: int | None = None, rule: str = "score",
                 keep_first: bool = True, keep_last: bool = True, per_kv_head: bool = False,
                 norm: float = NORM, impl: str = "auto",
                 max_context: int | None = None):
        self.threshold = check_share("threshold", threshold)
        self.estimate_block_size = check_estimate_block_size(estimate_block_size, stride)
        self.stride = int(stride)
        if selection_unit is not None:
            check_int("selection_unit", selection_unit)
            if selection_unit % estimate_block_size:
                raise ValueError(f"selection_unit ({selection_unit}) must be a multiple of "
                                 f"estimate_block_size ({estimate_block_size})")
        self.selection_unit = selection_unit
        self.rule = check_choice("rule", rule, RULES)
        self.keep_first = check_flag("keep_first", keep_first)
        self.keep_last = check_flag("keep_last", keep_last)
        self.per_kv_head = check_flag("per_kv_head", per_kv_head)
        self.norm, self.impl = check_norm(norm), check_choice("impl", impl, impls.IMPLS)
        self.max_context = None if max_context is None else check_int("max_context",
                                                                      max_context)
        self._layouts: dict[tuple, _Layout] = {}

    # --- the whole call -------------------------------------------------------------------

    def select_blocks(self, q: torch.Tensor, cache: PagedKVCache, block_ids):
        """The ids of the pages in `block_ids` that the chunk `q` attends to.

        q: the chunk's queries `[Hq, Lq, D]` or `[1, Hq, Lq, D]`, all after the cached
          context; the cache's dtype and device, Hq a multiple of the cache's Hkv,
          contiguous and aligned (the rules of `to_jax`); any length.
        block_ids: the sequence's cached pages in order (the chunk excluded), all full
          but the last, which holds at least one token: a list of ids or a 1-D integer
          numpy array.
        Returns the selected ids in context order, every page of each selected unit: a
        list, or a numpy array for numpy `block_ids` (no Python int per page: the faster
        form for thousands of small pages).
        Blocks must not change during the call; it returns after the estimate has
        finished (the selection is read to the host), so the staging pages and the block
        table are free again. With a key shadow the estimate reads the blocks' fp8 keys
        (module docstring): no offloaded page is copied.
        """
        shadow = cache.shadow if isinstance(cache, PagedKVCache) else None
        q, place, layout, table = self._prepare(q, cache, block_ids, shadow is not None)
        if shadow is None:
            units = _selection(*views_for_one_computation(place, q,
                                                          persistent=(cache.keys, table)),
                               scoring=layout.scoring, choice=layout.choice)
        else:
            units = _shadow_selection(
                *views_for_one_computation(place, q, persistent=(
                    shadow.values, shadow.scales, shadow.offsets, table)),
                scoring=layout.scoring, choice=layout.choice, group=shadow.group)
        return _chosen(read_through_torch(units), layout.per_unit, block_ids)  # the one read

    # --- the steps, for torch.compile -----------------------------------------------------

    def block_table(self, q: torch.Tensor, cache: PagedKVCache, block_ids) -> torch.Tensor:
        """Host work of a selection (checks, staging, the table): the cache's block table
        for the chunk q (`PagedKVCache.block_table`, int32 `[width + 1]`), its width
        covering the context and the chunk, a power of two of whole units."""
        return self._prepare(q, cache, block_ids, False)[3]

    def scores(self, q: torch.Tensor, cache: PagedKVCache, table: torch.Tensor) -> torch.Tensor:
        """Each unit's share of the chunk's attention: float32 `[1, Hq, units]` (rule
        "vote": `[1, Hq, R, units]`), on q's device; table from `block_table`. The custom
        op `xattn::policy_scores` inside torch.compile."""
        op = policy_scores_op if torch.compiler.is_compiling() else policy_scores
        return op(q, cache.keys, table, self._unit(cache.block_size),
                  self.estimate_block_size, self.stride, float(self.norm),
                  self.rule == "vote", self.impl)

    def selection(self, scores: torch.Tensor, cache: PagedKVCache,
                  table: torch.Tensor) -> torch.Tensor:
        """The chosen units from `scores`: bool `[units]` on the scores' device. The custom
        op `xattn::policy_selection` inside torch.compile."""
        op = policy_selection_op if torch.compiler.is_compiling() else policy_selection
        return op(scores, table, self._unit(cache.block_size), float(self.threshold),
                  bool(self.keep_first), bool(self.keep_last),
                  cache.kv_heads if self.per_kv_head else 0, self.rule)

    def chosen_blocks(self, units, cache: PagedKVCache, block_ids):
        """The ids of `block_ids` in the chosen units (bool `[units]`: numpy, or a torch
        tensor, read to the host): a list, or a numpy array for a numpy `block_ids`."""
        if isinstance(units, torch.Tensor):
            units = units.cpu().numpy()
        return _chosen(units, self._layout(cache).per_unit, block_ids)

    # --- helpers --------------------------------------------------------------------------

    def _unit(self, page: int) -> int:
        """Tokens per selection unit for pages of `page` tokens."""
        if self.selection_unit is None:
            return page * self.estimate_block_size // math.gcd(page, self.estimate_block_size)
        return self.selection_unit

    def _layout(self, cache: PagedKVCache) -> _Layout:
        """The settings for `cache`'s layout (cached per page size, Hkv and device)."""
        key = (cache.block_size, cache.kv_heads, cache.device)
        layout = self._layouts.get(key)
        if layout is None:
            unit = self._unit(cache.block_size)
            if unit % cache.block_size:
                raise ValueError(f"selection_unit ({unit}) must be a multiple of the "
                                 f"cache's block_size ({cache.block_size})")
            # resolved for the cache's device: inside the jitted call it has none yet
            impl = impls.resolve(self.impl, device=place_of(cache.keys, "cache.keys",
                                                            False)[1].jax_device)
            layout = self._layouts[key] = _Layout(
                Scoring(unit, self.estimate_block_size, self.stride, float(self.norm),
                        self.rule == "vote", impl),
                Choice(unit, float(self.threshold), bool(self.keep_first),
                       bool(self.keep_last), cache.kv_heads if self.per_kv_head else 0,
                       self.rule),
                unit // cache.block_size)
        return layout

    def _prepare(self, q, cache, block_ids, shadow: bool):
        """q as `[1, Hq, Lq, D]` (checked), its Place, the cache's layout and the block
        table, written (checks and staging: `PagedKVCache.block_table`; with `shadow`,
        the table of the key shadow's pages: `PagedKVCache.shadow_table`)."""
        if not isinstance(cache, PagedKVCache):
            raise TypeError(f"cache must be a PagedKVCache, got {type(cache).__name__}")
        q, place = place_of(self._check_q(q, cache), "q", False)
        layout = self._layout(cache)
        per_unit, unit = layout.per_unit, layout.scoring.unit
        n = len(block_ids) if isinstance(block_ids, (list, tuple, range, np.ndarray)) else 0
        # the table covers the context and the chunk (JAX requires Lq <= its capacity)
        if self.max_context is None:
            units = next_pow2(max(cdiv(n, per_unit), cdiv(q.shape[2], unit)))
        else:
            if max(n * cache.block_size, q.shape[2]) > self.max_context:
                raise ValueError(
                    f"the context ({n} blocks of {cache.block_size} tokens) and the chunk "
                    f"({q.shape[2]} queries) must each hold at most max_context "
                    f"({self.max_context}) tokens")
            units = cdiv(self.max_context, unit)
        table = cache.shadow_table if shadow else cache.block_table
        return q, place, layout, table(block_ids, units * per_unit)

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
        return q.detach() if q.requires_grad else q


def _chosen(units: np.ndarray, per_unit: int, block_ids):
    """The ids of `block_ids` in the chosen units (bool `[units]`, `per_unit` pages
    each): a list, or a numpy array for a numpy `block_ids`."""
    if isinstance(block_ids, np.ndarray):
        return block_ids[np.repeat(units, per_unit)[:len(block_ids)]]
    if per_unit < _SLICES_FROM:
        return list(itertools.compress(block_ids, np.repeat(units, per_unit).tolist()))
    chosen = []
    for start in (np.flatnonzero(units) * per_unit).tolist():
        chosen += block_ids[start:start + per_unit]
    return chosen


# --- torch custom ops -------------------------------------------------------------------

def policy_scores(q: torch.Tensor, pages: torch.Tensor, table: torch.Tensor, unit: int,
                  estimate_block_size: int, stride: int, norm: float, vote: bool,
                  impl: str) -> torch.Tensor:
    """`_unit_scores` on torch tensors: q `[Hq, Lq, D]` or `[1, Hq, Lq, D]`, pages the
    cache's keys, table from `PagedKVCache.block_table`; all on one device (the views of
    pages and table are reused across calls: `dlpack.persistent_view`)."""
    q = q[None] if q.ndim == 3 else q
    q, place = place_of(q, "q", False)
    for name, x in (("pages", pages), ("table", table)):
        if place_of(x, name, False)[1] is not place:
            raise ValueError(f"{name} must be on q's device {q.device}, got {x.device}")
    scoring = Scoring(unit, estimate_block_size, stride, norm, vote,
                      impls.resolve(impl, device=place.jax_device))
    return to_torch(_scores(*views_for_one_computation(place, q, persistent=(pages, table)),
                            scoring=scoring))


def policy_selection(scores: torch.Tensor, table: torch.Tensor, unit: int, threshold: float,
                     keep_first: bool, keep_last: bool, kv_heads: int,
                     rule: str) -> torch.Tensor:
    """`_unit_mask` on torch tensors: the units chosen from `policy_scores`."""
    scores, place = place_of(scores, "scores", False)
    if place_of(table, "table", False)[1] is not place:
        raise ValueError(f"table must be on the scores' device {scores.device}, got "
                         f"{table.device}")
    choice = Choice(unit, threshold, keep_first, keep_last, kv_heads, rule)
    return to_torch(_mask(*views_for_one_computation(place, scores, persistent=(table,)),
                          choice=choice))


policy_scores_op = torch.library.custom_op("xattn::policy_scores", policy_scores,
                                           mutates_args=())
policy_selection_op = torch.library.custom_op("xattn::policy_selection", policy_selection,
                                              mutates_args=())


@policy_scores_op.register_fake
def _policy_scores_shape(q, pages, table, unit, estimate_block_size, stride, norm, vote,
                         impl):
    units = (table.shape[0] - 1) * pages.shape[1] // unit
    heads, q_len = q.shape[-3], q.shape[-2]
    shape = (1, heads, cdiv(q_len, unit), units) if vote else (1, heads, units)
    return q.new_empty(shape, dtype=torch.float32)


@policy_selection_op.register_fake
def _policy_selection_shape(scores, table, unit, threshold, keep_first, keep_last, kv_heads,
                            rule):
    return scores.new_empty(scores.shape[-1:], dtype=torch.bool)
