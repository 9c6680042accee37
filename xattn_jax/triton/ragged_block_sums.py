"""Sections 1-3 of a ragged step as one persistent Pallas Triton-backend kernel
(docs/estimate.md, "Ragged steps"), or the sampled rows' block scores on a
`RaggedSampledGeometry` (stride 1: rows are sampled query tokens, columns single keys).

Programs walk (row tile, query head) pairs, longest first (`ragged.row_tiles`). For
each, a program runs every key tile its rows see, strided product by product
(`common.step_product`: the queries gathered from the packed q at their absolute
positions, the keys through the sequence's page table), keeps each row's running
maximum M and sum L (log2 units), and stores per key tile the row maxima m and the
rows' sums x of 2^(A' - m) over each key block's columns in its own scratch. Then it
reads its scratch back and writes the pair's block sums: x 2^(m - M) / L, summed over
each query block's rows. The scratch is per program, so the workspace does not grow with
the step: `RaggedPlan.programs` programs of `rows x (key blocks + key tiles)` floats.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from xattn_jax.geometry import next_pow2
from xattn_jax.partitioning import kernel_output
from xattn_jax.ragged.geometry import RaggedGeometry, RaggedSampledGeometry
from xattn_jax.ragged.layout import RaggedBlocks
from xattn_jax.ragged.row_tiles import FIELDS, RowTiles, max_key_tiles, row_tiles
from xattn_jax.row_statistics import DEFAULT_SCRATCH_BYTES, LOG2_E
from xattn_jax.triton.common import _head_columns, step_product, whole_spec
from xattn_jax.triton.plan import MIN_SIDE, Tiles, TUNED

_SEQ, _MASK_ROW, _MASK_ROWS, _FIRST_ROW, _KEY_TILES = range(len(FIELDS))


@dataclasses.dataclass(frozen=True)
class RaggedPlan:
    """One call: tiles `block_q` reshaped rows x `block_k` columns, `block_d` head-dim
    columns per step; `programs` persistent programs; interpret: Pallas interpret mode.
    Hashable (a static jit argument). Quacks as `triton.plan.Plan` for `step_product`."""

    geom: RaggedGeometry
    block_q: int
    block_k: int
    block_d: int
    num_warps: int
    num_stages: int
    programs: int
    interpret: bool

    @property
    def head_parts(self) -> int:
        return next_pow2(self.geom.head_dim) // self.block_d

    @property
    def steps(self) -> int:
        """Pipeline steps per key tile: one per stride member and head-dim part."""
        return self.geom.stride * self.head_parts

    @property
    def block_rows(self) -> int:
        """Rows per query block (`geom.block_rows`)."""
        return self.geom.block_rows

    @property
    def block_cols(self) -> int:
        """Columns per key block (`geom.block_cols`)."""
        return self.geom.block_cols

    @property
    def blocks_per_tile(self) -> int:
        return self.block_k // self.block_cols

    @property
    def key_tiles(self) -> int:
        return max_key_tiles(self.geom, self.block_k)

    @property
    def program_scratch_bytes(self) -> int:
        """One program's floats: x per row and key block, m per row and key tile."""
        return 4 * self.block_q * self.key_tiles * (self.blocks_per_tile + 1)


def unsupported_reason(geom: RaggedGeometry, dtype=jnp.bfloat16,
                       tiles: Tiles | None = None) -> str | None:
    """Why the kernel cannot run a step of `geom` in `dtype` (None if it can)."""
    tiles = tiles or _tiles(geom, dtype)
    if (geom.block_rows > tiles.block_q or tiles.block_q % geom.block_rows
            or tiles.block_k % geom.block_cols):
        return (f"impl='triton' estimates ragged steps whose query blocks' rows divide "
                f"{tiles.block_q} and key blocks' columns divide {tiles.block_k}; got "
                f"{geom.block_rows} and {geom.block_cols} (block_size {geom.block_size}, "
                f"stride {geom.stride})")
    if geom.page_size % geom.stride:
        return (f"impl='triton' estimates ragged steps whose pages hold whole stride "
                f"groups (page_size a multiple of {geom.stride}); got {geom.page_size}")
    return None


def _tiles(geom: RaggedGeometry, dtype=jnp.bfloat16) -> Tiles:
    """The whole-prompt kernel's tuned tiles, rows capped to keep the scratch small,
    columns widened to a whole key block (the sampled rows' blocks of single keys;
    docs/tuning.md: ragged-sampled-rows)."""
    tiles = TUNED[4 if jnp.dtype(dtype).itemsize >= 4 else 2]
    return dataclasses.replace(tiles, block_q=min(tiles.block_q, RAGGED_ROWS),
                               block_k=max(tiles.block_k, geom.block_cols))


RAGGED_ROWS = 64  # reshaped rows per tile: half the scratch of 128 (docs/tuning.md: ragged-rows)
TARGET_PROGRAMS = 132  # one program per SM of an H100 / H200


def plan_ragged(geom: RaggedGeometry, dtype, *, interpret: bool,
                max_scratch_bytes: int | None = None, tiles: Tiles | None = None,
                programs: int | None = None) -> RaggedPlan:
    """The plan of one ragged block-sum call: the tuned tiles (or `tiles`), and as many
    programs as the scratch bound allows, at most `programs` (default TARGET_PROGRAMS)."""
    tiles = tiles or _tiles(geom, dtype)
    block_d = min(tiles.block_d or next_pow2(geom.head_dim), next_pow2(geom.head_dim))
    plan = RaggedPlan(geom, max(MIN_SIDE, tiles.block_q), tiles.block_k, block_d,
                      tiles.num_warps, tiles.num_stages, 1, interpret)
    bound = max_scratch_bytes or DEFAULT_SCRATCH_BYTES
    fit = max(1, bound // plan.program_scratch_bytes)
    return dataclasses.replace(plan, programs=min(programs or TARGET_PROGRAMS, fit))


def _load_queries(q_ref, tile, head, positions, *, part, depth, head_dim):
    """Queries at key `positions` `[n]` of the tile's sequence, columns of head-dim
    part `part`: `[n, depth]`, zero outside the sequence's chunk."""
    first, count, start = tile["first_position"], tile["kv_len"], tile["q_start"]
    real = (positions >= first) & (positions < count)
    token = jnp.where(real, start + positions - first, 0)
    cols, col_mask = _head_columns(head_dim, part, depth)
    mask = real[:, None] if col_mask is None else real[:, None] & col_mask
    return plgpu.load(q_ref.at[token[:, None], head, cols], mask=mask, other=0)


def _load_keys(k_ref, pages, tile, kv_head, positions, *, part, depth, head_dim, fused):
    """Keys at `positions` `[n]` of the tile's sequence (pages: their pages, `[n]`),
    zero from its kv_len on: `[n, depth]`."""
    page_size = k_ref.shape[1]
    real = positions < tile["kv_len"]
    cols, col_mask = _head_columns(head_dim, part, depth)
    mask = real[:, None] if col_mask is None else real[:, None] & col_mask
    rows = (positions % page_size)[:, None]
    index = (pages[:, None], rows, kv_head) + ((0,) if fused else ()) + (cols,)
    return plgpu.load(k_ref.at[index], mask=mask, other=0)


def _kernel(count_ref, tiles_ref, starts_ref, q_ref, k_ref, table_ref, sums_ref,
            x_ref, m_ref, *, plan: RaggedPlan, scale: float):
    geom = plan.geom
    rows, cols, n = plan.block_q, plan.block_k, plan.block_rows
    units, steps, s = plan.blocks_per_tile, plan.steps, geom.stride
    program = pl.program_id(0)
    items = count_ref[0] * geom.q_heads
    mine = jax.lax.div(jnp.maximum(items - program, 0) + (plan.programs - 1),
                       jnp.int32(plan.programs))
    row_index = jnp.arange(rows)

    def one_item(j, carry):
        item = program + j * plan.programs
        t, head = jax.lax.div(item, jnp.int32(geom.q_heads)), jax.lax.rem(
            item, jnp.int32(geom.q_heads))
        seq = tiles_ref[t, _SEQ]
        tile = {"first_position": starts_ref[seq, 1], "kv_len": starts_ref[seq, 2],
                "q_start": starts_ref[seq, 0]}
        kv_head = jax.lax.div(head, jnp.int32(geom.group))
        row0 = tiles_ref[t, _FIRST_ROW]
        key_tiles = tiles_ref[t, _KEY_TILES]
        key_cols = jax.lax.div(tile["kv_len"] + (s - 1), jnp.int32(s))
        row_ids = row0 + row_index
        load_queries, diagonal, real_row = _rows_of_tile(
            geom, row_ids, tile, functools.partial(_load_queries, q_ref, tile, head,
                                                   head_dim=geom.head_dim))
        load_keys = functools.partial(_load_keys, k_ref, tile=tile, kv_head=kv_head,
                                      head_dim=geom.head_dim, fused=geom.fused)

        def pages_of(col_tile):
            """The page of each column of a key tile (pages hold whole stride groups)."""
            positions = (col_tile * cols + jnp.arange(cols)) * s
            entry = jnp.minimum(positions // geom.page_size, geom.pages_per_seq - 1)
            return jnp.clip(plgpu.load(table_ref.at[seq, entry]), 0, geom.num_pages - 1)

        def tile_stats(col_tile, a, carry):
            big_m, big_l = carry
            col_ids = col_tile * cols + jnp.arange(cols)
            seen = (col_ids[None, :] < key_cols) & (col_ids[None, :] <= diagonal[:, None])
            a = jnp.where(seen, a, -jnp.inf)
            m = a.max(axis=1)
            shift = jnp.where(m == -jnp.inf, 0.0, m)
            p = jnp.exp2(a - shift[:, None])
            x = p.reshape(rows, units, plan.block_cols).sum(axis=2)
            plgpu.store(x_ref.at[program, :, pl.ds(col_tile * units, units)], x)
            plgpu.store(m_ref.at[program, :, col_tile], m)
            new_m = jnp.maximum(big_m, m)
            old = jnp.where(big_m == -jnp.inf, 0.0, big_l * jnp.exp2(big_m - new_m))
            add = jnp.where(m == -jnp.inf, 0.0, x.sum(axis=1) * jnp.exp2(m - new_m))
            return new_m, old + add

        def step(i, carry):
            product, pages, stats = carry
            col_tile, j = jax.lax.div(i, steps), jax.lax.rem(i, steps)
            pages = jax.lax.cond(j == 0, lambda: pages_of(col_tile), lambda: pages)
            product = product + step_product(
                load_queries, functools.partial(_keys_with_pages, load_keys, pages),
                row0, col_tile * cols, j, plan=plan)

            def last_step(product, stats):
                return jnp.zeros_like(product), tile_stats(
                    col_tile, product * jnp.float32(scale), stats)

            product, stats = jax.lax.cond(j == steps - 1, last_step,
                                          lambda p, st: (p, st), product, stats)
            return product, pages, stats

        init = (jnp.zeros((rows, cols), jnp.float32), pages_of(0),
                (jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32)))
        _, _, (big_m, big_l) = jax.lax.fori_loop(0, key_tiles * steps, step, init)

        # the block sums of the pair: rows summed per query block, key tile by key tile
        weight_rows = real_row & (big_l > 0)
        local_rows = jnp.arange(rows // n)
        out_rows = tiles_ref[t, _MASK_ROW] + local_rows  # inside the padded output
        own = (local_rows < tiles_ref[t, _MASK_ROWS])[:, None]  # the next tile's are not

        def write(col_tile, sums):
            block_ids = col_tile * units + jnp.arange(units)
            plgpu.store(sums_ref.at[head, out_rows[:, None], block_ids[None, :]], sums,
                        mask=own)

        def normalize(col_tile, carry):
            x = plgpu.load(x_ref.at[program, :, pl.ds(col_tile * units, units)])
            m = plgpu.load(m_ref.at[program, :, col_tile])
            w = jnp.where(weight_rows & (m > -jnp.inf),
                          jnp.exp2(m - big_m) / jnp.where(big_l > 0, big_l, 1.0), 0.0)
            write(col_tile, (x * w[:, None]).reshape(rows // n, n, units).sum(axis=1))
            return carry

        jax.lax.fori_loop(0, key_tiles, normalize, None)

        def zeros(i, carry):  # key tiles no row of the pair sees: blocks of mass 0
            write(key_tiles + i, jnp.zeros((rows // n, units), jnp.float32))
            return carry

        jax.lax.fori_loop(0, plan.key_tiles - key_tiles, zeros, None)
        return carry

    jax.lax.fori_loop(0, mine, one_item, None)


def _rows_of_tile(geom: RaggedGeometry, row_ids, tile, load_queries):
    """The rows `row_ids` `[rows]` of a tile's sequence: (the loader `step_product` calls
    for their queries, each row's last visible column, whether the row holds a query of
    the chunk)."""
    first, count = tile["first_position"], tile["kv_len"]
    if not isinstance(geom, RaggedSampledGeometry):  # reshaped row i sees columns <= i
        s = geom.stride
        return load_queries, row_ids, (row_ids * s + (s - 1) >= first) & (row_ids * s < count)

    def place(rows):
        return geom.sampled_position(rows, first, count)

    def load(rows, *, part, depth):  # at stride 1 step_product passes the row indices
        return load_queries(place(rows), part=part, depth=depth)

    block_start = jax.lax.div(row_ids, jnp.int32(geom.rows)) * geom.block_size
    return load, place(row_ids), (block_start + geom.block_size > first) & (block_start < count)


def _keys_with_pages(load_keys, pages, positions, *, part, depth):
    """`load_keys` for a step's key positions `[cols]` (one stride member of each column)
    whose pages are `pages`, the columns' pages."""
    return load_keys(positions=positions, pages=pages, part=part, depth=depth)


@functools.partial(jax.jit, static_argnames=("plan", "norm"))
def ragged_block_sums(q, k, page_indices, blocks: RaggedBlocks, *, plan: RaggedPlan,
                      norm: float) -> jax.Array:
    """Block sums float32 `[Hq, QB, KB]` of a ragged step (`reference.ragged.block_sums`'s
    values in the rows of estimated sequences; other rows hold anything); on a
    `RaggedSampledGeometry`, the sampled rows' (norm unused).

    q `[T, Hq, D]`; k `[num_pages, page_size, Hkv, D]`, or a fused cache's view
    `[num_pages, page_size, Hkv, 2, D]` (its K read in place); page_indices int32
    `[S, pages_per_seq]`; plan from `plan_ragged`. Pages must hold whole stride groups
    (page_size a multiple of S)."""
    geom = plan.geom
    tiles: RowTiles = row_tiles(blocks, geom, rows=plan.block_q, block_k=plan.block_k)
    starts = jnp.stack([blocks.q_starts, blocks.first_position, blocks.kv_lens], axis=1)
    # padded by a tile's rows and to whole key tiles: stores need no clamped indices
    shape = (geom.q_heads, geom.q_block_rows + plan.block_q // plan.block_rows,
             plan.key_tiles * plan.blocks_per_tile)
    scratch = [(plan.programs, plan.block_q, plan.key_tiles * plan.blocks_per_tile),
               (plan.programs, plan.block_q, plan.key_tiles)]
    scale = LOG2_E * geom.score_scale(norm)
    operands = (tiles.count.reshape(1), tiles.table, starts, q, k,
                page_indices.astype(jnp.int32))
    sums, _, _ = pl.pallas_call(
        functools.partial(_kernel, plan=plan, scale=scale),
        grid=(plan.programs,),
        in_specs=[whole_spec(x.shape) for x in operands],
        out_specs=[whole_spec(shape)] + [whole_spec(x) for x in scratch],
        out_shape=[kernel_output(shape, jnp.float32, q, k)]
        + [kernel_output(x, jnp.float32, q, k) for x in scratch],
        compiler_params=plgpu.CompilerParams(num_warps=plan.num_warps,
                                             num_stages=plan.num_stages),
        interpret=plan.interpret,
    )(*operands)
    return sums[:, :geom.q_block_rows, :geom.k_blocks]
