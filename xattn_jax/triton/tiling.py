"""Tile shapes and Triton launch parameters of the Pallas kernels, chosen by measurement.

`python -m bench.tune` measured these on an H200 (bench/results/tuning.md has the tables):
for 2-byte inputs 128 x 256 tiles with 8 warps, the head dim fed in steps of 64 columns
and 4 pipeline stages (192 KiB of shared memory) were the fastest of the variants tried,
1.1-1.15x over 128 x 128 tiles taking the whole head dim per step in 3 stages. float32
inputs need twice the shared memory per tile (a 64 x 64 tile with 2 stages asked for
256 KiB, over the H200's 227 KiB), so they take 32 x 32 tiles: float32 is the exactness
path, not the fast one. Head dims above 128 shrink the tile in proportion.

The one-pass kernel splits each row tile's key tiles among programs, `span` tiles each:
2 in causal calls (balances the triangle), 8 otherwise (measured: 8 beat all of a row's
at 64K), fewer where a short chunk of queries would otherwise leave the GPU with few
programs.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from xattn_jax.geometry import Geometry, next_pow2

_FAST = (128, 256, 8, 4, 64)  # rows, cols, num_warps, num_stages, depth for bf16 / f16
_EXACT = (32, 32, 4, 2, None)  # for float32
_MIN_SIDE = 16  # Triton's smallest dot operand side
_BASE_HEAD_DIM = 128
_SPAN, _CAUSAL_SPAN = 8, 2  # key tiles per one-pass program
_MIN_PROGRAMS = 1024  # one-pass grids smaller than this split the keys further


@dataclasses.dataclass(frozen=True)
class Tiling:
    """A program's tile (reshaped query rows x key columns, powers of two, >= 16 on GPU)
    and its Triton launch parameters."""

    rows: int = 64
    cols: int = 64
    num_warps: int = 4
    num_stages: int = 2
    span: int | None = None  # key tiles per one-pass program; None: all of a row's
    depth: int | None = None  # head-dim columns per pipeline step (power of two); None: all

    def __post_init__(self):
        if self.depth is not None and (self.depth < _MIN_SIDE or self.depth & (self.depth - 1)):
            raise ValueError(f"Tiling.depth must be None or a power of two >= {_MIN_SIDE}, "
                             f"got {self.depth}")

    def step_depth(self, geom: Geometry) -> int:
        """Head-dim columns per pipeline step for this geometry: `depth`, at most the head
        dim padded to a power of two (all of it when depth is None)."""
        return min(self.depth or next_pow2(geom.head_dim), next_pow2(geom.head_dim))

    def fine(self, geom: Geometry) -> int:
        """The internal block in reshaped rows: the largest divisor of block_rows that
        divides both tile sides."""
        return math.gcd(geom.block_rows, self.rows, self.cols)

    def key_tiles(self, geom: Geometry) -> int:
        return -(-geom.k_cols // self.cols)

    def key_span(self, geom: Geometry) -> int:
        """Key tiles per one-pass program."""
        return min(self.span or self.key_tiles(geom), self.key_tiles(geom))


def default_tiling(geom: Geometry, dtype, causal: bool = False) -> Tiling:
    """The measured tiling for inputs of `dtype` and the geometry's head_dim."""
    rows, cols, warps, stages, depth = _FAST if jnp.dtype(dtype).itemsize == 2 else _EXACT
    shrink = max(1, next_pow2(geom.head_dim) // _BASE_HEAD_DIM)
    tiling = Tiling(max(_MIN_SIDE, rows // shrink), max(_MIN_SIDE, cols // shrink), warps,
                    stages, depth=depth)
    row_programs = geom.batch * geom.q_heads * -(-geom.q_rows // tiling.rows)
    groups = -(-_MIN_PROGRAMS // row_programs)
    span = min(_CAUSAL_SPAN if causal else _SPAN, -(-tiling.key_tiles(geom) // groups))
    return dataclasses.replace(tiling, span=span)
