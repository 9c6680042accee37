"""Which fp8 key scheme keeps the estimate's selections: mask agreement with bf16 keys.

    python -m bench.fp8_schemes [--length 16384] [--real 4096] [--groups 16,64,4096]
                                [--queries bf16,fp8-row] [--center-tokens 4096] [--md PATH]

Each candidate quantizes the keys to float8_e4m3fn in groups of `group` consecutive
tokens (a cache page, or a part of one) and dequantizes them to bfloat16; the estimate
then runs on them exactly as on the bf16 keys (the reference implementation, on the CPU):
- `head`: one scale per KV head over the whole sequence (amax / 448);
- `group`: one scale per (group, KV head);
- `channel`: one scale per (group, KV head, channel);
- `group-mean`: `xattn_jax.fp8.quantize_keys`, the scheme chosen: each group's mean key
  (per KV head and channel) removed first and kept as an offset, then one scale per
  (group, KV head);
- `group-mean-pow2`: the same with the scale rounded up to a power of two;
- `channel-mean`: the mean removed, then one scale per channel;
- `center-group`: one fixed center per KV head (the mean key, per channel, over the first
  `--center-tokens` tokens, or all of them if fewer) removed from every key, then one
  scale per (group, KV head) and no per-group offset. An fp8-product kernel gets the
  center for free (it adds the same constant to every score of a reshaped query row,
  which the softmax ignores) and the group scale as a per-column multiply, where
  `group-mean`'s offsets cost an extra correction product.
The control row `bf16 itself` compares the estimate on the float32 keys with the one on
their bf16 rounding: how many selections a rounding 16 times finer already changes.

Queries (`--queries`), what an fp8-product kernel would compute:
- `bf16`: the bf16 queries themselves; the keys dequantized to bf16;
- `fp8-row`: each reshaped query row (the S = 8 consecutive tokens of one head that
  one dot product of the strided product reads, x D channels) quantized to e4m3 with one
  scale and dequantized to float32 (`round_trip_queries`); the keys are then dequantized
  to float32 too, so that only the quantization differs from the bf16 estimate. Control
  rows: `fp8-row` queries with the bf16 keys (the queries' own share of the loss), and
  the bf16 queries and keys as float32 (the change of dtype alone).

Data: the demo's structured synthetic context (`xattn_jax.demo.synthetic`: sinks, a
local window, stripes, noise; 8 heads of 128) of `--length` tokens, and with `--real N`
the real model's queries and keys of every layer on the first N tokens of each text of
`--texts` (`bench.texts`; `bench.llama`, the weights of `bench.smollm2`), both rounded
to bfloat16.

Metrics, against the same call on the bf16 queries and keys:
- `estimate`: `xattn_estimate` (causal, block 128, stride 8, threshold 0.9): the share
  of the causally allowed (query block, key block) pairs whose selection is the same,
  the lowest over the data's layers and their mean;
- `chunks`: chunked prefill, each chunk of `chunk` queries over the keys before it
  (`kv_block_scores` then `select_kv_blocks` at 0.95): the share of the KV blocks holding
  keys whose selection is the same, the lowest over the layers and their mean;
- `sums error`: the largest difference in the estimate's block sums, relative to its
  row's total, over the layers.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import commit, log, today, versions
from xattn_jax import fp8, kv_block_scores, select_kv_blocks, xattn_estimate
from xattn_jax.demo.synthetic import structured_qk

E4M3_MAX = fp8.E4M3_MAX
SCHEMES = ("head", "group", "channel", "group-mean", "group-mean-pow2", "channel-mean",
           "center-group")
QUERIES = ("bf16", "fp8-row")
CONTROL = "bf16 itself"  # keys: float32 against their bf16 rounding (bf16 queries)
UNQUANTIZED = "bf16"  # keys: the bf16 keys themselves (fp8-row queries' control)
AS_FLOAT32 = "bf16 as float32"  # queries and keys: the bf16 ones, cast to float32
ESTIMATE = dict(block_size=128, stride=8, threshold=0.9, causal=True)
CENTER_TOKENS = 4096


@dataclasses.dataclass(frozen=True)
class Chunks:
    """Chunked prefill's sizes: `chunk` queries per chunk, KV blocks of `kv_block`
    tokens scored at estimate blocks of `estimate_block`, selected at `threshold`."""

    chunk: int
    kv_block: int
    estimate_block: int
    threshold: float = 0.95


def _fp8(x: jax.Array, scale: jax.Array) -> jax.Array:
    """x / scale rounded to float8_e4m3fn (saturated: e4m3fn has no infinity), float32."""
    return jnp.clip(x / scale, -E4M3_MAX, E4M3_MAX).astype(fp8.FP8).astype(jnp.float32)


def center(k: jax.Array, tokens: int) -> jax.Array:
    """The mean key over the first `tokens` tokens (all, if fewer), per KV head and
    channel: float32 `[B, H, 1, D]` of k `[B, H, L, D]`."""
    return k[:, :, :tokens].astype(jnp.float32).mean(axis=2, keepdims=True)


@functools.partial(jax.jit, static_argnames=("scheme", "group", "dtype", "center_tokens"))
def round_trip(k: jax.Array, scheme: str, group: int, dtype=None,
               center_tokens: int = CENTER_TOKENS) -> jax.Array:
    """k `[B, H, L, D]` (bf16) quantized by `scheme` in groups of `group` tokens and
    dequantized: k's shape, in `dtype` (default k's)."""
    dtype = dtype or k.dtype
    if scheme == "group-mean":
        return fp8.dequantize(fp8.quantize_keys(k, group=group), dtype)
    b, h, length, d = k.shape
    shift = center(k, center_tokens) if scheme == "center-group" else 0.0
    pad = -length % group
    x = jnp.pad(k.astype(jnp.float32) - shift, ((0, 0), (0, 0), (0, pad), (0, 0)))
    x = x.reshape(b, h, -1, group, d)  # [B, H, groups, group, D]
    offset = x.mean(axis=3, keepdims=True) if scheme.endswith(("-mean", "-pow2")) else 0.0
    x = x - offset
    axes = {"head": (2, 3, 4), "group": (3, 4), "channel": 3, "group-mean-pow2": (3, 4),
            "channel-mean": 3, "center-group": (3, 4)}[scheme]
    amax = jnp.max(jnp.abs(x), axis=axes, keepdims=True)
    scale = jnp.where(amax > 0, amax / E4M3_MAX, 1.0)
    if scheme == "group-mean-pow2":
        scale = jnp.exp2(jnp.ceil(jnp.log2(scale)))
    out = _fp8(x, scale) * scale + offset
    return (out.reshape(b, h, -1, d)[:, :, :length] + shift).astype(dtype)


def quantize_query_rows(q: jax.Array, stride: int) -> tuple[jax.Array, jax.Array]:
    """q `[B, Hq, L, D]` in reshaped rows of `stride` tokens (the last one padded with
    zeros), each quantized to float8_e4m3fn with one scale, its largest magnitude / 448
    (plain: fp8.quantize_keys rounds its key scales up to 20 significant bits, which only
    makes values * scale exact in float32; 1 for a row of zeros). Returns (values
    float8_e4m3fn `[B, Hq, rows, stride, D]`, scales float32 `[B, Hq, rows, 1, 1]`).

    One scale per query token (`fp8-token`) is not measured: a strided dot product sums
    the products of S different query tokens, so per-token scales cannot factor out of it.
    """
    b, h, length, d = q.shape
    x = jnp.pad(q.astype(jnp.float32), ((0, 0), (0, 0), (0, -length % stride), (0, 0)))
    x = x.reshape(b, h, -1, stride, d)
    amax = jnp.max(jnp.abs(x), axis=(3, 4), keepdims=True)
    scales = jnp.where(amax > 0, amax / E4M3_MAX, 1.0)
    return jnp.clip(x / scales, -E4M3_MAX, E4M3_MAX).astype(fp8.FP8), scales


@functools.partial(jax.jit, static_argnames=("stride",))
def round_trip_queries(q: jax.Array, stride: int = ESTIMATE["stride"]) -> jax.Array:
    """q `[B, Hq, L, D]` quantized by `quantize_query_rows` and dequantized, float32 (an
    fp8 kernel accumulates in float32): float32(values) * scale, q's shape."""
    values, scales = quantize_query_rows(q, stride)
    b, h, length, d = q.shape
    return (values.astype(jnp.float32) * scales).reshape(b, h, -1, d)[:, :, :length]


def agreement(a: jax.Array, b: jax.Array, where: jax.Array) -> float:
    """The share of the entries `where` (broadcast) on which bool masks a and b agree."""
    where = jnp.broadcast_to(where, a.shape)
    return float(((a == b) & where).sum() / where.sum())


def estimate_metrics(q, k, q2, k2) -> tuple[float, float]:
    """(mask agreement over the allowed pairs, largest block-sum error / row total) of
    the causal estimate on (q2, k2) against (q, k)."""
    sums, mask = xattn_estimate(q, k, **ESTIMATE)
    sums2, mask2 = xattn_estimate(q2, k2, **ESTIMATE)
    blocks = mask.shape[-1]
    allowed = jnp.tril(jnp.ones((blocks, blocks), bool))
    total = sums.sum(axis=-1, keepdims=True)
    error = float(jnp.max(jnp.abs(sums2 - sums) / total))
    return agreement(mask, mask2, allowed), error


def chunk_agreement(q, k, q2, k2, sizes: Chunks) -> float:
    """Mask agreement over every chunk's KV blocks holding keys: chunk c's queries are
    tokens [c * chunk, (c + 1) * chunk), its keys those before it."""
    same, count = 0, 0
    for start in range(sizes.chunk, q.shape[2] - sizes.chunk + 1, sizes.chunk):
        masks = []
        for queries, keys in ((q, k), (q2, k2)):
            scores = kv_block_scores(queries[:, :, start:start + sizes.chunk], keys,
                                     kv_block_size=sizes.kv_block,
                                     estimate_block_size=sizes.estimate_block,
                                     stride=ESTIMATE["stride"], k_len=start)
            masks.append(np.asarray(select_kv_blocks(scores, threshold=sizes.threshold)))
        valid = -(-start // sizes.kv_block)
        same += int((masks[0][:, :valid] == masks[1][:, :valid]).sum())
        count += masks[0][:, :valid].size
    return same / count


def inputs(q, k, k32, queries: str, scheme: str, group, center_tokens: int):
    """(q2, k2), what the estimate compared with the one on bf16 q and k `[B, H, L, D]`
    runs on (k32: the float32 keys k was rounded from)."""
    if queries == AS_FLOAT32:
        return q.astype(jnp.float32), k.astype(jnp.float32)
    if queries == "bf16":
        return (q.astype(jnp.float32), k32) if scheme == CONTROL else \
            (q, round_trip(k, scheme, group, center_tokens=center_tokens))
    assert queries == "fp8-row", queries
    k2 = k.astype(jnp.float32) if scheme == UNQUANTIZED else \
        round_trip(k, scheme, group, jnp.float32, center_tokens=center_tokens)
    return round_trip_queries(q), k2


def measure(cases, queries: str, scheme: str, group, sizes: Chunks,
            center_tokens: int = CENTER_TOKENS) -> dict:
    """A (queries, key scheme)'s metrics over `cases` ((name, q, k) float32): against the
    estimate on bf16 q and k, the estimate on `inputs`."""
    est, chunks, errors = [], [], []
    for _, q32, k32 in cases:
        q, k = q32.astype(jnp.bfloat16), k32.astype(jnp.bfloat16)
        q2, k2 = inputs(q, k, k32, queries, scheme, group, center_tokens)
        agree, error = estimate_metrics(q, k, q2, k2)
        est.append(agree)
        errors.append(error)
        chunks.append(chunk_agreement(q, k, q2, k2, sizes))
    return {"estimate_min": min(est), "estimate_mean": float(np.mean(est)),
            "chunks_min": min(chunks), "chunks_mean": float(np.mean(chunks)),
            "sums_error": max(errors)}


def synthetic_cases(length: int, heads: int = 8, seed: int = 0) -> list:
    data = structured_qk(seed, heads=heads, length=length, head_dim=128)
    return [("synthetic", data.q, data.k)]


def real_model_cases(length: int, text: str = "python-docs") -> list:
    """(layer name, q, k) float32 of every layer of the real model on `length` tokens of
    `text`: the queries and keys the dense forward computes (rotary positions applied)."""
    from bench import llama, model_quality, texts

    model = model_quality.Model(jnp.float32)
    tokens = jnp.asarray(texts.text_tokens(model.tokenizer, text, length))[None]

    def dense_keeping_qk(q, k, v, layer):
        return llama.dense_attention(q, k, v, layer, scale=model.cfg.scale), (q, k)

    _, (qs, ks), _ = llama.prefill(model.params, tokens, None, cfg=model.cfg,
                                   attention=dense_keeping_qk)
    return [(f"{text}, layer {i}", q, k) for i, (q, k) in enumerate(zip(qs, ks))]


def runs(queries, schemes, groups) -> list[tuple]:
    """(queries, key scheme, group) of the table's rows: each query kind's controls, then
    every scheme and group (`head`: one group, the whole sequence)."""
    out = []
    for kind in queries:
        out += [("bf16", CONTROL, None)] if kind == "bf16" else \
            [(AS_FLOAT32, AS_FLOAT32, None), (kind, UNQUANTIZED, None)]
        out += [(kind, scheme, group) for scheme in schemes
                for group in (groups[:1] if scheme == "head" else groups)]
    return out


def rows(name: str, cases, sizes: Chunks, queries, schemes, groups,
         center_tokens: int = CENTER_TOKENS) -> list[str]:
    """The table's rows of one data set (`runs`)."""
    lines = []
    for kind, scheme, group in runs(queries, schemes, groups):
        m = measure(cases, kind, scheme, group, sizes, center_tokens)
        log(f"{name}, queries {kind}, keys {scheme}, group {group}: {m}")
        shown = "-" if group is None else "all" if scheme == "head" else group
        lines.append(f"| {name} | {kind} | {scheme} | {shown} | {m['estimate_min']:.5f} | "
                     f"{m['estimate_mean']:.5f} | {m['chunks_min']:.5f} | "
                     f"{m['chunks_mean']:.5f} | {m['sums_error']:.2e} |")
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=16384,
                        help="tokens of the synthetic context (0: none)")
    parser.add_argument("--real", type=int, default=0,
                        help="tokens of real text through the real model (0: none)")
    parser.add_argument("--texts", default="python-docs",
                        help="comma-separated texts of bench.texts for --real")
    parser.add_argument("--groups", default="16,64,4096", help="tokens per scale group")
    parser.add_argument("--schemes", default=",".join(SCHEMES))
    parser.add_argument("--queries", default="bf16",
                        help=f"comma-separated query kinds, of {','.join(QUERIES)}")
    parser.add_argument("--center-tokens", type=int, default=CENTER_TOKENS,
                        help="tokens whose mean key is center-group's center")
    parser.add_argument("--md", help="write the markdown table here")
    args = parser.parse_args(argv)
    schemes, groups = args.schemes.split(","), [int(g) for g in args.groups.split(",")]
    queries = args.queries.split(",")
    unknown = sorted(set(schemes) - set(SCHEMES)) + sorted(set(queries) - set(QUERIES))
    if unknown:
        parser.error(f"unknown schemes or query kinds: {', '.join(unknown)}")
    table_rows = functools.partial(rows, queries=queries, schemes=schemes, groups=groups,
                                   center_tokens=args.center_tokens)
    lines = [("| data | queries | keys | group | estimate agreement, lowest | estimate "
              "agreement, mean | chunk agreement, lowest | chunk agreement, mean | "
              "sums error |"), "|---|---|---|---|---|---|---|---|---|"]
    if args.length:
        lines += table_rows(f"synthetic {args.length}", synthetic_cases(args.length),
                            Chunks(2048, 1024, 256))
    if args.real:
        log(f"capturing the real model's q and k on {args.real} tokens of {args.texts}")
        cases = [case for text in args.texts.split(",")
                 for case in real_model_cases(args.real, text)]
        lines += table_rows(f"real model {args.real}", cases, Chunks(512, 256, 128))
    command = "python -m bench.fp8_schemes " + " ".join(sys.argv[1:] if argv is None else argv)
    table = (f"{today()}, commit {commit()}, {versions()}, CPU\n\n`{command.strip()}`\n\n"
             + "\n".join(lines) + "\n")
    print(table)
    if args.md:
        with open(args.md, "w") as f:
            f.write(table)


if __name__ == "__main__":
    main()
