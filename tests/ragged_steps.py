"""Random ragged serving steps for the tests: packed queries, a paged cache, the step's
offsets, and each sequence's own contiguous q, k, v (to call `xattention` on)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from xattn_jax.geometry import cdiv


@dataclasses.dataclass
class Step:
    q: np.ndarray  # [T, Hq, D]
    k: np.ndarray  # [num_pages, page_size, Hkv, D]
    v: np.ndarray
    kv_lens: np.ndarray  # int32 [S]
    page_indices: np.ndarray  # int32 [S, pages_per_seq]
    cu_q_lens: np.ndarray  # int32 [S + 1]
    num_seqs: int
    lengths: list  # (q_len, kv_len) of each live sequence

    def fused(self) -> np.ndarray:
        """k and v as one cache `[num_pages, page_size, 2 Hkv, D]`, K head h at 2h."""
        both = np.stack([self.k, self.v], axis=3)  # [P, page, Hkv, 2, D]
        return both.reshape(*self.k.shape[:2], -1, self.k.shape[3])

    def sequence(self, s: int):
        """Sequence s's q `[1, Hq, q_len, D]`, k and v `[1, Hkv, kv_len, D]`."""
        q_len, kv_len = self.lengths[s]
        rows = slice(self.cu_q_lens[s], self.cu_q_lens[s] + q_len)
        position = np.arange(kv_len)
        page = self.page_indices[s, position // self.k.shape[1]]
        slot = position % self.k.shape[1]

        def contiguous(cache):
            return cache[page, slot].transpose(1, 0, 2)[None]

        return self.q[rows].transpose(1, 0, 2)[None], contiguous(self.k), contiguous(self.v)

    def args(self, **overrides):
        """The positional arguments of `ragged_xattention`."""
        fields = dict(q=self.q, k=self.k, v=self.v, kv_lens=self.kv_lens,
                      page_indices=self.page_indices, cu_q_lens=self.cu_q_lens,
                      num_seqs=self.num_seqs)
        fields.update(overrides)
        return tuple(fields.values())


def make_step(rng: np.random.Generator, lengths, *, q_heads=4, kv_heads=2, head_dim=16,
              page_size=16, pages_per_seq=None, spare_slots=0, spare_tokens=0,
              shared_prefix_pages=0, dtype=np.float32, scale=1.5) -> Step:
    """A step of the live sequences `lengths` [(q_len, kv_len)], `spare_slots` empty
    sequence slots after them and `spare_tokens` unused rows of q. Pages are shuffled;
    with shared_prefix_pages, sequences 0 and 1 share their first pages (and keys)."""
    pages_per_seq = pages_per_seq or max(cdiv(kv, page_size) for _, kv in lengths) + 1
    seqs = len(lengths) + spare_slots
    num_pages = seqs * pages_per_seq + 2
    k = rng.standard_normal((num_pages, page_size, kv_heads, head_dim)) * scale
    v = rng.standard_normal((num_pages, page_size, kv_heads, head_dim))
    table = rng.permutation(num_pages)[:seqs * pages_per_seq].reshape(seqs, pages_per_seq)
    if shared_prefix_pages and len(lengths) > 1:
        table[1, :shared_prefix_pages] = table[0, :shared_prefix_pages]
    tokens = sum(q for q, _ in lengths) + spare_tokens
    q = rng.standard_normal((max(tokens, 1), q_heads, head_dim)) * scale
    q_lens = [ql for ql, _ in lengths] + [0] * spare_slots
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    kv = [kl for _, kl in lengths] + [0] * spare_slots
    cast = (lambda x: np.asarray(jnp.asarray(x, dtype))) if dtype != np.float32 else \
        (lambda x: x.astype(np.float32))
    return Step(q=cast(q), k=cast(k), v=cast(v), kv_lens=np.asarray(kv, np.int32),
                page_indices=table.astype(np.int32), cu_q_lens=cu.astype(np.int32),
                num_seqs=len(lengths), lengths=list(lengths))


def random_lengths(rng: np.random.Generator, count: int, *, block_size: int,
                   max_kv: int) -> list:
    """(q_len, kv_len) pairs of every kind a step mixes: decode rows, short chunks,
    chunks on and off block boundaries, whole prompts, empty sequences."""
    out = []
    for _ in range(count):
        kind = rng.integers(0, 5)
        kv_len = int(rng.integers(1, max_kv + 1))
        if kind == 0:
            q_len = 1
        elif kind == 1:
            q_len = int(rng.integers(0, min(block_size, kv_len) + 1))
        elif kind == 2 and kv_len >= block_size:  # aligned start
            q_len = kv_len - block_size * int(rng.integers(0, kv_len // block_size))
        else:
            q_len = int(rng.integers(min(block_size, kv_len), kv_len + 1))
        out.append((q_len, kv_len))
    return out
