"""The backends by name, and the one place where each call's `impl` is resolved.

- "reference": plain JAX (`xattn_jax.reference`); any device; every op.
- "triton": Pallas kernels on the Triton backend (`xattn_jax.triton`); NVIDIA GPUs, and
  elsewhere Pallas interpret mode (slow: for tests). The estimate's ops (the sampled
  rows' too); no attention.
- "mosaic": Pallas kernels on the Mosaic GPU backend (`xattn_jax.mosaic`); NVIDIA Hopper
  GPUs. Block-sparse attention and the estimate's block sums; the other estimate ops
  run the Triton kernels (its companion), and a ValueError names what else a call needs.
- "auto": the first backend of AUTO_ORDER that has the ops and runs compiled on the
  inputs' device, "mosaic" with `fallback`: for the estimate "mosaic" on Hopper (its
  block sums run the Triton kernel for the calls they do not take and for calls of
  fewer CTAs than `heuristics.auto_min_ctas`; docs/tuning.md: mosaic-auto-min-ctas),
  "triton" on other GPUs, "reference" elsewhere; for attention "mosaic" on Hopper (the
  calls its kernel does not take, by dtype, head dim, block size or page size, run on
  the reference), "reference" elsewhere.

The device is that of the first concrete `jax.Array` among the inputs; inside a trace
(a caller's `jax.jit`), where an input has no device yet, it is JAX's default backend
(or pass `device=`, or a backend resolved earlier).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax

from xattn_jax.backend import Backend
from xattn_jax.mosaic.backend import MosaicBackend
from xattn_jax.reference.backend import ReferenceBackend
from xattn_jax.triton.backend import TritonBackend

# the ops a call resolves one backend for: the estimate's, and the attention's
ESTIMATE = ("strided_scores", "block_sums", "select_blocks", "sampled_block_mass")
ATTENTION = ("block_sparse_attention",)
RAGGED_ESTIMATE = ("ragged_block_sums", "select_blocks")  # a ragged step's two stages
RAGGED_ATTENTION = ("ragged_attention",)


def _mosaic(device: jax.Device | None, auto: bool) -> MosaicBackend:
    return MosaicBackend(companion=TritonBackend.for_device(device), fallback=auto)


# name -> the backend of that name for a device (auto: as "auto" picks it)
BACKENDS: dict[str, Callable[[jax.Device | None, bool], Backend]] = {
    "reference": lambda device, auto: ReferenceBackend(),
    "triton": lambda device, auto: TritonBackend.for_device(device),
    "mosaic": _mosaic,
}
AUTO_ORDER = ("mosaic", "triton", "reference")  # "auto" takes the first that runs a call
IMPLS = ("auto", *BACKENDS)


def device_of(*arrays) -> jax.Device | None:
    """The device the first concrete jax.Array among `arrays` lives on; None inside a
    trace or for host data (then JAX's default device runs the call)."""
    for x in arrays:
        if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
            devices = x.devices()
            if len(devices) == 1:
                return next(iter(devices))
            return min(devices, key=lambda d: d.id)
    return None


def resolve(impl: str | Backend, *arrays, ops: tuple[str, ...] = ESTIMATE,
            device: jax.Device | None = None) -> Backend:
    """The backend that `impl` names for the ops `ops` (ESTIMATE or ATTENTION), for
    inputs `arrays` (or for `device`, where given). A backend from an earlier `resolve`
    is returned as it is: a caller that traces the public functions in its own jit,
    where the inputs have no device yet, pins the backend of the device they will run on
    this way.

    A ValueError for a name not in IMPLS, and for a backend that has no kernel for `ops`
    or cannot run on the device: the message says what it needs.
    """
    if isinstance(impl, Backend):
        return impl
    if not isinstance(impl, str) or impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    key = (impl, ops, device or device_of(*arrays))
    try:
        hash(key)
    except TypeError:  # a device stand-in that is no jax.Device: resolved every time
        return _resolve_name(*key)
    return _resolve_name_once(*key)


class XAttentionBackends(NamedTuple):
    """`xattention`'s backends: its attention's and its estimate's."""

    attention: Backend
    estimate: Backend


def resolve_xattention(impl: str | Backend | XAttentionBackends, *arrays,
                       device: jax.Device | None = None) -> XAttentionBackends:
    """`xattention`'s backends for `impl` (as `resolve`): the attention's is the one
    `impl` names; the estimate runs its "reference" for impl="reference", else its
    "auto". A pair from an earlier call is returned as it is."""
    if isinstance(impl, XAttentionBackends):
        return impl
    attention = resolve(impl, *arrays, ops=ATTENTION, device=device)
    estimate = "reference" if impl == "reference" else "auto"
    return XAttentionBackends(attention, resolve(estimate, *arrays, device=device))


class RaggedBackends(NamedTuple):
    """`ragged_xattention`'s backends: its estimate's and its attention's. fallback (as
    "auto" resolves): a stage whose kernel does not take a step runs on the reference
    (`for_step`)."""

    estimate: Backend
    attention: Backend
    fallback: bool

    def for_step(self, geom, dtype, estimate_geom=None) -> RaggedBackends:
        """The backends that run a step of `geom` (a `ragged.geometry.RaggedGeometry`)
        in `dtype`, its estimate on `estimate_geom` (default geom): a stage whose kernel
        does not take it moves to the reference with `fallback`, else raises a ValueError
        saying why."""
        stages = []
        for backend, op, sizes in ((self.estimate, "ragged_block_sums", estimate_geom or geom),
                                   (self.attention, "ragged_attention", geom)):
            reason = backend.ragged_unsupported(op, sizes, dtype)
            if reason is not None and not self.fallback:
                raise ValueError(f"{reason}; impl='reference' or 'auto' take this step")
            stages.append(backend if reason is None else BACKENDS["reference"](None, True))
        return RaggedBackends(*stages, self.fallback)


def resolve_ragged(impl: str | RaggedBackends, *arrays,
                   device: jax.Device | None = None) -> RaggedBackends:
    """`ragged_xattention`'s backends for `impl` (as `resolve`): "auto" the best for the
    device per stage; a name, that backend for each stage it has a kernel for and the
    reference for the other (the Triton backend has no attention). A triple from an
    earlier call is returned as it is."""
    if isinstance(impl, RaggedBackends):
        return impl
    if not isinstance(impl, str) or impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    device = device or device_of(*arrays)

    def stage(ops: tuple[str, ...]) -> Backend:
        named = impl == "auto" or _has(BACKENDS[impl](device, False), ops)
        return resolve(impl if named else "reference", ops=ops, device=device)

    return RaggedBackends(stage(RAGGED_ESTIMATE), stage(RAGGED_ATTENTION), impl == "auto")


def _resolve_name(impl: str, ops: tuple[str, ...], device: jax.Device | None) -> Backend:
    """`resolve` of a name in IMPLS."""
    if impl == "auto":
        candidates = (BACKENDS[name](device, True) for name in AUTO_ORDER)
        # the reference, last, runs every call
        return next(backend for backend in candidates if _has(backend, ops)
                    and backend.unavailable(device, compiled=True) is None)
    backend = BACKENDS[impl](device, False)
    missing = [op for op in ops if not backend.has(op)]
    if missing:
        raise backend.not_supported(missing[0], f"impl={_others(impl, ops, device)}")
    reason = backend.unavailable(device, compiled=False)
    if reason is not None:
        raise ValueError(f"{reason}; use impl={_others(impl, ops, device)}")
    return backend


# a device's backends do not change while the process runs: each call's is looked up
_resolve_name_once = functools.lru_cache(maxsize=256)(_resolve_name)


def _others(impl: str, ops: tuple[str, ...], device) -> str:
    """The other names that run `ops`, for a refusal of `impl`: "'a', 'b' or 'auto'"."""
    names = [repr(name) for name in BACKENDS
             if name != impl and _has(BACKENDS[name](device, False), ops)]
    return f"{', '.join(names)} or 'auto'"


def _has(backend: Backend, ops: tuple[str, ...]) -> bool:
    return all(backend.has(op) for op in ops)
