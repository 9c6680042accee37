"""One prefill of the real model in transformers: sdpa against XAttention through
`xattn_torch_bridge.hf`, timed and compared in one run.

    python -m bench.hf_prefill --json bench/results/hf_prefill.json \\
        --md bench/results/hf_prefill.md
    python -m bench.hf_prefill --smoke      # CPU, float32, 512 tokens, block 64

SmolLM2-135M-Instruct (`bench.smollm2`, loaded by transformers from its GGUF), bf16 on
CUDA, batch 1, on the first `--length` (8192) tokens of the text "licenses"
(`bench.texts`). Rows (impl):
- `sdpa`: transformers' sdpa attention (dense, causal);
- `xattention`: `xattn_torch_bridge.hf.register("xattention")` with xattention's
  defaults (block 64 in the smoke run), recorded in `settings`;
- `xattention-sampled-rows`: the same on the sampled-rows estimate
  (`estimate="sampled-rows"`).
ms: the median over `--reps` rounds (after `--warmup`; each round one forward of each
row, in turn) of one forward's time, `model(ids, logits_to_keep=1)` (a prefill: the last
position's logits), by CUDA events around it (the wall time on the CPU). The bridged
rows also have, from one more untimed forward of each row with every position's logits:
`density` (`last_density`: the share of the causally visible blocks computed, over
layers and heads); `bridged_calls` and `fallbacks` of that forward (every layer should go
through the bridge); and against sdpa's logits over the second half's positions, `top1`
(the share whose most likely next token is sdpa's) and `kl_mean` (mean KL(sdpa ||
xattention) per position, nats).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import statistics
import sys
import time

import xattn_torch_bridge  # first: configures JAX's GPU memory

import torch  # noqa: E402
import xattn_jax  # noqa: E402

from bench import smollm2, texts  # noqa: E402
from bench.common import (JSON_HELP, commit, gpu_name, log, today, versions,  # noqa: E402
                          write_outputs)

TEXT = "licenses"
NAME = "xattention"  # the registered attention implementation
# registered implementations and the xattention options each adds to the run's
REGISTERED = {NAME: {}, f"{NAME}-sampled-rows": {"estimate": "sampled-rows"}}
# xattention's arguments that a registration may set, recorded with each run
SETTINGS = ("threshold", "block_size", "stride", "norm", "min_blocks", "dense_last",
            "estimate")


@dataclasses.dataclass(frozen=True)
class Run:
    device: str
    dtype: torch.dtype
    length: int  # tokens of the prompt
    warmup: int  # untimed rounds
    reps: int  # timed rounds
    options: tuple  # (name, value) pairs passed to hf.register


def run_of(args) -> Run:
    if args.smoke:
        return Run("cpu", torch.float32, 512, warmup=1, reps=1,
                   options=(("block_size", 64),))
    return Run("cuda", torch.bfloat16, args.length, args.warmup, args.reps, ())


def settings(options: dict) -> dict:
    """The settings the registration runs: xattn_jax.xattention's defaults, `options`
    over them."""
    params = inspect.signature(xattn_jax.xattention).parameters
    return {name: options.get(name, params[name].default) for name in SETTINGS}


def load(run: Run):
    """The model (eval mode, on run.device in run.dtype) and the prompt, int64 `[1, L]`."""
    model, tokenizer = smollm2.load_transformers(run.dtype)
    model = model.to(run.device)
    ids = texts.text_tokens(tokenizer, TEXT, run.length)
    return model, torch.tensor([ids], device=run.device)


def forward(model, ids, implementation: str, **kwargs) -> torch.Tensor:
    """The logits `[1, L or kwargs' logits_to_keep, vocab]` of one forward with the
    attention `implementation`."""
    model.set_attn_implementation(implementation)
    with torch.no_grad():
        return model(ids, **kwargs).logits


def prefill_ms(model, ids, implementation: str) -> float:
    """ms of one prefill forward: CUDA events around it on CUDA, else the wall time."""
    model.set_attn_implementation(implementation)  # outside the timed region
    if ids.device.type != "cuda":
        start = time.perf_counter()
        forward(model, ids, implementation, logits_to_keep=1)
        return 1e3 * (time.perf_counter() - start)
    start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
    start.record()
    forward(model, ids, implementation, logits_to_keep=1)
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def agreement(dense: torch.Tensor, got: torch.Tensor) -> dict:
    """top-1 agreement and mean KL(dense || got) over the second half's positions, for
    logits `[1, L, vocab]`."""
    start = dense.shape[1] // 2
    ld, lg = (x[0, start:].float().log_softmax(-1) for x in (dense, got))
    kl = (ld.exp() * (ld - lg)).sum(-1)
    return {"top1": float((ld.argmax(-1) == lg.argmax(-1)).float().mean()),
            "kl_mean": float(kl.mean())}


def measure(run: Run) -> list[dict]:
    """One row per implementation: times of alternating forwards, then each bridged row's
    density, bridge counts and agreement with sdpa from one full-logits forward."""
    from xattn_torch_bridge import hf

    model, ids = load(run)
    options = {name: dict(run.options) | extra for name, extra in REGISTERED.items()}
    handles = {name: hf.register(name, **opts) for name, opts in options.items()}
    impls = ("sdpa", *REGISTERED)
    for _ in range(run.warmup):
        for impl in impls:
            prefill_ms(model, ids, impl)
    times = {impl: [] for impl in impls}
    for r in range(run.reps):
        for impl in impls:
            times[impl].append(prefill_ms(model, ids, impl))
        log(f"round {r + 1}/{run.reps}: " + ", ".join(f"{i} {t[-1]:.2f} ms"
                                                     for i, t in times.items()))
    dense = forward(model, ids, "sdpa")
    bridged = {}
    for name, handle in handles.items():
        handle.reset()
        got = forward(model, ids, name)
        bridged[name] = {"density": handle.last_density,
                         "bridged_calls": handle.bridged_calls,
                         "fallbacks": handle.fallbacks,
                         "fallback_counts": handle.fallback_counts,
                         "layers": model.config.num_hidden_layers,
                         "settings": settings(options[name])} | agreement(dense, got)
    # no floor or memory figure for a whole model's forward
    meta = {"gpu": gpu_name(), "floor_ms": None, "extra_mib": None, "text": TEXT,
            "length": run.length, "dtype": str(run.dtype).removeprefix("torch."),
            "reps": run.reps,
            "date": today(), "versions": versions(), "commit": commit()}
    case = f"smollm2-135m-prefill-{run.length}"
    return [{"case": case, "impl": impl, "ms": round(statistics.median(times[impl]), 4)}
            | bridged.get(impl, {}) | meta for impl in impls]


def markdown(rows: list[dict], command: str) -> str:
    first, sdpa = rows[0], rows[0]["ms"]
    lines = [f"`{command}`", "",
             f"GPU: {first['gpu']}; {first['versions']}; {first['date']}; commit "
             f"{first['commit']}; SmolLM2-135M-Instruct, {first['dtype']}, {first['length']} "
             f"tokens of {first['text']!r}; median of {first['reps']} forwards", "",
             "| impl | ms per prefill | vs sdpa | density | bridged calls | fallbacks | "
             "top-1 | KL mean |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = [""] * 5 if "density" not in r else [
            f"{r['density']:.3f}", f"{r['bridged_calls']} of {r['layers']} layers",
            str(r["fallbacks"]), f"{r['top1']:.4f}", f"{r['kl_mean']:.4f}"]
        lines.append(f"| {r['impl']} | {r['ms']:.2f} | {sdpa / r['ms']:.2f}x | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=8192, help="prompt tokens")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds")
    parser.add_argument("--reps", type=int, default=10, help="timed rounds")
    parser.add_argument("--json", help=JSON_HELP)
    parser.add_argument("--md", help="write the markdown table here")
    parser.add_argument("--smoke", action="store_true",
                        help="CPU, float32, 512 tokens, block 64: checks that it runs")
    args = parser.parse_args(argv)
    reason = smollm2.missing()
    if reason:
        print(reason, file=sys.stderr)
        return 2
    if not args.smoke and not xattn_torch_bridge.cuda_available():
        print("needs torch with CUDA and JAX's CUDA backend (or pass --smoke)",
              file=sys.stderr)
        return 2
    if args.smoke:
        torch.set_num_threads(1)  # torch's idle CPU threads spin and slow JAX's CPU work
    rows = measure(run_of(args))
    table = markdown(rows, "python -m bench.hf_prefill "
                     + " ".join(sys.argv[1:] if argv is None else argv))
    write_outputs(rows, table, args.json, args.md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
