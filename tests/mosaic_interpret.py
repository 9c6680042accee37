"""Runs the Mosaic GPU attention kernel on CPU in Pallas' GPU interpret mode (jax >= 0.11).

GPU interpret mode simulates the warpgroups, shared memory, TMA copies and barriers of a
kernel (and checks that every completed barrier phase was observed and, with
`detect_races`, that shared memory accesses are ordered by barriers), but in jax 0.11.2 it
interprets neither `pl.run_state` on a wgmma accumulator nor a wgmma whose left operand is
an array in registers, both of which the kernel's p.v product uses. `interpret_kernel()`
supplies the two, for its duration only:

- the kernel module's `pl.run_state(f)(ACC.init(acc))` becomes
  `run_scoped(f on a zeroed accumulator) + acc`, the same sum;
- the interpreter's wgmma rule accepts an array left operand: acc += a @ b, with b and acc
  read from the simulated memory.

The ragged kernel (`xattn_jax.mosaic.attention.ragged_kernel`) needs two more: its
copies from shared to global memory take a predicate, which the interpreter refuses, and
its unoptimized store into a staging buffer is Mosaic GPU's own code on jax 0.11
(`inline_mgpu`, which the interpreter does not run). Within:
- a predicated copy runs the interpreter's copy under `lax.cond` on its predicate;
- `ragged_kernel.store_plain` is an ordinary store into the buffer (the layouts it
  exists for do not matter to the interpreter).

The forced GPU interpret mode applies to every `pallas_call` traced within, the
Triton-backend statistics epilogue (`xattn_jax.mosaic.estimate.stats_epilogue`) included,
whose blocked windows the Mosaic GPU interpreter refuses (jax 0.12); within, that kernel
runs in Pallas' own interpret mode instead, so that a call's whole path is still checked.

Test-only: it replaces private jax internals, so `unsupported_reason()` says when this jax
does not have them.

Known stall of the interpreter itself (seen on this project's 2-core CPU machine): it runs
each simulated warpgroup as a jitted program on its own Python thread, blocked in a host
callback while it waits on a barrier. Some program shapes then never finish, e.g. several
calls with k_len (keys in use) given, causal or not, while the same kernel inputs finish on
other paths; the stuck threads are two waiting on barriers and two inside XLA's execute,
which points at XLA's CPU thread pool (2 threads here) held by the blocked callbacks. The
cases in tests/test_mosaic_attention.py run; k_len is covered there by the CPU walk of the
key-tile lists, the CUDA lowering and the GPU tests.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import numpy as np


def unsupported_reason() -> str | None:
    if jax.__version_info__ < (0, 11):  # Python 3.11's newest jax is 0.10.2
        return (f"the Mosaic GPU interpret-mode harness needs jax >= 0.11, this is jax "
                f"{jax.__version__}, whose GPU interpreter lacks what the harness uses: "
                f"plgpu.force_gpu_interpret_mode, jaxpr_interpret.resolve_ref and the "
                f"interpreter's mesh_location (it passes device, grid point and thread ids "
                f"to its callbacks instead); it also imports absl-py")
    try:
        from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks, jaxpr_interpret
        from jax.experimental.pallas import mosaic_gpu as plgpu
    except Exception as error:  # no Mosaic GPU interpret mode in this jax
        return f"no Mosaic GPU interpret mode: {error!r}"
    needed = [(jaxpr_interpret.JaxprInterpreter, "_interpret_wgmma_ref_p"),
              (jaxpr_interpret.JaxprInterpreter, "_interpret_copy_smem_to_gmem_p"),
              (jaxpr_interpret, "resolve_ref"), (gpu_callbacks, "_get_shared_memory"),
              (gpu_callbacks, "TOKEN_SHAPE_DTYPE"), (plgpu, "force_gpu_interpret_mode")]
    missing = [name for owner, name in needed if not hasattr(owner, name)]
    return f"jax internals changed, missing {missing}" if missing else None


# the jax versions whose GPU interpreter stalls on the attention kernel (seen on this
# project's 2-core CI machine, 2026-12-06: jax 0.12.1 never finished the first case, its
# warpgroup threads waiting on barriers; jax 0.12.0.1 ran all five cases in 14 s)
ATTENTION_STALLS_FROM = (0, 12, 1)


def attention_unsupported_reason() -> str | None:
    """Why the attention kernel cannot run in GPU interpret mode here, or None."""
    reason = unsupported_reason()
    if reason is None and jax.__version_info__ >= ATTENTION_STALLS_FROM:
        reason = (f"jax {jax.__version__}'s GPU interpreter stalls on the attention kernel "
                  f"(from jax {'.'.join(map(str, ATTENTION_STALLS_FROM))}; .ci/run runs "
                  f"these cases under jax 0.12.0.1)")
    return reason


def _add_matmul(*, token, mesh_location, thread, acc_key, acc_transforms, lhs, rhs_key,
                rhs_transforms, source_info=None):
    """Host side of a wgmma with an array lhs: acc += lhs @ rhs in simulated memory."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks as callbacks

    memory = callbacks._get_shared_memory()
    info = callbacks.memory.GPULoggingInfo(mesh_location, thread, source_info)

    def region(key, transforms):
        key = callbacks.HostAllocationKey.from_array(key)
        transforms = jax.tree.map(int, callbacks._remove_noop_transforms(transforms))
        return key, memory.access(key, transforms)

    rhs_key, rhs_range = region(rhs_key, rhs_transforms)
    rhs, _, _ = memory.get_buffer_content(rhs_key, rhs_range, thread, logging_info=info)
    acc_key, acc_range = region(acc_key, acc_transforms)
    acc, _, _ = memory.get_buffer_content(acc_key, acc_range, thread, logging_info=info)
    total = acc + np.matmul(np.asarray(lhs), rhs, dtype=acc.dtype)
    memory.store_buffer_content(acc_key, acc_range, total, thread, logging_info=info)
    return token


def _wgmma_rule(original):
    from jax._src import callback
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks, jaxpr_interpret
    from jax._src.state import types as state_types

    def rule(self, eqn, token, get_invals):
        if isinstance(eqn.invars[1].aval, state_types.AbstractRef):
            return original(self, eqn, token, get_invals)
        acc, lhs, rhs, *leaves = get_invals()
        trees = [eqn.params[f"{name}_transforms_tree"] or jax.tree.structure([])
                 for name in ("acc", "a", "b")]
        acc_t, _, rhs_t = jax.tree.unflatten(jax.tree_util.treedef_tuple(trees), leaves)
        acc, acc_t = jaxpr_interpret.resolve_ref(eqn.invars[0].aval, acc, acc_t)
        rhs, rhs_t = jaxpr_interpret.resolve_ref(eqn.invars[2].aval, rhs, rhs_t)
        token = callback.io_callback(
            functools.partial(_add_matmul, source_info=eqn.source_info),
            gpu_callbacks.TOKEN_SHAPE_DTYPE, token=token, mesh_location=self.mesh_location,
            thread=self.thread, acc_key=acc, acc_transforms=acc_t, lhs=lhs, rhs_key=rhs,
            rhs_transforms=rhs_t)
        return token, []

    return rule


def _predicated_copy_rule(original):
    """The interpreter's copy from shared to global memory, done iff its predicate."""
    from jax import lax

    def rule(self, eqn, token, src, dst, *flat_args, has_user_predicate, **params):
        if not has_user_predicate:
            return original(self, eqn, token, src, dst, *flat_args,
                            has_user_predicate=False, **params)
        *flat_args, predicate = flat_args

        def copy(token):
            return original(self, eqn, token, src, dst, *flat_args,
                            has_user_predicate=False, **params)[0]

        return lax.cond(predicate, copy, lambda token: token, token), []

    return rule


def _store_plain(stage, rows) -> None:
    """`ragged_kernel.store_plain` as the interpreter runs it: an ordinary store."""
    stage[...] = rows


def _epilogue_interpreted(original, plgpu):
    """`epilogue.stats_block_sums` traced outside the forced GPU interpret mode, with
    Pallas' own interpret mode."""

    @functools.wraps(original)
    def call(*args, **kwargs):
        with plgpu.force_gpu_interpret_mode(None):
            return original(*args, **kwargs, interpret=True)

    return call


class _PallasWithScopedRunState:
    """`jax.experimental.pallas` with run_state on an accumulator done by run_scoped."""

    def __init__(self, pl, plgpu):
        self._pl, self._plgpu = pl, plgpu

    def __getattr__(self, name):
        return getattr(self._pl, name)

    def run_state(self, body):
        def call(acc_init):
            initial = acc_init._init

            def scoped(acc_ref):
                body(acc_ref)
                return acc_ref[...]

            accumulator = self._plgpu.ACC(initial.shape, initial.dtype)
            return self._pl.run_scoped(scoped, accumulator) + initial

        return call


@contextlib.contextmanager
def interpret_kernel(detect_races: bool = True):
    """Within: calls of `xattn_jax.mosaic.attention.kernel` and `ragged_kernel` run in GPU
    interpret mode on CPU, the statistics epilogue's kernel in Pallas' interpret mode.
    Yields a function returning whether the race detector found a race. Clears jax's
    caches on exit so that no interpreted trace is reused outside."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks, jaxpr_interpret
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from xattn_jax.mosaic.attention import kernel, ragged_kernel
    from xattn_jax.mosaic.estimate import stats_epilogue as epilogue

    interpreter = jaxpr_interpret.JaxprInterpreter
    original_rule = interpreter._interpret_wgmma_ref_p
    interpreter._interpret_wgmma_ref_p = _wgmma_rule(original_rule)
    original_copy = interpreter._interpret_copy_smem_to_gmem_p
    interpreter._interpret_copy_smem_to_gmem_p = _predicated_copy_rule(original_copy)
    kernel.pl = _PallasWithScopedRunState(pl, plgpu)
    store_plain = ragged_kernel.store_plain
    ragged_kernel.store_plain = _store_plain
    stats_block_sums = epilogue.stats_block_sums
    epilogue.stats_block_sums = _epilogue_interpreted(stats_block_sums, plgpu)
    jax.clear_caches()
    try:
        with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams(
                detect_races=detect_races)):
            yield lambda: bool(gpu_callbacks.get_races().races_found)
    finally:
        kernel.pl = pl
        ragged_kernel.store_plain = store_plain
        epilogue.stats_block_sums = stats_block_sums
        interpreter._interpret_wgmma_ref_p = original_rule
        interpreter._interpret_copy_smem_to_gmem_p = original_copy
        jax.clear_caches()
