"""Chunked prefill over a KV cache offloaded to host memory, three ways side by side.

    python -m bench.offload --prompts 32k,64k,128k --json bench/results/offload.json \\
        --md bench/results/offload.md
    python -m bench.offload --smoke        # the CPU, tiny sizes, in seconds

The seed engine's scenario on one attention layer: a prompt of N tokens prefilled in
chunks of 4096, Llama-3.1-8B's attention shapes (Hq 32 reading Hkv 8, D 128, bf16), the
KV cache in pages of 4096 tokens in pinned host memory but for a few resident pages: the
first (the sink) and the `--resident` most recent before the chunk, and the chunk's own.
The data are the demo's structured q and k (`xattn_jax.demo.synthetic`: sinks, a local
window, stripes, noise; q shared by the 4 query heads of each KV head) and random v, so
the estimate keeps a part of the pages.

Every chunk with context (chunks 1 .. N/4096 - 1) runs three ways, each timed from its
first copy to its output (wall time, synchronized):
- `load-all`: every offloaded context page's K and V copied to the device, then
  attention over every page;
- `seed` (the seed engine's way): every offloaded page's keys copied for the estimate
  (`XAttentionPolicy.select_blocks` on a `PagedKVCache` without a shadow stages them on
  its side stream), then the selected offloaded pages' K and V copied, then attention
  over the selected pages and the chunk;
- `shadow`: the estimate on the resident fp8 key shadow (`select_blocks` on a cache with
  `key_shadow="fp8"`: no copy), then the selected offloaded pages' K and V copied, then
  the same attention.
Page copies run on a side stream, all of a step issued at once, the kernels waiting for
them only where they read them. The attention is `block_sparse_attention` through a
block table of the pages kept (padded to every page, the padding masked out; causal in
the chunk's own page), the Mosaic kernel on Hopper.

Records (one per prompt and way, summed over the chunks; `bench.common.record`):
- `ms`; `h2d_mib`, the bytes copied host to device; `h2d_gbps`, the pinned copy rate
  measured in the run;
- `floor_ms`: per chunk the larger of the copies at that rate and the FLOPs of the
  estimate and of the attention kept at the rate of the run's 8192^3 matmul (copies
  overlapped with compute, as a pipelined engine overlaps a layer's loads with the
  layer before; here one layer runs alone, so its copies are exposed);
- `extra_mib`: device memory beyond the resident pages at the largest chunk (loaded
  pages, staging, the shadow);
- `density`: the share of context pages attended; `same_as_seed` (shadow): the share
  of the seed's page choices it repeats.
`--smoke` shrinks every size (pages and chunks of 256, 4 heads of 64) for a CPU run, where
copies are memcpy and the floors mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import sys
import time

import xattn_torch_bridge as xb  # first: configures JAX's GPU memory

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.chunked import tokens  # noqa: E402
from bench.common import (JSON_HELP, MATMUL_FLOPS, log, matmul_tflops,  # noqa: E402
                          merge_json, record, strided_flops)
from xattn_jax.demo.synthetic import structured_qk  # noqa: E402

WAYS = ("load-all", "seed", "shadow")
COPY_PROBE_MIB = 256  # the pinned host-to-device copy timed for the floors


@dataclasses.dataclass(frozen=True)
class Scenario:
    """Sizes: heads, head dim, pages (= chunks) of `page` tokens, the estimate's stride,
    block and threshold, `resident` recent pages kept on the device."""

    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    page: int = 4096
    stride: int = 8
    estimate_block: int = 1024
    threshold: float = 0.95
    resident: int = 1
    reps: int = 3


FULL = Scenario()
SMOKE = Scenario(q_heads=4, kv_heads=2, head_dim=64, page=256, estimate_block=64,
                 threshold=0.9, reps=1)


@dataclasses.dataclass
class Setup:
    """One prompt's data: the chunks' queries `[n, Hq, page, D]`, the caches the
    estimates read (`plain` stages, `shadow` keeps fp8 keys), both holding every page,
    and the attention's device pools `[n, page, Hkv, D]` (page p in slot p)."""

    queries: torch.Tensor
    plain: xb.PagedKVCache
    shadow: xb.PagedKVCache
    ids: list[int]
    pool_k: torch.Tensor
    pool_v: torch.Tensor


def build(length: int, sc: Scenario, device: str) -> Setup:
    pages = length // sc.page
    data = structured_qk(0, heads=sc.kv_heads, length=length, head_dim=sc.head_dim)
    dtype = torch.bfloat16
    group = sc.q_heads // sc.kv_heads
    q = torch.from_numpy(np.repeat(np.asarray(data.q[0], np.float32), group, axis=0))
    queries = q.reshape(sc.q_heads, pages, sc.page, -1).transpose(0, 1).to(device, dtype) \
        .contiguous()
    k = torch.from_numpy(np.array(data.k[0], np.float32)).transpose(0, 1).contiguous().to(dtype)
    v = torch.randn(k.shape, generator=torch.Generator().manual_seed(length)).to(dtype)
    caches = [xb.PagedKVCache(pages, sc.page, sc.kv_heads, sc.head_dim, dtype=dtype,
                              device=device, num_cpu_blocks=pages, staging_slots=pages,
                              key_shadow=shadow) for shadow in (None, "fp8")]
    ids = [cache.append([], k.to(device), v.to(device)) for cache in caches][0]
    shape = (pages, sc.page, sc.kv_heads, sc.head_dim)
    pool_k, pool_v = (x.reshape(shape).to(device) for x in (k, v))
    for cache in caches:
        cache.offload(ids[1:])
    return Setup(queries, *caches, ids, pool_k, pool_v)


def set_residency(cache: xb.PagedKVCache, ids: list[int], chunk: int, resident: int):
    """Before chunk `chunk`: pages 0, the `resident` before it and its own on the device,
    the others offloaded (moves outside the timed work)."""
    keep = {0, chunk, *range(max(1, chunk - resident), chunk)}
    out = [i for p, i in enumerate(ids) if p not in keep and cache.is_resident(i)]
    cache.offload(out)
    cache.load([ids[p] for p in sorted(keep) if not cache.is_resident(ids[p])])


class Copier:
    """Copies pages of a cache's host pool into the device pools on a side stream."""

    def __init__(self, setup: Setup):
        self.setup = setup
        cuda = setup.pool_k.device.type == "cuda"
        self.stream = torch.cuda.Stream(setup.pool_k.device) if cuda else None

    def copy(self, pages: list[int], values: bool = True) -> int:
        """Issues the copies of `pages`' K (and V) from the plain cache's host pool;
        torch's current stream waits for them. Returns the bytes copied."""
        s, done = self.setup, 0
        context = torch.cuda.stream(self.stream) if self.stream else contextlib.nullcontext()
        if self.stream:
            self.stream.wait_stream(torch.cuda.current_stream())
        with context:
            for p in pages:
                k, v = s.plain.kv(s.ids[p])
                s.pool_k[p].copy_(k, non_blocking=True)
                done += k.numel() * k.element_size()
                if values:
                    s.pool_v[p].copy_(v, non_blocking=True)
                    done += v.numel() * v.element_size()
        if self.stream:
            torch.cuda.current_stream().wait_stream(self.stream)
        return done


def attend(setup: Setup, chunk: int, pages: list[int]) -> torch.Tensor:
    """Attention of chunk `chunk` over `pages` (context pages) and its own page: a block
    table of every page slot, padding masked out, causal."""
    n = setup.pool_k.shape[0]
    kept = pages + [chunk]
    table = torch.tensor([kept + [chunk] * (n - len(kept))], dtype=torch.int32,
                         device=setup.pool_k.device)
    q = setup.queries[chunk][None]
    mask = torch.zeros(1, q.shape[1], 1, n, dtype=torch.bool, device=q.device)
    mask[..., :len(kept)] = True
    k_len = torch.tensor(len(kept) * setup.pool_k.shape[1], dtype=torch.int32,
                         device=q.device)
    return xb.block_sparse_attention(q, setup.pool_k, setup.pool_v, mask,
                                     block_size=setup.pool_k.shape[1], causal=True,
                                     block_table=table, k_len=k_len)


def run_way(way: str, setup: Setup, chunk: int, policy: xb.XAttentionPolicy,
            copier: Copier) -> tuple[int, list[int]]:
    """One chunk the way `way` does it: (bytes copied to the device, context pages
    attended)."""
    context = setup.ids[:chunk]
    offloaded = [p for p in range(chunk) if not setup.plain.is_resident(setup.ids[p])]
    staged = setup.plain.copies["stage"]
    if way == "load-all":
        pages, moved = list(range(chunk)), copier.copy(offloaded)
    else:
        cache = setup.plain if way == "seed" else setup.shadow
        chosen = set(policy.select_blocks(setup.queries[chunk], cache, context))
        pages = [p for p in range(chunk) if setup.ids[p] in chosen]
        page_bytes = setup.pool_k[0].numel() * setup.pool_k.element_size()
        moved = (setup.plain.copies["stage"] - staged) * page_bytes
        moved += copier.copy([p for p in pages if p in offloaded])
    attend(setup, chunk, pages).sum().item()  # waits for the output
    return moved, pages


def timed(fn, reps: int, sync) -> tuple[float, object]:
    """Median wall ms of fn() over reps after one warm-up call, and its last result."""
    out = fn()
    times = []
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        out = fn()
        sync()
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times), out


def copy_rate(device: str) -> float:
    """Bytes per second of a pinned host-to-device copy of COPY_PROBE_MIB (memcpy off a
    GPU)."""
    cuda = device == "cuda"
    host = torch.empty(COPY_PROBE_MIB << 20, dtype=torch.uint8, pin_memory=cuda)
    dest = torch.empty_like(host, device=device)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    ms, _ = timed(lambda: dest.copy_(host, non_blocking=cuda), 5, sync)
    return (COPY_PROBE_MIB << 20) / (ms / 1e3)


def chunk_flops(sc: Scenario, chunk: int, kept: int, way: str) -> float:
    """The estimate's strided product (seed, shadow) and the attention over `kept`
    context pages plus the causal half of the chunk's own."""
    keys = kept * sc.page + sc.page / 2
    flops = 4.0 * sc.q_heads * sc.page * keys * sc.head_dim
    if way != "load-all":
        flops += strided_flops(sc.q_heads, sc.page, chunk * sc.page, sc.stride,
                               sc.head_dim, causal=False)
    return flops


def prompt_rows(length: int, sc: Scenario, device: str, rate: float,
                tflops: float | None) -> list[dict]:
    setup = build(length, sc, device)
    # one block-table width for the whole prompt: the selection compiles once per way
    policy = xb.XAttentionPolicy(sc.threshold, sc.stride, sc.estimate_block,
                                 max_context=length)
    copier = Copier(setup)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    flop_rate = (tflops or MATMUL_FLOPS / 1e12) * 1e12
    page_mib = setup.pool_k[0].numel() * setup.pool_k.element_size() / 2**20
    totals = {w: dict(ms=0.0, floor=0.0, bytes=0, kept=0, extra=0.0) for w in WAYS}
    seed_pages, same, context_pages = {}, 0, 0
    for chunk in range(1, setup.queries.shape[0]):
        for cache in (setup.plain, setup.shadow):
            set_residency(cache, setup.ids, chunk, sc.resident)
        offloaded = sum(not setup.plain.is_resident(setup.ids[p]) for p in range(chunk))
        context_pages += chunk
        for way in WAYS:
            ms, (moved, pages) = timed(lambda: run_way(way, setup, chunk, policy, copier),
                                       sc.reps, sync)
            t = totals[way]
            t["ms"] += ms
            t["bytes"] += moved
            t["kept"] += len(pages)
            t["floor"] += 1e3 * max(moved / rate,
                                    chunk_flops(sc, chunk, len(pages), way) / flop_rate)
            loaded = 2 * sum(not setup.plain.is_resident(setup.ids[p]) for p in pages)
            staging = offloaded if way == "seed" else 0
            extra = (loaded + staging) * page_mib
            if way == "shadow":
                extra += _shadow_mib(setup.shadow, len(setup.ids))
            t["extra"] = max(t["extra"], extra)
            if way == "seed":
                seed_pages[chunk] = set(pages)
            elif way == "shadow":
                same += chunk - len(seed_pages[chunk] ^ set(pages))
        log(f"{length} tokens, chunk {chunk}: " + ", ".join(
            f"{w} {totals[w]['ms']:.1f} ms" for w in WAYS))
    return [_record(length, way, t, context_pages, rate, tflops,
                    same / context_pages if way == "shadow" else None)
            for way, t in totals.items()]


def _shadow_mib(cache: xb.PagedKVCache, pages: int) -> float:
    """The shadow pages of `pages` blocks."""
    s = cache.shadow
    return pages * sum(x[0].numel() * x.element_size()
                       for x in (s.values, s.scales, s.offsets)) / 2**20


def _record(length: int, way: str, t: dict, context_pages: int, rate: float, tflops,
            same) -> dict:
    row = record(f"prefill-{length // 1024}k", way, t["ms"], t["floor"], t["extra"], tflops)
    row.update(h2d_mib=round(t["bytes"] / 2**20, 1), h2d_gbps=round(rate / 1e9, 2),
               density=round(t["kept"] / context_pages, 4))
    if same is not None:
        row["same_as_seed"] = round(same, 4)
    return row


def markdown(rows: list[dict], rate: float, command: str) -> str:
    first = rows[0]
    lines = ["# Offloaded KV cache: chunked prefill, three ways", "",
             f"{first['gpu']}; {first['versions']}; {first['date']}; commit "
             f"{first['commit']}; pinned host-to-device copies measured at "
             f"{rate / 1e9:.1f} GB/s in the run.", "", f"`{command}`", "",
             "| prompt | way | ms | floor ms | host-to-device MiB | of load-all | density | "
             "extra MiB | same pages as seed |", "|---|---|---|---|---|---|---|---|---|"]
    base = {r["case"]: r["h2d_mib"] for r in rows if r["impl"] == "load-all"}
    for r in rows:
        share = r["h2d_mib"] / base[r["case"]] if base[r["case"]] else float("nan")
        lines.append(f"| {r['case']} | {r['impl']} | {r['ms']:.2f} | {r['floor_ms']:.2f} | "
                     f"{r['h2d_mib']:.1f} | {share:.2f} | {r['density']:.3f} | "
                     f"{r['extra_mib']:.1f} | {r.get('same_as_seed', '')} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", help="prompt lengths (default 32k,64k,128k; with "
                                          "--smoke 32k, scaled down 16 times)")
    parser.add_argument("--threshold", type=float)
    parser.add_argument("--resident", type=int, help="recent pages kept on the device")
    parser.add_argument("--json", help=JSON_HELP)
    parser.add_argument("--md", help="write the markdown table here")
    parser.add_argument("--smoke", action="store_true", help="CPU-sized: pages of 256")
    args = parser.parse_args(argv)
    sc = SMOKE if args.smoke else FULL
    changes = {k: v for k, v in (("threshold", args.threshold), ("resident", args.resident))
               if v is not None}
    sc = dataclasses.replace(sc, **changes)
    device = "cuda" if torch.cuda.is_available() and xb.cuda_available() else "cpu"
    names = args.prompts or ("32k" if args.smoke else "32k,64k,128k")
    prompts = [tokens(p) // (FULL.page // sc.page) for p in names.split(",")]
    rate, tflops = copy_rate(device), matmul_tflops()
    log(f"pinned copies: {rate / 1e9:.1f} GB/s; matmul: {tflops} TFLOP/s")
    rows = []
    for length in prompts:
        rows += prompt_rows(length, sc, device, rate, tflops)
        if args.json:
            merge_json(args.json, rows)
    command = "python -m bench.offload " + " ".join(sys.argv[1:] if argv is None else argv)
    table = markdown(rows, rate, command.strip())
    print(table)
    if args.md:
        with open(args.md, "w") as f:
            f.write(table)
    return 0


if __name__ == "__main__":
    main()
