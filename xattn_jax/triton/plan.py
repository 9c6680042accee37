"""One plan per Triton-backend kernel call: which kernel runs, with which tiles, in how
many kernel calls, with how much scratch. Built here, from the geometry, the dtype, the
causal flag, where it runs and the caller's scratch bound; the kernels read the plan and
derive nothing themselves.

Tuned values (`TUNED`, `*_SPAN`, `MIN_PROGRAMS`, `SELECT_*`) were measured
on an H200 with `python -m bench.tune`; docs/tuning.md has the decisions, cited by name.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import jax.numpy as jnp

from xattn_jax.geometry import Geometry, cdiv, next_pow2
from xattn_jax.row_statistics import DEFAULT_SCRATCH_BYTES, UnitSums
from xattn_jax.sampled_geometry import SampledGeometry

ONE_PASS, TWO_PASS, STRIDED_SCORES = "one_pass", "two_pass", "strided_scores"
BLOCK_SUM_KERNELS = (ONE_PASS, TWO_PASS)
MIN_SIDE = 16  # Triton's smallest dot operand side


@dataclasses.dataclass(frozen=True)
class Tiles:
    """Tile sizes and launch parameters: a row of `TUNED`, or a caller's choice (tests,
    `bench.tune`).

    block_q / block_k: reshaped query rows / key columns per tile (powers of two, >= 16
    on a GPU); block_d: head-dim columns per pipeline step (a power of two >= 16; None:
    all of the head dim); span: key tiles per one-pass program (None: the default rule of
    `plan_block_sums`).
    """

    block_q: int = 64
    block_k: int = 64
    block_d: int | None = None
    num_warps: int = 4
    num_stages: int = 2
    span: int | None = None

    def __post_init__(self):
        if self.block_d is not None and (self.block_d < MIN_SIDE
                                         or self.block_d & (self.block_d - 1)):
            raise ValueError(f"block_d must be None or a power of two >= {MIN_SIDE}, got "
                             f"{self.block_d}")


# By input itemsize. 2 bytes: wide tiles, the head dim in steps, 4 stages in 192 KiB of
# shared memory (docs/tuning.md: triton-tile-2byte); 4 bytes (float32, the exactness
# path): the largest tile within the shared memory (docs/tuning.md: triton-tile-4byte).
TUNED = {2: Tiles(block_q=128, block_k=256, block_d=64, num_warps=8, num_stages=4),
         4: Tiles(block_q=32, block_k=32, block_d=None, num_warps=4, num_stages=2)}
BASE_HEAD_DIM = 128  # larger head dims shrink the tile (docs/tuning.md: triton-head-dim-shrink)
# key tiles per one-pass program (docs/tuning.md: triton-span, triton-causal-span)
SPAN, CAUSAL_SPAN = 8, 2
# Sampled rows' key tiles hold single keys: their programs take this many times the tiles,
# the keys of a program at stride 8 (docs/tuning.md: triton-sampled-rows-plan)
SAMPLED_SPAN_SCALE = 8
MIN_PROGRAMS = 1024  # smaller grids split the keys further (docs/tuning.md: triton-min-programs)
# The selection program: (the padded width up to which it applies, None for every wider
# row; the elements, rows x padded key blocks, it holds; its warps), the fastest at each
# width (docs/tuning.md: select-programs).
SELECT_PROGRAMS = ((512, 1024, 2), (2048, 2048, 4), (None, 4096, 8))
# A causal selection's row tiles run in up to SELECT_WIDTHS kernel calls, by the padded
# width their rows' allowed blocks need (`plan_select_blocks`): W, W / 2, .. (W: kb
# padded to a power of two), none narrower than min(W / 2, SELECT_MIN_WIDTH): narrower
# calls search fewer blocks per step, below that width the launch costs more than the
# rows save (docs/tuning.md: select-widths).
SELECT_WIDTHS = 3
SELECT_MIN_WIDTH = 512
SCORES_TILE = 64  # the score kernel's square tile, <= block_q (docs/tuning.md: triton-scores-tile)


@dataclasses.dataclass(frozen=True)
class Plan(UnitSums):
    """What one Triton-backend kernel call runs. Hashable: a static jit argument.

    kernel: ONE_PASS, TWO_PASS or STRIDED_SCORES (the selection's plan is a
    `SelectPlan`). block_q x block_k: the tile (reshaped query rows x key columns);
    block_d: head-dim columns per pipeline step. span: key
    tiles per program. call_heads / call_rows: the query heads and reshaped query rows one
    kernel call covers (ONE_PASS; calls run one after another, reusing the scratch);
    scratch_bytes: one call's scratch. interpret: Pallas interpret mode (off a GPU).
    """

    geom: Geometry
    kernel: str
    block_q: int
    block_k: int
    block_d: int
    num_warps: int
    num_stages: int
    span: int = 1
    call_heads: int = 0
    call_rows: int = 0
    scratch_bytes: int = 0
    interpret: bool = False

    @property
    def key_tiles(self) -> int:
        """Key tiles covering the reshaped key columns."""
        return cdiv(self.geom.k_cols, self.block_k)

    @property
    def head_parts(self) -> int:
        """Pieces of block_d head-dim columns a stride member's product takes."""
        return next_pow2(self.geom.head_dim) // self.block_d

    @property
    def fine(self) -> int:
        """The two-pass kernel's internal block in rows and columns: the largest divisor
        of a query block's rows and a key block's columns that divides both tile sides."""
        return math.gcd(self.geom.block_rows, self.geom.block_cols, self.block_q,
                        self.block_k)

    @property
    def key_groups(self) -> int:
        """One-pass programs per row tile: key tiles in groups of `span`."""
        return cdiv(self.key_tiles, self.span)

    @property
    def stored_key_tiles(self) -> int:
        """Key tiles the one-pass scratch holds: the real ones padded to whole spans."""
        return self.key_groups * self.span

    @property
    def keys_fit(self) -> bool:
        """Whether the key tiles end within the key buffer (Lk tokens), so that every key
        token a kernel reads is in it. Then Lk is a multiple of S, and the kernels read
        keys unmasked if their key count is a multiple of S too: keys past a shorter count
        read whatever the buffer holds, which the column mask hides unless they share a
        stride group with real keys."""
        return self.key_tiles * self.block_k * self.geom.stride <= self.geom.k_len

    @property
    def padded_rows(self) -> int:
        """The reshaped query rows a call covering all of them holds: whole row tiles."""
        return cdiv(self.geom.q_rows, self.block_q) * self.block_q

    @property
    def head_row_scratch_bytes(self) -> int:
        """One-pass scratch bytes per reshaped query row and query head: the maximum m,
        the unit sums x and, with several units per tile, the row total s, for every key
        tile and batch element."""
        return (self.geom.batch * self.stored_key_tiles * self.stat_planes
                * jnp.dtype(jnp.float32).itemsize)

    @property
    def all_rows(self) -> bool:
        """Whether one call covers every query row (else row steps)."""
        return self.call_rows >= self.geom.q_rows

    @property
    def calls(self) -> int:
        """Kernel calls of a ONE_PASS plan."""
        if self.kernel != ONE_PASS:
            return 1
        per_call = self.geom.q_blocks if self.all_rows else self.call_rows // self.geom.block_rows
        return cdiv(self.geom.q_heads, self.call_heads) * cdiv(self.geom.q_blocks, per_call)


def tuned_tiles(geom: Geometry, dtype) -> Tiles:
    """The measured tiles for inputs of `dtype` and the geometry's head_dim."""
    tiles = TUNED[4 if jnp.dtype(dtype).itemsize >= 4 else 2]
    shrink = max(1, next_pow2(geom.head_dim) // BASE_HEAD_DIM)
    return dataclasses.replace(tiles, block_q=max(MIN_SIDE, tiles.block_q // shrink),
                               block_k=max(MIN_SIDE, tiles.block_k // shrink))


def _default_span(geom: Geometry, tiles: Tiles, causal: bool) -> int:
    """Key tiles per one-pass program: 2 in causal calls (balances the triangle), 8
    otherwise (SAMPLED_SPAN_SCALE times that for sampled rows), fewer where a short chunk
    of queries would leave the GPU with fewer than MIN_PROGRAMS programs."""
    key_tiles = cdiv(geom.k_cols, tiles.block_k)
    row_programs = geom.batch * geom.q_heads * cdiv(geom.q_rows, tiles.block_q)
    groups = cdiv(MIN_PROGRAMS, row_programs)
    span = CAUSAL_SPAN if causal else SPAN
    if isinstance(geom, SampledGeometry):
        span *= SAMPLED_SPAN_SCALE
    return min(span, cdiv(key_tiles, groups))


def _even_steps(total: int, fit: int, quantum: int) -> int | None:
    """The size of the steps that cover `total` (heads, or rows): a multiple of
    `quantum`, the smallest that needs no more steps than the largest within `fit` (the
    last step overlaps the one before it: whatever it repeats is work done twice). None
    if not even one quantum fits."""
    if fit < quantum:
        return None
    steps = cdiv(total, fit // quantum * quantum)
    return cdiv(cdiv(total, steps), quantum) * quantum


def _call_shape(plan: Plan, max_scratch_bytes: int) -> tuple[int, int] | None:
    """The heads and rows one one-pass kernel call covers so that its scratch stays
    within `max_scratch_bytes`.

    Every row of as many heads as fit (all heads if they do: one call); else one head,
    its rows in steps that are multiples of both block_q and block_rows. A call's
    programs then share one head's keys, which stay in L2; steps over all heads with a
    few rows each read every head's keys again in every step (docs/tuning.md:
    triton-head-steps). None if not even one row step of one head fits.
    """
    geom = plan.geom
    all_rows = plan.padded_rows
    head_rows = max_scratch_bytes // plan.head_row_scratch_bytes  # rows that fit
    if head_rows >= all_rows:
        return _even_steps(geom.q_heads, head_rows // all_rows, 1), all_rows
    rows = _even_steps(geom.q_rows, head_rows, math.lcm(plan.block_q, geom.block_rows))
    return None if rows is None else (1, rows)


def plan_block_sums(geom: Geometry, dtype, causal: bool, *, interpret: bool,
                    max_scratch_bytes: int | None = None, tiles: Tiles | None = None,
                    kernel: str | None = None) -> Plan:
    """The plan of one block-sum call (sections 1-3 fused).

    tiles: default `tuned_tiles`; span default `_default_span`. kernel: default ONE_PASS
    if one row step of one head fits in `max_scratch_bytes` of scratch (default
    `row_statistics.DEFAULT_SCRATCH_BYTES`, docs/tuning.md: workspace-bound), else
    TWO_PASS (each score computed twice, no scratch).
    """
    tiles = tiles or tuned_tiles(geom, dtype)
    span = tiles.span or _default_span(geom, tiles, causal)
    block_d = min(tiles.block_d or next_pow2(geom.head_dim), next_pow2(geom.head_dim))
    plan = Plan(geom, ONE_PASS, tiles.block_q, tiles.block_k, block_d, tiles.num_warps,
                tiles.num_stages, interpret=interpret)
    plan = dataclasses.replace(plan, span=min(span, plan.key_tiles))
    bound = max_scratch_bytes or DEFAULT_SCRATCH_BYTES
    call = _call_shape(plan, bound)
    if kernel not in (None, *BLOCK_SUM_KERNELS):
        raise ValueError(f"kernel must be one of {BLOCK_SUM_KERNELS}, got {kernel!r}")
    if kernel == TWO_PASS or (kernel is None and call is None):
        return dataclasses.replace(plan, kernel=TWO_PASS, span=plan.key_tiles)
    if call is None:
        raise ValueError(f"the one-pass kernel needs more than max_scratch_bytes={bound} "
                         f"bytes of scratch for one row step of one head of {geom}: use "
                         f"kernel={TWO_PASS!r}")
    heads, rows = call
    return dataclasses.replace(plan, call_heads=heads, call_rows=rows,
                               scratch_bytes=plan.head_row_scratch_bytes * heads * rows)


def plan_strided_scores(geom: Geometry, dtype, *, interpret: bool,
                        tile: int | None = None) -> Plan:
    """The plan of one standalone score call: square tiles of `tile` (default SCORES_TILE,
    at most the tuned block_q), the whole head dim per step."""
    tile = tile or min(SCORES_TILE, tuned_tiles(geom, dtype).block_q)
    return Plan(geom, STRIDED_SCORES, tile, tile, next_pow2(geom.head_dim), num_warps=4,
                num_stages=2, interpret=interpret)


@dataclasses.dataclass(frozen=True)
class SelectCall:
    """One kernel call of a selection: row tiles first_tile .. first_tile + tiles - 1,
    each row holding its first `width` key blocks (a power of two, at least those up to
    its causal diagonal) on num_warps warps."""

    first_tile: int
    tiles: int
    width: int
    num_warps: int


@dataclasses.dataclass(frozen=True)
class SelectPlan:
    """The selection over block sums `[B, Hq, qb, kb]` (`select_blocks`). Hashable: a
    static jit argument. Programs of `rows` query-block rows write one bool mask `[B,
    Hq, row tiles x rows, width]` (width: kb padded to a power of two; cut to `[qb, kb]`
    after), in `calls` covering the row tiles in order; interpret: Pallas interpret mode
    (off a GPU)."""

    shape: tuple[int, int, int, int]
    rows: int
    width: int
    calls: tuple[SelectCall, ...]
    interpret: bool = False

    @property
    def row_tiles(self) -> int:
        """Programs of `rows` rows covering the qb query blocks."""
        return cdiv(self.shape[2], self.rows)


def _select_program(width: int) -> tuple[int, int]:
    """(elements, warps) of a selection program whose rows hold `width` key blocks
    (`SELECT_PROGRAMS`)."""
    return next((e, w) for up_to, e, w in SELECT_PROGRAMS if up_to is None or width <= up_to)


def narrowest_width(width: int) -> int:
    """The narrowest kernel call of a causal selection whose rows pad to `width` blocks:
    width / 2^(SELECT_WIDTHS - 1), but none below min(width / 2, SELECT_MIN_WIDTH)."""
    return max(1, width >> (SELECT_WIDTHS - 1), min(width // 2, SELECT_MIN_WIDTH))


def plan_select_blocks(shape: tuple[int, int, int, int], *, causal: bool, interpret: bool,
                       widths: int | None = None) -> SelectPlan:
    """The plan of the selection over block sums of `shape` `[B, Hq, qb, kb]`: rows per
    program the elements of the padded width's SELECT_PROGRAMS row over that width (at
    most qb padded to a power of two); one call at the padded width W, or causal (section
    4: row i's allowed blocks end at its diagonal, i + kb - qb) each row tile at the
    narrowest width holding the allowed blocks of its last row, with that width's warps:
    of W, W / 2, .. down to `narrowest_width` (given `widths`, W / 2^(widths - 1): a
    tuning run's)."""
    b, hq, qb, kb = shape
    if widths is not None and widths < 1:
        raise ValueError(f"widths must be at least 1; got {widths}")
    width = next_pow2(kb)
    rows = min(max(1, _select_program(width)[0] // width), next_pow2(qb))
    if not causal:
        narrowest = width
    else:
        narrowest = (narrowest_width(width) if widths is None
                     else max(1, width >> (widths - 1)))

    def tile_width(tile: int) -> int:
        """The narrowest width holding the blocks up to the row tile's last diagonal."""
        last_row = min((tile + 1) * rows, qb) - 1
        return max(next_pow2(min(kb, max(1, last_row + kb - qb + 1))), narrowest)

    calls, first = [], 0
    for width_of_tiles, tiles in itertools.groupby(map(tile_width, range(cdiv(qb, rows)))):
        count = sum(1 for _ in tiles)
        calls.append(SelectCall(first, count, width_of_tiles,
                                _select_program(width_of_tiles)[1]))
        first += count
    return SelectPlan(tuple(shape), rows, width, tuple(calls), interpret)
