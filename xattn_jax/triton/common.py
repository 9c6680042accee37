"""What every Triton-backend kernel shares: the grid and its BlockSpecs, the token
loaders (contiguous and paged), and the strided product (docs/estimate.md section 1),
written once here.

The grid is (column group, row tile, batch, query head). Pallas' Triton backend folds the
first two axes into CUDA's x, which the GPU launches fastest, so the programs running at
one time are the row tiles and key-column groups of one head: they share that head's keys
(and GQA's query heads one key head) in L2. With batch and head first, the programs
running together spanned every head, and the one-pass kernel was slower
(docs/tuning.md: triton-launch-order).

q and k are read in place in their `[B, H, L, D]` layout: a reshaped row is `S` token
rows of the original tensor, gathered by index inside the kernel, so there is no padded,
reshaped or head-repeated copy.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from xattn_jax.geometry import Geometry, next_pow2
from xattn_jax.triton.plan import Plan

COL_AXIS, ROW_AXIS, BATCH_AXIS, HEAD_AXIS = range(4)


def kernel_grid(plan: Plan, row_tiles: int, col_groups: int = 1,
                heads: int | None = None) -> tuple[int, ...]:
    """The grid of a call covering `heads` query heads (default all)."""
    return (col_groups, row_tiles, plan.geom.batch, heads or plan.geom.q_heads)


def head_spec(shape: tuple[int, ...]) -> pl.BlockSpec:
    """One (batch, query head)'s whole slab of an array `[B, Hq, *shape]`."""
    return pl.BlockSpec((None, None) + tuple(shape),
                        lambda c, r, b, h: (b, h) + (0,) * len(shape))


def key_head_spec(geom: Geometry) -> pl.BlockSpec:
    """The keys `[B, Hkv, Lk, D]` query head h reads: key head h // group."""
    g = geom.group
    return pl.BlockSpec((None, None, geom.k_len, geom.head_dim),
                        lambda c, r, b, h: (b, h // g, 0, 0))


def batch_spec(shape: tuple[int, ...]) -> pl.BlockSpec:
    """One batch element's row of an array `[B, *shape]` (a block table)."""
    return pl.BlockSpec((None,) + tuple(shape), lambda c, r, b, h: (b,) + (0,) * len(shape))


def whole_spec(shape: tuple[int, ...]) -> pl.BlockSpec:
    """An array every program reads whole (a paged cache, scalars)."""
    return pl.BlockSpec(tuple(shape), lambda *_: (0,) * len(shape))


def _head_columns(head_dim: int, part, depth: int | None) -> tuple[jax.Array, jax.Array | None]:
    """Column index `[1, depth]` of head-dim part `part` (columns part*depth onwards of
    the head dim padded to a power of two; depth None: all of it) and its mask (None for a
    power-of-two head_dim).

    With a power-of-two head_dim the column index is a plain range and the row mask is
    constant along a row, which lets Triton vectorize the loads (a clamped or masked
    column index costs several times the kernel's time).
    """
    width = depth or next_pow2(head_dim)
    dims = part * width + jnp.arange(width)
    if next_pow2(head_dim) == head_dim:
        return dims[None, :], None
    return jnp.minimum(dims, head_dim - 1)[None, :], (dims < head_dim)[None, :]


def _load(ref, mask):
    """ref read as zeros where `mask` (None: everywhere) is false."""
    return plgpu.load(ref) if mask is None else plgpu.load(ref, mask=mask, other=0)


def _row_mask(tokens: jax.Array, length, col_mask):
    """The load mask `[n, width]` (None: no mask) and the rows to read, clamped inside
    `length` where one is given."""
    if length is None:
        return col_mask, tokens
    mask = (tokens < length)[:, None]
    return (mask if col_mask is None else mask & col_mask), jnp.minimum(tokens, length - 1)


def load_tokens(ref, tokens: jax.Array, length, head_dim: int, part=0,
                depth: int | None = None, lead: tuple = ()) -> jax.Array:
    """Token rows `tokens` (int32 `[n]`) of a `[L, head_dim]` ref, head-dim part `part`
    of `depth` columns (None: all, padded to a power of two): `[n, depth]`. For a ref
    with axes before L (a whole `[B, H, L, D]` array), `lead` holds their indices: one
    indexing, since Pallas' Triton backend takes a single indexer per load.

    length: rows at or past it read as zeros (an int, or a traced int32 read before the
    kernel's loop: a scalar load inside the loop costs the pipeline its stages). None:
    the caller has checked that every token is a row of ref, and the load has no row
    mask: Triton pipelines unmasked q and k loads better (docs/tuning.md:
    triton-unmasked-loads). Columns past head_dim read as zeros.
    """
    cols, col_mask = _head_columns(head_dim, part, depth)
    mask, rows = _row_mask(tokens, length, col_mask)
    return _load(ref.at[(*lead, rows[:, None], cols)], mask)


def tile_pages(table_ref, pages_ref, col0, cols: int, stride: int):
    """The pages holding key columns [col0, col0 + cols) of one sequence (reshaped
    columns of S tokens), read from its block table once per key tile, for
    `load_paged_tokens`: int32 `[cols]`, column j's page, where every column lies in one
    page (pages of whole stride groups); None otherwise (`load_paged_tokens` then reads
    an entry per token).

    pages_ref: `[num_pages, page_size, Hkv, D]`; table_ref: int32 `[pages_per_seq]`, token
    t in page table[t // page_size] at row t % page_size. Entries past the table read its
    last one, and page numbers are clamped into the cache: tiles or entries past the
    sequence's pages may hold anything, and their loads are masked or their columns
    unseen. A vector even where a whole tile lies in one page: Triton pipelines this
    load, and not a scalar read of the tile's one entry (docs/tuning.md:
    triton-paged-table-reads).
    """
    num_pages, page_size = pages_ref.shape[:2]
    if page_size % stride:
        return None
    entries = jnp.minimum((col0 + jnp.arange(cols)) * stride // page_size,
                          table_ref.shape[0] - 1)
    return jnp.clip(plgpu.load(table_ref.at[entries]), 0, num_pages - 1)


def load_paged_tokens(pages_ref, table_ref, kv_head, tokens: jax.Array, length,
                      head_dim: int, part=0, depth: int | None = None,
                      pages: jax.Array | None = None) -> jax.Array:
    """Token rows of one sequence in a paged cache, as `[n, depth]`, like `load_tokens`.

    pages_ref, table_ref: as `tile_pages`; kv_head: the key head to read. pages: the
    key tile's pages from `tile_pages` (tokens: a pipeline step's, one per column of that
    tile); None: one table entry read per token. Reading the table once per tile rather
    than at every step keeps a dependent load off each step's critical path.
    """
    num_pages, page_size = pages_ref.shape[:2]
    cols, col_mask = _head_columns(head_dim, part, depth)
    mask, slots = _row_mask(tokens, length, col_mask)
    if pages is None:
        pages = jnp.clip(plgpu.load(table_ref.at[slots // page_size]), 0, num_pages - 1)
    return _load(pages_ref.at[pages[:, None], (slots % page_size)[:, None], kv_head, cols],
                 mask)


def step_product(load_queries, load_keys, row0, col0, step, *, plan: Plan) -> jax.Array:
    """One pipeline step's share of the strided product: float32 `[block_q, block_k]`.

    A score tile is the sum of S * plan.head_parts steps: step t is stride member
    t // head_parts over head-dim part t % head_parts (block_d columns, a power of two
    dividing the padded head dim).
    Reshaped row i holds query tokens p*S + S-1, ..., p*S (its group read in reverse; p =
    `geom.query_position(i)`, i itself but for sampled rows) and column j key tokens j*S,
    ..., j*S + S-1, so member m pairs query token p*S + S-1-m with key token j*S + m. load_queries(tokens, part, depth) and load_keys(...) return
    one (batch, query head)'s query token rows and its key head's key token rows
    (`load_tokens` or `load_paged_tokens`, bound by the real token counts or unmasked).
    """
    s, parts, depth = plan.geom.stride, plan.head_parts, plan.block_d
    # lax.div/rem: step >= 0, and jnp's floor division lowers to i1 selects on GPU
    member, part = jax.lax.div(step, parts), jax.lax.rem(step, parts)
    positions = plan.geom.query_position(row0 + jnp.arange(plan.block_q))
    q_part = load_queries(positions * s + (s - 1 - member), part=part, depth=depth)
    k_part = load_keys((col0 + jnp.arange(plan.block_k)) * s + member, part=part,
                       depth=depth)
    precision = (jax.lax.Precision.HIGHEST if q_part.dtype == jnp.float32
                 else jax.lax.Precision.DEFAULT)
    return plgpu.dot(q_part, k_part, trans_b=True, precision=precision)


def score_tile(load_queries, load_keys, row0, col0, *, plan: Plan, scale: float) -> jax.Array:
    """Scores for reshaped rows [row0, row0 + block_q) and columns [col0, col0 + block_k):
    float32 `[block_q, block_k]`, the sum of the step products times `scale` (A is
    scale = 1 / (sqrt(D) * S * norm)). Arguments as `step_product`.
    """
    def add_step(step, acc):
        return acc + step_product(load_queries, load_keys, row0, col0, step, plan=plan)

    acc = jax.lax.fori_loop(0, plan.geom.stride * plan.head_parts, add_step,
                            jnp.zeros((plan.block_q, plan.block_k), jnp.float32))
    return acc * jnp.float32(scale)
