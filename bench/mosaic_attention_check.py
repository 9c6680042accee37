"""GPU check of the Mosaic GPU block-sparse attention kernel (xattn_jax.mosaic), one run.

    python -m bench.mosaic_attention_check [--skip-large] [--no-smoke] [--ptxas]

(--ptxas: Mosaic GPU prints ptxas' report of each kernel: registers, spills.)

1. Smoke: the first small case, and the first with a traced k_len, each in a subprocess
   with a time limit, so a kernel that hangs (a barrier protocol error) is reported as
   such instead of stalling the whole run.
2. Correctness at small shapes against a float32 plain-JAX dense reference (mask
   expanded): max abs/rel error of out, lse error, -inf pattern of lse (empty rows), NaNs,
   and a bit-identical rerun. Each case is independent: a failure prints its full
   traceback and the run goes on.
3. Timing at Hq=32, Hkv=8, D=128, bf16, causal 16K (all-true mask and density 0.25):
   median of back-to-back calls (bench.common.time_ms) against cuDNN's dense causal
   attention (jax.nn.dot_product_attention, implementation="cudnn"), TFLOP/s on the
   visible allowed pairs (4 * D * pairs), plan variants (block_kv, stages) last.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import smoke_in_subprocess, time_ms
from xattn_jax import mosaic
from xattn_jax.mosaic.attention import block_sparse_attention as attention

SMOKE_LIMIT_S = 240
TIME_BUDGET_S = 220  # plan variants are skipped past this many seconds
LARGE = dict(batch=1, heads=32, kv_heads=8, length=16384, dim=128)


def _inputs(seed, batch, heads, kv_heads, q_len, k_len, dim, block_size, density,
            dtype=jnp.bfloat16):
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = jax.random.normal(keys[0], (batch, heads, q_len, dim), dtype)
    k = jax.random.normal(keys[1], (batch, kv_heads, k_len, dim), dtype)
    v = jax.random.normal(keys[2], (batch, kv_heads, k_len, dim), dtype)
    blocks = (batch, heads, -(-q_len // block_size), -(-k_len // block_size))
    mask = jax.random.uniform(keys[3], blocks) < density
    return q, k, v, mask


def _allowed(mask, q_len, k_len, block_size, causal, keys_in_use=None):
    n = k_len if keys_in_use is None else keys_in_use
    rows, keys = jnp.arange(q_len)[:, None], jnp.arange(k_len)[None, :]
    allowed = mask[:, :, rows // block_size, keys // block_size] & (keys < n)
    if causal:
        allowed = allowed & (keys <= rows + n - q_len)
    return allowed


@functools.partial(jax.jit, static_argnames=("block_size", "causal"))
def dense_reference(q, k, v, mask, keys_in_use=None, *, block_size, causal):
    """float32 out [B, Hq, Lq, D] and lse [B, Hq, Lq] (-inf and zeros for empty rows);
    `keys_in_use` n (default Lk): keys from n on hidden, row i at key i + n - Lq."""
    group = q.shape[1] // k.shape[1]
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)
    scores = jnp.einsum("bhid,bhjd->bhij", q, k, precision="highest") / np.sqrt(q.shape[-1])
    allowed = _allowed(mask, q.shape[2], k.shape[2], block_size, causal, keys_in_use)
    scores = jnp.where(allowed, scores, -jnp.inf)
    top = jnp.max(scores, axis=-1, keepdims=True)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    weights = jnp.exp(scores - top)
    total = weights.sum(-1, keepdims=True)
    out = jnp.einsum("bhij,bhjd->bhid", weights, v, precision="highest")
    out = out / jnp.where(total > 0, total, 1.0)
    return out, jnp.log(total[..., 0]) + top[..., 0]


def allowed_pairs(mask, q_len, k_len, block_size, causal) -> int:
    """Visible (query, key) pairs of all heads: what the kernel must multiply."""
    bs = block_size
    rows = np.arange(q_len)[:, None]
    col_start = np.arange(mask.shape[-1])[None, :] * bs
    col_end = np.minimum(col_start + bs, k_len)
    last = np.minimum(col_end, rows + k_len - q_len + 1) if causal else col_end
    per_row = np.clip(last - col_start, 0, None)  # [Lq, column blocks]
    row_block = np.arange(q_len) // bs
    per_block = np.zeros((mask.shape[-2], mask.shape[-1]), np.int64)
    np.add.at(per_block, row_block, per_row)
    return int((np.asarray(mask) * per_block).sum())


def check_case(name, seed, batch, heads, kv_heads, q_len, key_len, dim, block_size, density,
               causal, dtype=jnp.bfloat16, **options):
    """One small case; `options`: k_len (passed as an int32 array) and plan overrides."""
    if "k_len" in options:
        options = dict(options, k_len=jnp.int32(options["k_len"]))
    q, k, v, mask = _inputs(seed, batch, heads, kv_heads, q_len, key_len, dim, block_size,
                            density, dtype)
    start = time.perf_counter()
    out, lse = attention.block_sparse_attention(q, k, v, mask, block_size=block_size,
                                                causal=causal, return_lse=True, **options)
    out, lse = np.asarray(out.astype(jnp.float32)), np.asarray(lse)
    compile_s = time.perf_counter() - start
    rerun, _ = attention.block_sparse_attention(q, k, v, mask, block_size=block_size,
                                                causal=causal, return_lse=True, **options)
    identical = np.array_equal(np.asarray(rerun.astype(jnp.float32)), out, equal_nan=True)
    want_out, want_lse = (np.asarray(x) for x in dense_reference(
        q, k, v, mask, options.get("k_len"), block_size=block_size, causal=causal))
    empty = np.isneginf(want_lse)
    abs_err = np.abs(out - want_out)
    rel_err = abs_err.max() / max(np.abs(want_out).max(), 1e-30)
    finite = ~empty
    lse_err = np.abs(lse[finite] - want_lse[finite]).max() if finite.any() else 0.0
    worst_row = np.unravel_index(np.nanargmax(abs_err.max(-1)), abs_err.shape[:3])
    tol = 2e-2 if dtype == jnp.bfloat16 else 5e-3
    ok = (np.isfinite(out).all() and abs_err.max() <= tol and lse_err <= 1e-2 and identical
          and np.array_equal(np.isneginf(lse), empty) and np.all(out[empty] == 0))
    print(f"{'PASS' if ok else 'FAIL'} {name}: out max abs {abs_err.max():.2e} rel "
          f"{rel_err:.2e} (worst b,h,row {tuple(int(i) for i in worst_row)}), lse max abs "
          f"{lse_err:.2e}, empty rows {int(empty.sum())} (-inf lse match "
          f"{np.array_equal(np.isneginf(lse), empty)}, zero out {np.all(out[empty] == 0)}),"
          f" NaN {int(np.isnan(out).sum())}, rerun identical {identical}, first call "
          f"{compile_s:.1f}s", flush=True)
    return ok


SMALL_CASES = [
    # name, seed, batch, heads, kv_heads, Lq, Lk, dim, block_size, density, causal
    ("causal 1024 all-true", 0, 1, 4, 2, 1024, 1024, 128, 128, 1.0, True),
    ("non-causal 1024 all-true", 1, 1, 4, 2, 1024, 1024, 128, 128, 1.0, False),
    ("causal 1024 density 0.3", 2, 1, 4, 2, 1024, 1024, 128, 128, 0.3, True),
    ("non-causal 1024 density 0.3", 3, 1, 4, 2, 1024, 1024, 128, 128, 0.3, False),
    ("causal Lq 512 < Lk 1024", 4, 1, 4, 2, 512, 1024, 128, 128, 0.6, True),
    ("causal Lq 1024 > Lk 512 (early rows empty)", 5, 1, 4, 2, 1024, 512, 128, 128, 0.6,
     True),
    ("causal odd 1000", 6, 1, 4, 2, 1000, 1000, 128, 128, 0.5, True),
    ("non-causal odd Lq 1000 Lk 1100", 7, 2, 4, 1, 1000, 1100, 128, 128, 0.5, False),
    ("causal density 0.05 (many empty rows)", 8, 1, 4, 2, 1024, 1024, 128, 128, 0.05, True),
    ("causal D64 block 256 fp16", 9, 1, 4, 4, 1024, 1024, 64, 256, 0.5, True, jnp.float16),
    ("causal D256", 10, 1, 2, 1, 512, 512, 256, 128, 0.7, True),
]
PLAN_VARIANTS = [dict(block_kv=64), dict(stages=3), dict(block_kv=64, stages=4)]
# (case, options): k_len, the keys in use, traced (one compilation for any value)
KEYS_IN_USE_CASES = [
    (("causal Lq 256 Lk 1024, 700 keys in use", 12, 1, 4, 2, 256, 1024, 128, 128, 0.7,
      True), {"k_len": 700}),
    (("non-causal Lq 200 Lk 1024, 517 keys in use", 13, 1, 4, 2, 200, 1024, 128, 128, 0.7,
      False), {"k_len": 517}),
]


def run_small(with_keys_in_use: bool) -> None:
    cases = [(case, {}) for case in SMALL_CASES]
    cases += KEYS_IN_USE_CASES if with_keys_in_use else []
    for case, options in cases:
        try:
            check_case(*case, **options)
        except Exception:
            print(f"ERROR {case[0]}:", flush=True)
            traceback.print_exc()
            sys.stdout.flush()
    for plan in PLAN_VARIANTS:
        try:
            check_case(f"causal 1024 density 0.5 plan {plan}", 11, 1, 4, 2, 1024, 1024, 128,
                       128, 0.5, True, **plan)
        except Exception:
            print(f"ERROR plan {plan}:", flush=True)
            traceback.print_exc()


def _cudnn_attention(q, k, v):
    """cuDNN causal attention in its [B, L, H, D] layout (k/v heads repeated if needed)."""
    q, k, v = (x.swapaxes(1, 2) for x in (q, k, v))
    try:
        fn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=True, implementation="cudnn"))
        fn(q, k, v).block_until_ready()
        return fn, (q, k, v), "GQA native"
    except Exception as error:
        print(f"cudnn with GQA refused ({type(error).__name__}: {error}); repeating k/v "
              "heads outside the timing", flush=True)
        group = q.shape[2] // k.shape[2]
        k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
        fn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=True, implementation="cudnn"))
        return fn, (q, k, v), "k/v heads repeated"


def run_large(started: float) -> None:
    b, h, hkv, n, d = (LARGE[key] for key in ("batch", "heads", "kv_heads", "length", "dim"))
    rows = []
    cudnn_ms = None
    q, k, v, dense_mask = _inputs(20, b, h, hkv, n, n, d, 128, 1.0)
    try:
        fn, args, how = _cudnn_attention(q, k, v)
        cudnn_ms = time_ms(fn, [args])
        pairs = allowed_pairs(dense_mask, n, n, 128, True)
        rows.append((f"cudnn dense causal ({how})", cudnn_ms, 4 * d * pairs / cudnn_ms / 1e9))
        cudnn_out = fn(*args).swapaxes(1, 2)
    except Exception:
        print("ERROR cudnn:", flush=True)
        traceback.print_exc()
        cudnn_out = None
    cases = [("mosaic causal all-true", 1.0, {}), ("mosaic causal density 0.25", 0.25, {})]
    cases += [(f"mosaic causal all-true {plan}", 1.0, plan) for plan in PLAN_VARIANTS]
    for name, density, plan in cases:
        if plan and time.perf_counter() - started > TIME_BUDGET_S:
            print(f"skipped {name}: time budget", flush=True)
            continue
        try:
            mask = dense_mask if density == 1.0 else _inputs(21, b, h, hkv, n, n, d, 128,
                                                             density)[3]
            fn = functools.partial(attention.block_sparse_attention, block_size=128,
                                   causal=True, **plan)
            out = fn(q, k, v, mask)
            if density == 1.0 and cudnn_out is not None:
                diff = float(jnp.abs(out.astype(jnp.float32)
                                     - cudnn_out.astype(jnp.float32)).max())
                print(f"{name}: max abs diff to cudnn {diff:.2e} "
                      f"(finite {bool(jnp.isfinite(out).all())})", flush=True)
            ms = time_ms(fn, [(q, k, v, mask)])
            pairs = allowed_pairs(mask, n, n, 128, True)
            rows.append((name, ms, 4 * d * pairs / ms / 1e9))
        except Exception:
            print(f"ERROR {name}:", flush=True)
            traceback.print_exc()
    try:
        plan = attention.attention_plan(d, d, jnp.bfloat16, 128, with_lse=False)
        lists = jax.jit(lambda m: attention.key_tile_lists(
            m, q_len=n, k_len=n, block_size=128, causal=True, plan=plan))
        rows.append(("  of which key_tile_lists", time_ms(lists, [(dense_mask,)]), 0.0))
    except Exception:
        traceback.print_exc()
    print(f"\nB{b} Hq{h} Hkv{hkv} L{n} D{d} bf16 causal, block_size 128")
    print(f"{'case':48s} {'ms':>8s} {'TFLOP/s':>8s} {'vs cudnn':>9s}")
    for name, ms, tflops in rows:
        ratio = f"{cudnn_ms / ms:8.2f}x" if cudnn_ms else "      n/a"
        print(f"{name:48s} {ms:8.3f} {tflops:8.1f} {ratio}")
    print("(TFLOP/s on the visible allowed pairs, 4*D per pair; vs cudnn = cudnn ms / ms, "
          ">1 is faster than dense cudnn)", flush=True)


def smoke(call: str) -> str:
    """`call` (an expression on this module's names) in a subprocess with a time limit:
    "pass", "fail" or "hang"."""
    return smoke_in_subprocess("bench.mosaic_attention_check", call, SMOKE_LIMIT_S)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-large", action="store_true")
    parser.add_argument("--no-smoke", action="store_true")
    parser.add_argument("--ptxas", action="store_true")
    args = parser.parse_args()
    if args.ptxas:  # read by Mosaic GPU when it compiles, inherited by the smoke process
        os.environ["MOSAIC_GPU_DUMP_PTXAS"] = "1"
    started = time.perf_counter()
    print(f"jax {jax.__version__}, devices {jax.devices()}, "
          f"mosaic.available() = {mosaic.available()!r}", flush=True)
    if mosaic.available() is not None:
        return
    print("default plan at D=128, block_size=128:",
          attention.attention_plan(128, 128, jnp.bfloat16, 128, with_lse=False), flush=True)
    outcome = "skipped" if args.no_smoke else smoke("check_case(*SMALL_CASES[0])")
    if outcome == "hang":
        return
    if outcome == "fail":
        print("smoke failed: running the small cases anyway for their errors", flush=True)
        args.skip_large = True
    keys_in_use = "skipped" if args.no_smoke else smoke(
        "check_case(*KEYS_IN_USE_CASES[0][0], **KEYS_IN_USE_CASES[0][1])")
    run_small(with_keys_in_use=keys_in_use != "hang")
    if not args.skip_large:
        run_large(started)
    print(f"total {time.perf_counter() - started:.0f}s", flush=True)


if __name__ == "__main__":
    main()
