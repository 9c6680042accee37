"""The exact epilogue of the one-pass block sums (docs/estimate.md sections 2-3), shared
by the one-pass kernels of both backends (`xattn_jax.triton.one_pass`,
`xattn_jax.mosaic.estimate.block_sums`), and the walk of a call made of several kernel calls
(`in_steps`).

A row's softmax needs its maximum and sum over every key before any block sum can be
normalized, so those kernels store, per reshaped query row r and key tile t, the tile's
maximum m[t, r] of A' = A * log2(e), the sums x[t, r, u] of 2^(A' - m) over the columns
of each unit u (`gcd(block_cols, tile columns)` columns: a key block is a whole number
of units) and their totals. `combine` forms per row M = max_t m and L = sum_t 2^(m - M)
total, weighs each x by 2^(m - M) / L (exactly the row's softmax mass in the unit) and
sums rows and units into blocks. The rows are reshaped query rows (`geom.block_rows` to a
query block) or sampled query rows (`xattn_jax.sampled_geometry`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from xattn_jax.geometry import Geometry, cdiv

LOG2_E = 1.4426950408889634  # scores are kept in base 2: 2^(A log2 e) = e^A
# The statistics one kernel call of either backend holds by default, at every call
# length: with the epilogue's temporaries the estimate's workspace stays within 64 MiB
# beyond its outputs (docs/tuning.md: workspace-bound)
DEFAULT_SCRATCH_BYTES = 48 << 20


class UnitSums:
    """The unit sums of a plan whose key tiles are `block_k` reshaped columns of key
    blocks of `geom.block_cols` (both backends' one-pass plans derive from it)."""

    @property
    def unit(self) -> int:
        """Columns per unit sum: gcd(block_cols, block_k), so that a key block and a key
        tile are each a whole number of units."""
        return math.gcd(self.geom.block_cols, self.block_k)

    @property
    def units_per_tile(self) -> int:
        return self.block_k // self.unit

    @property
    def stat_planes(self) -> int:
        """Floats stored per row and key tile: the maximum, the unit sums and, with
        several units, their total."""
        units = self.units_per_tile
        return 1 + units + (units > 1)


def fit(x: jax.Array, axis: int, size: int) -> jax.Array:
    """Cuts or zero-pads `axis` to `size`."""
    if x.shape[axis] >= size:
        return jax.lax.slice_in_dim(x, 0, size, axis=axis)
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad)


def row_weights(maxes: jax.Array, totals: jax.Array, where: jax.Array | None = None
                ) -> jax.Array:
    """2^(m - M) / L of each tile (axis 2) and row: the share of the row's softmax mass
    per unit of its sum, M = max of the maxes m and L = sum of 2^(m - M) totals over the
    tiles (of a row's tiles where `where`, broadcastable to maxes: elsewhere the weight
    is 0, and neither m nor the totals are read into it). maxes and totals `[B, Hq, T,
    R]` -> `[B, Hq, T, R]`."""
    if where is not None:
        maxes = jnp.where(where, maxes, -jnp.inf)
    row_max = maxes.max(axis=2, keepdims=True)  # [B, Hq, 1, R]
    scale = jnp.exp2(maxes - row_max)  # [B, Hq, T, R]
    if where is None:
        total = (totals * scale).sum(axis=2, keepdims=True)
    else:  # a row with no tile here has M = -inf: its scale is NaN, and never taken
        scale = jnp.where(where, scale, 0.0)
        total = jnp.where(where, totals * scale, 0.0).sum(axis=2, keepdims=True)
    return scale / total


def row_counts(rows: jax.Array, geom: Geometry, sees_keys) -> jax.Array:
    """Whether each reshaped query row (int32 array) adds to the block sums: padded rows,
    and every row of a call without keys (sees_keys False, maybe traced), add nothing.
    Any other row sees at least one key, so it has no softmax when each of its scores is
    -inf (an inf in k): its maximum -inf makes it NaN, as in the reference
    (docs/estimate.md, "Numerics"). A row holding a NaN stays NaN even where a maximum
    skipped the NaN: its x is NaN."""
    return (rows < geom.q_rows) & sees_keys


def combine(maxes: jax.Array, sums: jax.Array, totals: jax.Array, geom: Geometry,
             unit: int, first_row, q_blocks: int, sees_keys) -> jax.Array:
    """maxes `[B, Hq, T, R]`, sums `[B, Hq, T, R, P]` and totals `[B, Hq, T, R]` (sums
    summed over P) of rows first_row .. first_row + R -> block sums `[B, Hq, q_blocks,
    kb]` of those rows. sees_keys: bool (may be traced), whether the call has any key
    (False for an empty cache, whose rows then add nothing).

    Written in the kernel's layout, rows summed into blocks first, so that XLA fuses the
    weighting into that reduction and no temporary as large as the scratch is made.
    """
    b, h, key_tiles, rows = maxes.shape
    counts = row_counts(first_row + jnp.arange(rows), geom, sees_keys)
    weights = row_weights(maxes, totals)
    probs = jnp.where(counts[..., None], sums * weights[..., None], 0.0)
    probs = fit(probs, 3, q_blocks * geom.block_rows)
    rows_summed = probs.reshape(b, h, key_tiles, q_blocks, geom.block_rows, -1).sum(axis=4)
    return blocks_of_units(rows_summed, geom, unit)


def blocks_of_units(rows_summed: jax.Array, geom: Geometry, unit: int) -> jax.Array:
    """Sums `[B, Hq, T, qb, P]` of each query block's rows per tile and unit -> block
    sums `[B, Hq, qb, kb]` (a key block is `block_cols / unit` consecutive units)."""
    b, h, _, q_blocks, _ = rows_summed.shape
    per_block = geom.block_cols // unit
    units = jnp.moveaxis(rows_summed, 2, 3).reshape(b, h, q_blocks, -1)  # [B, Hq, qb, T*P]
    units = fit(units, 3, geom.k_blocks * per_block)
    return units.reshape(b, h, q_blocks, geom.k_blocks, per_block).sum(axis=4)


def step_start(step, q_blocks: int, blocks: int):
    """The first query block of row step `step` (a Python int or a traced int32 scalar) of
    `blocks` query blocks each out of `q_blocks`: step x blocks, the last step's moved
    back to end at the last block (`in_steps`)."""
    if isinstance(step, int):
        return min(step * blocks, q_blocks - blocks)
    return jnp.minimum(step * blocks, q_blocks - blocks)


def in_steps(geom: Geometry, heads: int, blocks: int, block_sums_of,
             steps: range | None = None, out: jax.Array | None = None) -> jax.Array:
    """The block sums `[B, Hq, qb, kb]` of a call made of several kernel calls, one after
    another: `heads` query heads and `blocks` query blocks each, block_sums_of(first_head,
    first_row, blocks) giving `[B, heads, blocks, kb]` (first_row in reshaped rows; both
    traced int32). Each writes its part of the result in place; the last head group and
    the last row step of each start early enough to end at the last head and block
    (recomputing, identically, a few the one before wrote), so nothing is padded or
    copied. steps: the row steps walked (default all ceil(qb / blocks), `step_start`
    numbers them), of every head group; out: the result the earlier steps wrote, so that a
    caller may walk the steps in several loops, each with its own block_sums_of (default
    a new array left uninitialized where the backend allows, `jax.lax.empty`: the
    caller's loops walk every step, which together write every element; docs/tuning.md:
    steps-output-uninitialized)."""
    steps = range(cdiv(geom.q_blocks, blocks)) if steps is None else steps

    def one_call(i, out):
        # lax.div/rem: i >= 0
        head = jnp.minimum(jax.lax.div(i, len(steps)) * heads, geom.q_heads - heads)
        step = steps.start + jax.lax.rem(i, len(steps))
        start = step_start(step, geom.q_blocks, blocks)
        part = block_sums_of(head, start * geom.block_rows, blocks)
        return jax.lax.dynamic_update_slice(out, part, (0, head, start, 0))

    if out is None:
        out = jax.lax.empty((geom.batch, geom.q_heads, geom.q_blocks, geom.k_blocks),
                            jnp.float32)
    return jax.lax.fori_loop(0, cdiv(geom.q_heads, heads) * len(steps), one_call, out)
