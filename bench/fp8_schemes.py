"""Which fp8 key scheme keeps the estimate's selections: mask agreement with bf16 keys.

    python -m bench.fp8_schemes [--length 16384] [--real 4096] [--groups 16,64,4096]
                                [--md PATH]

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
- `channel-mean`: the mean removed, then one scale per channel.
The control row `bf16 itself` compares the estimate on the float32 keys with the one on
their bf16 rounding: how many selections a rounding 16 times finer already changes.

Data: the demo's structured synthetic context (`xattn_jax.demo.synthetic`: sinks, a
local window, stripes, noise; 8 heads of 128) of `--length` tokens, and with `--real N`
the real model's queries and keys of every layer on the first N tokens of each text of
`--texts` (`bench.texts`; `bench.llama`, the weights of `bench.smollm2`), both rounded
to bfloat16.

Metrics, against the same call on the bf16 keys:
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
SCHEMES = ("head", "group", "channel", "group-mean", "group-mean-pow2", "channel-mean")
CONTROL = "bf16 itself"
ESTIMATE = dict(block_size=128, stride=8, threshold=0.9, causal=True)


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


@functools.partial(jax.jit, static_argnames=("scheme", "group"))
def round_trip(k: jax.Array, scheme: str, group: int) -> jax.Array:
    """k `[B, H, L, D]` (bf16) quantized by `scheme` in groups of `group` tokens and
    dequantized: bf16, k's shape."""
    if scheme == "group-mean":
        return fp8.dequantize(fp8.quantize_keys(k, group=group), k.dtype)
    b, h, length, d = k.shape
    pad = -length % group
    x = jnp.pad(k.astype(jnp.float32), ((0, 0), (0, 0), (0, pad), (0, 0)))
    x = x.reshape(b, h, -1, group, d)  # [B, H, groups, group, D]
    offset = x.mean(axis=3, keepdims=True) if scheme.endswith(("-mean", "-pow2")) else 0.0
    x = x - offset
    axes = {"head": (2, 3, 4), "group": (3, 4), "channel": 3, "group-mean-pow2": (3, 4),
            "channel-mean": 3}[scheme]
    amax = jnp.max(jnp.abs(x), axis=axes, keepdims=True)
    scale = jnp.where(amax > 0, amax / E4M3_MAX, 1.0)
    if scheme == "group-mean-pow2":
        scale = jnp.exp2(jnp.ceil(jnp.log2(scale)))
    out = _fp8(x, scale) * scale + offset
    return out.reshape(b, h, -1, d)[:, :, :length].astype(k.dtype)


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


def measure(cases, scheme: str, group: int, sizes: Chunks) -> dict:
    """A scheme's metrics over `cases` ((name, q, k) float32): against the estimate on
    bf16 q and k, the estimate on bf16 q and the scheme's keys (CONTROL: float32 keys)."""
    est, chunks, errors = [], [], []
    for _, q32, k32 in cases:
        q, k = q32.astype(jnp.bfloat16), k32.astype(jnp.bfloat16)
        q2, k2 = (q.astype(jnp.float32), k32) if scheme == CONTROL else \
            (q, round_trip(k, scheme, group))
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


def rows(name: str, cases, sizes: Chunks, schemes, groups) -> list[str]:
    """The table's rows of one data set: the control, then every scheme and group."""
    runs = [(CONTROL, None)] + [(s, g) for s in schemes
                                for g in (groups[:1] if s == "head" else groups)]
    lines = []
    for scheme, group in runs:
        m = measure(cases, scheme, group, sizes)
        log(f"{name}, {scheme}, group {group}: {m}")
        shown = "-" if scheme == CONTROL else "all" if scheme == "head" else group
        lines.append(f"| {name} | {scheme} | {shown} | {m['estimate_min']:.5f} | "
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
    parser.add_argument("--md", help="write the markdown table here")
    args = parser.parse_args(argv)
    schemes, groups = args.schemes.split(","), [int(g) for g in args.groups.split(",")]
    lines = ["| data | scheme | group | estimate agreement, lowest | estimate agreement, "
             "mean | chunk agreement, lowest | chunk agreement, mean | sums error |",
             "|---|---|---|---|---|---|---|---|"]
    if args.length:
        lines += rows(f"synthetic {args.length}", synthetic_cases(args.length),
                      Chunks(2048, 1024, 256), schemes, groups)
    if args.real:
        log(f"capturing the real model's q and k on {args.real} tokens of {args.texts}")
        cases = [case for text in args.texts.split(",")
                 for case in real_model_cases(args.real, text)]
        lines += rows(f"real model {args.real}", cases, Chunks(512, 256, 128), schemes,
                      groups)
    command = "python -m bench.fp8_schemes " + " ".join(sys.argv[1:] if argv is None else argv)
    table = (f"{today()}, commit {commit()}, {versions()}, CPU\n\n`{command.strip()}`\n\n"
             + "\n".join(lines) + "\n")
    print(table)
    if args.md:
        with open(args.md, "w") as f:
            f.write(table)


if __name__ == "__main__":
    main()
