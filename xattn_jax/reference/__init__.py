"""The plain-JAX reference: the source of truth every kernel is tested against.

`estimate`: sections 1-4 of docs/estimate.md (strided scores, softmax block sums, the
threshold selection). `attention`: section 6 (block-sparse attention on the mask).
`sampled_rows`: the sampled rows' block scores ("Sampled rows"). `paged`: a paged KV
cache read as contiguous keys.
"""

from xattn_jax.reference.attention import block_sparse_attention
from xattn_jax.reference.estimate import (block_sums, forced_and_allowed, select_blocks,
                                          softmax_block_sums, strided_scores, take_descending,
                                          visible)
from xattn_jax.reference.paged import gather_pages

__all__ = ["block_sparse_attention", "block_sums", "forced_and_allowed", "gather_pages",
           "select_blocks", "softmax_block_sums", "strided_scores", "take_descending",
           "visible"]
