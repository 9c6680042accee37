"""FlexAttention (torch) as the peer of a ragged step's attention in `bench.serving_step`:
the step's mask (`RaggedMask.blocks`) as one flex BlockMask over the step laid out block
by block, the call, and the check that it computes what ours computes.

Layout (flex takes one q and one k, v, batch 1, no page table):
- queries: mask row r (sequence s's absolute query block I) owns flex rows r bs .. r bs +
  bs - 1, each query at its offset in the block; rows outside the chunk are zero;
- keys and values: sequence s owns key blocks kb0[s] .. kb0[s] + ceil(kv_len / bs) - 1,
  its keys in order, zero past kv_len, gathered from the paged cache outside the timed
  region.
Row r's kept key block J is flex key block kb0[s] + J: a full block before the diagonal,
a partial one on it, where mask_mod applies causality by position (and, as `bench.flex`
explains, the eager path of a smoke run applies mask_mod alone, so it holds the block
mask too). Decode rows take a query block each, as they take a CTA in our kernel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from bench import flex
from xattn_jax.ragged.geometry import RaggedGeometry
from xattn_jax.ragged.layout import RaggedBlocks
from xattn_jax.reference.ragged import gather_rows


def _key_layout(blocks: RaggedBlocks, geom: RaggedGeometry):
    """Per sequence, int64 numpy: its key blocks and its first flex key block kb0."""
    kv = np.asarray(blocks.kv_lens).astype(np.int64)
    counts = -(-kv // geom.block_size)
    return counts, np.concatenate([[0], np.cumsum(counts)[:-1]])


def packed_inputs(q, k, v, page_indices, blocks: RaggedBlocks, geom: RaggedGeometry):
    """The flex layout of a step: q `[1, Hq, QB bs, D]`, k and v `[1, Hkv, NK bs, D]` (JAX
    arrays in the step's dtype), from q `[T, Hq, D]` and paged caches."""
    bs = geom.block_size
    position = np.asarray(blocks.row_block)[:, None] * bs + np.arange(bs)  # [QB, bs]
    seq = np.array(blocks.row_seq)  # writable: torch takes it
    first = np.asarray(blocks.first_position)[seq][:, None]
    kv = np.asarray(blocks.kv_lens)[seq][:, None]
    real = (position >= first) & (position < kv) & np.asarray(blocks.row_live)[:, None]
    token = np.clip(np.asarray(blocks.q_starts)[seq][:, None] + position - first, 0,
                    geom.tokens - 1)
    rows = jnp.where(jnp.asarray(real.reshape(-1))[:, None, None], q[token.reshape(-1)], 0)
    counts, _ = _key_layout(blocks, geom)
    table = np.asarray(page_indices)
    keys = np.concatenate([np.arange(c * bs) for c in counts])  # positions, sequence by sequence
    owner = np.repeat(np.arange(len(counts)), counts * bs)
    page = table[owner, np.minimum(keys // geom.page_size, table.shape[1] - 1)]
    inside = jnp.asarray(keys < np.asarray(blocks.kv_lens)[owner])[:, None, None]

    def gathered(cache):  # [NK bs, Hkv, D] -> [1, Hkv, NK bs, D]
        x = jnp.where(inside, cache[page, keys % geom.page_size], 0)
        return x.transpose(1, 0, 2)[None]

    return rows.transpose(1, 0, 2)[None], gathered(k), gathered(v)


def to_block_mask(mask: np.ndarray, blocks: RaggedBlocks, geom: RaggedGeometry, device):
    """The flex BlockMask of a step's bool mask `[Hq, QB, KB]` in `packed_inputs`' layout,
    on torch `device`, and the flex key blocks it must list: bool `[Hq, QB, NK]`."""
    import torch
    from torch.nn.attention.flex_attention import BlockMask

    bs = geom.block_size
    counts, kb0 = _key_layout(blocks, geom)
    seq = np.array(blocks.row_seq)  # writable: torch takes it
    row_block = np.asarray(blocks.row_block)
    local = np.arange(mask.shape[-1])
    kept = (mask & (local[None, :] <= row_block[:, None])
            & (local[None, :] < counts[seq][:, None]) & np.asarray(blocks.row_live)[:, None])
    flat = np.zeros((*mask.shape[:2], int(counts.sum())), bool)  # [Hq, QB, NK]
    h, r, j = np.nonzero(kept)
    flat[h, r, kb0[seq[r]] + j] = True
    diagonal = np.zeros_like(flat)
    diagonal[h, r, kb0[seq[r]] + j] = j == row_block[r]

    key_seq = torch.as_tensor(np.repeat(np.arange(len(counts)), counts), device=device)
    key_start = torch.as_tensor(np.repeat(kb0, counts) * bs, device=device)  # its first key
    kv_lens = torch.as_tensor(np.array(blocks.kv_lens), device=device)
    row_seq, row_start = (torch.as_tensor(x, device=device) for x in (seq, row_block * bs))
    kept_blocks = torch.as_tensor(flat, device=device)

    def mask_mod(b, head, q_idx, kv_idx):
        r, kb = q_idx // bs, kv_idx // bs
        s = key_seq[kb]
        key = kv_idx - key_start[kb]  # key position in its sequence
        return ((row_seq[r] == s) & (key <= row_start[r] + q_idx % bs) & (key < kv_lens[s])
                & kept_blocks[head, r, kb])

    def lists(chosen):  # each row's count, then its block indices, the chosen ones first
        chosen = torch.as_tensor(chosen, device=device)[None]
        order = torch.argsort((~chosen).to(torch.int8), dim=-1, stable=True)
        return chosen.sum(-1, dtype=torch.int32), order.to(torch.int32)

    block_mask = BlockMask.from_kv_blocks(
        *lists(diagonal), *lists(flat & ~diagonal), BLOCK_SIZE=bs, mask_mod=mask_mod,
        seq_lengths=(mask.shape[1] * bs, flat.shape[-1] * bs))
    return block_mask, flat


def torch_device(array: jax.Array):
    """The torch device of a JAX array's memory."""
    from xattn_torch_bridge import to_torch

    return to_torch(array).device


def peer_call(q, k, v, page_indices, mask, blocks: RaggedBlocks, geom: RaggedGeometry,
              compiled: bool):
    """(a function of no arguments running flex on the step, one mapping its output to
    the step's `[T, Hq, D]` JAX array, and the cells its block lists get wrong: which
    the compiled kernel reads and the eager path ignores) for the step's q, paged k, v
    and bool mask `[Hq, QB, KB]`."""
    from xattn_torch_bridge import to_torch, to_jax

    fq, fk, fv = packed_inputs(q, k, v, page_indices, blocks, geom)
    tq, tk, tv = (to_torch(x) for x in (fq, fk, fv))
    if tk.shape[1] != tq.shape[1] and not flex.has_gqa():  # outside the timed region
        tk, tv = (x.repeat_interleave(tq.shape[1] // tk.shape[1], dim=1) for x in (tk, tv))
    block_mask, listed = to_block_mask(np.asarray(mask), blocks, geom, tq.device)
    wrong = int(np.sum(block_mask.to_dense().bool().cpu().numpy()[0] != listed))
    call = flex.attention_call(tq, tk, tv, block_mask, compiled)

    def unpacked(out):  # [1, Hq, QB bs, D] -> [T, Hq, D]
        return gather_rows(to_jax(out.contiguous())[0].transpose(1, 0, 2), blocks, geom)

    return call, unpacked, wrong
