"""GPU check and timing of the Mosaic GPU block sums (xattn_jax.mosaic.block_sums), one run.

    python -m bench.mosaic_estimate_check [--block-k 128,64] [--stages 5,3]
        [--cluster 1,2,4] [--cases causal-32k,...] [--skip-check] [--skip-time]
        [--no-smoke] [--ptxas]

A whole run may take more than 10 minutes (compilations: every case and variant is a
new kernel); split it with --skip-time / --skip-check --no-smoke --cases.

(--block-k / --stages / --cluster: plan variants, each a comma-separated list, checked
and timed in every combination (`estimate_plan.estimate_plan`; one that does not fit
prints its error); the default plan always runs first, and is not repeated as a
variant. Default --cluster 1,2,4: the multicast variants run. --ptxas: Mosaic GPU
prints ptxas' report of each kernel: registers, spills.)

1. Smoke: the first check case, with the default plan and with each variant, each in a
   subprocess with a time limit, so that a kernel that hangs (a barrier protocol error)
   is reported as such instead of stalling the run; variants that hang are dropped.
2. Correctness, bf16, D 128, stride 8, GQA 32:8, fresh random inputs per case: against
   the plain-JAX reference (run one KV group of heads at a time, so that 64K fits) and
   the Triton kernel: relative error (max |diff| / max |reference|, bound 5e-5 as the GPU
   tests), NaNs, rows summing to their real reshaped rows, causal blocks after the
   diagonal exactly 0, a bit-identical rerun. The kernel's statistics buffer is not
   initialized (tiles no row sees are not written): before each call a NaN-filled
   buffer of its size is freed, so that the allocator hands that memory to the call.
   Each case is independent: a failure prints its traceback and the run goes on.
3. Timing (bench.common.time_ms: back-to-back calls after warm-up, median): the block
   sums (sections 1-3) of Mosaic and of Triton (`impl="triton"`'s plan) at the
   `bench.cases.ESTIMATE` shapes causal-32k, causal-64k, noncausal-64k-b128 (MHA 32:32)
   and gqa-64k-causal, plus the Mosaic kernel alone (statistics, no XLA epilogue) for
   the default plan, each variant, and the default plan leaving one stage out
   (`estimate_plan.LEAVE_OUT`: the products, or the statistics past the row maxima).
   TFLOP/s on the visible strided product; a table last.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import os
import subprocess
import sys
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.cases import ESTIMATE, GQA_CASE  # noqa: E402
from bench.common import floor_ms, time_ms  # noqa: E402
from xattn_jax import impls, mosaic, reference  # noqa: E402
from xattn_jax.geometry import Geometry  # noqa: E402
from xattn_jax.mosaic import block_sums as mosaic_block_sums  # noqa: E402
from xattn_jax.mosaic import estimate_plan  # noqa: E402

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


def triton_sums(geom: Geometry, causal: bool):
    triton = impls.Implementation("triton")
    return jax.jit(functools.partial(triton.block_sums, geom=geom, causal=causal, norm=1.0))


def mosaic_sums(geom: Geometry, causal: bool, **plan_options):
    plan = estimate_plan.estimate_plan(geom, jnp.bfloat16, **plan_options)
    return plan, functools.partial(mosaic_block_sums.block_sums, plan=plan, causal=causal,
                                   norm=1.0)


def _poison(nbytes: int) -> None:
    """Frees a NaN-filled device buffer of `nbytes`, for the next allocation to reuse."""
    jax.block_until_ready(jnp.full((nbytes // 4,), jnp.nan, jnp.float32)).delete()


def _rel(a, b) -> float:
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def check_case(name, seed, shape, causal, **plan_options) -> bool:
    geom = _geom(*shape)
    q, k = _inputs(seed, geom)
    plan, run = mosaic_sums(geom, causal, **plan_options)
    start = time.perf_counter()
    _poison(plan.scratch_bytes)
    got = np.asarray(run(q, k))
    first_s = time.perf_counter() - start
    _poison(plan.scratch_bytes)
    identical = np.array_equal(np.asarray(run(q, k)), got, equal_nan=True)
    want = reference_sums(q, k, geom, causal)
    err = _rel(got, want)
    triton_err = _rel(got, np.asarray(triton_sums(geom, causal)(q, k)))
    real_rows = np.minimum(geom.q_rows - np.arange(geom.q_blocks) * geom.block_rows,
                           geom.block_rows)
    rows_err = float(np.abs(got.sum(-1) / real_rows - 1.0).max())
    after = np.arange(geom.k_blocks)[None, :] > (np.arange(geom.q_blocks)[:, None]
                                                 + geom.k_blocks - geom.q_blocks)
    zeros = not causal or bool(np.all(got[..., after] == 0))
    nans = int(np.isnan(got).sum())
    ok = err <= RTOL and nans == 0 and rows_err <= RTOL and zeros and identical
    print(f"{'PASS' if ok else 'FAIL'} {name} {plan_options or ''}: rel err vs reference "
          f"{err:.2e}, vs triton {triton_err:.2e}, row sums rel err {rows_err:.2e}, NaN "
          f"{nans}, causal zeros {zeros}, rerun identical {identical}, first call "
          f"{first_s:.1f}s (stages {plan.stages}, block_k {plan.block_k}, smem "
          f"{plan.smem_bytes(2)}, scratch {plan.scratch_bytes / 2**20:.0f} MiB)", flush=True)
    return ok


def run_checks(variants) -> None:
    for name, seed, shape, causal in CHECK_CASES:
        try:
            check_case(name, seed, shape, causal)
        except Exception:
            print(f"ERROR {name}:", flush=True)
            traceback.print_exc()
            sys.stdout.flush()
    for options in variants:  # each variant once, on a causal and a non-causal case
        for name, seed, shape, causal in (CHECK_CASES[0], CHECK_CASES[1]):
            try:
                check_case(name, seed + 100, shape, causal, **options)
            except Exception:
                print(f"ERROR {name} {options}:", flush=True)
                traceback.print_exc()
                sys.stdout.flush()


def _kernel_only(geom: Geometry, causal: bool, plan):
    """The Mosaic kernel alone on pre-padded, pre-reshaped inputs (no epilogue)."""
    from xattn_jax.mosaic import tile_stats
    from xattn_jax.row_statistics import LOG2_E

    run = jax.jit(functools.partial(tile_stats.tile_stats, plan=plan, causal=causal,
                                    scale=geom.scale * LOG2_E))

    def strided(x, length):
        x = jnp.pad(x, ((0, 0), (0, 0), (0, length - x.shape[2]), (0, 0)))
        return x.reshape(x.shape[0], x.shape[1], length // STRIDE, STRIDE, HEAD_DIM)

    return run, strided


def run_timing(variants, cases=TIMED) -> None:
    rows = []
    for case in cases:
        shape = ESTIMATE[case]
        geom, causal = shape.geom(), shape.causal
        flops = shape.strided_flops()
        floor = floor_ms(flops)
        try:
            q, k = shape.random_qk(len(case))
        except Exception:
            print(f"ERROR inputs {case}:", flush=True)
            traceback.print_exc()
            continue
        timed = [("triton", lambda: triton_sums(geom, causal))]
        timed += [(f"mosaic {options or 'default'}",
                   functools.partial(lambda o: mosaic_sums(geom, causal, **o)[1], options))
                  for options in [{}] + variants]
        for impl, make in timed:
            try:
                ms = time_ms(make(), [(q, k)], warmup=3, reps=10)
                rows.append((case, impl, ms, flops / ms / 1e9, ms / floor))
                print(f"{case} {impl}: {ms:.3f} ms", flush=True)
            except Exception:
                print(f"ERROR timing {case} {impl}:", flush=True)
                traceback.print_exc()
                sys.stdout.flush()
        leave_out = [{"leave_out": stage} for stage in estimate_plan.LEAVE_OUT]
        for options in [{}] + variants + leave_out:
            try:
                plan = estimate_plan.estimate_plan(geom, jnp.bfloat16, **options)
                run, strided = _kernel_only(geom, causal, plan)
                q5 = strided(q, plan.padded_rows * STRIDE)
                k5 = strided(k, plan.padded_cols * STRIDE)
                ms = time_ms(run, [(q5, k5)], warmup=3, reps=10)
                rows.append((case, f"  kernel alone {options or 'default'}", ms,
                             flops / ms / 1e9, ms / floor))
                del q5, k5
            except Exception:
                print(f"ERROR timing {case} kernel alone {options}:", flush=True)
                traceback.print_exc()
        del q, k
    print(f"\n{jax.devices()[0].device_kind}, jax {jax.__version__}; block sums "
          "(sections 1-3), bf16, D 128, stride 8, Hq 32")
    print(f"{'case':20s} {'impl':44s} {'ms':>8s} {'TFLOP/s':>8s} {'/floor':>7s} "
          f"{'vs triton':>9s}")
    triton_ms = {case: ms for case, impl, ms, _, _ in rows if impl == "triton"}
    for case, impl, ms, tflops, ratio in rows:
        speedup = f"{triton_ms[case] / ms:8.2f}x" if case in triton_ms else "      n/a"
        print(f"{case:20s} {impl:44s} {ms:8.3f} {tflops:8.1f} {ratio:7.2f} {speedup}")
    print("(TFLOP/s on the visible strided product; floor: bench.common.floor_ms; vs "
          "triton = triton ms / ms, > 1 is faster than Triton)", flush=True)


def smoke(options: dict) -> str:
    """The first check case with plan `options` in a subprocess with a time limit:
    "pass", "fail" or "hang"."""
    code = ("from bench.mosaic_estimate_check import *; import sys; "
            f"sys.exit(0 if check_case(*CHECK_CASES[0], **{options!r}) else 1)")
    try:
        done = subprocess.run([sys.executable, "-c", code], timeout=SMOKE_LIMIT_S)
    except subprocess.TimeoutExpired:
        print(f"SMOKE HANG {options or 'default'}: the first case did not finish in "
              f"{SMOKE_LIMIT_S}s (barrier protocol deadlock?)", flush=True)
        return "hang"
    print(f"smoke {options or 'default'}: exit code {done.returncode}", flush=True)
    return "pass" if done.returncode == 0 else "fail"


def _ints(text: str | None) -> list[int | None]:
    return [None] if not text else [int(x) for x in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-k", help="comma-separated block_k values to try")
    parser.add_argument("--stages", help="comma-separated stages values to try")
    parser.add_argument("--cluster", default="1,2,4",
                        help="comma-separated cluster sizes to try (default 1,2,4)")
    parser.add_argument("--cases", default=",".join(TIMED),
                        help=f"comma-separated timed cases (default {','.join(TIMED)})")
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
    variants = [{key: value for key, value in zip(("block_k", "stages", "cluster"), values)
                 if value is not None}
                for values in itertools.product(_ints(args.block_k), _ints(args.stages),
                                                _ints(args.cluster))]
    default_options = ({}, {"cluster": estimate_plan.CLUSTER})
    variants = [v for v in variants if v not in default_options]
    started = time.perf_counter()
    print(f"jax {jax.__version__}, devices {jax.devices()}, "
          f"mosaic.available() = {mosaic.available()!r}", flush=True)
    if mosaic.available() is not None:
        return
    default = estimate_plan.estimate_plan(ESTIMATE["causal-64k"].geom(), jnp.bfloat16)
    print(f"default plan at causal-64k: {default}, smem {default.smem_bytes(2)} B, scratch "
          f"{default.scratch_bytes / 2**20:.0f} MiB; variants {variants}", flush=True)
    outcome = "skipped" if args.no_smoke else smoke({})
    if outcome == "hang":
        return
    if not args.no_smoke:
        variants = [v for v in variants if smoke(v) != "hang"]
    if not args.skip_check:
        run_checks(variants)
    if not args.skip_time and outcome != "fail":
        run_timing(variants, cases)
    print(f"total {time.perf_counter() - started:.0f}s", flush=True)


if __name__ == "__main__":
    main()
