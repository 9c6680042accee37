"""The one format for a call's shapes, and the named shapes the benchmarks and the tests
share (`bench.estimate`, `bench.chunked`, `bench.ab`, `tests/cases.py`,
`tests/test_gpu_large.py`).

A `Shape` is q `[batch, q_heads, q_len, head_dim]`, k `[batch, kv_heads, k_len,
head_dim]` and the estimate's layout (stride, block size, causal flag, dtype); for the
attention, v `[batch, kv_heads, k_len, v_head_dim]` (None: v_head_dim = head_dim).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import strided_flops
from xattn_jax.geometry import Geometry


@dataclasses.dataclass(frozen=True)
class Shape:
    id: str
    batch: int
    q_heads: int
    kv_heads: int
    q_len: int
    k_len: int
    head_dim: int
    stride: int
    block_size: int
    causal: bool
    dtype: object = jnp.float32
    v_head_dim: int | None = None

    @property
    def q_shape(self) -> tuple[int, int, int, int]:
        return self.batch, self.q_heads, self.q_len, self.head_dim

    @property
    def k_shape(self) -> tuple[int, int, int, int]:
        return self.batch, self.kv_heads, self.k_len, self.head_dim

    @property
    def v_shape(self) -> tuple[int, int, int, int]:
        return self.batch, self.kv_heads, self.k_len, self.v_head_dim or self.head_dim

    def geom(self) -> Geometry:
        return Geometry(self.batch, self.q_heads, self.kv_heads, self.q_len, self.k_len,
                        self.head_dim, self.stride, self.block_size)

    def strided_flops(self) -> float:
        """FLOPs of the strided product (`common.strided_flops`) for every sequence."""
        return self.batch * strided_flops(self.q_heads, self.q_len, self.k_len, self.stride,
                                          self.head_dim, self.causal)

    def random_qk(self, seed: int) -> tuple[jax.Array, jax.Array]:
        """Standard normal q and k of this shape and dtype (on the default device)."""
        kq, kk = jax.random.split(jax.random.PRNGKey(seed))
        q = jax.random.normal(kq, self.q_shape, jnp.float32).astype(self.dtype)
        k = jax.random.normal(kk, self.k_shape, jnp.float32).astype(self.dtype)
        return q, k


def _h200(name: str, kv_heads: int, q_len: int, k_len: int, block_size: int,
          causal: bool) -> Shape:
    """A benchmark shape of the H200 runs: bf16, one sequence, 32 query heads of 128."""
    return Shape(name, 1, 32, kv_heads, q_len, k_len, 128, 8, block_size, causal,
                 jnp.bfloat16)


BLOCK_SIZES = (64, 128, 256, 512, 1024, 2048, 4096)
GQA_CASE = "gqa-64k-causal"

ESTIMATE = {  # bench.estimate: xattn_estimate, Lq = Lk
    **{f"noncausal-64k-b{b}": _h200(f"noncausal-64k-b{b}", 32, 65536, 65536, b, False)
       for b in BLOCK_SIZES},
    "causal-32k": _h200("causal-32k", 32, 32768, 32768, 128, True),
    "causal-64k": _h200("causal-64k", 32, 65536, 65536, 128, True),
    "causal-128k": _h200("causal-128k", 32, 131072, 131072, 128, True),
    "noncausal-128k": _h200("noncausal-128k", 32, 131072, 131072, 128, False),
    "causal-1m": _h200("causal-1m", 32, 1 << 20, 1 << 20, 128, True),
    GQA_CASE: _h200(GQA_CASE, 8, 65536, 65536, 128, True),
    **{f"noncausal-{n}-b{b}": _h200(f"noncausal-{n}-b{b}", 32, length, length, b, False)
       for length, n in ((16384, "16k"), (32768, "32k")) for b in BLOCK_SIZES},
}

# bench.chunked: a 4096-query chunk over a cache (kv_block_scores at estimate blocks of
# 1024, KV blocks of 4096, then select_kv_blocks), GQA 32:8, non-causal
CHUNK = {f"chunk4096-ctx{n}": _h200(f"chunk4096-ctx{n}", 8, 4096, length, 1024, False)
         for length, n in ((16384, "16k"), (32768, "32k"), (65536, "64k"),
                           (131072, "128k"))}


def paged_pools(rng: np.random.Generator, page_size: int, *caches: jax.Array,
                spare_pages: int = 1, spare=0.0):
    """Contiguous caches `[B, H, L, last]` (L a multiple of page_size; their last
    dimensions may differ) as page pools `[B L / page_size + spare_pages, page_size, H,
    last]` sharing one block table int32 `[B, L / page_size]` drawn from `rng` (pages in a
    shuffled order); the spare pages hold `spare`. Returns (*pools, table)."""
    b, h, length = caches[0].shape[:3]
    per_seq = length // page_size
    pool_size = b * per_seq + spare_pages
    table = rng.permutation(pool_size)[:b * per_seq].reshape(b, per_seq)
    pools = []
    for x in caches:
        pages = x.reshape(b, h, per_seq, page_size, -1).transpose(0, 2, 3, 1, 4)
        pool = jnp.full((pool_size,) + pages.shape[2:], spare, x.dtype)
        pools.append(pool.at[table.reshape(-1)].set(pages.reshape(-1, *pages.shape[2:])))
    return (*pools, jnp.asarray(table, jnp.int32))
