"""Section 4 as a Pallas kernel: threshold selection without sorting.

The rule takes candidate blocks in descending order while the selected total is below
`threshold * total`. Sorting is not needed to find that set: with G(x) = forced mass +
the mass of candidates >= x, the last value taken is x* = max{x : G(x) >= target}. Block
sums are non-negative floats, whose order is the order of their int32 bit patterns, so a
31-step bisection over the bit patterns finds x* exactly: its bits from the top, each set
where G still reaches the target with it. The steps are unrolled (the kernel is bound by
the steps' arithmetic; docs/tuning.md: select-bisection-unrolled). Everything above x* is
taken; blocks equal to x* are taken in index order (a running count) while
still below target.

A program holds `rows` rows of one (batch, query head), each padded to the power-of-two
width Triton's tiles need. Nothing is read or written outside the arrays: the block sums
are read in place, by indices clamped into `[qb, kb]` under a mask (padding reads as
zero), with no padded copy of the float32 input; the bool mask is written unmasked into
an output padded to whole tiles, cut to `[qb, kb]` after (no copy where nothing is
padded; an int8 output and a conversion pass were slower, docs/tuning.md:
select-bool-output). A causal selection runs in several kernel calls
(`plan.SelectPlan`): a row tile's search holds only the narrowest power of two of its
row's blocks that includes its diagonal, summing the later ones into the row total
only, and each call writes its row tiles into the same mask in place.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from xattn_jax.partitioning import kernel_output
from xattn_jax.triton.plan import SelectPlan

_FLOAT_BITS = 31  # bisection steps: non-negative float32 bit patterns are < 2**31


def _select_kernel(sums_ref, threshold_ref, *refs, q_blocks: int, k_blocks: int,
                   rows: int, width: int, out_width: int, first_tile: int, causal: bool,
                   keep_sink: bool, keep_recent: bool, row_diagonals: bool):
    mask_ref = refs[-1]  # after the mask of the calls before, aliased to it (never read)
    diagonal_ref = refs[0] if row_diagonals else None
    h = pl.program_id(1)
    row_ids = (first_tile + pl.program_id(2)) * rows + jnp.arange(rows)
    clamped_rows = jnp.minimum(row_ids, q_blocks - 1)[:, None]

    def load(first, size):
        """Block sums of the program's rows in columns first .. first + size (`[rows,
        size]`), and where they are real: padding reads as zero."""
        blocks = first + jnp.arange(size)
        real = (row_ids < q_blocks)[:, None] & (blocks < k_blocks)[None, :]
        inside = (clamped_rows, jnp.minimum(blocks, k_blocks - 1)[None, :])
        return plgpu.load(sums_ref.at[inside], mask=real, other=0.0), real

    sums, real = load(0, width)
    total = sums.sum(axis=1)
    # Columns past `width` (past every row's diagonal) count in the total only, their
    # mask False: in power-of-two pieces, as Triton's tiles need.
    piece = width
    while piece < out_width:
        total += load(piece, piece)[0].sum(axis=1)
        mask_ref[:, pl.ds(piece, piece)] = jnp.zeros((rows, piece), jnp.bool_)
        piece *= 2

    j = jnp.arange(width)[None, :]
    if diagonal_ref is None:
        diagonal = row_ids[:, None] + (k_blocks - q_blocks)
    else:
        diagonal = plgpu.load(diagonal_ref.at[clamped_rows])
    forced = real & (((j == 0) & (causal or keep_sink))
                     | ((j == diagonal) & (causal or keep_recent)))
    allowed = real & (j <= diagonal) if causal else real
    candidate = allowed & ~forced

    target = threshold_ref[h] * total
    forced_mass = jnp.where(forced, sums, 0.0).sum(axis=1)
    bits = jnp.where(candidate, jax.lax.bitcast_convert_type(sums, jnp.int32), -1)

    def reached(x):  # G(x) >= target, per row
        return forced_mass + jnp.where(bits >= x[:, None], sums, 0.0).sum(axis=1) >= target

    # x*, bit by bit from the top (G(0) >= target unless the candidates miss it, below)
    lo = jnp.zeros((rows,), jnp.int32)
    for bit in reversed(range(_FLOAT_BITS)):
        with_bit = lo | (1 << bit)
        lo = jnp.where(reached(with_bit), with_bit, lo)
    above = bits > lo[:, None]
    tied = bits == lo[:, None]
    tie_value = jax.lax.bitcast_convert_type(lo, jnp.float32)
    above_mass = forced_mass + jnp.where(above, sums, 0.0).sum(axis=1)
    ties_before = jnp.cumsum(tied.astype(jnp.int32), axis=1) - 1
    take_tie = tied & (above_mass[:, None] + ties_before * tie_value[:, None] < target[:, None])
    chosen = forced | above | take_tie
    # Forced blocks alone reach the target: nothing more. The candidates together miss it
    # (float rounding): all of them.
    chosen = jnp.where((forced_mass >= target)[:, None], forced, chosen)
    chosen = jnp.where(reached(jnp.zeros((rows,), jnp.int32))[:, None], chosen, forced | candidate)
    # A threshold of 1 or more, or a non-finite row: everything allowed.
    keep_all = ~jnp.isfinite(total) | (threshold_ref[h] >= 1)
    chosen = jnp.where(keep_all[:, None], allowed, chosen)
    mask_ref[:, pl.ds(0, width)] = chosen  # padding: False (`real` is in every term)


@functools.partial(jax.jit, static_argnames=("plan", "causal", "keep_sink", "keep_recent"))
def select_blocks(block_sums: jax.Array, threshold: jax.Array, *, plan: SelectPlan,
                  causal: bool, keep_sink: bool = False, keep_recent: bool = False,
                  diagonal: jax.Array | None = None) -> jax.Array:
    """Triton-backend section 4. block_sums: float32 `[B, Hq, qb, kb]`; threshold: float32
    `[Hq]`; plan: from `plan.plan_select_blocks` for that shape and causal flag (with
    `diagonal`: a plan of one call at the whole width, `causal=False`'s).
    diagonal: int32 `[qb]`, each row's diagonal block where it is not i + kb - qb
    (`reference.forced_and_allowed`), for causal selections.

    Returns bool `[B, Hq, qb, kb]`, the same rule as `reference.select_blocks`. Each of
    the plan's calls writes its row tiles into one mask, the later ones in place.
    """
    b, hq, qb, kb = block_sums.shape
    rows, width = plan.rows, plan.width
    diagonals = () if diagonal is None else (diagonal.astype(jnp.int32),)
    mask = None
    for call in plan.calls:
        kernel = functools.partial(_select_kernel, q_blocks=qb, k_blocks=kb, rows=rows,
                                   width=call.width, out_width=width,
                                   first_tile=call.first_tile, causal=causal,
                                   keep_sink=keep_sink, keep_recent=keep_recent,
                                   row_diagonals=bool(diagonals))
        mask_spec = pl.BlockSpec((None, None, rows, width),
                                 lambda i, h, r, first=call.first_tile: (i, h, first + r, 0))
        earlier = () if mask is None else (mask,)
        extra = diagonals + earlier
        mask = pl.pallas_call(
            kernel,
            grid=(b, hq, call.tiles),
            in_specs=[pl.BlockSpec((None, None, qb, kb), lambda i, h, r: (i, h, 0, 0)),
                      pl.BlockSpec((hq,), lambda i, h, r: (0,))]
            + [pl.BlockSpec((qb,), lambda i, h, r: (0,))] * len(diagonals)
            + [mask_spec] * len(earlier),
            out_specs=mask_spec,
            out_shape=kernel_output((b, hq, plan.row_tiles * rows, width), jnp.bool_,
                                    block_sums, threshold),
            input_output_aliases={2 + len(diagonals): 0} if earlier else {},
            compiler_params=plgpu.CompilerParams(num_warps=call.num_warps),
            interpret=plan.interpret,
        )(block_sums, threshold, *extra)
    return mask[:, :, :qb, :kb]

