"""The static plan of one Mosaic GPU block-sum call (docs/estimate.md sections 1-3) on
Hopper: tiles, pipeline depth, shared memory and scratch. Plain Python (no Mosaic GPU
import), so that a caller can ask `unsupported_reason` anywhere.

The kernel (`xattn_jax.mosaic.tile_stats`) computes the strided scores as one deep-K
product, K = S * D: a CTA holds `ROWS` reshaped query rows of one (batch, query head)
resident in shared memory (all S stride members, `S * D / block_d` chunks of
`ROWS x block_d`) and streams key chunks of `block_k` reshaped key columns x `block_d`
head-dim columns (one stride member each) through a ring of `stages` slots. Its two
consumer warpgroups take the CTA's key tiles in turns (warpgroup w the tiles t = w mod 2),
so that one's row statistics (`one_pass` of the Triton backend: max, per-unit exp2 sums
and totals per key tile) overlap the other's matrix products. With `cluster` = c > 1, the
CTAs of c consecutive row tiles form a cluster and share each key chunk (TMA multicast:
each loads 1/c of it), dividing the key traffic from L2 by c: alone, a CTA reads 2 bytes
of keys per ROWS x 2 = 128 flops, 64 flops per byte, which may bound it below the tensor
cores (to be measured).

Tuned values are first guesses, to be measured on the H200 with
`python -m bench.mosaic_estimate_check`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from xattn_jax.geometry import Geometry, cdiv
from xattn_jax.mosaic.plan import SUPPORTED_DTYPES
from xattn_jax.mosaic.smem import SMEM_BYTES, smem_bytes
from xattn_jax.row_statistics import UnitSums
from xattn_jax.triton.plan import ONE_PASS_WHOLE_CALL_BYTES

ROWS = 64  # reshaped query rows per CTA: one wgmma M tile, shared by both consumers
CONSUMERS = 2  # consumer warpgroups, taking the key tiles in turns
BLOCK_K = 128  # reshaped key columns per key tile (wgmma N); to be measured
BLOCK_D = 64  # head-dim columns per pipeline step: one 128-byte swizzled bf16 row
MAX_STAGES = 8  # the deepest key ring the default plan takes; to be measured
MIN_STAGES = 2
CLUSTER = 1  # CTAs sharing key chunks (TMA multicast); 2 and 4 to be measured
CLUSTERS = (1, 2, 4)
# Timing variants that leave one stage of the kernel out (`bench.mosaic_estimate_check`;
# their results are not block sums): the consumers' matrix products (scores read as 0),
# or the statistics past the row maxima.
LEAVE_OUT = ("product", "statistics")
HEAD_DIMS = (64, 128)
MAX_BLOCK_K = 256  # a consumer's float32 accumulator: block_k / 2 registers per thread
COLUMN_TILE = 8  # the wgmma register layout's column tile: unit sums slice at this grain
STAT_BYTES = 4  # float32 statistics
# Scratch bound: the statistics of one call, as the Triton one-pass kernel's whole call
# (row and head steps are not implemented yet: larger calls are refused)
MAX_SCRATCH_BYTES = ONE_PASS_WHOLE_CALL_BYTES


@dataclasses.dataclass(frozen=True)
class EstimatePlan(UnitSums):
    """Tiles of one call. Hashable: a static jit argument.

    block_k: reshaped key columns per key tile; block_d: head-dim columns per pipeline
    step; stages: key chunks of `block_k x block_d` in flight (the ring's slots);
    cluster: CTAs of consecutive row tiles sharing the key chunks; leave_out: None, or
    a stage of LEAVE_OUT that the kernel skips (timing only).
    """

    geom: Geometry
    block_k: int
    block_d: int
    stages: int
    cluster: int = CLUSTER
    leave_out: str | None = None

    @property
    def row_tiles(self) -> int:
        """CTAs per (batch, query head): whole clusters."""
        return cdiv(self.geom.q_rows, ROWS * self.cluster) * self.cluster

    @property
    def padded_rows(self) -> int:
        return self.row_tiles * ROWS

    @property
    def key_tiles(self) -> int:
        return cdiv(self.geom.k_cols, self.block_k)

    @property
    def padded_cols(self) -> int:
        return self.key_tiles * self.block_k

    @property
    def head_parts(self) -> int:
        """Pipeline steps per stride member."""
        return self.geom.head_dim // self.block_d

    @property
    def steps_per_tile(self) -> int:
        """Pipeline steps (key chunks) of one key tile: S x head_parts."""
        return self.geom.stride * self.head_parts

    def smem_bytes(self, itemsize: int) -> int:
        """Shared memory of one CTA as Mosaic GPU counts it (`mosaic.smem`): resident
        queries, the key ring, one statistics buffer per consumer, and the barriers of
        `tile_stats.tile_stats` (queries ready; per consumer and slot, a chunk ready; per
        slot, the slot free)."""
        geom = self.geom
        queries = ROWS * geom.stride * geom.head_dim * itemsize
        ring = self.stages * self.block_k * self.block_d * itemsize
        stats = CONSUMERS * self.stat_planes * ROWS * STAT_BYTES
        return smem_bytes([queries, ring, stats],
                          barriers=1 + CONSUMERS * self.stages + self.stages)

    @property
    def scratch_bytes(self) -> int:
        """The statistics array: `[B, Hq, key_tiles, stat_planes, padded_rows]` floats."""
        geom = self.geom
        return (geom.batch * geom.q_heads * self.key_tiles * self.stat_planes
                * self.padded_rows * STAT_BYTES)


def unsupported_reason(geom: Geometry, dtype, *, key_len: bool = False,
                       paged: bool = False) -> str | None:
    """Why the Mosaic block-sum kernel cannot run this call (None if it can).

    It needs q and k in bfloat16 or float16, D in HEAD_DIMS, block_size a multiple of
    COLUMN_TILE x stride, all Lk keys in use (no key_len) in a contiguous k (no paged
    cache), the resident queries (ROWS x S x D) and a ring of MIN_STAGES key chunks in
    shared memory, and statistics within MAX_SCRATCH_BYTES. Any Lq and Lk otherwise
    (padded to whole tiles by the caller). The Triton backend takes everything else.
    """
    dtype = jnp.dtype(dtype)
    if dtype not in SUPPORTED_DTYPES:
        return f"impl='mosaic' needs q and k in bfloat16 or float16; got {dtype}"
    if geom.head_dim not in HEAD_DIMS:
        return f"impl='mosaic' needs head_dim in {HEAD_DIMS}; got {geom.head_dim}"
    if geom.block_rows % COLUMN_TILE:
        return (f"impl='mosaic' needs block_size a multiple of {COLUMN_TILE} x stride = "
                f"{COLUMN_TILE * geom.stride}; got {geom.block_size}")
    if key_len or paged:
        return ("impl='mosaic' block sums read a contiguous k with all keys in use "
                "(no key_len, no paged cache) in this version")
    plan = EstimatePlan(geom, BLOCK_K, BLOCK_D, MIN_STAGES)
    smem = plan.smem_bytes(dtype.itemsize)
    if smem > SMEM_BYTES:
        return (f"impl='mosaic' holds {ROWS} query rows x stride {geom.stride} x head_dim "
                f"{geom.head_dim} in shared memory: {smem} bytes with the key ring, over "
                f"{SMEM_BYTES}")
    if plan.scratch_bytes > MAX_SCRATCH_BYTES:
        return (f"impl='mosaic' block sums need {plan.scratch_bytes} bytes of statistics, "
                f"over {MAX_SCRATCH_BYTES} (row steps are not implemented yet)")
    return None


def estimate_plan(geom: Geometry, dtype, *, block_k: int | None = None,
                  stages: int | None = None, cluster: int | None = None,
                  leave_out: str | None = None) -> EstimatePlan:
    """The plan of one call. block_k (a multiple of 64, at most MAX_BLOCK_K), stages and
    cluster (in CLUSTERS) override the defaults (tuning runs); the default stages are the
    most that fit in shared memory, at most MAX_STAGES. leave_out: a timing variant
    (LEAVE_OUT). Raises ValueError for arguments the kernel does not take
    (`unsupported_reason`) and overrides that do not fit."""
    reason = unsupported_reason(geom, dtype)
    if reason is not None:
        raise ValueError(reason)
    if leave_out not in (None, *LEAVE_OUT):
        raise ValueError(f"leave_out must be None or one of {LEAVE_OUT}; got {leave_out!r}")
    cluster = CLUSTER if cluster is None else cluster
    if cluster not in CLUSTERS:
        raise ValueError(f"cluster must be one of {CLUSTERS}; got {cluster}")
    block_k = BLOCK_K if block_k is None else block_k
    if block_k % 64 or not 64 <= block_k <= MAX_BLOCK_K:
        raise ValueError(f"block_k must be a multiple of 64 in [64, {MAX_BLOCK_K}]; got "
                         f"{block_k}")
    itemsize = jnp.dtype(dtype).itemsize
    if stages is None:
        fits = [n for n in range(MIN_STAGES, MAX_STAGES + 1)
                if EstimatePlan(geom, block_k, BLOCK_D, n, cluster).smem_bytes(itemsize)
                <= SMEM_BYTES]
        stages = fits[-1] if fits else MIN_STAGES
    if stages < MIN_STAGES:
        raise ValueError(f"stages must be at least {MIN_STAGES}; got {stages}")
    plan = EstimatePlan(geom, block_k, BLOCK_D, stages, cluster, leave_out)
    smem = plan.smem_bytes(itemsize)
    if smem > SMEM_BYTES:
        raise ValueError(f"plan {plan} needs {smem} bytes of shared memory; the limit is "
                         f"{SMEM_BYTES}")
    if plan.scratch_bytes > MAX_SCRATCH_BYTES:
        raise ValueError(f"plan {plan} needs {plan.scratch_bytes} bytes of statistics; "
                         f"the limit is {MAX_SCRATCH_BYTES}")
    return plan


def visible_tiles(plan: EstimatePlan, causal: bool, row0):
    """Key tiles 0 .. n - 1 hold a column some row of the row tile starting at `row0`
    (a Python int, a traced int32 scalar or an int32 array) may see (section 2: column
    j <= row + (Lk - Lq) / S with causal, j < k_cols always). Shared by the kernel (the
    tiles a cluster computes: those of its last row tile) and the epilogue (which
    statistics are real)."""
    geom = plan.geom
    row0 = jnp.asarray(row0, jnp.int32)
    if not causal:
        return jnp.full(row0.shape, plan.key_tiles, jnp.int32)
    last_col = jnp.minimum(row0 + (ROWS - 1 + geom.row_offset), geom.k_cols - 1)
    return _div(last_col, plan.block_k) + 1


def unmasked_tiles(plan: EstimatePlan, causal: bool, row0):
    """Key tiles 0 .. n - 1 every row of the row tile starting at `row0` sees in full:
    the kernel masks only the later ones."""
    geom = plan.geom
    row0 = jnp.asarray(row0, jnp.int32)
    whole = geom.k_cols // plan.block_k
    if not causal:
        return jnp.full(row0.shape, whole, jnp.int32)
    return jnp.minimum(_div(row0 + (geom.row_offset + 1), plan.block_k), whole)


def _div(x, divisor: int):
    """x // divisor for x >= 0 (lax.div: jnp's floor division adds sign fix-ups)."""
    return jax.lax.div(x, jnp.int32(divisor))
