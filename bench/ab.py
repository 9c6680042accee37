"""A/B of two versions of xattn_jax in one process, case by case, in alternation.

    python -m bench.ab --old PATH [--cases NAME,...] [--rounds 3] [--impl NAME] [--json OUT]

PATH is a checkout of the other version (e.g. `git worktree add /tmp/old COMMIT`). Its
`xattn_jax` is imported under the name `xattn_old` (a copy with its imports renamed), so
both versions share one process, one GPU state and one clock history; each round times
the old then the new version of every case (back-to-back medians, `bench.common.time_ms`),
and the report gives each side's median over the rounds and the new / old ratio. The
cases are `bench.estimate`'s (the estimate) and `bench.chunked`'s chunk rows (kv_block_scores
then select_kv_blocks over a 4096-token chunk). Both versions are called through their
public API with the Triton-backend kernels (`impl` "pallas" or "triton", whichever the
version names), or with `--impl` another implementation both have (e.g. "mosaic" on
Hopper).
"""

from __future__ import annotations

import argparse
import importlib
import pathlib
import shutil
import statistics
import sys
import tempfile

import jax
import jax.numpy as jnp

from bench.cases import CHUNK, ESTIMATE
from bench.common import JSON_HELP, floor_ms, log, merge_json, record, time_ms

DEFAULT_CASES = [name for name in ESTIMATE
                 if not name.startswith(("noncausal-16k", "noncausal-32k"))] + list(CHUNK)


def load_renamed(path: str, name: str = "xattn_old"):
    """The package `xattn_jax` of the checkout at `path`, imported as `name`."""
    target = pathlib.Path(tempfile.mkdtemp()) / name
    shutil.copytree(pathlib.Path(path) / "xattn_jax", target)
    for source in target.rglob("*.py"):
        source.write_text(source.read_text().replace("xattn_jax", name))
    sys.path.insert(0, str(target.parent))
    return importlib.import_module(name)


def kernel_impl(module) -> str:
    """The name a version gives its Triton-backend kernels."""
    impls = getattr(module, "impls", None)
    return "triton" if impls is not None and "triton" in impls.IMPLS else "pallas"


def case_shape(name: str):
    """The `bench.cases.Shape` of a chunk row or an estimate case."""
    return CHUNK.get(name) or ESTIMATE[name]


def case_fn(module, name: str, impl: str | None = None):
    """(fn, args) of one case, for one version: its `impl` (default `kernel_impl`)."""
    impl = impl or kernel_impl(module)
    shape = case_shape(name)
    q, k = shape.random_qk(len(name))
    if name in CHUNK:
        @jax.jit
        def chunk(q, k, k_len):
            scores = module.kv_block_scores(q, k, kv_block_size=4096,
                                            estimate_block_size=shape.block_size,
                                            stride=shape.stride, k_len=k_len, impl=impl)
            return scores, module.select_kv_blocks(scores, threshold=0.95)

        return chunk, (q, k, jnp.int32(shape.k_len))

    def estimate(q, k):
        return module.xattn_estimate(q, k, block_size=shape.block_size, stride=shape.stride,
                                     causal=shape.causal, impl=impl)

    return estimate, (q, k)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", required=True, help="checkout of the other version")
    parser.add_argument("--cases", default=",".join(DEFAULT_CASES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--impl", help="the impl both versions run (default: each "
                        "version's Triton-backend kernels)")
    parser.add_argument("--json", help=JSON_HELP)
    args = parser.parse_args(argv)
    import xattn_jax as new

    old = load_renamed(args.old)
    names = args.cases.split(",")
    rows, records = [], []
    for i, name in enumerate(names):
        log(f"[{i + 1}/{len(names)}] {name}")
        fns = {label: case_fn(module, name, args.impl)
               for label, module in (("old", old), ("new", new))}
        reps = 2 if name == "causal-1m" else 10
        times = {"old": [], "new": []}
        for _ in range(args.rounds):
            for label, (fn, fn_args) in fns.items():
                times[label].append(time_ms(fn, [fn_args], warmup=2, reps=reps))
        old_ms, new_ms = (statistics.median(times[label]) for label in ("old", "new"))
        log(f"  old {old_ms:.3f} ms, new {new_ms:.3f} ms, new / old {new_ms / old_ms:.3f}")
        floor = floor_ms(case_shape(name).strided_flops())
        rows.append((name, old_ms, new_ms, floor, times))
        impl = f" {args.impl}" if args.impl else ""
        records += [record(name, f"xattn-jax {label}{impl}", ms, floor, float("nan"))
                    for label, ms in (("old", old_ms), ("new", new_ms))]
        if args.json:
            merge_json(args.json, records)
        del fns
    print("| case | old ms (x floor) | new ms (x floor) | new / old | rounds old | rounds new |")
    print("|---|---|---|---|---|---|")
    for name, old_ms, new_ms, floor, times in rows:
        print(f"| {name} | {old_ms:.3f} ({old_ms / floor:.2f}) | {new_ms:.3f} "
              f"({new_ms / floor:.2f}) | {new_ms / old_ms:.3f} | "
              + " ".join(f"{t:.3f}" for t in times["old"]) + " | "
              + " ".join(f"{t:.3f}" for t in times["new"]) + " |")


if __name__ == "__main__":
    main()
