"""Times the seed's chunked-prefill selection: a chunk of queries against a KV cache.

    python -m bench.chunked [--contexts 16k,32k,64k,128k] [--impls auto,triton,mosaic]
                            [--json PATH] [--compare-original PATH] [--small]

Rows (bf16, Hq = 32 reading Hkv = 8 in place, D = 128, stride 8, chunk 4096, KV blocks
4096, estimate blocks 1024, threshold 0.95):
- `chunk4096-ctx{N}`: `kv_block_scores` + `select_kv_blocks` in one jitted call on a
  contiguous cache, device time per call (`bench.common.time_ms`), against the floor
  (strided-product FLOPs at 753 TFLOP/s) and the floor at the rate of the 8192^3 matmul
  timed just before (`bench.common.matmul_tflops`, the same run's ceiling);
- with `--compare-original PATH`: the original kernels on the same inputs, K repeated to
  Hq as the seed's engine does, block sums at 4096 directly (`impl` "original", the
  seed's baseline) and at 1024 summed up to 4096 (case suffix `-hier1024`).
`XAttentionPolicy.select_blocks` on a torch cache is timed against these kernels by
`bench.torch_path`.
`--impls`: the implementations of ours timed on each context, one after the other
(default "auto"; rows name them as `bench.estimate` does).
`--small` shrinks every size (contexts by 8) for a CPU smoke run; there the default
implementation is the reference and the floors mean nothing.
Their records are kept in bench/results/estimate.json beside `bench.estimate`'s: `--json`
merges a run's rows into a file by case, implementation and GPU (`bench.common.merge_json`).
"""

from __future__ import annotations

import argparse
import functools

import xattn_torch_bridge  # noqa: F401  first: configures JAX's GPU memory

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench.common import (JSON_HELP, Sizes, floor_ms, jax_extra_mib,  # noqa: E402
                          log, matmul_tflops, merge_json, print_report, record,
                          strided_flops, time_ms)
from bench.estimate import impl_label  # noqa: E402
from xattn_jax import kv_block_scores, select_kv_blocks  # noqa: E402


FULL = Sizes()
SMALL = Sizes(q_heads=4, kv_heads=2, head_dim=64, chunk=512, kv_block=512, estimate_block=128)


def tokens(text: str) -> int:
    return int(text[:-1]) * 1024 if text.endswith("k") else int(text)


def inputs(context: int, sz: Sizes) -> tuple[jax.Array, jax.Array]:
    keys = jax.random.split(jax.random.PRNGKey(context), 2)
    q = jax.random.normal(keys[0], (1, sz.q_heads, sz.chunk, sz.head_dim), jnp.bfloat16)
    k = jax.random.normal(keys[1], (1, sz.kv_heads, context, sz.head_dim), jnp.bfloat16)
    return q, k


def floor_of(context: int, sz: Sizes) -> float:
    return floor_ms(strided_flops(sz.q_heads, sz.chunk, context, sz.stride, sz.head_dim,
                                  causal=False))


def kernel_rows(name: str, context: int, sz: Sizes, impls=("auto",)) -> list[dict]:
    q, k = inputs(context, sz)
    args = (q, k, jnp.int32(context))
    floor = floor_of(context, sz)
    ceiling = matmul_tflops()
    rows = []
    for impl in impls:
        @jax.jit
        def fn(q, k, k_len):
            scores = kv_block_scores(q, k, kv_block_size=sz.kv_block,
                                     estimate_block_size=sz.estimate_block,
                                     stride=sz.stride, k_len=k_len, impl=impl)
            return scores, select_kv_blocks(scores, threshold=sz.threshold)

        ms = time_ms(fn, [args], warmup=3, reps=30)
        label = impl_label(impl)
        log(f"chunk{sz.chunk}-ctx{name}, {label}: {ms:.3f} ms, {ms / floor:.2f} x floor")
        rows.append(record(f"chunk{sz.chunk}-ctx{name}", label, ms, floor,
                           jax_extra_mib(fn, *args), ceiling))
    return rows


def _original_rows(name: str, context: int, sz: Sizes, original) -> list[dict]:
    q, k = inputs(context, sz)
    case, rows, ceiling = f"chunk{sz.chunk}-ctx{name}", [], matmul_tflops()
    for block, label in ((sz.kv_block, case),
                         (sz.estimate_block, f"{case}-hier{sz.estimate_block}")):
        try:
            ms, mib = original.time_kv_scores(q, k, block_size=block,
                                              kv_block_size=sz.kv_block, stride=sz.stride,
                                              reps=30)
        except original.Unsupported as why:
            log(f"{label}: original skipped ({why})")
            continue
        rows.append(record(label, "original", ms, floor_of(context, sz), mib, ceiling))
        log(f"{label}: original {ms:.3f} ms")
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="16k,32k,64k,128k")
    parser.add_argument("--impls", default="auto",
                        help="comma-separated implementations of ours to time: auto, "
                             "triton, mosaic")
    parser.add_argument("--json", help=JSON_HELP)
    parser.add_argument("--compare-original", metavar="PATH",
                        help="a checkout of mit-han-lab/x-attention to time side by side")
    parser.add_argument("--small", action="store_true", help="tiny sizes, for a CPU run")
    args = parser.parse_args(argv)
    sz = SMALL if args.small else FULL
    original = None
    if args.compare_original:
        from bench import original as original_module
        original_module.load(args.compare_original)
        original = original_module
    records = []
    contexts = [tokens(text) // (8 if args.small else 1) for text in args.contexts.split(",")]
    # Ours first, the original after: a chunk call lasts half a millisecond, and ours
    # measured 10-15% slower right after the original's kernels had run in the process
    # (docs/tuning.md: bench-ours-first).
    runs = [(functools.partial(kernel_rows, impls=args.impls.split(",")), "xattn-jax")]
    if original is not None:
        runs.append((functools.partial(_original_rows, original=original), "original"))
    for run, what in runs:
        for i, context in enumerate(contexts):
            log(f"{what} [{i + 1}/{len(contexts)}] context {context} tokens")
            records += run(f"{context // 1024}k", context, sz)
            if args.json:
                merge_json(args.json, records)
    print_report(records)


if __name__ == "__main__":
    main()
