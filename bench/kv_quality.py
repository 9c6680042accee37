"""Density and recall of the KV-block selection rules on the demo's structured data.

    python -m bench.kv_quality [--context 32768] [--chunk 2048] [--kv-block 2048]

The seed's chunked-prefill scenario at a CPU-friendly size: the demo's synthetic context
(attention sinks, a local window, vertical and diagonal stripes, noise; xattn_jax.demo.synthetic)
is split into cached keys and a last chunk of queries. `kv_block_scores` scores the cached
KV blocks for the chunk and `select_kv_blocks` picks blocks by each rule. Recall is the
share of the chunk's exact attention mass on the cached keys (softmax(q.k / sqrt(D)) at
full resolution) that falls in the selected blocks; density is the share of the cached
blocks selected. Runs on the CPU in a minute or two; prints a markdown table.
"""

from __future__ import annotations

import argparse

import jax.numpy as jnp

from bench.common import log, today, versions
from xattn_jax.kv_blocks import kv_block_scores, select_kv_blocks
from xattn_jax.demo.recall import coverage
from xattn_jax.demo.synthetic import structured_qk

THRESHOLDS = (0.9, 0.95, 0.99)
KV_HEADS = 2  # query heads are grouped in 2 for the per-KV-head selection


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=32768, help="cached tokens")
    p.add_argument("--chunk", type=int, default=2048, help="queries in the chunk")
    p.add_argument("--kv-block", type=int, default=2048, help="KV-cache block, tokens")
    p.add_argument("--estimate-block", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--stride", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    log("building the structured context")
    data = structured_qk(args.seed, heads=args.heads, length=args.context + args.chunk,
                         head_dim=64)
    q = data.q[:, :, args.context:]
    k = data.k[:, :, :args.context]
    scores = {rule: kv_block_scores(q, k, kv_block_size=args.kv_block,
                                    estimate_block_size=args.estimate_block,
                                    stride=args.stride, per_query_block=rule == "vote")
              for rule in ("score", "vote")}
    query_blocks = -(-args.chunk // args.kv_block)
    rows = []
    for rule, per_kv_head in (("score", False), ("score", True), ("vote", False),
                              ("vote", True)):
        for threshold in THRESHOLDS:
            log(f"{rule}, per_kv_head={per_kv_head}, threshold {threshold}")
            mask = select_kv_blocks(scores[rule], threshold=threshold, rule=rule,
                                    per_kv_head=per_kv_head, kv_heads=KV_HEADS)
            per_head = (jnp.repeat(mask, args.heads // KV_HEADS, axis=1) if per_kv_head
                        else jnp.repeat(mask[:, None], args.heads, axis=1))
            full = jnp.repeat(per_head[:, :, None], query_blocks, axis=2)
            cov = coverage(q, k, full, block_size=args.kv_block, causal=False)
            rows.append((rule, per_kv_head, threshold, float(cov.density.mean()),
                         float(cov.recall.mean())))
    print(f"\nKV-block selection on the demo's structured data, {today()}; {versions()}, CPU")
    print(f"`python -m bench.kv_quality --context {args.context} --chunk {args.chunk} "
          f"--kv-block {args.kv_block} --estimate-block {args.estimate_block} "
          f"--heads {args.heads} --stride {args.stride} --seed {args.seed}`\n")
    print("| rule | per KV head | threshold | density | recall |")
    print("|---|---|---|---|---|")
    for rule, per_kv_head, threshold, density, recall in rows:
        print(f"| {rule} | {'yes' if per_kv_head else 'no'} | {threshold} | {density:.3f} | "
              f"{recall:.4f} |")


if __name__ == "__main__":
    main()
