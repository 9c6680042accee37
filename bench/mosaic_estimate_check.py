"""GPU check and timing of the Mosaic GPU block sums (xattn_jax.mosaic.estimate) with
their default plans, one run.

    python -m bench.mosaic_estimate_check [--cases causal-32k,...] [--max-scratch-mib N]
        [--skip-check] [--skip-time] [--no-smoke] [--ptxas]

1. Smoke: the first check case in a subprocess with a time limit, so that a kernel that
   hangs (a barrier protocol error) is reported as such instead of stalling the run.
2. Correctness, bf16, D 128, stride 8, GQA 32:8, fresh random inputs per case: against
   the plain-JAX reference (one KV group of heads at a time, so that 64K fits) and the
   Triton kernel: relative error (max |diff| / max |reference|, bound 5e-5 as the GPU
   tests), NaNs, rows summing to their real reshaped rows, causal blocks after the
   diagonal exactly 0, a bit-identical rerun. The statistics buffer is not initialized
   (tiles no row sees are not written): before each call a NaN-filled buffer of its size
   is freed, so that the allocator hands that memory to the call.
3. Timing (`bench.common.time_ms`: back-to-back calls after warm-up, median): the block
   sums of Mosaic and of Triton (`impl="triton"`'s plan), and the Mosaic kernel alone
   (statistics, no epilogue), at the `bench.cases.ESTIMATE` shapes; TFLOP/s on the
   visible strided product. --max-scratch-mib bounds both kernels' statistics.
   (--ptxas: Mosaic GPU prints ptxas' report of each kernel: registers, spills.)
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.cases import ESTIMATE, GQA_CASE  # noqa: E402
from bench.common import floor_ms, smoke_in_subprocess, time_ms  # noqa: E402
from xattn_jax import mosaic, reference  # noqa: E402
from xattn_jax.geometry import Geometry  # noqa: E402
from xattn_jax.mosaic.estimate import block_sums as mosaic_block_sums  # noqa: E402
from xattn_jax.mosaic.estimate.plan import estimate_plan  # noqa: E402
from xattn_jax.triton.backend import TritonBackend  # noqa: E402

SMOKE_LIMIT_S = 180
RTOL = 5e-5  # the GPU tests' float32 bound (tests/cases.py: 1e-5 x GPU_SLACK)
STRIDE, HEAD_DIM = 8, 128
TIMED = ("causal-32k", "causal-64k", "noncausal-64k-b128", GQA_CASE)

# name, seed, (batch, q_heads, kv_heads, Lq, Lk, block_size), causal
CHECK_CASES = [
    ("causal 4K b128", 0, (1, 32, 8, 4096, 4096, 128), True),
    ("non-causal 4K b64", 1, (1, 32, 8, 4096, 4096, 64), False),
    ("causal 8K b256 B2", 2, (2, 32, 8, 8192, 8192, 256), True),
    ("non-causal 16K b1024", 3, (1, 32, 8, 16384, 16384, 1024), False),
    ("causal Lq 4K < Lk 12K b512", 4, (1, 32, 8, 4096, 12288, 512), True),
    ("non-causal odd Lq 3000 Lk 5001 b128", 5, (1, 32, 8, 3000, 5001, 128), False),
    ("causal 32K b128", 6, (1, 32, 8, 32768, 32768, 128), True),
    ("causal 64K b64", 7, (1, 32, 8, 65536, 65536, 64), True),
    ("non-causal 64K b512", 8, (1, 32, 8, 65536, 65536, 512), False),
    ("causal odd Lq 2900 < Lk 4948 b128", 9, (1, 32, 8, 2900, 4948, 128), True),
]


def _geom(batch, q_heads, kv_heads, q_len, k_len, block_size) -> Geometry:
    return Geometry(batch, q_heads, kv_heads, q_len, k_len, HEAD_DIM, STRIDE, block_size)


def _inputs(seed: int, geom: Geometry):
    kq, kk = jax.random.split(jax.random.PRNGKey(seed))
    scale = (2.0 * STRIDE ** 0.5) ** 0.5  # scores of standard deviation near 2 (tests)
    q = jax.random.normal(kq, (geom.batch, geom.q_heads, geom.q_len, HEAD_DIM)) * scale
    k = jax.random.normal(kk, (geom.batch, geom.kv_heads, geom.k_len, HEAD_DIM)) * scale
    return q.astype(jnp.bfloat16), k.astype(jnp.bfloat16)


def reference_sums(q, k, geom: Geometry, causal: bool) -> np.ndarray:
    """Sections 1-3 in plain JAX, one KV group of query heads at a time."""
    one_group = dataclasses.replace(geom, q_heads=geom.group, kv_heads=1)
    run = jax.jit(functools.partial(reference.block_sums, geom=one_group, causal=causal,
                                    norm=1.0))
    parts = [np.asarray(run(q[:, g * geom.group:(g + 1) * geom.group], k[:, g:g + 1]))
             for g in range(geom.kv_heads)]
    return np.concatenate(parts, axis=1)


def triton_sums(geom: Geometry, causal: bool, bound: int | None = None):
    triton = TritonBackend()
    return jax.jit(functools.partial(triton.block_sums, geom=geom, causal=causal, norm=1.0,
                                     max_scratch_bytes=bound))


def mosaic_sums(geom: Geometry, causal: bool, bound: int | None = None):
    plan = estimate_plan(geom, jnp.bfloat16, causal=causal, max_scratch_bytes=bound)
    return plan, functools.partial(mosaic_block_sums.block_sums, plan=plan, norm=1.0)


def _poison(nbytes: int) -> None:
    """Frees a NaN-filled device buffer of `nbytes`, for the next allocation to reuse."""
    jax.block_until_ready(jnp.full((nbytes // 4,), jnp.nan, jnp.float32)).delete()


def _rel(a, b) -> float:
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def check_case(name, seed, shape, causal) -> bool:
    geom = _geom(*shape)
    q, k = _inputs(seed, geom)
    plan, run = mosaic_sums(geom, causal)
    start = time.perf_counter()
    _poison(plan.scratch_bytes)
    got = np.asarray(run(q, k))
    first_s = time.perf_counter() - start
    _poison(plan.scratch_bytes)
    identical = np.array_equal(np.asarray(run(q, k)), got, equal_nan=True)
    err = _rel(got, reference_sums(q, k, geom, causal))
    triton_err = _rel(got, np.asarray(triton_sums(geom, causal)(q, k)))
    real_rows = np.minimum(geom.q_rows - np.arange(geom.q_blocks) * geom.block_rows,
                           geom.block_rows)
    rows_err = float(np.abs(got.sum(-1) / real_rows - 1.0).max())
    after = np.arange(geom.k_blocks)[None, :] > (np.arange(geom.q_blocks)[:, None]
                                                 + geom.k_blocks - geom.q_blocks)
    zeros = not causal or bool(np.all(got[..., after] == 0))
    nans = int(np.isnan(got).sum())
    ok = err <= RTOL and nans == 0 and rows_err <= RTOL and zeros and identical
    print(f"{'PASS' if ok else 'FAIL'} {name}: rel err vs reference {err:.2e}, vs triton "
          f"{triton_err:.2e}, row sums rel err {rows_err:.2e}, NaN {nans}, causal zeros "
          f"{zeros}, rerun identical {identical}, first call {first_s:.1f}s ({plan})",
          flush=True)
    return ok


def run_checks() -> None:
    for case in CHECK_CASES:
        try:
            check_case(*case)
        except Exception:
            print(f"ERROR {case[0]}:", flush=True)
            traceback.print_exc()
            sys.stdout.flush()


def _kernel_only(geom: Geometry, plan):
    """The Mosaic kernel alone on pre-padded, pre-reshaped q and k (no epilogue), all
    keys in use, the call's first row and head 0."""
    from xattn_jax.mosaic.estimate import kernel
    from xattn_jax.row_statistics import LOG2_E

    scalars = jnp.array([geom.k_cols * STRIDE, 0, 0], jnp.int32)
    run = jax.jit(lambda q5, k5: kernel.tile_stats(
        q5, k5, None, None, scalars, plan=plan, scale=geom.scale * LOG2_E))

    def strided(x, length):
        x = jnp.pad(x, ((0, 0), (0, 0), (0, length - x.shape[2]), (0, 0)))
        return x.reshape(x.shape[0], x.shape[1], length // STRIDE, STRIDE, HEAD_DIM)

    return run, strided


def run_timing(cases, bound: int | None) -> None:
    rows = []
    for case in cases:
        shape = ESTIMATE[case]
        geom, causal = shape.geom(), shape.causal
        flops = shape.strided_flops()
        floor = floor_ms(flops)
        q, k = shape.random_qk(len(case))
        plan, mosaic_run = mosaic_sums(geom, causal, bound)
        timed = [("triton", triton_sums(geom, causal, bound)), ("mosaic", mosaic_run)]
        if not plan.call_rows and not plan.call_heads:  # the kernel of one call
            run, strided = _kernel_only(geom, plan)
            q5 = strided(q, plan.padded_rows * STRIDE)
            k5 = strided(k, plan.padded_cols * STRIDE)
            timed.append(("  kernel alone", lambda q_, k_: run(q5, k5)))
        for impl, fn in timed:
            try:
                ms = time_ms(fn, [(q, k)], warmup=3, reps=10)
                rows.append((case, impl, ms, flops / ms / 1e9, ms / floor))
                print(f"{case} {impl}: {ms:.3f} ms", flush=True)
            except Exception:
                print(f"ERROR timing {case} {impl}:", flush=True)
                traceback.print_exc()
        del q, k
    print(f"\n{jax.devices()[0].device_kind}, jax {jax.__version__}; block sums "
          f"(sections 1-3), bf16, D 128, stride 8, Hq 32, max_scratch_bytes {bound}")
    print(f"{'case':20s} {'impl':16s} {'ms':>8s} {'TFLOP/s':>8s} {'/floor':>7s} "
          f"{'vs triton':>9s}")
    triton_ms = {case: ms for case, impl, ms, _, _ in rows if impl == "triton"}
    for case, impl, ms, tflops, ratio in rows:
        speedup = f"{triton_ms[case] / ms:8.2f}x" if case in triton_ms else "      n/a"
        print(f"{case:20s} {impl:16s} {ms:8.3f} {tflops:8.1f} {ratio:7.2f} {speedup}")
    print("(TFLOP/s on the visible strided product; floor: bench.common.floor_ms; vs "
          "triton = triton ms / ms, > 1 is faster than Triton)", flush=True)


def smoke() -> str:
    """The first check in a subprocess with a time limit: "pass", "fail" or "hang"."""
    return smoke_in_subprocess("bench.mosaic_estimate_check", "check_case(*CHECK_CASES[0])", SMOKE_LIMIT_S)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(TIMED),
                        help=f"comma-separated timed cases (default {','.join(TIMED)})")
    parser.add_argument("--max-scratch-mib", type=int,
                        help="both kernels' statistics bound, in MiB (default: theirs)")
    parser.add_argument("--skip-check", action="store_true")
    parser.add_argument("--skip-time", action="store_true")
    parser.add_argument("--no-smoke", action="store_true")
    parser.add_argument("--ptxas", action="store_true")
    args = parser.parse_args()
    cases = args.cases.split(",")
    unknown = [case for case in cases if case not in ESTIMATE]
    if unknown:
        parser.error(f"unknown case(s) {unknown}; choose from {list(ESTIMATE)}")
    if args.ptxas:  # read by Mosaic GPU when it compiles, inherited by the smoke process
        os.environ["MOSAIC_GPU_DUMP_PTXAS"] = "1"
    started = time.perf_counter()
    print(f"jax {jax.__version__}, devices {jax.devices()}, "
          f"mosaic.available() = {mosaic.available()!r}", flush=True)
    if mosaic.available() is not None:
        return
    outcome = "skipped" if args.no_smoke else smoke()
    if outcome == "hang":
        return
    if not args.skip_check:
        run_checks()
    if not args.skip_time and outcome != "fail":
        bound = None if args.max_scratch_mib is None else args.max_scratch_mib << 20
        run_timing(cases, bound)
    print(f"total {time.perf_counter() - started:.0f}s", flush=True)


if __name__ == "__main__":
    main()
