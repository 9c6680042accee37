"""Section 1 as a Pallas kernel: strided antidiagonal scores, tile by tile, stored.

The fused block-sum kernels (`one_pass`, `two_pass`) consume the same tiles
(`common.score_tile`) without ever writing the score matrix; this one writes it, to
inspect. GQA picks the key head in the BlockSpec index map (`common.key_head_spec`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from xattn_jax.triton.common import (COL_AXIS, ROW_AXIS, head_spec, kernel_grid,
                                     key_head_spec, load_tokens, score_tile)
from xattn_jax.partitioning import kernel_output
from xattn_jax.triton.plan import Plan


def _strided_scores_kernel(q_ref, k_ref, out_ref, *, plan: Plan, norm: float):
    geom, tile = plan.geom, plan.block_q
    row0 = pl.program_id(ROW_AXIS) * tile
    col0 = pl.program_id(COL_AXIS) * tile
    load_queries = functools.partial(load_tokens, q_ref, length=geom.q_len,
                                     head_dim=geom.head_dim)
    load_keys = functools.partial(load_tokens, k_ref, length=geom.k_len,
                                  head_dim=geom.head_dim)
    a = score_tile(load_queries, load_keys, row0, col0, plan=plan, scale=geom.scale / norm)
    mask = ((row0 + jnp.arange(tile)) < geom.q_rows)[:, None] \
        & ((col0 + jnp.arange(tile)) < geom.k_cols)[None, :]
    plgpu.store(out_ref.at[pl.ds(row0, tile), pl.ds(col0, tile)], a, mask=mask)


@functools.partial(jax.jit, static_argnames=("plan", "norm"))
def strided_scores(q: jax.Array, k: jax.Array, *, plan: Plan, norm: float) -> jax.Array:
    """Triton-backend section 1: float32 scores `[B, Hq, ceil(Lq/S), ceil(Lk/S)]`.

    q: `[B, Hq, Lq, D]`, k: `[B, Hkv, Lk, D]` (float32, bfloat16 or float16); plan: from
    `plan.plan_strided_scores`. This writes the whole score matrix, O((L/S)^2) memory: use
    it to inspect scores, not inside the estimate, which fuses it away.
    """
    geom, tile = plan.geom, plan.block_q
    grid = kernel_grid(plan, pl.cdiv(geom.q_rows, tile), pl.cdiv(geom.k_cols, tile))
    kernel = functools.partial(_strided_scores_kernel, plan=plan, norm=norm)
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[head_spec((geom.q_len, geom.head_dim)), key_head_spec(geom)],
        out_specs=head_spec((geom.q_rows, geom.k_cols)),
        out_shape=kernel_output((geom.batch, geom.q_heads, geom.q_rows, geom.k_cols),
                                jnp.float32, q, k),
        compiler_params=plgpu.CompilerParams(num_warps=plan.num_warps,
                                             num_stages=plan.num_stages),
        interpret=plan.interpret,
    )(q, k)
