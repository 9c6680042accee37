"""Times one serving step in one call (`ragged_xattention`) against the loop a serving
engine runs today (one `xattention` per request, dense attention for decode rows) and
against dense attention, on the GPU.

    python -m bench.serving_step [--steps long-prefill,short-chunks] [--page-size 128]
                                 [--rows estimate,step,loop,dense] [--impl auto]
                                 [--json PATH] [--md PATH] [--smoke]

Steps (bf16, structured synthetic chunks from `xattn_jax.demo.synthetic`: sinks, a local
window, stripes; random decode rows and values):
- `long-prefill`: Llama-3.1-8B shapes (Hq 32, Hkv 8, D 128); four chunks of 8192 queries
  at contexts 32K, 64K, 96K and 128K, plus 64 decode rows at contexts of 4K-32K.
- `short-chunks`: SmolLM2 shapes (Hq 9, Hkv 3, D 64); 32 chunks of 512 queries at
  contexts of 1K-16K, plus 32 decode rows at contexts of 1K-16K.
Chunks start on block boundaries (so that `xattention` can take each alone). The step's
keys and values sit in one paged cache of `--page-size` tokens a page, pages shuffled;
the decode rows come first (`decode_seqs`), as JAX serving stacks order them.

Rows (median device time, `bench.common.time_ms`):
- `ragged` the whole step in one call; `ragged-estimate` its layout, block sums and
  selection alone;
- `loop` the per-request calls summed: `xattention` on each chunk's contiguous k and v
  (gathered outside the timed region), cuDNN dense attention for each decode row;
  `loop-estimate` `xattn_estimate` of each chunk summed; `loop-host` the whole loop's
  wall time, launches and waits included (`latency_ms`), beside `ragged-host`;
- `dense` cuDNN's dense causal attention per request, summed.
Each chunk's ragged mask rows are compared with its own `xattention` mask (`mask_diff`:
blocks that differ, from float rounding near the threshold).
floor_ms: 4 * D * (kept causal pairs) FLOPs at the same run's matmul rate, plus the
strided product of the estimated chunks. `--smoke` shrinks everything to run on a CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.common import (MATMUL_FLOPS, latency_ms, log, matmul_tflops, record,  # noqa: E402
                          report, strided_flops, time_ms, write_outputs)
from xattn_jax import ragged_xattention, xattention, xattn_estimate  # noqa: E402
from xattn_jax.defaults import DENSE_LAST, MIN_BLOCKS, THRESHOLD  # noqa: E402
from xattn_jax.demo.synthetic import structured_qk  # noqa: E402
from xattn_jax.geometry import cdiv  # noqa: E402
from xattn_jax import impls  # noqa: E402
from xattn_jax.ragged.api import ragged_mask  # noqa: E402
from xattn_jax.ragged.checks import check_step  # noqa: E402
from xattn_jax.ragged.layout import ragged_blocks  # noqa: E402

BLOCK, STRIDE = 128, 8


@dataclasses.dataclass(frozen=True)
class StepShape:
    """One step: heads, head dim, chunks (queries, context) and decode rows' contexts."""

    name: str
    q_heads: int
    kv_heads: int
    head_dim: int
    chunks: tuple
    decodes: tuple


def step_shapes(smoke: bool) -> dict[str, StepShape]:
    rng = np.random.default_rng(0)
    if smoke:
        return {"long-prefill": StepShape("long-prefill", 4, 2, 32, ((256, 512), (256, 768)),
                                          (300, 400)),
                "short-chunks": StepShape("short-chunks", 3, 1, 32,
                                          tuple((128, c) for c in (256, 384, 512)), (129, 300))}
    long_decodes = tuple(int(x) for x in rng.integers(4096, 32769, 64))
    short_contexts = np.linspace(1024, 16384, 32) // 128 * 128
    short_decodes = tuple(int(x) for x in rng.integers(1024, 16385, 32))
    return {
        "long-prefill": StepShape("long-prefill", 32, 8, 128,
                                  tuple((8192, c) for c in (32768, 65536, 98304, 131072)),
                                  long_decodes),
        "short-chunks": StepShape("short-chunks", 9, 3, 64,
                                  tuple((512, int(c)) for c in short_contexts), short_decodes),
    }


@dataclasses.dataclass
class Step:
    """A built step: the packed arguments, and each request's contiguous q, k, v."""

    shape: StepShape
    args: tuple  # q, k, v, kv_lens, page_indices, cu_q_lens, num_seqs
    decode_seqs: int
    requests: list  # (q [1, Hq, Lq, D], k, v [1, Hkv, Lk, D]) per sequence, decode first


def _request(shape: StepShape, q_len: int, context: int, seed: int, structured: bool):
    """One request's q `[Hq, q_len, D]`, k and v `[Hkv, context, D]`, float32 numpy."""
    g = shape.q_heads // shape.kv_heads
    rng = np.random.default_rng(seed)
    if structured:
        data = structured_qk(seed, heads=shape.kv_heads, length=context,
                             head_dim=shape.head_dim)
        q = np.repeat(np.asarray(data.q[0, :, context - q_len:]), g, axis=0)
        k = np.asarray(data.k[0])
    else:
        q = rng.standard_normal((shape.q_heads, q_len, shape.head_dim), np.float32)
        k = rng.standard_normal((shape.kv_heads, context, shape.head_dim), np.float32)
    v = rng.standard_normal((shape.kv_heads, context, shape.head_dim), np.float32)
    return q, k, v


def build_step(shape: StepShape, page_size: int, dtype=jnp.bfloat16) -> Step:
    """The step's packed queries and shuffled paged cache (decode rows first)."""
    lengths = [(1, c) for c in shape.decodes] + list(shape.chunks)
    pages_per_seq = max(cdiv(c, page_size) for _, c in lengths)
    num_pages = sum(cdiv(c, page_size) for _, c in lengths) + 1
    k_cache = np.zeros((num_pages, page_size, shape.kv_heads, shape.head_dim), np.float32)
    v_cache = np.zeros_like(k_cache)
    order = np.random.default_rng(1).permutation(num_pages)
    table = np.zeros((len(lengths), pages_per_seq), np.int32)
    queries, requests, used = [], [], 0
    for s, (q_len, context) in enumerate(lengths):
        q, k, v = _request(shape, q_len, context, seed=s, structured=q_len > 1)
        pages = order[used:used + cdiv(context, page_size)]
        used += len(pages)
        table[s, :len(pages)] = pages
        padded = cdiv(context, page_size) * page_size
        for cache, x in ((k_cache, k), (v_cache, v)):
            x = np.pad(x, ((0, 0), (0, padded - context), (0, 0)))
            cache[pages] = x.reshape(shape.kv_heads, len(pages), page_size, -1).transpose(
                1, 2, 0, 3)
        queries.append(q.transpose(1, 0, 2))
        requests.append(tuple(jnp.asarray(x[None], dtype) for x in (q, k, v)))
        log(f"{shape.name}: request {s + 1}/{len(lengths)} built")
    cu = np.concatenate([[0], np.cumsum([q for q, _ in lengths])]).astype(np.int32)
    args = (jnp.asarray(np.concatenate(queries), dtype), jnp.asarray(k_cache, dtype),
            jnp.asarray(v_cache, dtype), jnp.asarray([c for _, c in lengths], jnp.int32),
            jnp.asarray(table), jnp.asarray(cu), jnp.int32(len(lengths)))
    return Step(shape, args, len(shape.decodes), requests)


def ragged_mask_call(step: Step, impl: str):
    """The ragged step's estimate alone (layout, block sums, selection), jitted."""
    geom = check_step(*step.args, None, block_size=BLOCK, stride=STRIDE)[0]
    estimate = impls.resolve_ragged(impl, step.args[0]).for_step(geom,
                                                                  step.args[0].dtype).estimate
    threshold = jnp.full((geom.q_heads,), THRESHOLD, jnp.float32)

    @jax.jit
    def call(q, k, v, kv_lens, table, cu, num_seqs):
        blocks = ragged_blocks(cu, kv_lens, num_seqs, jnp.int32(step.decode_seqs), geom)
        return ragged_mask(q, k, table, blocks, threshold, geom, estimate=estimate, norm=1.0,
                           min_blocks=MIN_BLOCKS, dense_last=DENSE_LAST)

    return call


def _mask_diff(step: Step, ragged_mask, request_masks) -> int:
    """Blocks where a chunk's ragged mask rows differ from its own `xattention` mask."""
    blocks = ragged_blocks(step.args[5], step.args[3], step.args[6],
                           jnp.int32(step.decode_seqs),
                           check_step(*step.args, None, block_size=BLOCK, stride=STRIDE)[0])
    diff = 0
    for s, mask in request_masks.items():
        rows = ragged_mask[:, int(blocks.cu_q_blocks[s]):int(blocks.cu_q_blocks[s + 1])]
        diff += int(jnp.sum(rows[:, :, :mask.shape[-1]] != mask[0]))
    return diff


def _dense_cudnn(q, k, v):
    """cuDNN's dense causal attention of one request in its [B, L, H, D] layout."""
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")


def _kept_pairs(mask_rows, step: Step) -> float:
    """Causally visible (query, key) pairs of kept blocks, summed over heads (an upper
    bound at block granularity for diagonal blocks)."""
    return float(jnp.sum(mask_rows)) * BLOCK * BLOCK


def run_step(step: Step, rows: set[str], impl: str, tflops: float | None) -> list[dict]:
    shape, out = step.shape, []
    name = f"{shape.name}-page{step.args[1].shape[1]}"
    rate = (tflops * 1e12) if tflops else MATMUL_FLOPS
    estimate_flops = sum(strided_flops(shape.q_heads, q, c, STRIDE, shape.head_dim, True)
                         for q, c in shape.chunks)

    def add(case, impl_name, ms, flops, **extra):
        row = record(f"{name}-{case}" if case else name, impl_name, ms, 1e3 * flops / rate,
                     0.0, tflops)
        row.update(extra)
        out.append(row)
        log(f"{row['case']} {impl_name}: {ms:.3f} ms")

    chunk_requests = step.requests[step.decode_seqs:]
    if "estimate" in rows:
        call = ragged_mask_call(step, impl)
        mask = call(*step.args)
        ms = time_ms(call, [step.args])
        masks = {}
        loop_ms = 0.0
        for s, (q, k, _) in enumerate(chunk_requests):
            est = jax.jit(lambda q, k: xattn_estimate(
                q, k, block_size=BLOCK, stride=STRIDE, threshold=THRESHOLD,
                min_blocks=MIN_BLOCKS, dense_last=DENSE_LAST)[1])
            masks[step.decode_seqs + s] = est(q, k)
            loop_ms += time_ms(est, [(q, k)])
        add("ragged-estimate", impl, ms, estimate_flops,
            mask_diff=_mask_diff(step, mask, masks))
        add("loop-estimate", "auto", loop_ms, estimate_flops)
    if "step" in rows:
        call = jax.jit(lambda *a: ragged_xattention(*a, decode_seqs=step.decode_seqs,
                                                    block_size=BLOCK, stride=STRIDE,
                                                    return_mask=True, impl=impl))
        _, mask = call(*step.args)
        flops = 4 * shape.head_dim * _kept_pairs(mask.blocks, step) + estimate_flops
        add("ragged", impl, time_ms(call, [step.args]), flops,
            host_ms=round(latency_ms(call, [step.args]), 4))
    if "loop" in rows or "dense" in rows:
        chunk_calls = [jax.jit(lambda q, k, v: xattention(q, k, v, block_size=BLOCK,
                                                           stride=STRIDE))] * len(chunk_requests)
        dense = jax.jit(lambda q, k, v: _dense_cudnn(*(x.transpose(0, 2, 1, 3)
                                                       for x in (q, k, v))))
        if "loop" in rows:
            calls = [dense] * step.decode_seqs + chunk_calls
            ms = sum(time_ms(c, [r]) for c, r in zip(calls, step.requests))

            def whole_loop():
                return [c(*r) for c, r in zip(calls, step.requests)]

            add("loop", "auto", ms, estimate_flops,
                host_ms=round(latency_ms(lambda: whole_loop(), [()]), 4))
        if "dense" in rows:
            ms = sum(time_ms(dense, [r]) for r in step.requests)
            pairs = sum(q * (c - q) + q * (q + 1) / 2 for q, c in
                        [(1, c) for c in shape.decodes] + list(shape.chunks))
            add("dense", "cudnn", ms, 4 * shape.head_dim * pairs * shape.q_heads)
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", default="long-prefill,short-chunks")
    parser.add_argument("--page-size", type=int, default=128)
    parser.add_argument("--rows", default="estimate,step,loop,dense")
    parser.add_argument("--impl", default="auto")
    parser.add_argument("--json")
    parser.add_argument("--md")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    shapes = step_shapes(args.smoke)
    tflops = matmul_tflops()
    records = []
    for name in args.steps.split(","):
        step = build_step(shapes[name], args.page_size)
        records += run_step(step, set(args.rows.split(",")), args.impl, tflops)
    write_outputs(records, report(records), args.json, args.md)


if __name__ == "__main__":
    main()
