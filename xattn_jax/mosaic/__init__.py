"""Pallas Mosaic GPU kernels for NVIDIA Hopper GPUs (H100, H200).

`available(device)` says why they cannot run on a device (None where they can).
"""

from __future__ import annotations

import jax

HOPPER = "9"  # compute capability major version
TAKES_CACHE = False  # whether the attention kernel takes k_len and paged caches


def available(device: jax.Device | None = None) -> str | None:
    """None if Mosaic GPU kernels can run on `device` (default: JAX's default device),
    else what they need, as a sentence."""
    device = device or jax.devices()[0]
    capability = getattr(device, "compute_capability", "")
    if device.platform != "gpu" or not str(capability).startswith(HOPPER):
        return (f"impl='mosaic' needs an NVIDIA Hopper GPU (compute capability 9.x); the "
                f"inputs are on {device.device_kind} ({device.platform})")
    try:
        from jax.experimental.pallas import mosaic_gpu  # noqa: F401
    except ImportError as e:
        return f"impl='mosaic' needs jax.experimental.pallas.mosaic_gpu ({e})"
    return None
