"""Times the whole `xattn_estimate` (block sums and mask) on the GPU against its floor.

    python -m bench.estimate [--cases NAME,...|all] [--impls auto,triton,mosaic]
                             [--max-scratch-mib N] [--json PATH] [--compare-original PATH]

bf16, Hq = 32, D = 128, stride 8, random data. Every row reports the median device time
per call (`bench.common.time_ms`: back-to-back calls; the original: CUDA events), the
floor (strided-product FLOPs at the measured 753 TFLOP/s), their ratio and the extra GPU
memory of one call (outputs plus XLA temporaries, beyond the inputs), and the ratio to
the floor at the rate of the 8192^3 matmul timed the same way just before the case
(`bench.common.matmul_tflops`: the same run's ceiling, under the same power cap). With
`--compare-original PATH`, the original mit-han-lab/x-attention estimate from a checkout
at PATH is timed on the same inputs in the same run (see bench/original.py). `--impls`:
the implementations timed on each case, one after the other (default "auto", what a
caller gets: on Hopper the Mosaic block sums where they take the call); rows name them
"xattn-jax" ("auto") or "xattn-jax-NAME". `--max-scratch-mib N`: `xattn_estimate`'s
max_scratch_bytes (the kernels' workspace bound; their default without), appended to
the case names as "-scratchNm".
"""

from __future__ import annotations

import argparse
import os
import statistics

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax.numpy as jnp  # noqa: E402

from bench.cases import ESTIMATE, GQA_CASE  # noqa: E402
from bench.common import (JSON_HELP, floor_ms, jax_extra_mib, log,  # noqa: E402
                          matmul_tflops, merge_json, print_report, record, time_ms)
from xattn_jax import xattn_estimate  # noqa: E402

PAIRED_ROUNDS = 3  # GQA and its MHA twin alternate (docs/tuning.md: gqa-paired-rounds)
REPS = {"causal-128k": 5, "causal-1m": 2}  # timed batches per case; others by length
CASES = ESTIMATE


def _reps(shape) -> int:
    return REPS.get(shape.id, 20 if shape.k_len <= 32768 else 10)


def impl_label(impl: str) -> str:
    """A record's `impl` for one of ours: "xattn-jax" for "auto", else "xattn-jax-NAME"."""
    return "xattn-jax" if impl == "auto" else f"xattn-jax-{impl}"


def run_case(name: str, impls=("auto",), original=None,
             max_scratch_bytes: int | None = None) -> tuple[list[dict], list[str]]:
    """The case's records (ours for each of `impls`, then the original's if given) and
    notes for the report (none but for the GQA case, timed in alternation with MHA on the
    same values: its target is to be no slower than MHA, a difference smaller than the
    drift between rows timed minutes apart; MHA keys drawn at random on their own
    measured 1-2% apart from GQA's keys copied into MHA's layout)."""
    shape = CASES[name]
    reps, heads = _reps(shape), shape.q_heads
    q, k = shape.random_qk(len(name))
    floor = floor_ms(shape.strided_flops())
    ceiling = matmul_tflops()
    if ceiling is not None:
        log(f"{name}: the 8192^3 matmul now runs at {ceiling:.0f} TFLOP/s")
    rows, notes = [], []
    for impl in impls:
        def fn(q, k):
            return xattn_estimate(q, k, block_size=shape.block_size, stride=shape.stride,
                                  causal=shape.causal, impl=impl,
                                  max_scratch_bytes=max_scratch_bytes)

        label = impl_label(impl)
        case = name if max_scratch_bytes is None else f"{name}-scratch{max_scratch_bytes >> 20}m"
        if name == GQA_CASE:
            # MHA on the same values: K copied per query head, as the original does GQA
            k_mha = jnp.repeat(k, heads // shape.kv_heads, axis=1)
            times = {"GQA": [], "MHA": []}
            for _ in range(PAIRED_ROUNDS):
                for what, keys_of in (("GQA", k), ("MHA", k_mha)):
                    times[what].append(time_ms(fn, [(q, keys_of)], warmup=2, reps=reps))
            ms, mha_ms = (statistics.median(times[w]) for w in ("GQA", "MHA"))
            notes.append(
                f"{name}, {label}, timed in alternation with MHA (Hkv = 32, each key head "
                f"copied to its {heads // shape.kv_heads} query heads: the same scores) "
                f"over {PAIRED_ROUNDS} rounds: GQA {ms:.3f} ms (rounds "
                f"{', '.join(f'{t:.3f}' for t in times['GQA'])}), MHA {mha_ms:.3f} ms "
                f"(rounds {', '.join(f'{t:.3f}' for t in times['MHA'])})")
            log(notes[-1])
            del k_mha
        else:
            ms = time_ms(fn, [(q, k)], warmup=2, reps=reps)
        rows.append(record(case, label, ms, floor, jax_extra_mib(fn, q, k), ceiling))
        log(f"{case}, {label}: {ms:.3f} ms, {ms / floor:.2f} x floor, "
            f"{rows[-1]['extra_mib']:.0f} MiB")
    if original is not None:
        try:
            orig_ms, orig_mib = original.time_estimate(q, k, block_size=shape.block_size,
                                                       stride=shape.stride, causal=shape.causal,
                                                       reps=reps)
        except original.Unsupported as why:
            log(f"{name}: original skipped ({why})")
        else:
            rows.append(record(name, "original", orig_ms, floor, orig_mib, ceiling))
            log(f"{name}: original {orig_ms:.3f} ms, {orig_mib:.0f} MiB")
    del q, k
    return rows, notes


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="all",
                        help="comma-separated names, or 'all'; names: " + ", ".join(CASES))
    parser.add_argument("--impls", default="auto",
                        help="comma-separated implementations of ours to time: auto, "
                             "triton, mosaic")
    parser.add_argument("--max-scratch-mib", type=int,
                        help="xattn_estimate's max_scratch_bytes, in MiB")
    parser.add_argument("--json", help=JSON_HELP)
    parser.add_argument("--compare-original", metavar="PATH",
                        help="a checkout of mit-han-lab/x-attention to time side by side")
    args = parser.parse_args(argv)
    names = list(CASES) if args.cases == "all" else args.cases.split(",")
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {unknown}; choose from {list(CASES)}")
    original = None
    if args.compare_original:
        from bench import original as original_module
        original_module.load(args.compare_original)
        original = original_module
    records, notes = [], []
    for i, name in enumerate(names):
        log(f"[{i + 1}/{len(names)}] {name}")
        rows, case_notes = run_case(
            name, args.impls.split(","), original,
            None if args.max_scratch_mib is None else args.max_scratch_mib << 20)
        records += rows
        notes += case_notes
        if args.json:  # after every case, so a cut-short run keeps what it measured
            merge_json(args.json, records)
    print_report(records)
    for note in notes:
        print(f"\n{note}")


if __name__ == "__main__":
    main()
