"""xattn-jax: the XAttention block-sparse estimate as jit-compiled JAX with Pallas kernels.

Public API: `xattn_estimate` (the whole estimate), and its stages `strided_scores`,
`select_blocks`; `xattn_jax.reference` is the plain-JAX source of truth.
"""

from xattn_jax.api import select_blocks, strided_scores, xattn_estimate
from xattn_jax.geometry import Geometry

__all__ = ["Geometry", "select_blocks", "strided_scores", "xattn_estimate"]
