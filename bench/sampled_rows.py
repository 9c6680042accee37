"""Times the sampled-rows estimate beside the antidiagonal one, in one run on one GPU.

    python -m bench.sampled_rows [--cases NAME,...] [--impl auto] [--rounds 2]
                                 [--json PATH] [--small]

Llama-3.1-8B's attention (Hq 32 reading Hkv 8 in place, D 128), bf16, random data.
Rows per case, each the median device time per call (`bench.common.time_ms`), its two
estimates timed in alternation over `--rounds` rounds (the median of the rounds' medians):
- `llama-causal-32k`, `llama-causal-128k` (block 128, stride 8): "antidiagonal",
  `xattn_estimate` (block sums and mask); "sampled-rows", `sampled_block_mass` (16 rows
  per block) and `select_blocks` at the same threshold, jitted as one (`xattention`'s
  estimate);
- `chunk4096-ctx128k`: a chunk of 4096 queries over 128K cached keys (a traced count),
  `kv_block_scores` (KV blocks 4096, estimate blocks 1024) and `select_kv_blocks`, with
  `estimate="antidiagonal"` or `"sampled-rows"` (128 rows per estimate block: every 8th
  query).
Both estimates multiply the same q.k pairs (the sampled rows take 8x the exponentials),
so both rows share one floor: the strided product's FLOPs at 753 TFLOP/s, beside the
same run's matmul rate (`matmul_tflops`); extra_mib: the compiled call's outputs and
temporaries. The report ends with each case's sampled-rows / antidiagonal time.
`--impl`: the backend of both estimates (default "auto"). `--small` shrinks the sizes
(heads 4 over 2, D 64, lengths / 16) for a CPU smoke run, whose times mean nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench.common import (JSON_HELP, Sizes, floor_ms, jax_extra_mib, log,  # noqa: E402
                          matmul_tflops, merge_json, print_report, record, strided_flops,
                          time_ms)
from xattn_jax import (kv_block_scores, sampled_block_mass, select_blocks,  # noqa: E402
                       select_kv_blocks, xattn_estimate)
from xattn_jax.defaults import ORIGINAL_THRESHOLD  # noqa: E402

ESTIMATES = ("antidiagonal", "sampled-rows")
FULL = Sizes()  # Llama-3.1-8B's heads; the chunk's blocks of bench.chunked
SMALL = Sizes(q_heads=4, kv_heads=2, head_dim=64, kv_block=256, estimate_block=64)
SMALL_LENGTHS = 16  # --small divides the lengths by this


@dataclasses.dataclass(frozen=True)
class Case:
    """q `[1, Hq, q_len, D]` at the end of k `[1, Hkv, k_len, D]`; chunk: a chunk over a
    cache (kv_block_scores), else a whole causal prompt; reps: timed batches."""

    q_len: int
    k_len: int
    chunk: bool
    reps: int

    def flops(self, sz: Sizes) -> float:
        return strided_flops(sz.q_heads, self.q_len, self.k_len, sz.stride, sz.head_dim,
                             causal=not self.chunk)


CASES = {"llama-causal-32k": Case(32768, 32768, False, 20),
         "llama-causal-128k": Case(131072, 131072, False, 5),
         "chunk4096-ctx128k": Case(4096, 131072, True, 10)}


def estimate_call(case: Case, sz: Sizes, estimate: str, impl: str):
    """The jitted estimate (`xattn_estimate`'s threshold for both): `(q, k, k_len)` ->
    (scores, mask)."""
    if case.chunk:
        def chunk_call(q, k, k_len):
            scores = kv_block_scores(q, k, kv_block_size=sz.kv_block,
                                     estimate_block_size=sz.estimate_block,
                                     stride=sz.stride, k_len=k_len, impl=impl,
                                     estimate=estimate)
            return scores, select_kv_blocks(scores, threshold=ORIGINAL_THRESHOLD)
        return jax.jit(chunk_call)

    def prompt_call(q, k, k_len):
        del k_len  # a whole prompt: every key
        if estimate == "antidiagonal":
            return xattn_estimate(q, k, block_size=sz.block, stride=sz.stride, impl=impl)
        scores = sampled_block_mass(q, k, block_size=sz.block, impl=impl)
        return scores, select_blocks(scores, ORIGINAL_THRESHOLD, impl=impl)
    return jax.jit(prompt_call)


def run_case(name: str, case: Case, sz: Sizes, impl: str,
             rounds: int) -> tuple[list[dict], str]:
    """The case's two records and its line of the report's ratios."""
    keys = jax.random.split(jax.random.PRNGKey(case.k_len), 2)
    q = jax.random.normal(keys[0], (1, sz.q_heads, case.q_len, sz.head_dim), jnp.bfloat16)
    k = jax.random.normal(keys[1], (1, sz.kv_heads, case.k_len, sz.head_dim), jnp.bfloat16)
    args = (q, k, jnp.int32(case.k_len))
    calls = {estimate: estimate_call(case, sz, estimate, impl) for estimate in ESTIMATES}
    ceiling = matmul_tflops()
    times = {estimate: [] for estimate in ESTIMATES}
    for r in range(rounds):
        for estimate, call in calls.items():
            times[estimate].append(time_ms(call, [args], warmup=2, reps=case.reps))
            log(f"{name} round {r + 1}, {estimate}: {times[estimate][-1]:.3f} ms")
    rows = []
    for estimate, call in calls.items():
        ms = statistics.median(times[estimate])
        label = f"xattn-jax {estimate}" + ("" if impl == "auto" else f" ({impl})")
        rows.append(record(name, label, ms, floor_ms(case.flops(sz)),
                           jax_extra_mib(call, *args), ceiling))
        rows[-1]["rounds_ms"] = [round(t, 4) for t in times[estimate]]
    ratio = rows[1]["ms"] / rows[0]["ms"]
    return rows, f"{name}: sampled-rows / antidiagonal = {ratio:.2f}"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES),
                        help="comma-separated names: " + ", ".join(CASES))
    parser.add_argument("--impl", default="auto",
                        help="the backend of both estimates: auto, triton, mosaic, reference")
    parser.add_argument("--rounds", type=int, default=2,
                        help="rounds of the two estimates timed in alternation")
    parser.add_argument("--json", help=JSON_HELP)
    parser.add_argument("--small", action="store_true", help="tiny sizes, for a CPU run")
    args = parser.parse_args(argv)
    names = args.cases.split(",")
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {unknown}; choose from {list(CASES)}")
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    records, ratios = [], []
    for i, name in enumerate(names):
        log(f"[{i + 1}/{len(names)}] {name}")
        case, sz = CASES[name], SMALL if args.small else FULL
        if args.small:
            case = dataclasses.replace(case, q_len=case.q_len // SMALL_LENGTHS,
                                       k_len=case.k_len // SMALL_LENGTHS, reps=2)
        rows, ratio = run_case(name, case, sz, args.impl, args.rounds)
        records += rows
        ratios.append(ratio)
        if args.json:  # after every case, so a cut-short run keeps what it measured
            merge_json(args.json, records)
    print_report(records)
    print("\n" + "\n".join(ratios))


if __name__ == "__main__":
    main()
