"""The work of the ragged attention kernel (`ragged_kernel`), built on the device in plain
JAX from a step's layout and mask: which query rows each CTA takes, where its output goes,
and its key tiles per query head (docs/estimate.md section 6, "Ragged steps").

A CTA tile is `plan.rows_per_cta` consecutive key positions of one mask row (a query
block of one sequence; block_size is a multiple of rows_per_cta): tile i of mask row r
covers positions `row_block[r] * bs + i * rows_per_cta ..`. Its real rows are the
sequence's queries at those positions, `[first_position, kv_len)`; a tile with none is
dead. Consumer warpgroup w takes the tile's positions `w * block_q ..`: it loads the
block_q rows of q from the token of its first position, that row clamped into
`[0, T - block_q]` (so a box may start before its sequence or reach past it: those rows
are computed and never stored), and stores only its real rows.

The kernel's grid walks `num_slots(geom, plan)` slots per query head:
1. the live tiles, heaviest first (by the last key position they see), so that the
   longest CTAs start first;
2. "zero" slots, block_q rows per warpgroup, covering the rows of q past the last live
   sequence's (rows of no live sequence): they visit no key tile, so they store zeros;
3. inactive slots, whose CTAs exit at once.
`num_slots` bounds 1 and 2 together for any step that keeps the rules. Of a step outside
the rules, the tiles past the slots are dropped (unspecified rows, nothing read out of
bounds).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from xattn_jax.mosaic.attention.plan import AttentionPlan
from xattn_jax.ragged.geometry import RaggedGeometry
from xattn_jax.ragged.layout import RaggedBlocks

# the columns of `RaggedWork.slots`: whole-slot fields, then WG_FIELDS per warpgroup
ACTIVE, SEQ, LAST_ENTRY = 0, 1, 2  # 1 if the slot's CTA runs; its sequence; last page used
SLOT_FIELDS = 3
# per warpgroup w, at SLOT_FIELDS + w * WG_FIELDS + field: the first row of q it loads,
# that row's key position, then the first row and the number of rows of its box to store
LOAD, POSITION, BEGIN, COUNT = 0, 1, 2, 3
WG_FIELDS = 4


class RaggedWork(NamedTuple):
    """The kernel's work, int32, N = `num_slots`, nt = key tiles of the mask's width:

    - tiles `[Hq, N, nt]`: per (query head, slot) the key tiles (of `plan.block_kv` keys)
      the CTA visits, ascending, first in each row; the entries past `counts[..., 0]`
      are never read;
    - counts `[Hq, N, 1 + W]`: the number of tiles to visit, then per consumer warpgroup
      w the number of leading ones every real row of w sees whole (no per-element mask);
    - slots `[N, SLOT_FIELDS + W * WG_FIELDS]`: the fields named by this module's column
      constants (those of inactive slots are never read).
    """

    tiles: jax.Array
    counts: jax.Array
    slots: jax.Array


def kernel_rows(geom: RaggedGeometry, plan: AttentionPlan) -> int:
    """The query rows the kernel reads and writes: T, or one warpgroup's box if T is
    smaller (q is then padded)."""
    return max(geom.tokens, plan.block_q)


def num_slots(geom: RaggedGeometry, plan: AttentionPlan) -> int:
    """Slots per query head: the live tiles and zero slots of any step keeping the rules.

    S sequences of n_s queries (sum T) span at most sum((n_s + rows - 2) // rows + 1)
    <= (T + (rows - 2) S) // rows + S tiles, and the zero slots add one more than the
    rows past the sequences' would need alone. Each live tile holds a query of its own
    and each zero slot at least one row past the sequences', so there are at most T
    (the kernel's rows) of both, the tighter bound for steps of many decode rows."""
    rows, tokens = plan.rows_per_cta, kernel_rows(geom, plan)
    return min(tokens, (tokens + (rows - 2) * geom.seqs) // rows + geom.seqs + 1)


def compact_tiles(visit: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per row of `visit` (bool `[..., n]`): int32 `[..., n]` the indices of its set
    entries ascending, then those of its unset ones ascending (equal to
    `argsort(~visit, stable=True)`), and int32 `[..., n]` the number of set entries in
    `[0, i]`. One cumulative sum and one scatter (each row's destinations are a
    permutation), no sort."""
    n = visit.shape[-1]
    index = jnp.arange(n, dtype=jnp.int32)
    set_through = jnp.cumsum(visit, axis=-1, dtype=jnp.int32)
    num_set = set_through[..., -1:]
    dest = jnp.where(visit, set_through - 1, num_set + index - set_through)

    def place(row_dest):
        return jnp.zeros((n,), jnp.int32).at[row_dest].set(index, unique_indices=True)

    return jax.vmap(place)(dest.reshape(-1, n)).reshape(visit.shape), set_through


class _Tiles(NamedTuple):
    """The CTA tiles of a step `[QB * bs / rows_per_cta]`: mask row, sequence, first key
    position, the real positions `[low, high)` and whether the tile has any."""

    row: jax.Array
    seq: jax.Array
    start: jax.Array
    low: jax.Array
    high: jax.Array
    live: jax.Array


def _tiles(blocks: RaggedBlocks, geom: RaggedGeometry, rows: int) -> _Tiles:
    per_block = geom.block_size // rows
    unit = jnp.arange(geom.q_block_rows * per_block, dtype=jnp.int32)
    row = unit // per_block
    seq = blocks.row_seq[row]
    start = blocks.row_block[row] * geom.block_size + (unit % per_block) * rows
    low = jnp.maximum(start, blocks.first_position[seq])
    high = jnp.minimum(start + rows, blocks.kv_lens[seq])
    return _Tiles(row, seq, start, low, high, blocks.row_live[row] & (low < high))


def _warpgroup_fields(first_token, real_low, real_high, position_offset, tokens: int,
                      block_q: int) -> jax.Array:
    """`[N, WG_FIELDS]` of one warpgroup per slot: its box of block_q rows from
    `first_token` clamped into [0, tokens - block_q], its real rows `[real_low,
    real_high)` (tokens) kept within the box and q, the key position of the box's first
    row (its token + `position_offset`)."""
    load = jnp.clip(first_token, 0, tokens - block_q)
    low = jnp.maximum(real_low, load)
    high = jnp.minimum(jnp.minimum(real_high, load + block_q), tokens)
    return jnp.stack([load, load + position_offset, low - load,
                      jnp.maximum(high - low, 0)], axis=-1)


class _Slots(NamedTuple):
    """The slots `[N]`: the table `RaggedWork.slots`, and of the live ones their tile's
    mask row, first key position and end of real positions (others: any)."""

    table: jax.Array
    live: jax.Array
    row: jax.Array
    start: jax.Array
    high: jax.Array


def _slots(blocks: RaggedBlocks, geom: RaggedGeometry, plan: AttentionPlan) -> _Slots:
    rows, block_q, tokens = plan.rows_per_cta, plan.block_q, kernel_rows(geom, plan)
    tiles = _tiles(blocks, geom, rows)
    slot = jnp.arange(num_slots(geom, plan), dtype=jnp.int32)
    # live tiles first, those seeing the latest keys first; then the dead ones
    order = jnp.argsort(jnp.where(tiles.live, -tiles.high, 1), stable=True)
    num_live = tiles.live.sum(dtype=jnp.int32)
    tile = order[jnp.minimum(slot, order.size - 1)]
    live = slot < num_live
    seq, start = tiles.seq[tile], tiles.start[tile]
    # zero slots: rows * z .. of the rows from the end of the last sequence's on
    used = blocks.q_starts[-1] + blocks.q_lens[-1]
    zero = slot - num_live
    active = live | (zero < (jnp.maximum(tokens - used, 0) + rows - 1) // rows)
    q_start, first = blocks.q_starts[seq], blocks.first_position[seq]
    q_end = q_start + blocks.q_lens[seq]
    fields = []
    for w in range(plan.compute_warpgroups):
        token = q_start + start + w * block_q - first  # of the warpgroup's first position
        zero_token = used + zero * rows + w * block_q
        fields.append(_warpgroup_fields(
            jnp.where(live, token, zero_token),
            jnp.where(live, jnp.maximum(token, q_start), zero_token),
            jnp.where(live, jnp.minimum(token + block_q, q_end), zero_token + block_q),
            jnp.where(live, first - q_start, 0), tokens, block_q))
    last_entry = jnp.clip((blocks.kv_lens[seq] - 1) // geom.page_size, 0,
                          geom.pages_per_seq - 1)
    table = jnp.concatenate([jnp.stack([active.astype(jnp.int32), seq, last_entry], -1),
                             *fields], axis=-1)
    return _Slots(table, live, tiles.row[tile], start, tiles.high[tile])


def ragged_work(mask: jax.Array, blocks: RaggedBlocks, geom: RaggedGeometry,
                plan: AttentionPlan) -> RaggedWork:
    """The kernel's work for the mask bool `[Hq, QB, KB]` of a step laid out by `blocks`
    (`reference.ragged.attention`'s semantics: query row at key position p of mask row r
    sees key j iff j <= p and mask[h, r, j // bs])."""
    block_q, block_kv, warpgroups = plan.block_q, plan.block_kv, plan.compute_warpgroups
    slots = _slots(blocks, geom, plan)
    # key tiles: selected, and starting at or before the tile's last real position
    num_tiles = geom.k_blocks * geom.block_size // block_kv
    selected = mask[:, slots.row]  # [Hq, N, KB]
    if geom.block_size != block_kv:
        selected = jnp.repeat(selected, geom.block_size // block_kv, axis=-1)
    tile_key = jnp.arange(num_tiles, dtype=jnp.int32) * block_kv
    visit = selected & (slots.live[:, None] & (tile_key < slots.high[:, None]))[None]
    key_tiles, visited_through = compact_tiles(visit)
    seq = slots.table[:, SEQ]
    first_real = jnp.maximum(slots.start[:, None] + jnp.arange(warpgroups) * block_q,
                             blocks.first_position[seq][:, None])  # [N, W]
    # tiles below this index end at or before the warpgroup's first real position
    unmasked_below = jnp.minimum((first_real + 1) // block_kv, num_tiles)
    unmasked = jnp.take_along_axis(
        visited_through, jnp.broadcast_to(jnp.maximum(unmasked_below - 1, 0),
                                          visit.shape[:2] + (warpgroups,)), axis=-1)
    counts = jnp.concatenate([visited_through[..., -1:],
                              jnp.where(unmasked_below > 0, unmasked, 0)], axis=-1)
    return RaggedWork(tiles=key_tiles, counts=counts, slots=slots.table)
