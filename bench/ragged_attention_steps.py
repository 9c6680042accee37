"""Random inputs of a ragged serving step's attention stage (`xattn_jax.ragged`): prefill
chunks and decode rows packed in one q over one paged cache, with the step's layout and a
random block mask, for the Mosaic ragged attention's tests and GPU check
(`tests/test_ragged_attention.py`, `bench.ragged_attention_check`).

A step's cache pages are drawn in a shuffled order; SPARE_PAGES more hold NaN and fill the
page-table entries past each slot's last page in use, so that a kernel reading past a
sequence's keys shows. Slots from num_seqs on hold lengths of their
own (ignored by the call), and q's rows past the live sequences' hold data (their output
must be zero).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from xattn_jax.geometry import cdiv
from xattn_jax.ragged.geometry import RaggedGeometry
from xattn_jax.ragged.layout import RaggedBlocks, ragged_blocks

SPARE_PAGES = 2  # pages of NaN beyond those the sequences use


@dataclasses.dataclass(frozen=True)
class RaggedStep:
    """A step's shapes and lengths. Slot s of the first len(q_lens) has q_lens[s] queries,
    the last of its kv_lens[s] keys; slots from `num_seqs` (default: all given) on are
    ignored by the call, slots past the given ones are empty. T = `tokens` rows of q (at
    least the live sequences' queries), S = `seqs` slots; the mask keeps each (head,
    query block, key block) with probability `density`."""

    id: str
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    tokens: int
    seqs: int
    q_heads: int
    kv_heads: int
    head_dim: int
    page_size: int
    pages_per_seq: int
    block_size: int = 128
    fused: bool = False
    dtype: object = jnp.bfloat16
    density: float = 0.5
    num_seqs: int | None = None

    @property
    def live(self) -> int:
        return len(self.q_lens) if self.num_seqs is None else self.num_seqs

    def geom(self) -> RaggedGeometry:
        pages = self.seqs * self.pages_per_seq + SPARE_PAGES
        return RaggedGeometry(
            tokens=self.tokens, seqs=self.seqs, q_heads=self.q_heads,
            kv_heads=self.kv_heads, head_dim=self.head_dim, value_dim=self.head_dim,
            num_pages=pages, page_size=self.page_size, pages_per_seq=self.pages_per_seq,
            block_size=self.block_size, stride=8, fused=self.fused)


class StepArrays(NamedTuple):
    """A step's inputs: q `[T, Hq, D]`; k, v `[num_pages, page_size, Hkv, D]` (fused: v
    None and k `[num_pages, page_size, Hkv, 2, D]`); page_indices int32 `[S,
    pages_per_seq]`; mask bool `[Hq, QB, KB]`; the layout and the geometry."""

    q: jax.Array
    k: jax.Array
    v: jax.Array | None
    page_indices: jax.Array
    mask: jax.Array
    blocks: RaggedBlocks
    geom: RaggedGeometry


def _page_table(rng: np.random.Generator, step: RaggedStep, geom: RaggedGeometry):
    """int32 `[S, pages_per_seq]`: each given slot's pages in use drawn without
    replacement from the first S * pages_per_seq pages, the other entries spare pages."""
    spare = np.arange(geom.num_pages - SPARE_PAGES, geom.num_pages)
    table = rng.choice(spare, size=(step.seqs, step.pages_per_seq)).astype(np.int32)
    order = iter(rng.permutation(step.seqs * step.pages_per_seq))
    for slot, kv_len in enumerate(step.kv_lens):
        for entry in range(cdiv(kv_len, step.page_size)):
            table[slot, entry] = next(order)
    return table


def step_arrays(step: RaggedStep, rng: np.random.Generator) -> StepArrays:
    """Random inputs of `step` drawn from `rng` (q and the cache on the default device,
    standard normal in step.dtype; NaN in the spare pages)."""
    geom = step.geom()
    given = len(step.q_lens)
    assert given <= step.seqs and sum(step.q_lens[:step.live]) <= step.tokens
    q_key, cache_key = jax.random.split(jax.random.PRNGKey(rng.integers(2**31)))
    q = jax.random.normal(q_key, (step.tokens, step.q_heads, step.head_dim), step.dtype)
    cache_shape = (geom.num_pages, step.page_size, step.kv_heads, 2, step.head_dim)
    cache = jax.random.normal(cache_key, cache_shape, step.dtype)
    cache = cache.at[-SPARE_PAGES:].set(jnp.nan)
    k, v = (cache, None) if step.fused else (cache[:, :, :, 0], cache[:, :, :, 1])
    cu_q_lens = np.zeros(step.seqs + 1, np.int32)
    cu_q_lens[1:given + 1] = np.cumsum(step.q_lens)
    cu_q_lens[given + 1:] = cu_q_lens[given]
    kv_lens = np.zeros(step.seqs, np.int32)
    kv_lens[:given] = step.kv_lens
    blocks = ragged_blocks(jnp.asarray(cu_q_lens), jnp.asarray(kv_lens),
                           jnp.int32(step.live), jnp.int32(0), geom)
    mask = jnp.asarray(
        rng.random((step.q_heads, geom.q_block_rows, geom.k_blocks)) < step.density)
    return StepArrays(q, k, v, jnp.asarray(_page_table(rng, step, geom)), mask, blocks,
                      geom)
