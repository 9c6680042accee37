"""Measures Tiling variants of the fused block-sum kernel and checks each one first.

    python -m bench.tune [--variants R,C,W,S[,SPAN[,PASSES[,DEPTH]]];...] [--shapes NAME,...]

For every variant: block sums against the reference on small random inputs (float32 and
bfloat16, causal and not, GQA, odd lengths), then the median time on each shape with the
ratio to the floor. The table at the end is what chose `xattn_jax.tiling`. SPAN is the
one-pass kernel's key tiles per program (0: all of a row's), PASSES 1 or 2 (0: the
default choice), DEPTH the head-dim columns per pipeline step (0: all).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import floor_ms, log, strided_flops, time_ms
from xattn_jax import reference
from xattn_jax.checks import check_qk
from xattn_jax.triton.block_sums import block_sums, passes_for
from xattn_jax.triton.tiling import Tiling

SHAPES = {  # name: (Hq, Hkv, Lq, Lk, block_size, causal)
    "noncausal-64k-b64": (32, 32, 65536, 65536, 64, False),
    "noncausal-64k-b128": (32, 32, 65536, 65536, 128, False),
    "noncausal-64k-b4096": (32, 32, 65536, 65536, 4096, False),
    "causal-32k": (32, 32, 32768, 32768, 128, True),
    "causal-64k": (32, 32, 65536, 65536, 128, True),
    "chunk4096-ctx16k": (32, 8, 4096, 16384, 1024, False),
    "chunk4096-ctx64k": (32, 8, 4096, 65536, 1024, False),
}
DEFAULT_VARIANTS = ("128,256,8,4,8,1,64;128,256,8,4,2,1,64;128,256,8,4,0,1,64;"
                    "128,128,8,3,8,1;128,128,8,4,8,1,64;128,256,8,4,2,2,64")
CHECKS = [  # (Hq, Hkv, Lq, Lk, block_size, causal)
    (4, 2, 1000, 1000, 128, True), (4, 4, 777, 2000, 256, False), (2, 1, 512, 1536, 64, True)]


def _random(key, shape, dtype):
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def _variant(text: str) -> tuple[Tiling, int | None]:
    rows, cols, warps, stages, span, passes, depth = (list(map(int, text.split(",")))
                                                      + [0, 0, 0])[:7]
    return Tiling(rows, cols, warps, stages, span or None, depth or None), passes or None


def check(tiling: Tiling, passes: int | None) -> float:
    """Worst relative error of the variant's block sums over CHECKS on bf16 inputs.

    Both sides take the same inputs and accumulate in float32, so the error should be at
    float32 rounding level.
    """
    worst = 0.0
    key = jax.random.PRNGKey(np.random.default_rng().integers(2**31))
    for dtype in (jnp.bfloat16,):
        for hq, hkv, lq, lk, bs, causal in CHECKS:
            key, kq, kk = jax.random.split(key, 3)
            q = _random(kq, (1, hq, lq, 128), dtype)
            k = _random(kk, (1, hkv, lk, 128), dtype)
            geom = check_qk(q, k, stride=8, block_size=bs, causal=causal)
            want = reference.block_sums(q, k, geom, causal=causal, norm=1.0)
            got = block_sums(q, k, geom=geom, causal=causal, norm=1.0, tiling=tiling,
                             passes=passes)
            err = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
            worst = max(worst, err)
    return worst


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default=DEFAULT_VARIANTS,
                        help="rows,cols,num_warps,num_stages[,span[,passes[,depth"
                             "]]];... (default: %(default)s)")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="names from SHAPES")
    args = parser.parse_args(argv)
    variants = [_variant(v) for v in args.variants.split(";")]
    rows = []
    for tiling, passes in variants:
        log(f"checking {tiling}, passes {passes or 'default'}")
        try:
            err = check(tiling, passes)
        except jax.errors.JaxRuntimeError as e:  # e.g. the tile needs too much shared memory
            log(f"  failed: {str(e).splitlines()[0]}")
            continue
        times = {}
        for name in args.shapes.split(","):
            hq, hkv, q_len, k_len, bs, causal = SHAPES[name]
            keys = jax.random.split(jax.random.PRNGKey(0), 2)
            q = _random(keys[0], (1, hq, q_len, 128), jnp.bfloat16)
            k = _random(keys[1], (1, hkv, k_len, 128), jnp.bfloat16)
            geom = check_qk(q, k, stride=8, block_size=bs, causal=causal)
            fn = jax.jit(lambda q, k, g=geom, c=causal: block_sums(
                q, k, geom=g, causal=c, norm=1.0, tiling=tiling, passes=passes))
            try:
                times[name] = time_ms(fn, [(q, k)], warmup=2, reps=10)
            except jax.errors.JaxRuntimeError as e:
                log(f"  {name}: failed: {str(e).splitlines()[0]}")
                times[name] = float("nan")
                continue
            floor = floor_ms(strided_flops(hq, q_len, k_len, 8, 128, causal))
            used = passes or passes_for(geom, tiling)
            log(f"  {name}: {times[name]:.3f} ms ({times[name] / floor:.2f} x floor), "
                f"{used} pass(es)")
        rows.append((tiling, passes, err, times))
    print("| rows | cols | warps | stages | span | passes | depth | check err | "
          + " | ".join(f"{n} ms" for n in args.shapes.split(",")) + " |")
    print("|---" * (8 + len(args.shapes.split(","))) + "|")
    for tiling, passes, err, times in rows:
        print(f"| {tiling.rows} | {tiling.cols} | {tiling.num_warps} | {tiling.num_stages} | "
              f"{tiling.span or 'all'} | {passes or 'auto'} | {tiling.depth or 'all'} | "
              f"{err:.1e} | "
              + " | ".join(f"{t:.3f}" for t in times.values()) + " |")


if __name__ == "__main__":
    main()
