"""The plan of one Mosaic GPU block-sum call (docs/estimate.md sections 1-3): a hashable
value the kernel (`kernel.tile_stats`) and its wrapper (`block_sums`) read. `estimate_plan`
makes it (the tuned rules are in `heuristics`); `unsupported_reason` says which calls the
kernel does not take. Plain Python: no Mosaic GPU import.

The kernel computes the strided scores as one product with K = S x D: a CTA owns a row
tile of ROWS reshaped query rows of one (batch, query head), split between two consumer
warpgroups, and streams query and key chunks (`[ROWS, BLOCK_D]`, `[block_k, BLOCK_D]`,
one stride member and head-dim part each) through a ring of `stages` slots. Per key tile
it stores the row statistics of the Triton one-pass kernel (max, unit sums, totals).
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from xattn_jax.geometry import Geometry, cdiv
from xattn_jax.mosaic import SUPPORTED_DTYPES
from xattn_jax.mosaic.estimate import grid, heuristics
from xattn_jax.mosaic.smem import smem_bytes
from xattn_jax.row_statistics import DEFAULT_SCRATCH_BYTES, UnitSums

# rows of one consumer's product (a wgmma M tile), and consumers per CTA
# (docs/tuning.md: mosaic-streamed-queries)
WGMMA_ROWS, CONSUMERS = 64, 2
ROWS = CONSUMERS * WGMMA_ROWS  # a CTA's row tile (docs/tuning.md: mosaic-streamed-queries)
BLOCK_D = 64  # head-dim columns per pipeline step (docs/tuning.md: mosaic-ring)
# the wgmma layout's column tile, f32 statistics, head dims, bf16 / f16 operands
# (docs/tuning.md: mosaic-estimate-limits)
COLUMN_TILE, STAT_BYTES, HEAD_DIMS, OPERAND_BYTES = 8, 4, (64, 128), 2
# masked key tiles computed in widths of this many columns (docs/tuning.md:
# mosaic-trim-columns)
TRIM_COLUMNS = 128
# a causal call's product steps after a tile's first as a loop unrolled up to this many
# times where CTAs split rows (docs/tuning.md: mosaic-step-loop)
CAUSAL_STEP_LOOP = 5
# a causal call's row steps run their epilogues in this many loops (docs/tuning.md:
# mosaic-epilogue-loops)
EPILOGUE_LOOPS = 16
# causal launch groups: waves of CTAs, and the most keys their heads read (docs/tuning.md:
# mosaic-launch-groups)
LAUNCH_GROUP_WAVES, LAUNCH_KEY_BYTES = 1, 24 << 20
# row tiles per block of the persistent grid's work items (docs/tuning.md:
# mosaic-persistent-grid)
ROW_BLOCK_TILES = 64


@dataclasses.dataclass(frozen=True)
class EstimatePlan(UnitSums):
    """One call's plan. Hashable: a static jit argument.

    causal: the call's mask; sms: the device's SMs (a wave of CTAs); block_k: reshaped
    key columns per key tile; stages: ring slots; page_size: tokens per page of a paged k
    (None: contiguous), a multiple of block_k x S; key_groups: CTAs per row tile, each a
    span of `key_span` key tiles; persistent_ctas: 0, or the CTAs of a persistent grid
    walking `grid.work_items`; fold: a whole causal call's statistics folded
    (`grid.folded_place`); call_rows / call_heads: the rows of every head / the heads a
    kernel call covers (0: all), a call running in row steps, head steps, or both.
    """

    geom: Geometry
    causal: bool
    sms: int
    block_k: int
    stages: int
    page_size: int | None = None
    key_groups: int = 1
    persistent_ctas: int = 0
    fold: bool = False
    call_rows: int = 0
    call_heads: int = 0

    rows = ROWS

    @property
    def heads(self) -> int:
        return self.call_heads or self.geom.q_heads

    @property
    def pairs(self) -> int:
        """(batch, query head) pairs of one kernel call."""
        return self.geom.batch * self.heads

    @property
    def row_tiles(self) -> int:
        return cdiv(self.geom.q_rows, ROWS)

    @property
    def rows_per_call(self) -> int:
        return self.call_rows or self.row_tiles * ROWS

    @property
    def call_row_tiles(self) -> int:
        return self.rows_per_call // ROWS

    @property
    def padded_rows(self) -> int:
        """Every row tile's rows; in row steps, at least those the last step reads."""
        rows = self.row_tiles * ROWS
        if self.call_rows:
            return max(rows, self.geom.q_blocks * self.geom.block_rows)
        return rows

    @property
    def row_quantum(self) -> int:
        """Row steps are multiples of this: whole row tiles and query blocks."""
        return math.lcm(ROWS, self.geom.block_rows)

    @property
    def key_tiles(self) -> int:
        return cdiv(self.geom.k_cols, self.block_k)

    @property
    def padded_cols(self) -> int:
        return self.key_tiles * self.block_k

    @property
    def key_span(self) -> int:
        return cdiv(self.key_tiles, self.key_groups)

    @property
    def head_key_bytes(self) -> int:
        """One key head's keys, whole key tiles."""
        return self.padded_cols * self.geom.stride * self.geom.head_dim * OPERAND_BYTES

    @property
    def head_parts(self) -> int:
        return self.geom.head_dim // BLOCK_D

    @property
    def steps_per_tile(self) -> int:
        """Pipeline steps of a key tile: S x head_parts."""
        return self.geom.stride * self.head_parts

    @property
    def lag_steps(self) -> int:
        """Steps consumer 1 starts behind consumer 0: half a tile, within the ring."""
        return max(1, min(self.steps_per_tile // 2, self.stages - 1))

    @property
    def ordered_stats(self) -> bool:
        """Consumer 1 computes a tile's statistics after consumer 0's: non-causal calls
        whose ring is shorter than a tile (docs/tuning.md: mosaic-ordered-stats)."""
        return not self.causal and self.stages < self.steps_per_tile

    @property
    def masked_widths(self) -> tuple[int, ...]:
        """The widths a consumer's masked key tile is computed at."""
        step = math.gcd(TRIM_COLUMNS, self.block_k)
        return tuple(range(step, self.block_k + 1, step))

    @property
    def step_loop(self) -> int:
        """0: a key tile's product steps unrolled; n: steps 1 .. on as a loop unrolled n
        times (a causal call whose CTAs split rows: key groups or work items)."""
        steps = self.steps_per_tile
        if not self.causal or (self.key_groups == 1 and not self.persistent_ctas) or steps < 2:
            return 0
        return max(n for n in range(1, CAUSAL_STEP_LOOP + 1) if (steps - 1) % n == 0)

    @property
    def compacted(self) -> bool:
        """The grid leaves out CTAs whose span holds no visible tile: a whole causal call
        in key groups (docs/tuning.md: mosaic-compacted-grid)."""
        return self.causal and self.key_groups > 1 and not self.call_rows

    @property
    def listed(self) -> bool:
        """A persistent grid walks `grid.items_table`'s visible items: causal calls."""
        return self.causal and bool(self.persistent_ctas)

    @property
    def grid_rows(self) -> int:
        if self.compacted:
            return len(grid.walked_cells(self))
        return self.call_row_tiles * self.key_groups

    @property
    def launch_group(self) -> int:
        """(batch, head) pairs whose row tiles launch interleaved, longest first: in a
        causal call of one key group, the fewest filling LAUNCH_GROUP_WAVES waves, within
        the pairs of LAUNCH_KEY_BYTES of keys (one key head's at least); else 1."""
        if not self.causal or self.key_groups > 1 or self.persistent_ctas:
            return 1
        most = max(1, LAUNCH_KEY_BYTES // self.head_key_bytes) * self.geom.group
        groups = [g for g in range(1, min(most, self.pairs) + 1) if self.pairs % g == 0]
        wave = LAUNCH_GROUP_WAVES * self.sms
        return next((g for g in groups if g * self.grid_rows >= wave), groups[-1])

    @property
    def ctas(self) -> int:
        """CTAs of one kernel call."""
        return self.persistent_ctas or self.pairs * self.grid_rows

    def step_ctas(self, rows: int) -> int:
        """CTAs of a call of `rows` rows of every head (a persistent grid: its items)."""
        tiles = self.key_tiles if self.persistent_ctas else self.key_groups
        return self.pairs * rows // ROWS * tiles

    @property
    def row_block_tiles(self) -> int:
        return min(ROW_BLOCK_TILES, self.call_row_tiles)

    @property
    def row_blocks(self) -> int:
        return cdiv(self.call_row_tiles, self.row_block_tiles)

    @property
    def fold_places(self) -> int:
        """Places of folded statistics per pair: place p holds row tiles p and R - 1 - p."""
        return cdiv(self.call_row_tiles, 2)

    @property
    def fold_slots(self) -> int:
        return grid.fold_slots(self)

    @property
    def stats_shape(self) -> tuple[int, int, int, int, int]:
        """`[B, heads, slots, stat_planes, rows]`: fold_slots x fold_places rows folded,
        else key_tiles x rows_per_call."""
        if self.fold:
            slots, rows = self.fold_slots, self.fold_places * ROWS
        else:
            slots, rows = self.key_tiles, self.rows_per_call
        return self.geom.batch, self.heads, slots, self.stat_planes, rows

    @property
    def scratch_bytes(self) -> int:
        return math.prod(self.stats_shape) * STAT_BYTES

    @property
    def row_scratch_bytes(self) -> int:
        """Unfolded statistics of one row of every head."""
        return self.pairs * self.key_tiles * self.stat_planes * STAT_BYTES

    @property
    def epilogue_loops(self) -> int:
        if not self.causal:
            return 1
        return min(EPILOGUE_LOOPS, len(grid.step_first_rows(self)))

    @property
    def stats_epilogue(self) -> bool:
        """The epilogue as one Triton-backend kernel: folded statistics whose key tiles'
        units and blocks' rows are powers of two (docs/tuning.md: mosaic-stats-epilogue)."""
        return self.fold and all(n & (n - 1) == 0 for n in (self.block_k,
                                                            self.geom.block_rows))

    def smem_bytes(self, itemsize: int, ordered: bool | None = None) -> int:
        """Shared memory of a CTA as Mosaic GPU counts it: the query and key rings, the
        statistics buffers, and per slot a ready and a free barrier, consumer 1's start
        and, with `ordered` (default `ordered_stats`), its turn."""
        ordered = self.ordered_stats if ordered is None else ordered
        queries = self.stages * ROWS * BLOCK_D * itemsize
        keys = self.stages * self.block_k * BLOCK_D * itemsize
        stats = CONSUMERS * self.stat_planes * WGMMA_ROWS * STAT_BYTES
        return smem_bytes([queries, keys, stats], barriers=2 * self.stages + 1 + ordered)


def _limits_reason(geom: Geometry, dtype, key_len: bool, causal: bool,
                   page_size: int | None) -> str | None:
    dtype = jnp.dtype(dtype)
    if dtype not in SUPPORTED_DTYPES:
        return f"impl='mosaic' needs q and k in bfloat16 or float16; got {dtype}"
    if geom.head_dim not in HEAD_DIMS:
        return f"impl='mosaic' needs head_dim in {HEAD_DIMS}; got {geom.head_dim}"
    if geom.block_rows % COLUMN_TILE:
        return (f"impl='mosaic' needs block_size a multiple of {COLUMN_TILE} x stride = "
                f"{COLUMN_TILE * geom.stride}; got {geom.block_size}")
    if key_len and causal:
        return "impl='mosaic' block sums take key_len in non-causal calls only"
    if page_size is not None and page_size % (64 * geom.stride):
        return (f"impl='mosaic' reads paged caches whose pages hold a multiple of 64 x "
                f"stride = {64 * geom.stride} tokens; got page_size {page_size}")
    return None


def _plan_or_reason(geom: Geometry, dtype, key_len: bool, causal: bool,
                    page_size: int | None, max_scratch_bytes: int | None,
                    sms: int | None) -> EstimatePlan | str:
    reason = _limits_reason(geom, dtype, key_len, causal, page_size)
    if reason is not None:
        return reason
    plan = EstimatePlan(geom, causal, sms or heuristics.device_sms(),
                        heuristics.block_k(page_size, geom.stride), 0, page_size)
    plan = heuristics.deepest_ring(plan, jnp.dtype(dtype).itemsize)
    return heuristics.call_shape(plan, max_scratch_bytes or DEFAULT_SCRATCH_BYTES)


def unsupported_reason(geom: Geometry, dtype, *, causal: bool, key_len: bool = False,
                       page_size: int | None = None, max_scratch_bytes: int | None = None,
                       sms: int | None = None) -> str | None:
    """Why the Mosaic block sums do not take this call (None if they do). key_len: a count
    of keys in use is given; page_size: tokens per page of a paged k (None: contiguous);
    sms: the device's SMs (default `heuristics.device_sms`).

    They need q and k in bfloat16 or float16, D in HEAD_DIMS, block_size a multiple of
    COLUMN_TILE x stride, key_len in non-causal calls only, pages of a multiple of 64 x
    stride tokens, and within `max_scratch_bytes` (default DEFAULT_SCRATCH_BYTES:
    docs/tuning.md: workspace-bound) one
    kernel call's statistics, or a step `heuristics.call_shape` takes. The Triton backend
    takes the rest."""
    plan = _plan_or_reason(geom, dtype, key_len, causal, page_size, max_scratch_bytes, sms)
    return plan if isinstance(plan, str) else None


def estimate_plan(geom: Geometry, dtype, *, causal: bool, page_size: int | None = None,
                  max_scratch_bytes: int | None = None,
                  sms: int | None = None) -> EstimatePlan:
    """The plan of one call (arguments of `unsupported_reason`); ValueError for a call
    the kernel does not take."""
    plan = _plan_or_reason(geom, dtype, False, causal, page_size, max_scratch_bytes, sms)
    if isinstance(plan, str):
        raise ValueError(plan)
    return plan
