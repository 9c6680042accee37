"""What the two Mosaic GPU kernels (`attention.kernel`; `estimate.kernel`, the
estimate's statistics) share: the warpgroup axis, their registers per thread, and the shared-memory
layout of their wgmma operand tiles. Imports Mosaic GPU."""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

WG_AXIS = "wg"  # the kernels' warpgroup axis: consumers first, the producer last
# registers per thread, raised in the consumer warpgroups and lowered in the producer's
# (docs/tuning.md: mosaic-warpgroup-registers)
CONSUMER_REGISTERS, PRODUCER_REGISTERS = 232, 40
SWIZZLE_BYTES = 128  # wgmma's widest shared-memory swizzle (docs/tuning.md: mosaic-ring)


def tile_transforms(dtype) -> tuple:
    """Shared-memory layout of a `[rows, columns]` wgmma operand tile of `dtype`."""
    columns = SWIZZLE_BYTES // jnp.dtype(dtype).itemsize
    return (plgpu.TilingTransform((8, columns)), plgpu.SwizzleTransform(SWIZZLE_BYTES))
