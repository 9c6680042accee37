"""What the fused block-sum kernels share: one program's query rows, where its keys come
from, which key tiles it sees, and its masked score tiles (docs/estimate.md section 1 plus the
causal and padding masks of section 2).

A program owns `plan.block_q` reshaped query rows of one (batch, query head), on the
grid of `common.py`. The kernels take q and k whole and index the program's heads
themselves, so that a call can cover some of the heads (`Plan.call_heads`) without a
copy.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from xattn_jax.row_statistics import LOG2_E
from xattn_jax.triton.common import (BATCH_AXIS, HEAD_AXIS, ROW_AXIS, batch_spec,
                                     load_paged_tokens, load_tokens, score_tile,
                                     step_product, tile_pages, whole_spec)
from xattn_jax.triton.plan import Plan


class RowTile:
    """Rows [row0, row0 + rows) of one (batch, query head), inside a kernel: reshaped
    query rows, or sampled rows where `plan.geom` is a `SampledGeometry` (its
    `query_position` places them).

    q_ref: the whole `[B, Hq, Lq, D]`; k_ref: the whole `[B, Hkv, Lk, D]`, or the whole
    paged cache with `table_ref` (that sequence's block table); scalars_ref: int32 `[3]`,
    the real keys (a padded cache buffer holds fewer than Lk; more count as Lk), the
    first row of grid row tile 0 and the query head of grid head 0 (a call may cover
    only some rows and heads; the head is read only with `head_offset`, else grid head
    h is head h). row_extent: one past the last reshaped query row any of the kernel's
    calls reads. whole_groups: the key count is Lk or a multiple of S (see
    `Plan.keys_fit`).

    Loads are unmasked wherever every token they read lies in its buffer: the query rows
    read end within Lq, and for keys `Plan.keys_fit` and `whole_groups`. Triton pipelines
    unmasked q and k loads better (docs/tuning.md: triton-unmasked-loads).
    """

    def __init__(self, q_ref, k_ref, table_ref, scalars_ref, *, plan: Plan, causal: bool,
                 norm: float, row_extent: int, whole_groups: bool, head_offset: bool = False):
        geom = plan.geom
        self.geom, self.causal, self.norm, self.plan = geom, causal, norm, plan
        rows, cols, s = plan.block_q, plan.block_k, geom.stride
        self.row0 = scalars_ref[1] + pl.program_id(ROW_AXIS) * rows
        self.row_ids = self.row0 + jnp.arange(rows)
        self.row_real = self.row_ids < geom.q_rows
        batch, head = pl.program_id(BATCH_AXIS), pl.program_id(HEAD_AXIS)
        if head_offset:  # only then: an offset known at run time costs every load some
            head = head + scalars_ref[2]  # address arithmetic (more instructions in SASS)
        kv_head = jax.lax.div(head, jnp.int32(geom.group))  # GQA: no copy of k per head
        q_bound = None if geom.query_tokens_end(row_extent) <= geom.q_len else geom.q_len
        self.load_queries = functools.partial(load_tokens, q_ref, length=q_bound,
                                              head_dim=geom.head_dim, lead=(batch, head))
        # read here, before any loop (see `load_tokens`)
        k_len = jnp.minimum(scalars_ref[0], geom.k_len)
        self.k_cols = (k_len + s - 1) // s
        if table_ref is None:
            key_loader = functools.partial(load_tokens, k_ref, head_dim=geom.head_dim,
                                           lead=(batch, kv_head))
            self._table = None
        else:
            key_loader = functools.partial(load_paged_tokens, k_ref, table_ref, kv_head,
                                           head_dim=geom.head_dim)
            self._table = table_ref, k_ref
        unmasked = whole_groups and plan.keys_fit
        self._load_keys = functools.partial(key_loader, length=None if unmasked else k_len)
        if causal:
            # the column at each row's query position (the row itself but for sampled
            # rows), whose diagonal is row_offset on
            self._row_positions = geom.query_position(self.row_ids)
            self._first_position = geom.query_position(self.row0)
            last_row = jnp.minimum(self.row0 + rows, geom.q_rows) - 1
            last_col = jnp.minimum(geom.query_position(last_row) + geom.row_offset,
                                   self.k_cols - 1)
            visible = last_col // cols + 1
        else:
            visible = (self.k_cols + cols - 1) // cols
        # Key tiles 0 .. visible_tiles - 1 hold a column some row sees; a row tile made
        # only of padding sees nothing.
        self.visible_tiles = jax.lax.select(self.row0 < geom.q_rows, visible, jnp.int32(0))

    @property
    def _scale(self) -> float:
        return self.geom.scale / self.norm * LOG2_E

    @property
    def steps(self) -> int:
        """Pipeline steps per key tile (`strided_scores.step_product`)."""
        return self.geom.stride * self.plan.head_parts

    def tile_pages(self, col_tile):
        """A paged cache's pages of key tile `col_tile` (`common.tile_pages`: one table
        read per tile), for `step_product`; None for a contiguous k."""
        if self._table is None:
            return None
        return tile_pages(*self._table, col_tile * self.plan.block_k, self.plan.block_k,
                          self.geom.stride)

    def _keys(self, pages):
        """The key loader of a key tile whose pages are `pages` (`tile_pages`)."""
        if pages is None:
            return self._load_keys
        return functools.partial(self._load_keys, pages=pages)

    def scores(self, col_tile) -> jax.Array:
        """float32 `[rows, cols]`: A * log2(e) of key tile `col_tile`, -inf where a row may
        not see a column (past the real keys, or after the diagonal)."""
        a = score_tile(self.load_queries, self._keys(self.tile_pages(col_tile)), self.row0,
                       col_tile * self.plan.block_k, plan=self.plan, scale=self._scale)
        return self._mask(a, col_tile)

    def step_product(self, col_tile, step, pages) -> jax.Array:
        """Step `step`'s share of key tile `col_tile`'s product, unscaled, its pages
        `pages` (`tile_pages`); `finish` turns the sum over all `steps` into
        `scores(col_tile)`."""
        return step_product(self.load_queries, self._keys(pages), self.row0,
                            col_tile * self.plan.block_k, step, plan=self.plan)

    def finish(self, product: jax.Array, col_tile) -> jax.Array:
        return self._mask(product * jnp.float32(self._scale), col_tile)

    def _mask(self, a: jax.Array, col_tile) -> jax.Array:
        cols = self.plan.block_k
        last_col = col_tile * cols + cols - 1
        # Only tiles holding a column past the real keys, or one after the first row's
        # diagonal, pay for the mask (the epilogue is on the critical path).
        partial = last_col >= self.k_cols
        if self.causal:
            partial = partial | (last_col > self._first_position + self.geom.row_offset)

        def masked(a):
            col_ids = col_tile * cols + jnp.arange(cols)
            seen = (col_ids < self.k_cols)[None, :]
            if self.causal:
                seen = seen & (col_ids[None, :]
                               <= self._row_positions[:, None] + self.geom.row_offset)
            return jnp.where(seen, a, -jnp.inf)

        return jax.lax.cond(partial, masked, lambda a: a, a)


def key_operands(q, k, key_len, block_table, plan: Plan, first_row=0, first_head=0):
    """`(in_specs, operands)` of a kernel taking RowTile's refs: q and k (or the paged
    cache) whole, [block table], scalars (key_len, default all Lk; first_row and
    first_head, ints or traced int32s)."""
    if key_len is None:
        key_len = jnp.full((1,), plan.geom.k_len, jnp.int32)
    scalars = jnp.concatenate([key_len.astype(jnp.int32).reshape(1),
                               jnp.asarray(first_row, jnp.int32).reshape(1),
                               jnp.asarray(first_head, jnp.int32).reshape(1)])
    specs = [whole_spec(q.shape), whole_spec(k.shape)]
    if block_table is None:
        return specs + [whole_spec((3,))], (q, k, scalars)
    table = batch_spec((block_table.shape[1],))
    return specs + [table, whole_spec((3,))], (q, k, block_table.astype(jnp.int32), scalars)


def row_tile_refs(refs, paged: bool):
    """Splits a kernel's refs after q and k: `(table_ref or None, scalars_ref, outputs)`."""
    if paged:
        return refs[0], refs[1], refs[2:]
    return None, refs[0], refs[1:]
