"""Shared pieces of the benchmarks: timing, floors, memory, records and tables.

Floors use the ceilings measured on our H200 on 2026-11-29: the bf16 XLA matmul at 753
TFLOP/s and a device-to-device copy at 4.25 TB/s. Those were short runs: under
back-to-back load the H200 holds its power cap (~692 W, 1.50-1.58 GHz) and the same
matmul gives ~683 TFLOP/s (2026-11-30). So the estimate's benchmarks also time that
matmul beside each case (`matmul_tflops`) and give each row's ratio to the floor at that
same-run rate (docs/tuning.md: floor-same-run-matmul).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import pathlib
import platform
import statistics
import subprocess
import sys
import time

MATMUL_FLOPS = 753e12  # bf16, XLA 8192^3 on the H200
MATMUL_SIDE = 8192  # the square matmul behind MATMUL_FLOPS
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


# A timed batch of back-to-back calls lasts about this long (docs/tuning.md:
# timing-batch-length). Each batch is charged one launch and one wait.
BATCH_MS = 20.0
MAX_BATCH = 100  # calls per batch, at most


def time_ms(fn, inputs: list, warmup: int = 3, reps: int = 20) -> float:
    """Median device time in ms of one call fn(*inputs[i % len(inputs)]).

    Each of the `reps` measurements launches a batch of back-to-back calls (as many as
    take about BATCH_MS at the rate of a first, shorter batch) and waits for the last
    one, so the host's launch and wait latency (0.4 ms for the chunk call over 64K) is
    charged once per batch: this is the time a serving loop that does not wait after
    each call sees, comparable with the CUDA events `bench.original` times the original
    with. Rotating among several input sets keeps them out of L2 when each is small.
    `latency_ms` is the other measure.
    """
    import jax

    for i in range(warmup):
        jax.block_until_ready(fn(*inputs[i % len(inputs)]))

    def batch_ms(r: int, calls: int) -> float:
        start = time.perf_counter()
        jax.block_until_ready([fn(*inputs[(r + i) % len(inputs)]) for i in range(calls)])
        return 1e3 * (time.perf_counter() - start) / calls

    first = max(1, min(MAX_BATCH, round(BATCH_MS / latency_ms(fn, inputs, reps=3))))
    batch = max(1, min(MAX_BATCH, round(BATCH_MS / batch_ms(0, first))))
    return statistics.median(batch_ms(r, batch) for r in range(reps))


def matmul_tflops() -> float | None:
    """TFLOP/s of the bf16 XLA MATMUL_SIDE^3 matmul now, on random data, timed as the
    cases are (`time_ms`, back to back): the same-run ceiling beside MATMUL_FLOPS. None
    off a GPU (a smoke run, whose floors mean nothing)."""
    import jax
    import jax.numpy as jnp

    if jax.default_backend() != "gpu":
        return None
    ka, kb = jax.random.split(jax.random.PRNGKey(MATMUL_SIDE))
    a, b = (jax.random.normal(key, (MATMUL_SIDE,) * 2, jnp.float32).astype(jnp.bfloat16)
            for key in (ka, kb))
    ms = time_ms(jax.jit(jnp.matmul), [(a, b)])
    return 2.0 * MATMUL_SIDE**3 / ms / 1e9


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


def commit() -> str | None:
    """The checkout's commit (7 or more hex digits; "-dirty" if tracked files differ from
    it), or None outside a git checkout."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=pathlib.Path(__file__).parent,
                              capture_output=True, text=True)

    head = git("rev-parse", "--short=7", "HEAD")
    if head.returncode:
        return None
    dirty = git("diff", "--quiet", "HEAD").returncode != 0
    return head.stdout.strip() + ("-dirty" if dirty else "")


def record(case: str, impl: str, ms: float, floor: float, extra_mib: float,
           matmul_tflops: float | None = None) -> dict:
    """One row of results. matmul_tflops: the same-run ceiling (`matmul_tflops`), kept
    with the floor at that rate (`same_run_floor_ms`) where given."""
    row = {"case": case, "impl": impl, "gpu": gpu_name(), "ms": round(ms, 4),
           "floor_ms": round(floor, 4), "extra_mib": round(extra_mib, 1),
           "date": today(), "versions": versions(), "commit": commit()}
    if matmul_tflops is not None:
        row["matmul_tflops"] = round(matmul_tflops, 1)
        row["same_run_floor_ms"] = round(floor * MATMUL_FLOPS / (matmul_tflops * 1e12), 4)
    return row


def report(records: list[dict]) -> str:
    """The run's GPU, versions and date, then its records as a markdown table (with the
    same-run ceiling's columns where the records hold it)."""
    first = records[0]
    head = (f"GPU: {first['gpu']}; {first['versions']}; {first['date']}; "
            f"commit {first.get('commit')}")
    same_run = any("same_run_floor_ms" in r for r in records)
    extra = " same-run matmul TFLOP/s | time / same-run floor |" if same_run else ""
    lines = ["| case | impl | ms | floor ms | time / floor | extra MiB |" + extra,
             "|---|---|---|---|---|---|" + "---|---|" * same_run]
    for r in records:
        ratio = r["ms"] / r["floor_ms"] if r["floor_ms"] else float("nan")
        line = (f"| {r['case']} | {r['impl']} | {r['ms']:.3f} | {r['floor_ms']:.3f} | "
                f"{ratio:.2f} | {r['extra_mib']:.1f} |")
        if same_run:
            line += (f" {r['matmul_tflops']:.0f} | {r['ms'] / r['same_run_floor_ms']:.2f} |"
                     if r.get("same_run_floor_ms") else " | |")
        lines.append(line)
    return head + "\n\n" + "\n".join(lines) + "\n"


def print_report(records: list[dict]) -> None:
    """`report`, on stdout after a blank line."""
    print("\n" + report(records), end="")


# the fields that identify a row of a shared record: one row per case, implementation and
# GPU, whichever benchmark or run wrote it
RECORD_KEY = ("case", "impl", "gpu")
JSON_HELP = "merge the rows into this JSON record (by case, impl and gpu: merge_json)"


def merge_json(path: str, records: list[dict], key: tuple[str, ...] = RECORD_KEY) -> None:
    """Merges `records` into the JSON list of rows at `path` (made where there is none):
    the stored rows with the key of a new row (its values of the `key` fields) are
    replaced, where the first of them stood, by the new rows of that key; rows of new keys
    are appended; the others stay. So benchmarks sharing a record (`bench.estimate` and
    `bench.chunked`), and runs on other GPUs, keep each other's rows.

    Raises ValueError, before writing, for a row without one of the key fields."""
    for row in records:
        missing = [field for field in key if row.get(field) is None]
        if missing:
            raise ValueError(f"records: every row needs the fields {key} (a GPU among "
                             f"them), a row of {row.get('case')!r} lacks {missing}")
    path = pathlib.Path(path)
    stored = json.loads(path.read_text()) if path.exists() else []
    new = {}
    for row in records:
        new.setdefault(tuple(row[field] for field in key), []).append(row)
    merged, placed = [], set()
    for row in stored:
        row_key = tuple(row.get(field) for field in key)
        if row_key not in new:
            merged.append(row)
        elif row_key not in placed:
            merged += new[row_key]
            placed.add(row_key)
    merged += [row for row_key, rows in new.items() if row_key not in placed for row in rows]
    path.write_text(json.dumps(merged, indent=1) + "\n")


# the benchmarks whose rows share bench/results/model_quality.json, each row naming its own
MODEL_QUALITY, QUALITY_TIME, RETRIEVAL = "model_quality", "quality_time", "retrieval"


def rows_of(records: list[dict], benchmark: str) -> list[dict]:
    """The rows one benchmark wrote into a record that several share (their `benchmark`
    field: model_quality.json holds bench.model_quality's, bench.quality_time's and
    bench.retrieval's)."""
    return [r for r in records if r.get("benchmark") == benchmark]


def write_outputs(records: list[dict], table: str, json_path: str | None,
                  md_path: str | None, key: tuple[str, ...] = RECORD_KEY) -> None:
    """The markdown table on stdout; the records merged into `json_path` by `key`
    (`merge_json`) and the table written to `md_path` where they are given."""
    print(table)
    if json_path:
        merge_json(json_path, records, key)
    if md_path:
        with open(md_path, "w") as f:
            f.write(table)


def smoke_in_subprocess(module: str, call: str, limit_s: float) -> str:
    """`call` (an expression on `module`'s names, true where it passes) in a subprocess
    with a time limit, so that a kernel that deadlocks cannot hang the run: "pass",
    "fail" or "hang"."""
    code = f"from {module} import *; import sys; sys.exit(0 if {call} else 1)"
    try:
        done = subprocess.run([sys.executable, "-c", code], timeout=limit_s)
    except subprocess.TimeoutExpired:
        print(f"SMOKE HANG: {call} did not finish in {limit_s}s (barrier protocol "
              "deadlock?)", flush=True)
        return "hang"
    print(f"smoke {call}: exit code {done.returncode}", flush=True)
    return "pass" if done.returncode == 0 else "fail"
