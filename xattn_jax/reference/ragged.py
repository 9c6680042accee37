"""docs/estimate.md "Ragged steps" in plain JAX: the estimate's block sums and the
attention of a ragged step, one mask row (a query block of one sequence) at a time.

Each row gathers its block's queries from the packed q (queries outside the sequence's
chunk read as zeros) and its sequence's keys through the page table, then applies the
functions of sections 1-3 and 6 (`reference.estimate`, `reference.attention`) with the
row's absolute position. Rows run one after another (`lax.map`): memory is one row's
work, the scores of `block_size` queries against the page table's capacity.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from xattn_jax.geometry import Geometry, cdiv
from xattn_jax.ragged.geometry import RaggedGeometry, RaggedSampledGeometry
from xattn_jax.ragged.layout import RaggedBlocks
from xattn_jax.reference.attention import block_sparse_attention
from xattn_jax.reference.estimate import softmax_block_sums, strided_scores


def split_cache(k: jax.Array, v: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """Keys and values `[num_pages, page_size, Hkv, D]` of separate caches, or of one
    fused cache `[num_pages, page_size, Hkv, 2, D]` (K then V of each KV head)."""
    if v is not None:
        return k, v
    return k[:, :, :, 0], k[:, :, :, 1]


def _block_queries(q, blocks: RaggedBlocks, row, geom: RaggedGeometry):
    """The queries of mask row `row`'s block `[bs, Hq, D]` (zeros outside the chunk),
    its sequence, the block's first key position and which of its queries are real."""
    seq, bs = blocks.row_seq[row], geom.block_size
    position = blocks.row_block[row] * bs + jnp.arange(bs)
    real = ((position >= blocks.first_position[seq]) & (position < blocks.kv_lens[seq])
            & blocks.row_live[row])
    token = jnp.clip(blocks.token_of(seq, position), 0, geom.tokens - 1)
    return jnp.where(real[:, None, None], q[token], 0), seq, position[0], real


def _sequence_keys(k, page_table_row, count, geom: RaggedGeometry) -> jax.Array:
    """One sequence's keys `[1, Hkv, KB * bs, D]` read through its page table (later
    pages clamped into the cache), zero from `count` on."""
    length = geom.k_blocks * geom.block_size
    position = jnp.arange(length)
    entry = jnp.minimum(position // geom.page_size, geom.pages_per_seq - 1)
    page = jnp.clip(page_table_row[entry], 0, geom.num_pages - 1)
    keys = k[page, position % geom.page_size]  # [length, Hkv, D]
    keys = jnp.where((position < count)[:, None, None], keys, 0)
    return keys.transpose(1, 0, 2)[None]


def block_sums(q, k, page_indices, blocks: RaggedBlocks, geom: RaggedGeometry, *,
               norm: float) -> jax.Array:
    """Sections 1-3 per mask row: float32 `[Hq, QB, KB]`, zero in rows that are not live
    or whose sequence is not estimated. On a `RaggedSampledGeometry`, the sampled rows'
    block scores instead (`sampled_mass`; norm unused).

    q `[T, Hq, D]`; k `[num_pages, page_size, Hkv, D]`; page_indices int32
    `[S, pages_per_seq]`. A row's reshaped query rows are its block's stride groups at
    their absolute positions; a group's positions outside the chunk read as zeros, and a
    group holding no query of the chunk adds nothing. Column j (keys jS .. jS + S - 1,
    those from kv_len on zero) is visible to the row at absolute group i iff j <= i and
    jS < kv_len.
    """
    if isinstance(geom, RaggedSampledGeometry):
        return sampled_mass(q, k, page_indices, blocks, geom)
    bs, s = geom.block_size, geom.stride
    row_geom = Geometry(1, geom.q_heads, geom.kv_heads, bs, geom.k_blocks * bs,
                        geom.head_dim, s, bs)

    def one_row(row):
        queries, seq, block_start, real = _block_queries(q, blocks, row, geom)
        count = blocks.kv_lens[seq]
        keys = _sequence_keys(k, page_indices[seq], count, geom)
        scores = strided_scores(queries.transpose(1, 0, 2)[None], keys, row_geom, norm)
        sums = softmax_block_sums(scores, row_geom, True, key_cols=cdiv_traced(count, s),
                                  row_offset=block_start // s,
                                  real_rows=real.reshape(bs // s, s).any(axis=1))[0, :, 0]
        return jnp.where(blocks.estimated[seq] & blocks.row_live[row], sums, 0.0)

    rows = jax.lax.map(one_row, jnp.arange(geom.q_block_rows))  # [QB, Hq, KB]
    return rows.transpose(1, 0, 2)


def sampled_mass(q, k, page_indices, blocks: RaggedBlocks,
                 geom: RaggedSampledGeometry) -> jax.Array:
    """The sampled rows' block scores per mask row: float32 `[Hq, QB, KB]`, zero in rows
    that are not live or whose sequence is not estimated. A row's `geom.rows` queries sit
    at `geom.sampled_position`; each one's exact softmax (its softmax scale) over the keys
    it sees, summed per key block and over the rows."""
    bs, rows, group = geom.block_size, geom.rows, geom.group
    # 4-byte inputs need HIGHEST (not TF32); 2-byte inputs' products are exact in float32
    precision = jax.lax.Precision.HIGHEST if q.dtype.itemsize >= 4 else None

    def one_row(row):
        seq, count = blocks.row_seq[row], blocks.kv_lens[blocks.row_seq[row]]
        position = geom.sampled_position(blocks.row_block[row] * rows + jnp.arange(rows),
                                         blocks.first_position[seq], count)
        token = jnp.clip(blocks.token_of(seq, position), 0, geom.tokens - 1)
        queries = q[token].reshape(rows, geom.kv_heads, group, -1)  # [rows, Hkv, G, D]
        keys = _sequence_keys(k, page_indices[seq], count, geom)[0]  # [Hkv, KB * bs, D]
        scores = jnp.einsum("rkgd,kjd->kgrj", queries, keys, precision=precision,
                            preferred_element_type=jnp.float32)
        key = jnp.arange(keys.shape[1])
        seen = (key[None, :] < count) & (key[None, :] <= position[:, None])  # [rows, keys]
        p = jax.nn.softmax(jnp.where(seen, scores * geom.softmax_scale, -jnp.inf), axis=-1)
        mass = p.reshape(geom.q_heads, rows, geom.k_blocks, bs).sum(axis=(1, 3))
        return jnp.where(blocks.estimated[seq] & blocks.row_live[row], mass, 0.0)

    masses = jax.lax.map(one_row, jnp.arange(geom.q_block_rows))  # [QB, Hq, KB]
    return masses.transpose(1, 0, 2)


def cdiv_traced(n, d: int):
    """ceil(n / d) of a non-negative traced int."""
    return jax.lax.div(n + (d - 1), jnp.int32(d))


def attention(q, k, v, page_indices, mask, blocks: RaggedBlocks, geom: RaggedGeometry, *,
              scale: float) -> jax.Array:
    """Section 6 per mask row: `[T, Hq, Dv]` in q's dtype, zero in rows of no live
    sequence.

    mask: bool `[Hq, QB, KB]`; query row t of sequence s, at key position p, attends to
    key j iff j <= p and mask[h, row of p's block, j // bs]. k, v: paged caches
    `[num_pages, page_size, Hkv, D]` / `[.., Dv]`.
    """
    bs = geom.block_size
    # a table reaching every position of the last block (extra pages are never visible)
    reach = cdiv(geom.k_blocks * bs, geom.page_size)
    table = jnp.pad(page_indices, ((0, 0), (0, reach - geom.pages_per_seq)), mode="edge")
    key_blocks = cdiv(reach * geom.page_size, bs)

    def one_row(row):
        queries, seq, block_start, _ = _block_queries(q, blocks, row, geom)
        row_mask = jnp.pad(mask[:, row], ((0, 0), (0, key_blocks - geom.k_blocks)))
        out = block_sparse_attention(
            queries.transpose(1, 0, 2)[None], k, v, row_mask[None, :, None],
            block_size=bs, causal=True, scale=scale, k_len=block_start + bs,
            block_table=table[seq][None])
        return out[0].transpose(1, 0, 2)  # [bs, Hq, Dv]

    rows = jax.lax.map(one_row, jnp.arange(geom.q_block_rows))  # [QB, bs, Hq, Dv]
    return gather_rows(rows.reshape(-1, *rows.shape[2:]), blocks, geom)


def gather_rows(block_rows: jax.Array, blocks: RaggedBlocks, geom: RaggedGeometry):
    """Packed rows `[T, ...]` from per-block rows `[QB * bs, ...]` (row r * bs + i: query
    position i of mask row r's block); rows of no live sequence are zero."""
    token = jnp.arange(geom.tokens, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(blocks.q_starts, token, side="right") - 1, 0,
                   geom.seqs - 1)
    offset = token - blocks.q_starts[seq]
    live = (offset >= 0) & (offset < blocks.q_lens[seq])
    position = blocks.first_position[seq] + offset
    row = blocks.cu_q_blocks[seq] + position // geom.block_size - blocks.first_block[seq]
    index = jnp.clip(row * geom.block_size + position % geom.block_size, 0,
                     block_rows.shape[0] - 1)
    picked = block_rows[index]
    live = live.reshape(-1, *(1,) * (picked.ndim - 1))
    return jnp.where(live, picked, jnp.zeros((), picked.dtype))
