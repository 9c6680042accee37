"""GPU check and timing of the Mosaic GPU block sums (xattn_jax.mosaic.block_sums), one run.

    python -m bench.mosaic_estimate_check [--queries resident,streamed]
        [--block-k 128,64] [--stages 5,3] [--cluster 1,2,4] [--stagger 0,1]
        [--pair-rows 0,1] [--ordered-stats 0,1] [--trim-columns 0,32]
        [--step-loop 0,1]
        [--cases causal-32k,...]
        [--skip-check] [--skip-time] [--no-smoke] [--ptxas]

A whole run may take more than 10 minutes (compilations: every case and variant is a
new kernel); split it with --skip-time / --skip-check --no-smoke --cases.

(--queries / --block-k / --stages / --cluster / --stagger / --pair-rows /
--ordered-stats / --trim-columns / --step-loop: plan variants, each a comma-separated
list, checked and timed in every combination (`estimate_plan.estimate_plan`; options
equal to their layout's default are folded away, except ordered_stats and step_loop,
whose defaults depend on the call; a combination the plan refuses at causal-64k, e.g. a
stagger with the resident queries, prints its error once and is dropped); the default
plan always runs first, and is not repeated as a variant. Default --queries
resident,streamed: both layouts of the queries run (`estimate_plan.QUERY_LAYOUTS`);
default --cluster 1,2,4: the multicast variants of both layouts run. Every line and
table row names the plan's layout. --ptxas: Mosaic
GPU prints ptxas' report of each kernel: registers, spills.)

1. Smoke: the first check case, with the default plan and with each variant, each in a
   subprocess with a time limit, so that a kernel that hangs (a barrier protocol error)
   is reported as such instead of stalling the run; variants that hang are dropped.
2. Correctness, bf16, D 128, stride 8, GQA 32:8, fresh random inputs per case (every
   case with the default plan of each layout, the other variants on the first two, those
   with paired row tiles on every causal case: they change only causal calls):
   against the plain-JAX reference (run one KV group of heads at a time, so that 64K fits) and
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
   the default plan, each variant, and each layout's default plan leaving one stage out
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


def triton_sums(geom: Geometry, causal: bool):
    triton = impls.Implementation("triton")
    return jax.jit(functools.partial(triton.block_sums, geom=geom, causal=causal, norm=1.0))


def label(options: dict) -> str:
    """A plan variant as printed: its layout of the queries, then its other options."""
    rest = {key: value for key, value in options.items() if key != "queries"}
    return f"{options.get('queries', estimate_plan.QUERIES)} {rest or 'default'}"


def mosaic_sums(geom: Geometry, causal: bool, **plan_options):
    plan = estimate_plan.estimate_plan(geom, jnp.bfloat16, causal=causal, **plan_options)
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
    print(f"{'PASS' if ok else 'FAIL'} {name} [{label(plan_options)}]: rel err vs reference "
          f"{err:.2e}, vs triton {triton_err:.2e}, row sums rel err {rows_err:.2e}, NaN "
          f"{nans}, causal zeros {zeros}, rerun identical {identical}, first call "
          f"{first_s:.1f}s ({plan.queries} queries, {plan.rows} rows per CTA, stages "
          f"{plan.stages}, block_k {plan.block_k}, smem "
          f"{plan.smem_bytes(2)}, scratch {plan.scratch_bytes / 2**20:.0f} MiB)", flush=True)
    return ok


def variant_cases(options: dict) -> list:
    """The check cases of a variant other than a layout's default plan: with paired row
    tiles, every causal case (3 row tiles of 128 rows in the odd one); else a causal and
    a non-causal case."""
    if options.get("pair_rows"):
        return [case for case in CHECK_CASES if case[3]]
    return CHECK_CASES[:2]


def run_checks(layouts, variants) -> None:
    """Every case with each layout's default plan (`layouts`: plan options), each other
    variant on its `variant_cases`."""
    runs = [(options, CHECK_CASES, 0) for options in layouts]
    runs += [(options, variant_cases(options), 100) for options in variants]
    for options, cases, seed_offset in runs:
        for name, seed, shape, causal in cases:
            try:
                check_case(name, seed + seed_offset, shape, causal, **options)
            except Exception:
                print(f"ERROR {name} [{label(options)}]:", flush=True)
                traceback.print_exc()
                sys.stdout.flush()


def _kernel_only(geom: Geometry, causal: bool, plan):
    """The Mosaic kernel alone on pre-padded, pre-reshaped inputs (no epilogue): run(q5,
    k5) on q and k as `strided(x, padded_tokens)` gives them, all keys in use."""
    from xattn_jax.mosaic import tile_stats
    from xattn_jax.row_statistics import LOG2_E

    # all keys in use (no tail tile), the call's first row 0 and first head 0
    scalars = jnp.array([geom.k_cols * STRIDE, 0, 0], jnp.int32)
    run = jax.jit(lambda q5, k5: tile_stats.tile_stats(
        q5, k5, None, None, scalars, plan=plan, causal=causal, scale=geom.scale * LOG2_E))

    def strided(x, length):
        x = jnp.pad(x, ((0, 0), (0, 0), (0, length - x.shape[2]), (0, 0)))
        return x.reshape(x.shape[0], x.shape[1], length // STRIDE, STRIDE, HEAD_DIM)

    return run, strided


def run_timing(layouts, variants, cases=TIMED) -> None:
    """Times the plans of `layouts` (plan options: the default plan, each other layout's
    default plan; also timed leaving stages out) and `variants`, and Triton."""
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
        timed += [(f"mosaic {label(options)}",
                   functools.partial(lambda o: mosaic_sums(geom, causal, **o)[1], options))
                  for options in layouts + variants]
        for impl, make in timed:
            try:
                ms = time_ms(make(), [(q, k)], warmup=3, reps=10)
                rows.append((case, impl, ms, flops / ms / 1e9, ms / floor))
                print(f"{case} {impl}: {ms:.3f} ms", flush=True)
            except Exception:
                print(f"ERROR timing {case} {impl}:", flush=True)
                traceback.print_exc()
                sys.stdout.flush()
        leave_out = [{**options, "leave_out": stage} for options in layouts
                     for stage in estimate_plan.LEAVE_OUT]
        for options in layouts + variants + leave_out:
            try:
                plan = estimate_plan.estimate_plan(geom, jnp.bfloat16, causal=causal,
                                                   **options)
                run, strided = _kernel_only(geom, causal, plan)
                q5 = strided(q, plan.padded_rows * STRIDE)
                k5 = strided(k, plan.padded_cols * STRIDE)
                ms = time_ms(run, [(q5, k5)], warmup=3, reps=10)
                rows.append((case, f"  kernel alone {label(options)}", ms,
                             flops / ms / 1e9, ms / floor))
                del q5, k5
            except Exception:
                print(f"ERROR timing {case} kernel alone [{label(options)}]:", flush=True)
                traceback.print_exc()
        del q, k
    print(f"\n{jax.devices()[0].device_kind}, jax {jax.__version__}; block sums "
          "(sections 1-3), bf16, D 128, stride 8, Hq 32")
    print(f"{'case':20s} {'impl':60s} {'ms':>8s} {'TFLOP/s':>8s} {'/floor':>7s} "
          f"{'vs triton':>9s}")
    triton_ms = {case: ms for case, impl, ms, _, _ in rows if impl == "triton"}
    for case, impl, ms, tflops, ratio in rows:
        speedup = f"{triton_ms[case] / ms:8.2f}x" if case in triton_ms else "      n/a"
        print(f"{case:20s} {impl:60s} {ms:8.3f} {tflops:8.1f} {ratio:7.2f} {speedup}")
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
        print(f"SMOKE HANG [{label(options)}]: the first case did not finish in "
              f"{SMOKE_LIMIT_S}s (barrier protocol deadlock?)", flush=True)
        return "hang"
    print(f"smoke [{label(options)}]: exit code {done.returncode}", flush=True)
    return "pass" if done.returncode == 0 else "fail"


def _ints(text: str | None) -> list[int | None]:
    return [None] if not text else [int(x) for x in text.split(",")]


def _flags(text: str | None) -> list[bool | None]:
    return [None if x is None else bool(x) for x in _ints(text)]


# ordered_stats and step_loop have no default here: they depend on the call (ordered
# statistics in non-causal calls, the step loop in causal calls in key groups), so a
# value given is always timed as a variant
VARIANT_KEYS = ("queries", "block_k", "stages", "cluster", "stagger", "pair_rows",
                "ordered_stats", "trim_columns", "step_loop")


def default_options(queries: str) -> dict:
    """The value each variant option takes in the default plan of the `queries` layout
    (stages: the most that fit)."""
    return {"queries": estimate_plan.QUERIES, "block_k": estimate_plan.BLOCK_K[queries],
            "cluster": estimate_plan.CLUSTER,
            "stagger": estimate_plan.default_stagger(queries),
            "pair_rows": estimate_plan.PAIR_ROWS,
            "trim_columns": estimate_plan.default_trim_columns(
                estimate_plan.BLOCK_K[queries])}


def plan_variants(layouts, block_k, stages, cluster, stagger=(None,),
                  pair_rows=(None,), ordered_stats=(None,),
                  trim_columns=(None,), step_loop=(None,)) -> list[dict]:
    """Every combination of the given values as plan options, without the options the
    default plan of its layout has anyway, each once, the default plan itself left out."""
    variants = []
    for values in itertools.product(layouts, block_k, stages, cluster, stagger, pair_rows,
                                    ordered_stats, trim_columns, step_loop):
        defaults = default_options(values[0] or estimate_plan.QUERIES)
        options = {key: value for key, value in zip(VARIANT_KEYS, values)
                   if value is not None and defaults.get(key) != value}
        if options and options not in variants:
            variants.append(options)
    return variants


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queries", default=",".join(estimate_plan.QUERY_LAYOUTS),
                        help="comma-separated layouts of the queries to try (default "
                             f"{','.join(estimate_plan.QUERY_LAYOUTS)})")
    parser.add_argument("--block-k", help="comma-separated block_k values to try")
    parser.add_argument("--stages", help="comma-separated stages values to try")
    parser.add_argument("--cluster", default="1,2,4",
                        help="comma-separated cluster sizes to try (default 1,2,4)")
    parser.add_argument("--stagger", help="comma-separated stagger values to try (0, 1)")
    parser.add_argument("--pair-rows",
                        help="comma-separated pair_rows values to try (0, 1): two row "
                             "tiles per CTA in causal calls, streamed queries only")
    parser.add_argument("--ordered-stats",
                        help="comma-separated ordered_stats values to try (0, 1): consumer "
                             "1's statistics of a tile after consumer 0's, streamed "
                             "queries only")
    parser.add_argument("--trim-columns",
                        help="comma-separated trim_columns values to try (0: masked key "
                             "tiles computed whole)")
    parser.add_argument("--step-loop",
                        help="comma-separated step_loop values to try (0: a key tile's "
                             "steps unrolled; n: a loop unrolled n times), streamed "
                             "queries only")
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
    queries = args.queries.split(",")
    unknown = [layout for layout in queries if layout not in estimate_plan.QUERY_LAYOUTS]
    if unknown:
        parser.error(f"unknown --queries {unknown}; choose from "
                     f"{list(estimate_plan.QUERY_LAYOUTS)}")
    if args.ptxas:  # read by Mosaic GPU when it compiles, inherited by the smoke process
        os.environ["MOSAIC_GPU_DUMP_PTXAS"] = "1"
    # The default plan first, then each other layout's default plan: every check case,
    # and the timing leaving stages out too; then the other variants.
    layouts = [{}] + plan_variants(queries, [None], [None], [None])
    variants = plan_variants(queries, _ints(args.block_k), _ints(args.stages),
                             _ints(args.cluster), _flags(args.stagger),
                             _flags(args.pair_rows), _flags(args.ordered_stats),
                             _ints(args.trim_columns), _ints(args.step_loop))
    variants = [options for options in variants if options not in layouts]
    started = time.perf_counter()
    print(f"jax {jax.__version__}, devices {jax.devices()}, "
          f"mosaic.available() = {mosaic.available()!r}", flush=True)
    if mosaic.available() is not None:
        return
    geom = ESTIMATE["causal-64k"].geom()
    for options in layouts:
        plan = estimate_plan.estimate_plan(geom, jnp.bfloat16, causal=True, **options)
        print(f"plan [{label(options)}] at causal-64k: {plan}, smem {plan.smem_bytes(2)} "
              f"B, scratch {plan.scratch_bytes / 2**20:.0f} MiB", flush=True)
    for options in list(variants):
        try:
            estimate_plan.estimate_plan(geom, jnp.bfloat16, causal=True, **options)
        except ValueError as error:
            print(f"variant [{label(options)}] dropped: {error}", flush=True)
            variants.remove(options)
    print(f"layouts {layouts}, variants {variants}", flush=True)
    outcome = "skipped" if args.no_smoke else smoke({})
    if outcome == "hang":
        return
    if not args.no_smoke:
        layouts = [{}] + [v for v in layouts[1:] if smoke(v) != "hang"]
        variants = [v for v in variants if smoke(v) != "hang"]
    if not args.skip_check:
        run_checks(layouts, variants)
    if not args.skip_time and outcome != "fail":
        run_timing(layouts, variants, cases)
    print(f"total {time.perf_counter() - started:.0f}s", flush=True)


if __name__ == "__main__":
    main()
