"""GPU check of the ragged step's Mosaic attention kernel
(`xattn_jax.mosaic.attention.ragged_attention`), one run.

    python -m bench.ragged_attention_check [--skip-large] [--no-smoke]

1. Smoke: the first small step in a subprocess with a time limit, so a kernel that hangs
   (a barrier protocol error) is reported as such instead of stalling the run.
2. Correctness of small random steps (`SMALL_STEPS`: decode rows, chunks starting inside
   blocks, an empty sequence, slots past num_seqs, rows past the sequences', pages of 16
   to 512, fused caches, D 64 / 128 / 256) against `reference.ragged.attention`: max abs
   error, NaN, rows of no live sequence zero, a bit-identical rerun. Each step is
   independent: a failure prints its traceback and the run goes on.
3. Timing at Llama-3.1-8B's heads (Hq 32, Hkv 8, D 128, bf16, blocks of 128; `LARGE_STEPS`:
   decode rows only, decode rows with prefill chunks, prefill chunks only; pages of 16 and
   of 128; mask density 0.3 and all-true): median of back-to-back calls
   (`bench.common.time_ms`) of the whole call (work table and kernel), of the work table
   alone and of the plain-JAX reference, after the kernel's error against the reference;
   TFLOP/s on the visible allowed (query, key) pairs, 4 D FLOPs each.
"""

from __future__ import annotations

import argparse
import functools
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import smoke_in_subprocess, time_ms
from bench.ragged_attention_steps import RaggedStep, step_arrays
from xattn_jax import mosaic
from xattn_jax.mosaic.attention import ragged_work
from xattn_jax.mosaic.attention.ragged_attention import ragged_attention
from xattn_jax.mosaic.attention.ragged_plan import ragged_plan
from xattn_jax.reference import ragged as reference

SMOKE_LIMIT_S = 240

SMALL_STEPS = [
    RaggedStep("mixed d128 page16", (1, 70, 0, 200, 5), (300, 133, 50, 260, 40),
               tokens=300, seqs=6, q_heads=4, kv_heads=2, head_dim=128, page_size=16,
               pages_per_seq=24, num_seqs=4),
    RaggedStep("chunks d128 page128 all-true", (130, 1, 257), (640, 77, 257), tokens=400,
               seqs=4, q_heads=4, kv_heads=2, head_dim=128, page_size=128,
               pages_per_seq=5, density=1.0),
    RaggedStep("d128 page512 fused", (1, 1, 1000), (3000, 10, 2000), tokens=1003, seqs=3,
               q_heads=8, kv_heads=2, head_dim=128, page_size=512, pages_per_seq=6,
               fused=True),
    RaggedStep("d64 page32 blocks256", (300, 1, 1, 90), (900, 1000, 3, 95), tokens=512,
               seqs=4, q_heads=4, kv_heads=2, head_dim=64, page_size=32,
               pages_per_seq=32, block_size=256, density=0.6),
    RaggedStep("d256 page32 fp16 fused", (64, 129, 1), (64, 400, 500), tokens=200,
               seqs=3, q_heads=4, kv_heads=1, head_dim=256, page_size=32,
               pages_per_seq=16, fused=True, dtype=jnp.float16),
    RaggedStep("few rows d128 page16", (3, 1), (3, 700), tokens=8, seqs=2, q_heads=4,
               kv_heads=1, head_dim=128, page_size=16, pages_per_seq=48),
]


def _llama(name: str, q_lens, kv_lens, page_size: int, density: float) -> RaggedStep:
    """A step of Llama-3.1-8B's attention heads over 8K-key page tables."""
    return RaggedStep(name, tuple(q_lens), tuple(kv_lens), tokens=int(sum(q_lens)),
                      seqs=len(q_lens), q_heads=32, kv_heads=8, head_dim=128,
                      page_size=page_size, pages_per_seq=8192 // page_size,
                      density=density)


def large_steps() -> list[RaggedStep]:
    """Decode only (128 rows over 1K-8K keys), mixed (64 decode rows and 4 chunks of
    1024 over 4K-8K keys), prefill (4 chunks of 2048 ending at 8K keys); pages of 16 and
    128, density 0.3 and all-true."""
    rng = np.random.default_rng(0)
    decode = rng.integers(1024, 8193, 128)
    shapes = [("decode 128", [1] * 128, decode),
              ("mixed 64+4x1024", [1] * 64 + [1024] * 4,
               list(decode[:64]) + list(rng.integers(4096, 8193, 4))),
              ("prefill 4x2048", [2048] * 4, [8192] * 4)]
    return [_llama(f"{name} page{page} density {density}", q, kv, page, density)
            for name, q, kv in shapes for page in (16, 128) for density in (0.3, 1.0)]


def _call(arrays):
    """The kernel on a step's `StepArrays`."""
    return ragged_attention(arrays.q, arrays.k, arrays.v, arrays.page_indices,
                            arrays.mask, arrays.blocks, arrays.geom,
                            scale=arrays.geom.head_dim ** -0.5)


@functools.partial(jax.jit, static_argnames="geom")
def _reference_call(q, k, v, page_indices, mask, blocks, *, geom):
    keys, values = reference.split_cache(k, v)
    return reference.attention(q, keys, values, page_indices, mask, blocks, geom,
                               scale=geom.head_dim ** -0.5)


def _reference(arrays):
    """`reference.ragged.attention` on a step's `StepArrays` (jitted)."""
    return _reference_call(*arrays[:6], geom=arrays.geom)


def check_step(step: RaggedStep, seed: int = 0) -> bool:
    """The kernel against the reference on one random step; prints one line."""
    arrays = step_arrays(step, np.random.default_rng(seed))
    start = time.perf_counter()
    out = np.asarray(_call(arrays).astype(jnp.float32))
    first_s = time.perf_counter() - start
    identical = np.array_equal(np.asarray(_call(arrays).astype(jnp.float32)), out)
    want = np.asarray(_reference(arrays).astype(jnp.float32))
    used = int(arrays.blocks.q_starts[-1] + arrays.blocks.q_lens[-1])
    err = float(np.abs(out - want).max())
    tol = 2e-2 if step.dtype == jnp.bfloat16 else 5e-3
    zero_tail = bool((out[used:] == 0).all())
    ok = bool(np.isfinite(out).all()) and err <= tol and identical and zero_tail
    print(f"{'PASS' if ok else 'FAIL'} {step.id}: max abs {err:.2e}, NaN "
          f"{int(np.isnan(out).sum())}, rows past the sequences zero {zero_tail}, rerun "
          f"identical {identical}, first call {first_s:.1f}s", flush=True)
    return ok


def allowed_pairs(arrays) -> int:
    """Visible allowed (query, key) pairs of all heads: what the kernel must multiply."""
    blocks, geom = jax.tree.map(np.asarray, arrays.blocks), arrays.geom
    mask, bs = np.asarray(arrays.mask), geom.block_size
    pairs = 0
    for seq in range(geom.seqs):
        count = int(blocks.q_lens[seq])
        if not count:
            continue
        position = blocks.first_position[seq] + np.arange(count)
        row = blocks.cu_q_blocks[seq] + position // bs - blocks.first_block[seq]
        start = np.arange(geom.k_blocks) * bs
        per_block = np.clip(position[:, None] - start[None, :] + 1, 0, bs)  # [n, KB]
        pairs += int(np.einsum("hnk,nk->", mask[:, row].astype(np.int64), per_block))
    return pairs


def run_large() -> None:
    rows = []
    for step in large_steps():
        try:
            arrays = step_arrays(step, np.random.default_rng(1))
            err = float(jnp.abs(_call(arrays).astype(jnp.float32)
                                - _reference(arrays).astype(jnp.float32)).max())
            plan = ragged_plan(arrays.geom, step.dtype)
            table = jax.jit(lambda m, b: ragged_work.ragged_work(m, b, arrays.geom, plan))
            whole = time_ms(_call, [(arrays,)])
            lists = time_ms(table, [(arrays.mask, arrays.blocks)])
            plain = time_ms(_reference, [(arrays,)], warmup=1, reps=3)
            flops = 4 * step.head_dim * allowed_pairs(arrays)
            rows.append((step.id, err, whole, lists, plain, flops / whole / 1e9))
            print(f"{step.id}: max abs {err:.2e}, {whole:.3f} ms", flush=True)
        except Exception:
            print(f"ERROR {step.id}:", flush=True)
            traceback.print_exc()
    print("\nLlama-3.1-8B heads: Hq 32, Hkv 8, D 128, bf16, block 128, 8K-key tables")
    print(f"{'step':42s} {'max abs':>8s} {'ms':>8s} {'table ms':>9s} {'ref ms':>9s} "
          f"{'TFLOP/s':>8s}")
    for name, err, whole, lists, plain, tflops in rows:
        print(f"{name:42s} {err:8.1e} {whole:8.3f} {lists:9.3f} {plain:9.1f} {tflops:8.1f}")
    print("(ms: the whole call, work table included; table ms: the work table alone; "
          "TFLOP/s on the visible allowed pairs, 4*D per pair)", flush=True)


def smoke() -> str:
    """The first check in a subprocess with a time limit: "pass", "fail" or "hang"."""
    return smoke_in_subprocess("bench.ragged_attention_check", "check_step(SMALL_STEPS[0])", SMOKE_LIMIT_S)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-large", action="store_true")
    parser.add_argument("--no-smoke", action="store_true")
    args = parser.parse_args()
    started = time.perf_counter()
    print(f"jax {jax.__version__}, devices {jax.devices()}, "
          f"mosaic.available() = {mosaic.available()!r}", flush=True)
    if mosaic.available() is not None:
        return
    outcome = "skipped" if args.no_smoke else smoke()
    if outcome == "hang":
        return
    for step in SMALL_STEPS:
        try:
            check_step(step)
        except Exception:
            print(f"ERROR {step.id}:", flush=True)
            traceback.print_exc()
    if not args.skip_large and outcome != "fail":
        run_large()
    print(f"total {time.perf_counter() - started:.0f}s", flush=True)


if __name__ == "__main__":
    main()
