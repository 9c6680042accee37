"""Times block-sparse attention and XAttention on the GPU against cuDNN, FlexAttention and
the FLOP floor.

    python -m bench.attention [--cases NAME,...|all] [--impl auto|reference|mosaic]
                              [--json PATH] [--md PATH] [--smoke]
    python -m bench.attention --quality [--md PATH] [--png PATH] [--smoke]

Speed rows (bf16, B = 1, Hq = 32 reading Hkv = 8 in place, D = Dv = 128, block 128,
Lq = Lk, causal; median device time per call, `bench.common.time_ms`):
- `cudnn-causal-{16k,64k,128k}` (impl "cudnn"): dense causal attention,
  `jax.nn.dot_product_attention(implementation="cudnn")` in its `[B, L, H, D]` layout
  (inputs transposed outside the timed region; cuDNN reads the GQA heads itself).
- `attention-dense-causal-{16k,64k}`: `block_sparse_attention` on an all-true mask.
- `attention-d{0.1,0.25,0.5}-causal-{16k,64k}`: on random masks keeping each causally
  visible block with probability d, the diagonal block always.
- `attention-d0.25-chunk4096-ctx64k[-paged{4096,128}]`: the last 4096 queries of such a
  64K call (a chunk over its cached context), k and v contiguous or in a paged cache of
  4096- or 128-token pages, shuffled, read through the block table.
- `xattention-causal-128k`: `xattention` (estimate + attention, threshold 0.9 or
  `--threshold` T, the case then named `xattention-causal-128k-tT`, stride 8) on the
  structured synthetic data of `xattn_jax.demo.synthetic` (8 heads, each query head
  repeated to its 4 GQA query heads), v random; and `...-attention`,
  `block_sparse_attention` alone on the mask it selected.
- `smollm2-causal-{8k,32k}`: SmolLM2-135M's attention (Hq 9 reading Hkv 3, D 64):
  `block_sparse_attention` on an all-true mask, and cuDNN's dense causal attention at
  the same shapes (impl "cudnn"), in the same case.
Every `block_sparse_attention` row on contiguous k and v has a FlexAttention peer (impl
"flexattention", `bench.flex`): torch's flex_attention, compiled, on the same q, k, v and
the same mask as a flex BlockMask, its output checked against ours (`max_abs_error`,
`wrong_blocks`, `agrees`: the run exits with status 1 where one disagrees). Without torch
and CUDA the flex rows are skipped (the log says why).
floor_ms: 4 * D * (visible allowed (query, key) pairs, summed over heads) FLOPs at the
measured 753 TFLOP/s, plus the strided product's FLOPs for xattention; `density`: the
visible allowed pairs over all visible pairs; extra_mib: XLA's outputs plus temporaries
(torch's allocations for flex). `--md` writes the report's table.
`--quality`: `bench.attention_quality` (error, density and speed-up over thresholds and
strides). `--smoke` shrinks every size to run on a CPU in seconds (times mean nothing;
flex then runs eagerly, which checks the mask conversion).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Callable, NamedTuple

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench import flex  # noqa: E402
from bench.cases import paged_pools  # noqa: E402
from bench.common import (JSON_HELP, MATMUL_FLOPS, Sizes, floor_ms,  # noqa: E402
                          jax_extra_mib, log, merge_json, print_report, record, report,
                          strided_flops, time_ms)
from xattn_jax import block_sparse_attention, impls, xattention  # noqa: E402
from xattn_jax.backend import AttentionCall  # noqa: E402
from xattn_jax.demo.synthetic import structured_qk  # noqa: E402

THRESHOLD = 0.9
DENSITIES = (0.1, 0.25, 0.5)
REPS = {"8k": 20, "16k": 20, "32k": 10, "64k": 10, "128k": 5}


FULL = Sizes()
SMOKE = Sizes(q_heads=4, kv_heads=2, head_dim=32, block=32,
              lengths=(("16k", 256), ("64k", 512), ("128k", 1024)), quality_length=512)
# SmolLM2-135M's attention: 9 query heads reading 3 KV heads, head dim 64
SMOLLM2 = Sizes(q_heads=9, kv_heads=3, head_dim=64, lengths=(("8k", 8192), ("32k", 32768)))
SMOLLM2_SMOKE = dataclasses.replace(SMOLLM2, block=32, lengths=(("8k", 256), ("32k", 512)))
SIZES = {"main": (FULL, SMOKE), "smollm2": (SMOLLM2, SMOLLM2_SMOKE)}  # (full, smoke)


class Case(NamedTuple):
    """kind: "cudnn", "sparse" or "xattention"; length: a `Sizes.lengths` name; density:
    of the random mask ("sparse"); chunk: queries as a share of the keys (the last ones),
    1 for Lq = Lk; page: tokens per page of a paged cache at 64K keys (scaled with the
    length, at least a block), None for contiguous k and v; shapes: the `SIZES` entry;
    with_cudnn: cuDNN's dense causal attention at the same shapes is a row of the case."""

    kind: str
    length: str
    density: float | None = None
    chunk: float = 1.0
    page: int | None = None
    shapes: str = "main"
    with_cudnn: bool = False


def _cases() -> dict[str, Case]:
    cases = {f"cudnn-causal-{n}": Case("cudnn", n) for n in ("16k", "64k", "128k")}
    cases.update({f"attention-dense-causal-{n}": Case("sparse", n, 1.0)
                  for n in ("16k", "64k")})
    cases.update({f"attention-d{d}-causal-{n}": Case("sparse", n, d)
                  for d in DENSITIES for n in ("16k", "64k")})
    cases.update({f"attention-d0.25-chunk4096-ctx64k{'-paged' + str(page) if page else ''}":
                  Case("sparse", "64k", 0.25, chunk=1 / 16, page=page)
                  for page in (None, 4096, 128)})
    cases["xattention-causal-128k"] = Case("xattention", "128k")
    cases.update({f"smollm2-causal-{n}": Case("sparse", n, 1.0, shapes="smollm2",
                                              with_cudnn=True) for n in ("8k", "32k")})
    return cases


CASES = _cases()


# --- inputs and FLOPs ------------------------------------------------------------------

def random_qkv(length: int, sz: Sizes, seed: int = 0):
    """bf16 q `[1, Hq, L, D]`, k and v `[1, Hkv, L, D]`, standard normal."""
    keys = jax.random.split(jax.random.PRNGKey(seed), 3)
    shapes = ((1, sz.q_heads, length, sz.head_dim),) + ((1, sz.kv_heads, length,
                                                         sz.head_dim),) * 2
    return tuple(jax.random.normal(key, shape, jnp.bfloat16) for key, shape in zip(keys,
                                                                                  shapes))


def structured_qkv(length: int, sz: Sizes, dtype=jnp.bfloat16, seed: int = 0):
    """The demo's structured q and k (Hkv heads; each query head repeated to its GQA
    group) and random v, in `dtype`."""
    data = structured_qk(seed, heads=sz.kv_heads, length=length, head_dim=sz.head_dim)
    q = jnp.repeat(data.q, sz.q_heads // sz.kv_heads, axis=1)
    v = jax.random.normal(jax.random.PRNGKey(seed + 1), data.k.shape, jnp.float32)
    return q.astype(dtype), data.k.astype(dtype), v.astype(dtype)


def causal_mask(length: int, sz: Sizes, density: float, seed: int = 0) -> jax.Array:
    """bool `[1, Hq, n, n]` (n = L / block): each causally visible block kept with
    probability `density`, the diagonal always; all true for density 1."""
    n = -(-length // sz.block)
    if density >= 1.0:
        return jnp.ones((1, sz.q_heads, n, n), bool)
    draw = jax.random.uniform(jax.random.PRNGKey(seed), (1, sz.q_heads, n, n)) < density
    i, j = jnp.arange(n)[:, None], jnp.arange(n)[None, :]
    return (draw | (i == j)) & (j <= i)


def _clamped_sums(y: np.ndarray, n: int) -> np.ndarray:
    """sum_{u=0}^{y} min(u, n) for integer y (0 for y < 0), elementwise."""
    y = np.maximum(y, -1)
    low = np.minimum(y, n)
    return low * (low + 1) // 2 + np.maximum(y - n, 0) * n


def block_pairs(q_len: int, k_len: int, block_size: int, causal: bool) -> np.ndarray:
    """int64 `[qb, kb]`: the (query row, key) pairs of each block that the causal rule
    lets through (queries at the last Lq key positions)."""
    qb, kb = -(-q_len // block_size), -(-k_len // block_size)
    start_i = np.arange(qb) * block_size
    rows = np.minimum(start_i + block_size, q_len) - start_i
    start_j = np.arange(kb) * block_size
    cols = np.minimum(start_j + block_size, k_len) - start_j
    if not causal:
        return np.outer(rows, cols).astype(np.int64)
    # row i sees min(max(i + off + 1 - start_j, 0), cols) keys of block J
    first = start_i[:, None] + (k_len - q_len) + 1 - start_j[None, :]
    return (_clamped_sums(first + rows[:, None] - 1, cols[None, :])
            - _clamped_sums(first - 1, cols[None, :]))


def attention_flops(mask, q_len: int, k_len: int, sz: Sizes) -> tuple[float, float]:
    """(FLOPs of the allowed visible pairs, their share of all visible pairs)."""
    pairs = block_pairs(q_len, k_len, sz.block, causal=True)
    allowed = float((np.asarray(mask) * pairs).sum())
    visible = float(pairs.sum()) * mask.shape[0] * mask.shape[1]
    return 4.0 * sz.head_dim * allowed, allowed / visible


def impl_label(impl: str, sz: Sizes, page_size: int | None = None) -> str:
    """Which attention `impl` runs on JAX's default device for bf16 inputs of these sizes
    (and pages of `page_size` tokens; None: contiguous) (`xattn_jax.impls`), for the
    records."""
    backend = impls.resolve(impl, ops=impls.ATTENTION, device=jax.devices()[0])
    return backend.attention_backend(AttentionCall(sz.head_dim, sz.head_dim, jnp.bfloat16,
                                                   sz.block, page_size)).name


# --- cases ---------------------------------------------------------------------------

class Timed(NamedTuple):
    """One row's call fn(*args): its impl label, its useful FLOPs (the floor's) and more
    fields for its record."""

    fn: Callable
    args: tuple
    label: str
    flops: float
    extra: dict


def timed_row(name: str, call: Timed, reps: int) -> dict:
    ms = time_ms(call.fn, [call.args], warmup=2, reps=reps)
    floor = floor_ms(call.flops)
    row = record(name, call.label, ms, floor, jax_extra_mib(call.fn, *call.args)) | call.extra
    density = call.extra.get("density")
    log(f"{name} {call.label}: {ms:.3f} ms, {ms / floor:.2f} x floor "
        f"({call.flops / (ms * 1e-3) / 1e12:.0f} TFLOP/s useful, {MATMUL_FLOPS / 1e12:.0f} "
        f"the ceiling), {row['extra_mib']:.0f} MiB"
        + (f", density {density:.3f}" if density is not None else ""))
    return row


def cudnn_call(length: int, sz: Sizes) -> Timed:
    """Dense causal attention, cuDNN's on a GPU (XLA's elsewhere), `[B, L, H, D]`."""
    dense_impl = "cudnn" if jax.default_backend() == "gpu" else "xla"
    q, k, v = (x.transpose(0, 2, 1, 3) for x in random_qkv(length, sz))

    def fn(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                            implementation=dense_impl)

    flops = 4.0 * sz.head_dim * sz.q_heads * length * (length + 1) / 2
    return Timed(fn, (q, k, v), dense_impl, flops, {})


def masked_call(q, k, v, mask, k_len: int, sz: Sizes, impl: str, table=None,
                page_size: int | None = None) -> Timed:
    """block_sparse_attention on `mask`, causal, the queries the last of k_len keys."""
    def fn(q, k, v, mask, table):
        return block_sparse_attention(q, k, v, mask, block_size=sz.block, causal=True,
                                      block_table=table, impl=impl)

    flops, density = attention_flops(mask, q.shape[2], k_len, sz)
    extra = {"density": density} | ({"page_size": page_size} if page_size else {})
    return Timed(fn, (q, k, v, mask, table), f"xattn-jax/{impl_label(impl, sz, page_size)}",
                 flops, extra)


def sparse_call(case: Case, sz: Sizes, impl: str) -> Timed:
    """The case's random mask over random q, k, v (the last queries of a chunk, k and v
    in a paged cache where the case says)."""
    length = sz.length(case.length)
    q, k, v = random_qkv(length, sz)
    mask = causal_mask(length, sz, case.density)
    q_len = round(length * case.chunk)  # the last q_len queries
    q, mask = q[:, :, length - q_len:], mask[:, :, (length - q_len) // sz.block:]
    if case.page is None:
        return masked_call(q, k, v, mask, length, sz, impl)
    page_size = max(sz.block, case.page * length // 65536)
    k, v, table = paged_pools(np.random.default_rng(0), page_size, k, v)
    return masked_call(q, k, v, mask, length, sz, impl, table, page_size)


def xattention_calls(case: Case, sz: Sizes, impl: str,
                     threshold: float) -> tuple[Timed, Timed]:
    """`xattention` end to end on the structured data, and the attention alone on the
    mask it selects (a `masked_call`)."""
    length = sz.length(case.length)
    q, k, v = structured_qkv(length, sz)
    options = dict(threshold=threshold, block_size=sz.block, stride=sz.stride, causal=True,
                   impl=impl)

    def fn(q, k, v):
        return xattention(q, k, v, **options)

    _, mask = xattention(q, k, v, return_mask=True, **options)
    attention = masked_call(q, k, v, mask, length, sz, impl)
    flops = attention.flops + strided_flops(sz.q_heads, length, length, sz.stride,
                                            sz.head_dim, True)
    extra = {"density": attention.extra["density"], "threshold": threshold}
    return Timed(fn, (q, k, v), attention.label, flops, extra), attention


def flex_row(name: str, call: Timed, sz: Sizes, reps: int) -> dict:
    """FlexAttention on the mask and the q, k, v of `call` (a contiguous `masked_call`),
    checked against its output (`bench.flex`)."""
    q, k, v, mask, _ = call.args
    return flex.peer_row(name, q, k, v, mask, call.fn(*call.args), sz.block, call.flops,
                         {"density": call.extra["density"]}, reps)


def run_case(name: str, smoke: bool, impl: str, threshold: float = THRESHOLD,
             flex_off: str | None = None) -> list[dict]:
    """The case's rows: ours (cuDNN's for the `cudnn-*` cases); cuDNN's dense attention at
    the same shapes where the case has `with_cudnn`; xattention's attention alone on its
    mask; FlexAttention on each contiguous mask (unless `flex_off` says why not)."""
    case = CASES[name]
    sz, reps = SIZES[case.shapes][smoke], REPS[case.length]
    length = sz.length(case.length)
    if case.kind == "cudnn":
        return [timed_row(name, cudnn_call(length, sz), reps)]
    rows = [timed_row(name, cudnn_call(length, sz), reps)] if case.with_cudnn else []
    if case.kind == "sparse":
        masked = sparse_call(case, sz, impl)
        rows.append(timed_row(name, masked, reps))
    else:
        whole, masked = xattention_calls(case, sz, impl, threshold)
        if threshold != THRESHOLD:  # a row of its own in a shared record
            name = f"{name}-t{threshold:g}"
        rows.append(timed_row(name, whole, reps))
        name = f"{name}-attention"
        rows.append(timed_row(name, masked, reps))
    if case.page is None and flex_off is None:
        rows.append(flex_row(name, masked, sz, reps))
    return rows


def flex_checks(records: list[dict]) -> str:
    """The lines of the FlexAttention checks: each flex row's error against ours."""
    return "".join(
        f"- {r['case']}: FlexAttention ({r['mode']}) against ours, max abs error "
        f"{r['max_abs_error']:.2e}, {r['wrong_blocks']} wrong blocks: "
        f"{'agrees' if r['agrees'] else 'DISAGREES'}\n"
        for r in records if r["impl"] == flex.IMPL)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="all",
                        help="comma-separated names, or 'all'; names: " + ", ".join(CASES))
    parser.add_argument("--impl", default="auto", choices=("auto", "reference", "mosaic"),
                        help="the attention's implementation (default auto)")
    parser.add_argument("--json", help=JSON_HELP)
    parser.add_argument("--threshold", type=float, default=THRESHOLD,
                        help=f"the xattention row's threshold (default {THRESHOLD})")
    parser.add_argument("--quality", action="store_true",
                        help="the quality sweep instead (bench.attention_quality)")
    parser.add_argument("--md", help="write the report (with --quality, its report) here")
    parser.add_argument("--png", help="--quality: the plot's path")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes, to check on a CPU that everything runs")
    args = parser.parse_args(argv)
    if args.quality:
        from bench import attention_quality
        attention_quality.run(SMOKE if args.smoke else FULL, args.impl, smoke=args.smoke,
                              md=args.md, png=args.png)
        return 0
    names = list(CASES) if args.cases == "all" else args.cases.split(",")
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {unknown}; choose from {list(CASES)}")
    flex_off = flex.unavailable(args.smoke)
    if flex_off:
        log(f"no FlexAttention rows: {flex_off}")
    records = []
    for i, name in enumerate(names):
        log(f"[{i + 1}/{len(names)}] {name}")
        records.extend(run_case(name, args.smoke, args.impl, args.threshold, flex_off))
        if args.json:  # after every case, so a cut-short run keeps what it measured
            merge_json(args.json, records)
    checks = flex_checks(records)
    print_report(records)
    print("\n" + checks, end="")
    if args.md:
        line = " ".join(sys.argv[1:] if argv is None else argv)
        with open(args.md, "w") as f:
            f.write(f"`python -m bench.attention {line}`\n\n{report(records)}\n{checks}")
    return 0 if all(r["agrees"] for r in records if r["impl"] == flex.IMPL) else 1

if __name__ == "__main__":
    sys.exit(main())
