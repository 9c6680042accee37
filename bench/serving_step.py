"""Times one serving step in one call (`ragged_xattention`) against the loop a serving
engine runs today (one `xattention` per request, dense attention for decode rows) and
against dense attention, on the GPU.

    python -m bench.serving_step [--steps long-prefill,short-chunks] [--page-size 128]
                                 [--rows estimate,step,loop,dense] [--impl auto]
                                 [--estimate antidiagonal] [--json PATH] [--md PATH]
                                 [--smoke]

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
- `dense` cuDNN's dense causal attention per request, summed; `dense-causal-{n}k` one
  whole causal cuDNN call of the step's shapes (queries = keys), whose pairs per
  microsecond are the dense rate the attention's (`ragged-attention`) is held to;
- `flex` FlexAttention (torch, compiled on a GPU) on the ragged step's own mask as one
  BlockMask over the step laid out block by block (`bench.flex_ragged`), checked against
  `ragged-attention`'s output (`max_abs_error`, `wrong_blocks`, `agrees`);
- `bridged` the torch call (`xattn_torch_bridge.ragged_xattention`, the step padded to its
  bucket) and the plain call's host times, launches and waits included; `padded_host_ms`
  the plain call of the bridge's own padded step (its bucket's extra rows and slots):
  the bridge's overhead is `host_ms` less that.
Each chunk's ragged mask rows are compared with its own `xattention` mask (`mask_diff`:
blocks that differ, from float rounding near the threshold). `--estimate sampled-rows`
selects on sampled rows in the ragged step and the loop's `xattention` alike (cases
named `..-sampled-rows`; no `loop-estimate` row or mask comparison).
floor_ms: 4 * D * (kept causal pairs) FLOPs at the same run's matmul rate, plus the
strided product of the estimated chunks. `--smoke` shrinks everything to run on a CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench import flex, flex_ragged  # noqa: E402
from bench.common import (MATMUL_FLOPS, latency_ms, log, matmul_tflops,  # noqa: E402
                          merge_json, record, report, strided_flops, time_ms,
                          write_outputs)
from xattn_jax import ragged_xattention, xattention, xattn_estimate  # noqa: E402
from xattn_jax.defaults import DENSE_LAST, ESTIMATES, MIN_BLOCKS, THRESHOLD  # noqa: E402
from xattn_jax.demo.synthetic import structured_qk  # noqa: E402
from xattn_jax.geometry import cdiv, next_pow2  # noqa: E402
from xattn_jax import impls  # noqa: E402
from xattn_jax.ragged.api import estimate_geometry, ragged_mask  # noqa: E402
from xattn_jax.ragged.checks import check_step  # noqa: E402
from xattn_jax.ragged.geometry import RaggedGeometry  # noqa: E402
from xattn_jax.ragged.layout import RaggedBlocks, ragged_blocks  # noqa: E402

BLOCK, STRIDE = 128, 8


@dataclasses.dataclass(frozen=True)
class StepShape:
    """One step: heads, head dim, chunks (queries, context) and decode rows' contexts;
    dense_length: the whole causal call whose pairs per microsecond are the dense rate of
    these shapes."""

    name: str
    q_heads: int
    kv_heads: int
    head_dim: int
    chunks: tuple
    decodes: tuple
    dense_length: int


def step_shapes(smoke: bool) -> dict[str, StepShape]:
    rng = np.random.default_rng(0)
    if smoke:
        return {"long-prefill": StepShape("long-prefill", 4, 2, 32, ((256, 512), (256, 768)),
                                          (300, 400), 512),
                "short-chunks": StepShape("short-chunks", 3, 1, 32,
                                          tuple((128, c) for c in (256, 384, 512)), (129, 300),
                                          512)}
    # few distinct lengths, so that the per-request loop compiles few shapes
    long_decodes = tuple(int(x) for x in rng.choice(np.arange(4096, 32769, 4096), 64))
    short_contexts = np.repeat(np.arange(1024, 16385, 1024), 2)
    short_decodes = tuple(int(x) for x in rng.choice(np.arange(2048, 16385, 2048), 32))
    return {
        "long-prefill": StepShape("long-prefill", 32, 8, 128,
                                  tuple((8192, c) for c in (32768, 65536, 98304, 131072)),
                                  long_decodes, 32768),
        "short-chunks": StepShape("short-chunks", 9, 3, 64,
                                  tuple((512, int(c)) for c in short_contexts), short_decodes,
                                  16384),
    }


@dataclasses.dataclass
class Step:
    """A built step: the packed arguments, and each request's contiguous q, k, v."""

    shape: StepShape
    page_size: int
    args: tuple = ()  # q, k, v, kv_lens, page_indices, cu_q_lens, num_seqs
    decode_seqs: int = 0
    requests: list = dataclasses.field(default_factory=list)  # (q [1, Hq, Lq, D], k, v
    # [1, Hkv, Lk, D]) per sequence, decode first; none for the dense rate alone


def _request(shape: StepShape, q_len: int, context: int, seed: int, dtype):
    """One request's q `[1, Hq, q_len, D]`, k and v `[1, Hkv, context, D]` on the device:
    structured chunks (the synthetic heads, each repeated to its GQA group), random
    decode rows and values."""
    key_q, key_k, key_v = jax.random.split(jax.random.PRNGKey(seed), 3)
    kv_shape = (1, shape.kv_heads, context, shape.head_dim)
    v = jax.random.normal(key_v, kv_shape, dtype)
    if q_len == 1:
        return (jax.random.normal(key_q, (1, shape.q_heads, 1, shape.head_dim), dtype),
                jax.random.normal(key_k, kv_shape, dtype), v)
    data = structured_qk(seed, heads=shape.kv_heads, length=context, head_dim=shape.head_dim)
    q = jnp.repeat(data.q[:, :, context - q_len:], shape.q_heads // shape.kv_heads, axis=1)
    return q.astype(dtype), data.k.astype(dtype), v


def _pages(x: jax.Array, page_size: int) -> jax.Array:
    """`[1, Hkv, L, D]` as whole pages `[ceil(L / page), page, Hkv, D]`, zero-padded."""
    length = x.shape[2]
    x = jnp.pad(x[0], ((0, 0), (0, cdiv(length, page_size) * page_size - length), (0, 0)))
    return x.reshape(x.shape[0], -1, page_size, x.shape[2]).transpose(1, 2, 0, 3)


def build_step(shape: StepShape, page_size: int, dtype=jnp.bfloat16) -> Step:
    """The step's packed queries and shuffled paged cache (decode rows first), built on
    the device."""
    lengths = [(1, c) for c in shape.decodes] + list(shape.chunks)
    requests = []
    for s, (q_len, context) in enumerate(lengths):
        requests.append(_request(shape, q_len, context, s, dtype))
        if q_len > 1:
            log(f"{shape.name}: chunk over {context} keys built")
    counts = [cdiv(c, page_size) for _, c in lengths]
    num_pages = sum(counts) + 1
    order = np.random.default_rng(1).permutation(num_pages)  # request pages -> slots
    table = np.zeros((len(lengths), max(counts)), np.int32)
    starts = np.concatenate([[0], np.cumsum(counts)])
    for s, count in enumerate(counts):
        table[s, :count] = order[starts[s]:starts[s] + count]
    caches = []
    for part in (1, 2):  # k, v: the requests' pages in order, then moved to their slots
        content = jnp.concatenate([_pages(r[part], page_size) for r in requests]
                                  + [jnp.zeros((1, page_size) + requests[0][part].shape[1:2]
                                               + requests[0][part].shape[3:], dtype)])
        caches.append(content[np.argsort(order)])
    cu = np.concatenate([[0], np.cumsum([q for q, _ in lengths])]).astype(np.int32)
    q = jnp.concatenate([r[0][0].transpose(1, 0, 2) for r in requests])
    args = (q, *caches, jnp.asarray([c for _, c in lengths], jnp.int32), jnp.asarray(table),
            jnp.asarray(cu), jnp.int32(len(lengths)))
    log(f"{shape.name}: {len(lengths)} requests, {num_pages} pages of {page_size} built")
    return Step(shape, page_size, args, len(shape.decodes), requests)


def step_geometry(step: Step) -> RaggedGeometry:
    """The step's static sizes, as `ragged_xattention` checks them."""
    return check_step(*step.args, None, block_size=BLOCK, stride=STRIDE)[0]


def step_blocks(step: Step, geom: RaggedGeometry) -> RaggedBlocks:
    """The step's layout on the device (`ragged_blocks`)."""
    return ragged_blocks(step.args[5], step.args[3], step.args[6],
                         jnp.int32(step.decode_seqs), geom)


def ragged_step_call(step: Step, impl: str, estimate: str):
    """The whole step in one call, jitted, returning the output and its `RaggedMask`."""
    return jax.jit(lambda *a: ragged_xattention(
        *a, decode_seqs=step.decode_seqs, block_size=BLOCK, stride=STRIDE, return_mask=True,
        impl=impl, estimate=estimate))


def ragged_mask_call(step: Step, impl: str, estimate: str):
    """The ragged step's estimate alone (layout, block sums, selection), jitted."""
    geom = step_geometry(step)
    scores = estimate_geometry(geom, estimate, geom.head_dim ** -0.5)
    backend = impls.resolve_ragged(impl, step.args[0]).for_step(
        geom, step.args[0].dtype, estimate_geom=scores).estimate
    threshold = jnp.full((geom.q_heads,), THRESHOLD, jnp.float32)

    @jax.jit
    def call(q, k, v, kv_lens, table, cu, num_seqs):
        blocks = ragged_blocks(cu, kv_lens, num_seqs, jnp.int32(step.decode_seqs), geom)
        return ragged_mask(q, k, table, blocks, threshold, scores, estimate=backend,
                           norm=1.0, min_blocks=MIN_BLOCKS, dense_last=DENSE_LAST)

    return call


def _mask_diff(step: Step, ragged_mask, request_masks) -> int:
    """Blocks where a chunk's ragged mask rows differ from its own `xattention` mask."""
    blocks = step_blocks(step, step_geometry(step))
    diff = 0
    for s, mask in request_masks.items():
        rows = ragged_mask[:, int(blocks.cu_q_blocks[s]):int(blocks.cu_q_blocks[s + 1])]
        diff += int(jnp.sum(rows[:, :, :mask.shape[-1]] != mask[0]))
    return diff


def _dense(q, k, v):
    """Dense causal attention of one request (q the last of the keys) in its [B, L, H,
    D] layout: cuDNN on a GPU, XLA elsewhere (a smoke run)."""
    lq, lk = q.shape[1], k.shape[1]
    if jax.default_backend() == "gpu":
        if lq == lk:
            return jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                implementation="cudnn")
        mask = jnp.arange(lk)[None, :] <= jnp.arange(lk - lq, lk)[:, None]
        return jax.nn.dot_product_attention(q, k, v, mask=mask[None, None],
                                            implementation="cudnn")
    mask = jnp.arange(lk)[None, :] <= jnp.arange(lk - lq, lk)[:, None]
    return jax.nn.dot_product_attention(q, k, v, mask=mask[None, None])


def kept_pairs(mask: jax.Array, step: Step) -> float:
    """(query, key) pairs the ragged attention computes: over heads, each live mask row's
    queries against the causally visible keys of its kept blocks."""
    blocks = step_blocks(step, step_geometry(step))
    kept = np.asarray(mask).sum(axis=0).astype(np.float64)  # [QB, KB], over heads
    seq = np.asarray(blocks.row_seq)
    block = np.asarray(blocks.row_block)
    live = np.asarray(blocks.row_live)
    kv = np.asarray(blocks.kv_lens)[seq]
    first = np.asarray(blocks.first_position)[seq]
    lo = np.maximum(block * BLOCK, first)  # the row's real query positions [lo, hi)
    hi = np.minimum((block + 1) * BLOCK, kv)
    queries = np.where(live, np.maximum(hi - lo, 0), 0)
    key_start = np.arange(kept.shape[1]) * BLOCK
    before = np.clip(kv[:, None] - key_start[None, :], 0, BLOCK) * queries[:, None]
    # the diagonal block: query p sees keys I bs .. p
    diagonal = np.where(queries > 0, (lo + hi - 1) / 2 - block * BLOCK + 1, 0) * queries
    pairs = np.where(key_start[None, :] < (block * BLOCK)[:, None], before, 0.0)
    pairs[np.arange(len(block)), np.minimum(block, kept.shape[1] - 1)] += diagonal
    return float((kept * pairs).sum())


def dense_pairs(shape: StepShape) -> float:
    """(query, key) pairs of the step's dense causal attention, over heads."""
    lengths = [(1, c) for c in shape.decodes] + list(shape.chunks)
    return shape.q_heads * sum(q * (c - q) + q * (q + 1) / 2 for q, c in lengths)


def run_step(step: Step, rows: set[str], impl: str, tflops: float | None,
             estimate: str = "antidiagonal") -> list[dict]:
    shape, out = step.shape, []
    name = f"{shape.name}-page{step.page_size}"
    if estimate != "antidiagonal":
        name += f"-{estimate}"
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
    if "estimate" in rows and estimate != "antidiagonal":
        call = ragged_mask_call(step, impl, estimate)
        add("ragged-estimate", impl, time_ms(call, [step.args]), estimate_flops)
    elif "estimate" in rows:
        call = ragged_mask_call(step, impl, estimate)
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
        call = ragged_step_call(step, impl, estimate)
        _, mask = call(*step.args)
        pairs = kept_pairs(mask.blocks, step)
        flops = 4 * shape.head_dim * pairs + estimate_flops
        add("ragged", impl, time_ms(call, [step.args]), flops,
            host_ms=round(latency_ms(call, [step.args]), 4),
            density=round(pairs / dense_pairs(shape), 4))
        attention = ragged_attention_call(step, impl, mask.blocks)
        ms = time_ms(attention, [step.args])
        add("ragged-attention", impl, ms, 4 * shape.head_dim * pairs,
            pairs_per_us=round(pairs / ms / 1e3, 1))
    if "loop" in rows or "dense" in rows:
        chunk_calls = [jax.jit(lambda q, k, v: xattention(
            q, k, v, block_size=BLOCK, stride=STRIDE, estimate=estimate))] * len(chunk_requests)
        dense = jax.jit(lambda q, k, v: _dense(*(x.transpose(0, 2, 1, 3)
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
            pairs = dense_pairs(shape)
            add("dense", "cudnn", ms, 4 * shape.head_dim * pairs,
                pairs_per_us=round(pairs / ms / 1e3, 1))
    if "flex" in rows:
        flex_row(step, impl, estimate, add)
    if "bridged" in rows:
        out += bridged_rows(step, impl, add)
    if "dense-rate" in rows:
        length = shape.dense_length
        q, k, v = (jax.random.normal(key, (1, length, heads, shape.head_dim), jnp.bfloat16)
                   for key, heads in zip(jax.random.split(jax.random.PRNGKey(2), 3),
                                         (shape.q_heads, shape.kv_heads, shape.kv_heads)))
        call = jax.jit(_dense)
        ms = time_ms(call, [(q, k, v)])
        pairs = shape.q_heads * length * (length + 1) / 2
        add(f"dense-causal-{length}", "cudnn", ms, 4 * shape.head_dim * pairs,
            pairs_per_us=round(pairs / ms / 1e3, 1))
    return out


def ragged_attention_call(step: Step, impl: str, mask: jax.Array):
    """The step's attention alone on a given mask (`RaggedMask.blocks`), jitted."""
    geom = step_geometry(step)
    attention = impls.resolve_ragged(impl, step.args[0]).for_step(
        geom, step.args[0].dtype).attention
    scale = geom.head_dim ** -0.5

    @jax.jit
    def call(q, k, v, kv_lens, table, cu, num_seqs):
        blocks = ragged_blocks(cu, kv_lens, num_seqs, jnp.int32(step.decode_seqs), geom)
        return attention.ragged_attention(q, k, v, table, mask, blocks, geom, scale=scale)

    return call


def flex_row(step: Step, impl: str, estimate: str, add) -> None:
    """FlexAttention on the ragged step's mask, checked against our attention on it."""
    geom = step_geometry(step)
    _, mask = ragged_step_call(step, impl, estimate)(*step.args)
    ours = ragged_attention_call(step, impl, mask.blocks)(*step.args)
    blocks = step_blocks(step, geom)
    q, k, v, _, table = step.args[:5]
    compiled = jax.default_backend() == "gpu"
    call, unpacked, wrong = flex_ragged.peer_call(q, k, v, table, mask.blocks, blocks,
                                                  geom, compiled)
    got = np.asarray(unpacked(call()), np.float32)
    want = np.asarray(ours, np.float32)
    error = float(np.abs(got - want).max())
    agrees = wrong == 0 and bool((np.abs(got - want) <= flex.ATOL + flex.RTOL
                                  * np.abs(want)).all())
    device = flex_ragged.torch_device(q)
    ms = flex.time_ms(call, device, warmup=3, reps=20 if compiled else flex.EAGER_REPS)
    pairs = kept_pairs(mask.blocks, step)
    add("flex", flex.IMPL, ms, 4 * step.shape.head_dim * pairs,
        pairs_per_us=round(pairs / ms / 1e3, 1), max_abs_error=round(error, 5),
        wrong_blocks=wrong, agrees=agrees, mode="compiled" if compiled else "eager")


def bridged_rows(step: Step, impl: str, add) -> list:
    """The torch call (`xattn_torch_bridge.ragged_xattention`) against the plain JAX call
    on the same step: host time per call, launches and waits included."""
    import torch
    import xattn_torch_bridge as xb

    q, k, v, kv_lens, table, cu = (xb.to_torch(x) for x in step.args[:6])
    args = dict(cu_seqlens_q=cu, max_seqlen_q=int(np.diff(np.asarray(step.args[5])).max()),
                seqused_k=kv_lens, max_seqlen_k=int(np.asarray(step.args[3]).max()),
                block_table=table, block_size=BLOCK, stride=STRIDE)

    def bridged():
        return xb.ragged_xattention(q, k, v, **args)

    def synced():
        bridged()
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    synced()
    plain = jax.jit(lambda *a: ragged_xattention(*a, block_size=BLOCK, stride=STRIDE,
                                                 impl=impl))
    jax.block_until_ready(plain(*step.args))
    plain_ms = latency_ms(plain, [step.args])
    padded, padded_args = padded_call(step, impl, q, kv_lens, table, cu)
    jax.block_until_ready(padded(*padded_args))
    padded_ms = latency_ms(padded, [padded_args])
    reps = []
    for _ in range(20):
        start = time.perf_counter()
        synced()
        reps.append(1e3 * (time.perf_counter() - start))
    bridged_ms = float(np.median(reps))
    add("bridged", impl, bridged_ms, 0.0, host_ms=round(bridged_ms, 4),
        plain_host_ms=round(plain_ms, 4), padded_host_ms=round(padded_ms, 4))
    return []


def padded_call(step: Step, impl: str, q, kv_lens, table, cu):
    """The JAX computation the bridge runs (`xattn_torch_bridge.ragged._compiled`: the
    step padded to its bucket) and its arguments as JAX arrays, to time without the
    bridge: the bridge's own host time is `bridged` less this."""
    from xattn_torch_bridge import ragged as bridge_ragged, to_jax
    from xattn_jax.checks import threshold_per_head

    slots = next_pow2(kv_lens.shape[0])
    queries, meta = bridge_ragged._padded_step(q, cu, kv_lens, table, slots)
    run = bridge_ragged._compiled(None, BLOCK, STRIDE, MIN_BLOCKS, DENSE_LAST, "antidiagonal",
                                  impls.resolve_ragged(impl, step.args[0]), slots)
    threshold = threshold_per_head(THRESHOLD, step.shape.q_heads)
    return run, (to_jax(queries, copy=True), step.args[1], step.args[2],
                 to_jax(meta, copy=True), threshold)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", default="long-prefill,short-chunks")
    parser.add_argument("--page-size", type=int, default=128)
    parser.add_argument("--rows",
                        default="estimate,step,loop,dense,dense-rate,flex,bridged")
    parser.add_argument("--impl", default="auto")
    parser.add_argument("--estimate", default="antidiagonal",
                        choices=ESTIMATES)
    parser.add_argument("--json")
    parser.add_argument("--md")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    shapes = step_shapes(args.smoke)
    tflops = matmul_tflops()
    records = []
    for name in args.steps.split(","):
        # the dense rate alone needs no step built
        step = build_step(shapes[name], args.page_size) if args.rows != "dense-rate" else \
            Step(shapes[name], args.page_size)
        for row in args.rows.split(","):  # one row group at a time: a failure is logged
            try:
                records += run_step(step, {row}, args.impl, tflops, args.estimate)
            except Exception as error:  # noqa: BLE001 (the run goes on to the next rows)
                log(f"{name} {row}: FAILED {type(error).__name__}: {error}")
            if args.json and records:
                merge_json(args.json, records)
    write_outputs(records, report(records), None, args.md)


if __name__ == "__main__":
    main()
