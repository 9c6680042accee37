"""The implementation table: every public function's `impl` argument is resolved here,
and nowhere else.

- "reference": plain JAX (`xattn_jax.reference`); any device; every op.
- "triton": Pallas kernels on the Triton backend (`xattn_jax.triton`); NVIDIA GPUs, and
  elsewhere Pallas interpret mode (slow: for tests). The estimate's ops
  (`strided_scores`, `block_sums`, `select_blocks`); no attention kernel.
- "mosaic": Pallas kernels on the Mosaic GPU backend (`xattn_jax.mosaic`); NVIDIA Hopper
  GPUs (H100, H200). Block-sparse attention, and the estimate's fused block sums
  (sections 1-3, and so the chunk scores of section 5: a count of keys in use, paged
  caches with pages of a multiple of 64 x stride tokens; a ValueError names what else a
  call needs); the other estimate ops run the Triton kernels.
- "auto": the best of these for the device the inputs live on: for the estimate
  "mosaic" on Hopper, its block sums running the Triton kernel for the calls they do not
  take and for calls of fewer CTAs than `mosaic.heuristics.auto_min_ctas` (3/4 of
  the SMs), key groups included (short calls on few heads, whose keys the Triton kernel
  splits among more programs; a chunk sharded over 2 GPUs reaches 128 CTAs in key groups
  and stays on Mosaic; otherwise the Mosaic block sums measured 1.12-1.28x faster than
  the Triton kernel on every timed case on the H200, `bench/results/estimate_h200.md`),
  "triton" on other GPUs, "reference" elsewhere; for attention "mosaic" where it can run
  and takes the call's arguments (dtype, head dim, block size, page size), else
  "reference".

The device is that of the first concrete `jax.Array` among the inputs; inside a trace
(a caller's `jax.jit`), where an input has no device yet, it is JAX's default backend
(or pass `device=`, or an `Implementation` resolved earlier). Each resolved
implementation is a small hashable value, a static argument of the jitted functions,
that runs the ops; the Triton ones build their plan (`triton.plan`) at trace time.
"""

from __future__ import annotations

import dataclasses

import jax

from xattn_jax import mosaic, reference
from xattn_jax.geometry import Geometry
from xattn_jax.triton import block_sums as triton_block_sums
from xattn_jax.triton import select_blocks as triton_select
from xattn_jax.triton import strided_scores as triton_scores
from xattn_jax.triton.plan import plan_block_sums, plan_select_blocks, plan_strided_scores

IMPLS = ("auto", "reference", "triton", "mosaic")
ESTIMATE, ATTENTION = "estimate", "attention"  # the families of ops `resolve` serves
# wider rows select with the reference, an XLA sort
# (docs/tuning.md: select-reference-above-16384)
TRITON_MAX_KEY_BLOCKS = 16384

_reference_scores = jax.jit(reference.strided_scores, static_argnums=(2, 3))


@dataclasses.dataclass(frozen=True)
class Implementation:
    """A resolved implementation: "reference", "triton" (with `interpret` off a GPU) or
    "mosaic" (with `fallback`, as "auto" resolves on Hopper: block sums the Mosaic
    kernel does not take run the Triton kernel instead of raising)."""

    name: str
    interpret: bool = False
    fallback: bool = False

    def block_sparse_attention(self, q, k, v, mask, **kwargs):
        """Section 6 (arguments of `reference.block_sparse_attention`)."""
        if self.name == "mosaic":
            from xattn_jax.mosaic.attention import block_sparse_attention as mosaic_attention
            return mosaic_attention.block_sparse_attention(q, k, v, mask, **kwargs)
        return reference.block_sparse_attention(q, k, v, mask, **kwargs)

    def strided_scores(self, q, k, *, geom: Geometry, norm: float) -> jax.Array:
        """Section 1: float32 `[B, Hq, q_rows, k_cols]`."""
        if self.name == "reference":
            return _reference_scores(q, k, geom, norm)
        plan = plan_strided_scores(geom, q.dtype, interpret=self.interpret)
        return triton_scores.strided_scores(q, k, plan=plan, norm=norm)

    def block_sums(self, q, k, *, geom: Geometry, causal: bool, norm: float, key_len=None,
                   block_table=None, max_scratch_bytes: int | None = None) -> jax.Array:
        """Sections 1-3: float32 `[B, Hq, qb, kb]`. key_len: int32 `[]` (keys in use of
        a padded buffer, default all); block_table: int32 `[B, pages_per_seq]` when k is
        a paged cache `[num_pages, page_size, Hkv, D]`; max_scratch_bytes: the one-pass
        kernels' scratch bound per kernel call, Triton's or Mosaic's (default
        `row_statistics.DEFAULT_SCRATCH_BYTES`: docs/tuning.md: workspace-bound; the
        reference has none)."""
        if self.name == "reference":
            keys = k if block_table is None else reference.gather_pages(k, block_table)
            return reference.block_sums(q, keys, geom, causal=causal, norm=norm,
                                        key_len=key_len)
        if self.name == "mosaic":
            page_size = None if block_table is None else k.shape[1]
            plan, reason = _mosaic_plan(geom, q.dtype, causal, key_len is not None,
                                        page_size, max_scratch_bytes, auto=self.fallback)
            if plan is not None:
                from xattn_jax.mosaic.estimate import block_sums as mosaic_sums
                return mosaic_sums.block_sums(
                    q, k, plan=plan, norm=norm,
                    key_len=None if key_len is None else key_len.reshape(1),
                    block_table=block_table)
            if not self.fallback:
                raise ValueError(reason)
        plan = plan_block_sums(geom, q.dtype, causal, interpret=self.interpret,
                               max_scratch_bytes=max_scratch_bytes)
        return triton_block_sums.block_sums(
            q, k, plan=plan, causal=causal, norm=norm,
            key_len=None if key_len is None else key_len.reshape(1), block_table=block_table)

    def select_blocks(self, sums, threshold, *, causal: bool, keep_sink: bool,
                      keep_recent: bool) -> jax.Array:
        """Section 4: float32 sums `[B, Hq, qb, kb]`, threshold `[Hq]` -> bool mask."""
        rules = dict(causal=causal, keep_sink=keep_sink, keep_recent=keep_recent)
        if self.name == "reference" or sums.shape[-1] > TRITON_MAX_KEY_BLOCKS:
            return reference.select_blocks(sums, threshold, **rules)
        plan = plan_select_blocks(sums.shape, causal=causal, interpret=self.interpret)
        return triton_select.select_blocks(sums, threshold, plan=plan, **rules)


def _mosaic_plan(geom: Geometry, dtype, causal: bool, key_len: bool,
                 page_size: int | None, max_scratch_bytes: int | None, *, auto: bool):
    """`(plan, None)` of the Mosaic block sums for this call, or `(None, reason)` saying
    why they cannot take it, or with `auto` (the choice "auto" makes) why the Triton
    kernel runs it faster: fewer than `heuristics.auto_min_ctas` CTAs."""
    from xattn_jax.mosaic.estimate import heuristics, plan as estimate_plan

    reason = estimate_plan.unsupported_reason(geom, dtype, key_len=key_len, causal=causal,
                                              page_size=page_size,
                                              max_scratch_bytes=max_scratch_bytes)
    if reason is not None:
        return None, f"{reason}; impl='triton' or 'auto' take this call"
    plan = estimate_plan.estimate_plan(geom, dtype, causal=causal, page_size=page_size,
                                       max_scratch_bytes=max_scratch_bytes)
    if auto:
        minimum = heuristics.auto_min_ctas(plan.sms)
        if plan.ctas < minimum:
            return None, (f"{plan.ctas} CTAs, fewer than {minimum} (AUTO_MIN_FILL = "
                          f"{heuristics.AUTO_MIN_FILL} of the GPU's SMs)")
    return plan, None


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


def _platform(device: jax.Device | None) -> str:
    return device.platform if device is not None else jax.default_backend()


def resolve(impl: str | Implementation, *arrays, op: str = ESTIMATE,
            device: jax.Device | None = None,
            attention_args: tuple | None = None) -> Implementation:
    """The implementation of the ops of family `op` (ESTIMATE or ATTENTION) that `impl`
    names, for inputs `arrays` (or for `device`, where given). An `Implementation` from
    an earlier `resolve` is returned as it is: a caller that traces the public functions
    in its own jit, where the inputs have no device yet, pins the implementation of the
    device they will run on this way. attention_args: the attention call's (head_dim,
    value_dim, dtype, block_size, page_size), page_size None for contiguous k and v, which
    a kernel may not take (`mosaic.plan.unsupported_reason`).

    A ValueError for a name not in IMPLS, and for an implementation that has no kernel
    for `op` or cannot run on the device: the message says what it needs.
    """
    if isinstance(impl, Implementation):
        return impl
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    device = device or device_of(*arrays)
    on_gpu = _platform(device) == "gpu"
    if op == ATTENTION:
        return _resolve_attention(impl, device, attention_args)
    if impl == "mosaic":
        reason = mosaic.available(device)
        if reason is not None:
            raise ValueError(f"{reason}; use 'triton' or 'auto'")
        return Implementation("mosaic")
    if impl == "reference" or (impl == "auto" and not on_gpu):
        return Implementation("reference")
    if impl == "auto" and mosaic.available(device) is None:
        return Implementation("mosaic", fallback=True)
    return Implementation("triton", interpret=not on_gpu)


def _resolve_attention(impl: str, device, attention_args: tuple | None) -> Implementation:
    if impl == "triton":
        raise ValueError("impl='triton' has no block-sparse attention kernel; use "
                         "'reference', 'mosaic' (Hopper) or 'auto'")
    if impl == "reference":
        return Implementation("reference")
    reason = mosaic.available(device)
    if reason is None and attention_args is not None:
        from xattn_jax.mosaic.attention.plan import unsupported_reason
        reason = unsupported_reason(*attention_args)
    if reason is None:
        return Implementation("mosaic")
    if impl == "mosaic":
        raise ValueError(f"{reason}; use impl='auto' or 'reference'")
    return Implementation("reference")
