"""Shared pieces of the benchmarks: timing, floors, memory, records and tables.

Floors use the ceilings measured on our H200 (session 1, 2026-11-29): the bf16 XLA
matmul at 753 TFLOP/s and a device-to-device copy at 4.25 TB/s.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import platform
import statistics
import sys
import time

MATMUL_FLOPS = 753e12  # bf16, XLA 8192^3 on the H200
COPY_BYTES = 4.25e12  # bytes read + written per second on the H200


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The sizes of the benchmarks that scale down for a smoke run (`bench.chunked`,
    `bench.torch_path`, `bench.multi_gpu`, `bench.attention`): heads, head dim and stride;
    a chunk of `chunk` queries over a cache in KV blocks of `kv_block` tokens, estimated at
    `estimate_block`, selected at `threshold`; `block`, the block size of
    `bench.multi_gpu`'s estimate rows and of `bench.attention`'s attention and estimate;
    `lengths`, `bench.attention`'s sequence lengths by name, and `quality_length`, its
    quality sweep's."""

    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    stride: int = 8
    chunk: int = 4096
    kv_block: int = 4096
    estimate_block: int = 1024
    threshold: float = 0.95
    block: int = 128
    lengths: tuple = (("16k", 16384), ("64k", 65536), ("128k", 131072))
    quality_length: int = 16384

    def length(self, name: str) -> int:
        return dict(self.lengths)[name]


def log(msg: str) -> None:
    """Progress line on stderr, so stdout keeps only the tables."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def strided_flops(heads: int, q_len: int, k_len: int, stride: int, head_dim: int,
                  causal: bool) -> float:
    """FLOPs of the strided product, counting only the visible part in causal mode."""
    rows, cols = q_len / stride, k_len / stride
    pairs = rows * cols - (rows * rows / 2 if causal else 0.0)
    return 2.0 * heads * pairs * stride * head_dim


def floor_ms(flops: float, nbytes: float = 0.0) -> float:
    return 1e3 * max(flops / MATMUL_FLOPS, nbytes / COPY_BYTES)


BATCH_MS = 5.0  # a timed batch of back-to-back calls lasts about this long


def time_ms(fn, inputs: list, warmup: int = 3, reps: int = 20) -> float:
    """Median device time in ms of one call fn(*inputs[i % len(inputs)]).

    Each of the `reps` measurements launches a batch of back-to-back calls (as many as
    take about BATCH_MS) and waits for the last one, so the host's launch and wait
    latency, tens of microseconds, is not charged to every call: this is the time a
    serving loop that does not wait after each call sees, comparable with the CUDA
    events `bench.original` times the original with. Rotating among several input sets
    keeps them out of L2 when each is small. `latency_ms` is the other measure.
    """
    import jax

    for i in range(warmup):
        jax.block_until_ready(fn(*inputs[i % len(inputs)]))
    batch = max(1, min(100, round(BATCH_MS / latency_ms(fn, inputs, reps=3))))
    times = []
    for r in range(reps):
        start = time.perf_counter()
        jax.block_until_ready([fn(*inputs[(r + i) % len(inputs)]) for i in range(batch)])
        times.append(1e3 * (time.perf_counter() - start) / batch)
    return statistics.median(times)


def latency_ms(fn, inputs: list, reps: int = 20) -> float:
    """Median wall time in ms from launching one call to having waited for its result."""
    import jax

    times = []
    for i in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*inputs[i % len(inputs)]))
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def jax_extra_mib(fn, *args) -> float:
    """MiB XLA allocates for one call beyond its inputs: outputs plus temporaries."""
    import jax

    stats = jax.jit(fn).lower(*args).compile().memory_analysis()
    return (stats.output_size_in_bytes + stats.temp_size_in_bytes) / 2**20


def versions() -> str:
    import jax

    parts = [f"python {platform.python_version()}", f"jax {jax.__version__}"]
    for name in ("jaxlib", "torch", "triton"):
        try:
            parts.append(f"{name} {__import__(name).__version__}")
        except ImportError:
            pass
    return ", ".join(parts)


def gpu_name() -> str:
    import jax

    return jax.devices()[0].device_kind


def today() -> str:
    return datetime.date.today().isoformat()


def record(case: str, impl: str, ms: float, floor: float, extra_mib: float) -> dict:
    return {"case": case, "impl": impl, "gpu": gpu_name(), "ms": round(ms, 4),
            "floor_ms": round(floor, 4), "extra_mib": round(extra_mib, 1),
            "date": today(), "versions": versions()}


def print_report(records: list[dict]) -> None:
    """The run's GPU, versions and date, then its records as a markdown table."""
    first = records[0]
    print(f"\nGPU: {first['gpu']}; {first['versions']}; {first['date']}\n")
    lines = ["| case | impl | ms | floor ms | time / floor | extra MiB |",
             "|---|---|---|---|---|---|"]
    for r in records:
        ratio = r["ms"] / r["floor_ms"] if r["floor_ms"] else float("nan")
        lines.append(f"| {r['case']} | {r['impl']} | {r['ms']:.3f} | {r['floor_ms']:.3f} | "
                     f"{ratio:.2f} | {r['extra_mib']:.1f} |")
    print("\n".join(lines))


def write_json(path: str, records: list[dict]) -> None:
    with open(path, "w") as f:
        json.dump(records, f, indent=1)
