"""Pallas Mosaic GPU kernels for Hopper (sm_90): block-sparse attention on the estimate's
mask (`xattn_jax.mosaic.attention`; a ragged serving step's in
`xattn_jax.mosaic.attention.ragged_attention`) and the estimate's fused block sums
(`xattn_jax.mosaic.estimate`), run by the Mosaic backend (`backend`: impl="mosaic", and
"auto" on Hopper).

Importing this package never imports Mosaic GPU (it fails to import on some jax/CPU
installs); `available()` says whether the kernels can run.
"""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp

HOPPER_MAJOR = 9
SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))  # both kernels' operands
# The Mosaic GPU names the kernels use; an older jax lacking one cannot run it.
_MOSAIC_API = ("kernel", "CompilerParams", "SMEM", "Barrier", "ACC", "Layout",
               "TilingTransform", "SwizzleTransform", "copy_gmem_to_smem",
               "copy_smem_to_gmem", "wait_smem_to_gmem", "commit_smem", "barrier_arrive",
               "barrier_wait", "wgmma", "wgmma_wait", "layout_cast", "broadcasted_iota",
               "set_max_registers", "load", "inline_mgpu", "RefType")


def _device_reason(device) -> str | None:
    capability = getattr(device, "compute_capability", None)
    if device.platform != "gpu" or capability is None:
        return f"found {device.platform}"
    if str(capability).split(".")[0] != str(HOPPER_MAJOR):
        return f"found {device.device_kind} (compute capability {capability})"
    return None


def available(device=None) -> str | None:
    """None if the Mosaic GPU kernels can run on `device` (default: jax's first device),
    else a short reason: they need an NVIDIA Hopper GPU (compute capability 9.x) and a jax
    whose `jax.experimental.pallas.mosaic_gpu` imports and has the API they use."""
    device = jax.devices()[0] if device is None else device
    reason = _device_reason(device)
    if reason is not None:
        return ("impl='mosaic' needs an NVIDIA Hopper GPU (compute capability "
                f"{HOPPER_MAJOR}.x); {reason}")
    try:
        plgpu = importlib.import_module("jax.experimental.pallas.mosaic_gpu")
    except Exception as error:  # any import failure means the backend is unusable
        return ("impl='mosaic' needs jax.experimental.pallas.mosaic_gpu; "
                f"import failed: {error!r}")
    missing = [name for name in _MOSAIC_API if not hasattr(plgpu, name)]
    if missing:
        return (f"impl='mosaic' needs a newer jax (found {jax.__version__}): "
                f"jax.experimental.pallas.mosaic_gpu lacks {', '.join(missing)}")
    return None
