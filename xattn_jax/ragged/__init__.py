"""XAttention for a ragged serving step: many sequences' chunks and decode rows packed in
one call over one paged cache (docs/estimate.md, "Ragged steps")."""

from xattn_jax.ragged.api import RaggedMask, ragged_xattention

__all__ = ["RaggedMask", "ragged_xattention"]
