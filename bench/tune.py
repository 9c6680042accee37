"""Measures tile variants of the fused block-sum kernels and checks each one first.

    python -m bench.tune [--variants Q,K,W,S[,SPAN[,PASSES[,D]]];...] [--shapes NAME,...]
                         [--sampled-rows]

For every variant: block sums against the reference on small random inputs (bfloat16,
causal and not, GQA, odd lengths), then the median time on each shape with the ratio to
the floor. `--sampled-rows`: the same kernels on the sampled rows' geometry
(`xattn_jax.sampled_geometry`, block_size / 8 rows per block: the q.k products of stride
8), checked against the plain-JAX sampled rows. The table at the end is what chose `xattn_jax.triton.plan.TUNED`. Q, K: block_q,
block_k; W, S: warps and stages; SPAN the one-pass kernel's key tiles per program (0: the
plan's default), PASSES 1 or 2 (0: the plan's choice), D block_d, the head-dim columns per
pipeline step (0: all).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import floor_ms, log, strided_flops, time_ms
from xattn_jax import reference
from xattn_jax.checks import check_qk
from xattn_jax.reference import sampled_rows
from xattn_jax.sampled_geometry import SampledGeometry
from xattn_jax.triton.block_sums import block_sums
from xattn_jax.triton.plan import BLOCK_SUM_KERNELS, Tiles, plan_block_sums

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


def _variant(text: str) -> tuple[Tiles, str | None]:
    rows, cols, warps, stages, span, passes, depth = (list(map(int, text.split(",")))
                                                      + [0, 0, 0])[:7]
    kernel = BLOCK_SUM_KERNELS[passes - 1] if passes else None
    return Tiles(rows, cols, depth or None, warps, stages, span or None), kernel


def _geometry(q, k, block_size: int, causal: bool, sampled: bool):
    """The antidiagonal estimate's geometry at stride 8, or the sampled rows' of the same
    q.k products."""
    geom = check_qk(q, k, stride=8, block_size=block_size, causal=causal)
    return SampledGeometry.of(geom, block_size // 8, None) if sampled else geom


def _reference(q, k, geom, causal: bool):
    if isinstance(geom, SampledGeometry):
        return sampled_rows.block_mass(q, k, geom=geom, causal=causal)
    return reference.block_sums(q, k, geom, causal=causal, norm=1.0)


def _plan(geom, causal: bool, tiles: Tiles, kernel: str | None):
    return plan_block_sums(geom, jnp.bfloat16, causal, interpret=False, tiles=tiles,
                           kernel=kernel)


def check(tiles: Tiles, kernel: str | None, sampled: bool) -> float:
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
            geom = _geometry(q, k, bs, causal, sampled)
            want = _reference(q, k, geom, causal)
            got = block_sums(q, k, plan=_plan(geom, causal, tiles, kernel), causal=causal,
                             norm=1.0)
            err = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
            worst = max(worst, err)
    return worst


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default=DEFAULT_VARIANTS,
                        help="block_q,block_k,num_warps,num_stages[,span[,passes[,"
                             "block_d]]];... (default: %(default)s)")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="names from SHAPES")
    parser.add_argument("--sampled-rows", action="store_true",
                        help="the kernels on the sampled rows' geometry")
    args = parser.parse_args(argv)
    variants = [_variant(v) for v in args.variants.split(";")]
    rows = []
    for tiles, kernel in variants:
        log(f"checking {tiles}, kernel {kernel or 'default'}")
        try:
            err = check(tiles, kernel, args.sampled_rows)
        except jax.errors.JaxRuntimeError as e:  # e.g. the tile needs too much shared memory
            log(f"  failed: {str(e).splitlines()[0]}")
            continue
        times = {}
        for name in args.shapes.split(","):
            hq, hkv, q_len, k_len, bs, causal = SHAPES[name]
            keys = jax.random.split(jax.random.PRNGKey(0), 2)
            q = _random(keys[0], (1, hq, q_len, 128), jnp.bfloat16)
            k = _random(keys[1], (1, hkv, k_len, 128), jnp.bfloat16)
            geom = _geometry(q, k, bs, causal, args.sampled_rows)
            plan = _plan(geom, causal, tiles, kernel)
            fn = jax.jit(lambda q, k, p=plan, c=causal: block_sums(q, k, plan=p, causal=c,
                                                                  norm=1.0))
            try:
                times[name] = time_ms(fn, [(q, k)], warmup=2, reps=10)
            except jax.errors.JaxRuntimeError as e:
                log(f"  {name}: failed: {str(e).splitlines()[0]}")
                times[name] = float("nan")
                continue
            floor = floor_ms(strided_flops(hq, q_len, k_len, 8, 128, causal))
            log(f"  {name}: {times[name]:.3f} ms ({times[name] / floor:.2f} x floor), "
                f"{plan.kernel}, span {plan.span}, {plan.calls} call(s)")
        rows.append((tiles, kernel, err, times))
    print("| block_q | block_k | warps | stages | span | kernel | block_d | check err | "
          + " | ".join(f"{n} ms" for n in args.shapes.split(",")) + " |")
    print("|---" * (8 + len(args.shapes.split(","))) + "|")
    for tiles, kernel, err, times in rows:
        print(f"| {tiles.block_q} | {tiles.block_k} | {tiles.num_warps} | {tiles.num_stages} | "
              f"{tiles.span or 'plan'} | {kernel or 'plan'} | {tiles.block_d or 'all'} | "
              f"{err:.1e} | "
              + " | ".join(f"{t:.3f}" for t in times.values()) + " |")


if __name__ == "__main__":
    main()
