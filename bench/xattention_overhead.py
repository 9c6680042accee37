"""One attention layer's call: bridged XAttention and the transformers layer call against
plain JAX, in one run.

    python -m bench.xattention_overhead --json bench/results/torch_path.json
    python -m bench.xattention_overhead --smoke      # tiny sizes on the CPU: checks it runs

SmolLM2-135M's attention shapes (B 1, Hq 9 reading Hkv 3, D 64, bf16), causal, threshold
0.9, block 128, stride 8, at `--lengths` (default 8192 and 32768). Rows per length:
- `plain`: `xattn_jax.xattention` on JAX arrays, the public call (its Python checks run
  every call);
- `plain-jitted`: the same function jitted once (what a JAX model's layer pays);
- `bridged`: `xattn_torch_bridge.xattention` on torch tensors of the same memory;
- `hf-layer`: the call transformers makes per layer to the implementation
  `xattn_torch_bridge.hf.register` adds: q, k, v transposed views of `[B, L, H, D]`
  tensors (as transformers' projections make them), the output `[B, L, Hq, D]`, the
  density count; skipped without transformers;
- `sdpa`: torch's dense `scaled_dot_product_attention` (causal, GQA), the call it replaces.

Two figures per row, both medians over `--rounds` rounds that alternate the rows (so that
compared figures are taken under the same conditions): `ms`, the time per call of
`--calls` calls issued back to back, the device waited for once at the end (host and
device time, overlapped as a model's layers overlap them); `host_ms`, the host time of
each of those calls until it returned (its enqueue). The target: `bridged` and `hf-layer`
within TARGET_MS of `plain`'s `ms`.

`--smoke` checks that every row runs; its figures say nothing of the target: on the CPU
the reference computes, and the bridged rows' host time includes the computation
(`to_torch` waits for JAX's result on the CPU).

Its record is a section of bench/results/torch_path.md, beside the other torch-path
records, with its rows in bench/results/torch_path.json (`--json` merges them in).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import statistics
import sys
import time

import xattn_torch_bridge as bridge  # first: configures JAX's GPU memory

import jax  # noqa: E402
import torch  # noqa: E402
import xattn_jax  # noqa: E402

from bench.common import JSON_HELP, commit, log, merge_json, today, versions  # noqa: E402

TARGET_MS = 0.1  # bridged over plain per call, back to back: the bound set for the bridge
BATCH, Q_HEADS, KV_HEADS, HEAD_DIM = 1, 9, 3, 64  # SmolLM2-135M's attention
OPTIONS = dict(threshold=0.9, block_size=128, stride=8, causal=True)


@dataclasses.dataclass(frozen=True)
class Run:
    device: str
    lengths: tuple[int, ...]
    calls: int  # per timed batch
    reps: int  # batches per round
    rounds: int
    warmup: int


def _sync(device: str):
    return torch.cuda.synchronize if device == "cuda" else (lambda: None)


def timed_batches(fn, run: Run) -> tuple[float, float]:
    """(ms per call back to back, median host ms per call) of `run.reps` batches of
    `run.calls` calls of fn, the device idle before each batch and waited for after it."""
    sync = _sync(run.device)
    per_call, host = [], []
    for _ in range(run.reps):
        sync()
        start = time.perf_counter()
        for _ in range(run.calls):
            t0 = time.perf_counter()
            out = fn()
            host.append(time.perf_counter() - t0)
        jax.block_until_ready(out)
        sync()
        per_call.append((time.perf_counter() - start) / run.calls)
    return 1e3 * statistics.median(per_call), 1e3 * statistics.median(host)


class LayerModule(torch.nn.Module):
    """What transformers' attention call reads of its attention module."""

    def __init__(self, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.is_causal = True


def inputs(length: int, device: str):
    """q, k, v bf16 `[B, H, L, D]` (contiguous), and the same values as transposed views
    of `[B, L, H, D]` tensors (transformers' layout)."""
    gen = torch.Generator(device).manual_seed(length)
    shapes = ((BATCH, length, Q_HEADS, HEAD_DIM), (BATCH, length, KV_HEADS, HEAD_DIM),
              (BATCH, length, KV_HEADS, HEAD_DIM))
    stored = [torch.randn(s, generator=gen, device=device, dtype=torch.bfloat16)
              for s in shapes]
    views = [t.transpose(1, 2) for t in stored]
    return [v.contiguous() for v in views], views


def calls_of(length: int, device: str) -> dict:
    """The rows' calls at `length`, by name."""
    (q, k, v), views = inputs(length, device)
    qj, kj, vj = (bridge.to_jax(t) for t in (q, k, v))
    jitted = jax.jit(lambda q, k, v: xattn_jax.xattention(q, k, v, **OPTIONS))
    calls = {
        "plain": lambda: xattn_jax.xattention(qj, kj, vj, **OPTIONS),
        "plain-jitted": lambda: jitted(qj, kj, vj),
        "bridged": lambda: bridge.xattention(q, k, v, **OPTIONS),
    }
    if importlib.util.find_spec("transformers") is not None:
        calls["hf-layer"] = hf_layer_call((q, k, v), views)
    else:
        log("transformers is not installed: no hf-layer row")
    calls["sdpa"] = lambda: torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True, enable_gqa=True)
    return calls


def hf_layer_call(contiguous, views):
    """The layer call on `views`, checked first to give the bridged xattention's output
    of the same values, transposed (so the timed row computes what it says)."""
    from xattn_torch_bridge import hf

    handle = hf.register("xattention-bench", min_length=1, **{
        name: value for name, value in OPTIONS.items() if name != "causal"})
    module, scaling = LayerModule(0), HEAD_DIM ** -0.5
    want = bridge.xattention(*contiguous, scale=scaling, **OPTIONS).transpose(1, 2)
    if not torch.equal(handle(module, *views, None, scaling=scaling)[0], want):
        raise AssertionError("the hf layer call differs from the bridged xattention")
    return lambda: handle(module, *views, None, scaling=scaling)[0]


def length_rows(length: int, run: Run) -> list[dict]:
    calls = calls_of(length, run.device)
    for name, fn in calls.items():
        log(f"L {length}: warm-up {name}")
        for _ in range(run.warmup):
            out = fn()
        jax.block_until_ready(out)
        _sync(run.device)()
    figures = {name: [] for name in calls}
    for r in range(run.rounds):
        log(f"L {length}: round {r + 1}/{run.rounds}")
        for name, fn in calls.items():
            figures[name].append(timed_batches(fn, run))
    plain = statistics.median(ms for ms, _ in figures["plain"])
    rows = []
    for name, results in figures.items():
        row = {"case": f"causal-{length}", "impl": name,
               "ms": round(statistics.median(ms for ms, _ in results), 4),
               "host_ms": round(statistics.median(h for _, h in results), 4)}
        if name in ("bridged", "hf-layer"):
            row["target_ms"] = round(plain + TARGET_MS, 4)
        rows.append(row)
    return rows


def device_name(run: Run) -> str:
    return torch.cuda.get_device_name() if run.device == "cuda" else "CPU"


def print_table(rows: list[dict], run: Run) -> None:
    print(f"\n{device_name(run)}, {today()}; {versions()}")
    print(f"B {BATCH}, Hq {Q_HEADS}, Hkv {KV_HEADS}, D {HEAD_DIM}, bf16, {OPTIONS}; "
          f"{run.rounds} rounds of {run.reps} batches of {run.calls} calls; "
          f"`python -m bench.xattention_overhead {' '.join(sys.argv[1:])}`\n")
    print("| case | call | ms per call, back to back | host ms per call | target ms | "
          "verdict |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        target = r.get("target_ms")
        verdict = "" if target is None else ("met" if r["ms"] <= target else "NOT met")
        print(f"| {r['case']} | {r['impl']} | {r['ms']:.3f} | {r['host_ms']:.3f} | "
              f"{'' if target is None else f'{target:.3f}'} | {verdict} |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="8192,32768")
    parser.add_argument("--json", help=JSON_HELP)
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes on the CPU, to check that every row runs")
    args = parser.parse_args(argv)
    if args.smoke:
        run = Run("cpu", (256,), calls=2, reps=2, rounds=2, warmup=1)
        torch.set_num_threads(1)  # torch's idle CPU threads spin and slow JAX's CPU work
    elif bridge.cuda_available():
        run = Run("cuda", tuple(int(x) for x in args.lengths.split(",")), calls=20,
                  reps=15, rounds=5, warmup=10)
    else:
        print("needs torch with CUDA and JAX's CUDA backend (or pass --smoke)",
              file=sys.stderr)
        return 2
    rows = []
    # no floor or memory figure: the rows compare calls' host and device time
    stamp = dict(gpu=device_name(run), floor_ms=None, extra_mib=None, date=today(),
                 versions=versions(), commit=commit())
    for length in run.lengths:
        rows.extend(length_rows(length, run))
        if args.json:
            merge_json(args.json, [dict(r, **stamp) for r in rows])
    print_table(rows, run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
