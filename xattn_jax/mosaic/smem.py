"""Shared memory of a Mosaic GPU kernel as Mosaic GPU counts it, so that a plan is refused
by our check, with a message, before the compiler refuses it.

Fitted on the H200 (jax 0.11.2): every scratch buffer rounded up to 1 KiB, plus 2 KiB,
plus 8 bytes per barrier. It gives exactly the byte counts of the four plans the compiler
refused there (attention with 3 stages and lse: 232568; block sums with 6 stages at
blocks 1024 and 512: 232600, 233624, 233624).
"""

from __future__ import annotations

from collections.abc import Iterable

from xattn_jax.geometry import cdiv

SMEM_BYTES = 227 * 1024  # usable dynamic shared memory per CTA on sm_90
SMEM_ALIGN = 1024
SMEM_RESERVE = 2048
BARRIER_BYTES = 8


def smem_bytes(buffers: Iterable[int], barriers: int) -> int:
    """Bytes of shared memory a kernel with these scratch buffers (bytes each) and this
    many barriers asks for."""
    return (sum(cdiv(size, SMEM_ALIGN) * SMEM_ALIGN for size in buffers) + SMEM_RESERVE
            + BARRIER_BYTES * barriers)
