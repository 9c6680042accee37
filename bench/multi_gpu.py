"""Times the estimate on one GPU against a jax.jit over head-sharded inputs on all local GPUs.

    python -m bench.multi_gpu [--cases NAME,...] [--json PATH] [--smoke]

Cases (bf16, Hq = 32 reading Hkv = 8, D = 128, stride 8, random data):
- `causal-32k`, `causal-64k`: `xattn_estimate`, block 128;
- `chunk4096-ctx128k`: `kv_block_scores` + `select_kv_blocks` in one jitted call, as
  `bench.chunked` runs it (chunk 4096, KV blocks 4096, estimate blocks 1024, threshold
  0.95, one selection over all heads).
Rows per case: impl "1gpu" (inputs on device 0), "{n}gpu" (the same function under
`jax.jit`, q and k sharded `NamedSharding(mesh, P(None, "h"))` over a 1-D mesh of all n
local devices, as a serving stack calls it) and "{n}gpu-shard_map" (the same function
inside a hand-written `jax.shard_map` over the head axis: the target the partitioning
rules should match). Each row records ms (`bench.common.time_ms`), floor_ms (strided-
product FLOPs at 753 TFLOP/s, divided by n for the sharded rows), `speedup` (1gpu ms /
this row's ms), `collectives` (the collective ops in the compiled program: none for the
estimate; in the chunk case the selection, plain XLA ops, needs small all-reduces of
`[1, 32]` across head shards: the heads' mean and the blocks holding no key) and how its
results differ from the one-GPU row's: `max_abs_diff` of the scores and
`mask_mismatches`, the differing mask entries (a call over fewer heads may take other
kernel steps: float rounding).

On the 2-GPU machine (after `pip install -e '.[test]'` with jax[cuda13]):

    python -m bench.multi_gpu --json bench/results/multi_gpu.json

4 and 8 GPUs follow the same rules (xattn_jax/partitioning.py): Hkv = 8 divides into 2,
4 or 8 head shards, so every GPU holds whole KV groups (its Hq / n query heads and their
Hkv / n KV heads), computes them with no communication and returns its heads of the
results; the expected time is about 1/n of one GPU's plus a fixed launch cost. More head
shards than KV heads (16 GPUs on Hkv = 8) split heads inside a group: k is then read whole
on every GPU and each copies out its KV head first.

`--smoke` runs tiny sizes on 4 simulated CPU devices (the reference implementation), to
check that the script runs; its times mean nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

# stdlib only: JAX stays unimported until --smoke's flags
from bench.common import JSON_HELP, Sizes, log, merge_json, print_report

COLLECTIVES = ("all-gather", "all-reduce", "collective-permute", "all-to-all",
               "reduce-scatter")
SMOKE_DEVICES = 4


@dataclasses.dataclass(frozen=True)
class Case:
    q_len: int
    k_len: int
    causal: bool = True
    chunked: bool = False


FULL = Sizes()
SMOKE = Sizes(q_heads=8, kv_heads=4, head_dim=16, block=16, kv_block=64, estimate_block=16)
CASES = {"causal-32k": Case(32768, 32768), "causal-64k": Case(65536, 65536),
         "chunk4096-ctx128k": Case(4096, 131072, causal=False, chunked=True)}
SMOKE_SCALE = 256  # --smoke divides every length by this


def _function(case: Case, sz: Sizes):
    from xattn_jax import kv_block_scores, select_kv_blocks, xattn_estimate

    if not case.chunked:
        def estimate(q, k):
            return xattn_estimate(q, k, block_size=sz.block, stride=sz.stride,
                                  causal=case.causal)
        return estimate

    def chunk(q, k):
        scores = kv_block_scores(q, k, kv_block_size=sz.kv_block,
                                 estimate_block_size=sz.estimate_block, stride=sz.stride)
        return scores, select_kv_blocks(scores, threshold=sz.threshold)
    return chunk


def run_case(name: str, case: Case, sz: Sizes) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from bench.common import floor_ms, jax_extra_mib, record, strided_flops, time_ms

    devices = jax.local_devices()
    n = len(devices)
    keys = jax.random.split(jax.random.PRNGKey(len(name)), 2)
    q = jax.random.normal(keys[0], (1, sz.q_heads, case.q_len, sz.head_dim), jnp.bfloat16)
    k = jax.random.normal(keys[1], (1, sz.kv_heads, case.k_len, sz.head_dim), jnp.bfloat16)
    fn = _function(case, sz)
    floor = floor_ms(strided_flops(sz.q_heads, case.q_len, case.k_len, sz.stride,
                                   sz.head_dim, case.causal))
    mesh = Mesh(np.array(devices), ("h",))
    heads = NamedSharding(mesh, P(None, "h"))
    one = [jax.device_put(x, devices[0]) for x in (q, k)]
    sharded = [jax.device_put(x, heads) for x in (q, k)]
    runs = [("1gpu", fn, one, floor), (f"{n}gpu", fn, sharded, floor / n)]
    if not case.chunked:  # a selection over all heads is no per-shard computation
        mapped = jax.shard_map(fn, mesh=mesh, in_specs=(P(None, "h"),) * 2,
                               out_specs=(P(None, "h"),) * 2)
        runs.append((f"{n}gpu-shard_map", mapped, sharded, floor / n))
    rows, base, base_out = [], None, None
    for impl, f, args, row_floor in runs:
        jitted = jax.jit(f)
        text = jitted.lower(*args).compile().as_text()
        found = [c for c in COLLECTIVES if c in text]
        out = [np.asarray(x) for x in jax.tree.leaves(jitted(*args))]
        base_out = base_out or out
        ms = time_ms(jitted, [args], warmup=3, reps=20)
        base = base or ms
        row = record(name, impl, ms, row_floor, jax_extra_mib(f, *args))
        row.update(speedup=round(base / ms, 3), collectives=found,
                   devices=1 if impl == "1gpu" else n, **_differences(out, base_out))
        rows.append(row)
        log(f"{name} {impl}: {ms:.3f} ms, {ms / row_floor:.2f} x floor, speed-up "
            f"{base / ms:.2f}, collectives {found or 'none'}, scores differ from 1gpu by "
            f"{row['max_abs_diff']:.3g}, {row['mask_mismatches']} mask entries differ")
    return rows


def _differences(out: list, base: list) -> dict:
    """How a row's results differ from the one-GPU row's: the largest difference of the
    float results, and the count of differing entries of the bool ones."""
    import numpy as np

    floats = [np.abs(a.astype(np.float32) - b.astype(np.float32)).max()
              for a, b in zip(out, base) if a.dtype != bool]
    return {"max_abs_diff": float(max(floats)),
            "mask_mismatches": int(sum((a != b).sum() for a, b in zip(out, base)
                                       if a.dtype == bool))}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES),
                        help="comma-separated, from: " + ", ".join(CASES))
    parser.add_argument("--json", help=JSON_HELP)
    parser.add_argument("--smoke", action="store_true",
                        help=f"tiny sizes on {SMOKE_DEVICES} simulated CPU devices")
    args = parser.parse_args(argv)
    names = args.cases.split(",")
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {unknown}; choose from {list(CASES)}")
    if args.smoke:  # before JAX starts its backends
        if "jax" in sys.modules:
            parser.error("--smoke must set XLA_FLAGS before JAX is imported")
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_"
                                   f"platform_device_count={SMOKE_DEVICES}").strip()
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    sz = SMOKE if args.smoke else FULL
    records = []
    for i, name in enumerate(names):
        case = CASES[name]
        if args.smoke:
            case = dataclasses.replace(case, q_len=case.q_len // SMOKE_SCALE,
                                       k_len=case.k_len // SMOKE_SCALE)
        log(f"[{i + 1}/{len(names)}] {name}")
        records += run_case(name, case, sz)
        if args.json:
            merge_json(args.json, records)
    print_report(records)
    print("\n| case | impl | speed-up | collectives |\n|---|---|---|---|")
    for r in records:
        print(f"| {r['case']} | {r['impl']} | {r['speedup']:.2f} | "
              f"{', '.join(r['collectives']) or 'none'} |")


if __name__ == "__main__":
    main()
