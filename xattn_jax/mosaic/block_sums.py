"""Sections 1-3 fused on Hopper: the Mosaic GPU block sums.

`block_sums` pads q and k to whole tiles (a copy only where a length is not a multiple of
the tile), runs the row-statistics kernel (`xattn_jax.mosaic.tile_stats`, imported on
first call only, so that this module imports with any jax), marks the statistics of key
tiles a row tile never sees as empty (-inf maxima, zero sums: the kernel does not write
them), and normalizes exactly with the Triton one-pass kernel's epilogue
(`xattn_jax.row_statistics.combine`, as the Triton one-pass kernel: the statistics are
the same).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from xattn_jax.mosaic.estimate_plan import EstimatePlan, visible_tiles
from xattn_jax.row_statistics import LOG2_E, combine


def _strided(x: jax.Array, stride: int, length: int) -> jax.Array:
    """`[B, H, L, D]` zero-padded to `length` tokens, viewed as `[B, H, length / S, S, D]`."""
    b, h, tokens, d = x.shape
    if tokens < length:
        x = jnp.pad(x, ((0, 0), (0, 0), (0, length - tokens), (0, 0)))
    return x.reshape(b, h, length // stride, stride, d)


def _planes(stats: jax.Array, plan: EstimatePlan, causal: bool):
    """The kernel's statistics `[B, Hq, T, planes, R]` as `combine` takes them: maxima and
    totals `[B, Hq, T, R]`, unit sums `[B, Hq, T, R, P]`; tiles a row tile does not see
    become empty (-inf, 0), whatever their memory holds."""
    units = plan.units_per_tile
    row0 = jnp.arange(plan.padded_rows, dtype=jnp.int32) // plan.rows * plan.rows
    seen = jnp.arange(plan.key_tiles)[:, None] < visible_tiles(plan, causal, row0)[None, :]
    maxes = jnp.where(seen, stats[:, :, :, 0], -jnp.inf)
    sums = jnp.where(seen[..., None], jnp.moveaxis(stats[:, :, :, 1:1 + units], 3, 4), 0.0)
    totals = jnp.where(seen, stats[:, :, :, 1 + units], 0.0) if units > 1 else sums[..., 0]
    return maxes, sums, totals


@functools.partial(jax.jit, static_argnames=("plan", "causal", "norm"))
def block_sums(q: jax.Array, k: jax.Array, *, plan: EstimatePlan, causal: bool,
               norm: float) -> jax.Array:
    """Mosaic GPU sections 1-3: float32 block sums `[B, Hq, ceil(Lq/bs), ceil(Lk/bs)]`.

    q: `[B, Hq, Lq, D]`, k: `[B, Hkv, Lk, D]`, bfloat16 or float16 (one dtype); plan: from
    `estimate_plan.estimate_plan` for this geometry and dtype. Arguments are assumed
    checked (`xattn_jax.checks`); all Lk keys are in use.
    """
    from xattn_jax.mosaic import tile_stats  # imports Mosaic GPU: only where it runs

    geom = plan.geom
    s = geom.stride
    stats = tile_stats.tile_stats(_strided(q, s, plan.padded_rows * s),
                                  _strided(k, s, plan.padded_cols * s), plan=plan,
                                  causal=causal, scale=geom.scale / norm * LOG2_E)
    maxes, sums, totals = _planes(stats, plan, causal)
    return combine(maxes, sums, totals, geom, plan.unit, 0, geom.q_blocks, True)
