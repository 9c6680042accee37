"""Host overhead of the torch <-> JAX hand-off and of a whole bridged `xattn_estimate`.

    python -m bench.bridge_overhead            # on a CUDA machine (the H200)
    python -m bench.bridge_overhead --device cpu --length 1024   # a smoke run anywhere

Every figure is host time from `time.perf_counter_ns`: the median (and 10th / 90th
percentiles) over `--iters` calls after `--warmup` calls, with the device synchronized
before each call and outside the timed region, so each call starts on an idle GPU.
Freeing the results is outside the timed region too.

Rows:
- to_jax, to_torch: one direction of the hand-off of a bf16 `[B, Hq, L, D]` tensor.
- hand-off: `to_torch(to_jax(t))`, the round trip, whose target is 20 us.
- naive hand-off: `torch.from_dlpack(jnp.from_dlpack(t))`, for comparison.
- estimate dispatch: the time until `xattn_estimate` returns (the GPU works on after it),
  plain `xattn_jax` on JAX arrays and bridged on torch views of the same memory.
- estimate completed: the time until the results are ready (block_until_ready for JAX,
  a synchronize of torch's current stream for the bridge).
The overhead rows are the bridged minus the plain medians.

stdout holds one markdown table (its record: the hand-off section of
bench/results/torch_path.md); progress goes to stderr.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import xattn_torch_bridge as bridge  # first: configures JAX's GPU memory

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402
import torch.utils.dlpack  # noqa: E402
import xattn_jax  # noqa: E402
from xattn_torch_bridge import dlpack  # noqa: E402

from bench.common import log, today, versions  # noqa: E402

TARGET_US = 20.0


def host_us(fn, sync, iters: int, warmup: int) -> tuple[float, float, float]:
    """Median, 10th and 90th percentile host time of fn() in microseconds."""
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(iters):
        sync()
        start = time.perf_counter_ns()
        out = fn()
        times.append((time.perf_counter_ns() - start) / 1e3)
        del out
    deciles = statistics.quantiles(times, n=10)
    return statistics.median(times), deciles[0], deciles[-1]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--length", type=int, default=16384, help="Lq = Lk, tokens")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--stride", type=int, default=8)
    p.add_argument("--iters", type=int, default=2000, help="hand-off calls timed")
    p.add_argument("--estimate-iters", type=int, default=100)
    p.add_argument("--warmup", type=int, default=50)
    return p.parse_args()


def main() -> int:
    args = parse_args()
    if args.device == "cuda" and not bridge.cuda_available():
        print("needs torch with CUDA and JAX's CUDA backend (or pass --device cpu)",
              file=sys.stderr)
        return 2
    on_cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if on_cuda else (lambda: None)
    gen = torch.Generator(args.device).manual_seed(0)
    q = torch.randn(args.batch, args.q_heads, args.length, args.head_dim, generator=gen,
                    device=args.device, dtype=torch.bfloat16)
    k = torch.randn(args.batch, args.kv_heads, args.length, args.head_dim, generator=gen,
                    device=args.device, dtype=torch.bfloat16)
    q_jax, k_jax = bridge.to_jax(q), bridge.to_jax(k)
    assert q_jax.unsafe_buffer_pointer() == q.data_ptr(), "to_jax copied"
    assert bridge.to_torch(q_jax).data_ptr() == q.data_ptr(), "to_torch copied"
    result = jax.jit(lambda x: x + 1)(q_jax)  # a JAX-made array, as estimate results are

    rows = []

    def measure(what: str, fn, iters: int) -> float:
        log(f"{what}: {iters} calls")
        median, p10, p90 = host_us(fn, sync, iters, args.warmup)
        rows.append((what, median, p10, p90, iters))
        return median

    measure("to_jax", lambda: bridge.to_jax(q), args.iters)
    _, place = dlpack.place_of(q, "q", copy=False)
    measure("  to_jax part: checks and device lookup",
            lambda: dlpack.place_of(q, "q", copy=False), args.iters)
    measure("  to_jax part: stream order (event record + wait)",
            lambda: dlpack.jax_waits_for_torch(place), args.iters)
    measure("  to_jax part: capsule and JAX view", lambda: dlpack.view_in_jax(q, place),
            args.iters)
    measure("    of which: the torch capsule (to_dlpack)",
            lambda: torch.utils.dlpack.to_dlpack(q), args.iters)
    measure("  unordered capsule and JAX view (k's in a bridged estimate)",
            lambda: dlpack.view_in_jax(q, place, ordered=False), args.iters)
    measure("to_torch", lambda: bridge.to_torch(result), args.iters)
    handoff = measure("hand-off: to_torch(to_jax(t))",
                      lambda: bridge.to_torch(bridge.to_jax(q)), args.iters)
    measure("naive hand-off: torch.from_dlpack(jnp.from_dlpack(t))",
            lambda: torch.from_dlpack(jnp.from_dlpack(q)), args.iters)

    kwargs = dict(block_size=args.block_size, stride=args.stride, causal=True,
                  threshold=0.9, impl="auto")
    stream = torch.cuda.current_stream() if on_cuda else None

    def plain():
        return xattn_jax.xattn_estimate(q_jax, k_jax, **kwargs)

    def bridged():
        return bridge.xattn_estimate(q, k, **kwargs)

    def plain_done():
        return jax.block_until_ready(plain())

    def bridged_done():
        out = bridged()
        if stream is not None:
            stream.synchronize()
        return out

    n = args.estimate_iters
    dispatch = (measure("estimate dispatch, xattn_jax", plain, n),
                measure("estimate dispatch, bridged", bridged, n))
    done = (measure("estimate completed, xattn_jax", plain_done, n),
            measure("estimate completed, bridged", bridged_done, n))

    device = torch.cuda.get_device_name() if on_cuda else "CPU"
    shape = (f"q [{args.batch}, {args.q_heads}, {args.length}, {args.head_dim}] bf16, "
             f"Hkv {args.kv_heads}, block {args.block_size}, stride {args.stride}, causal")
    print(f"Bridge host overhead, {today()}, {device}; {versions()}")
    print(f"Inputs: {shape}. Host time (us), device idle before each call; "
          f"`python -m bench.bridge_overhead {' '.join(sys.argv[1:])}`.")
    print()
    print("| what | median us | p10 us | p90 us | calls |")
    print("|---|---|---|---|---|")
    for what, median, p10, p90, iters in rows:
        print(f"| {what} | {median:.1f} | {p10:.1f} | {p90:.1f} | {iters} |")
    print(f"| estimate dispatch overhead (bridged - xattn_jax) | "
          f"{dispatch[1] - dispatch[0]:.1f} | | | |")
    print(f"| estimate completed overhead (bridged - xattn_jax) | "
          f"{done[1] - done[0]:.1f} | | | |")
    print()
    verdict = "met" if handoff <= TARGET_US else "NOT met"
    print(f"Hand-off target (median <= {TARGET_US:.0f} us): {verdict} ({handoff:.1f} us).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
