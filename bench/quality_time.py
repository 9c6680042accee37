"""Quality per unit of time: the whole XAttention call's device time at each real-model
setting's measured density, `python -m bench.quality_time`.

The settings and their quality are `bench.model_quality`'s records (`--quality`, default
bench/results/model_quality.json) of the text the settings were not chosen on (`--text`,
default "licenses": docs/tuning.md, "Selection on a real model"): every setting on the
antidiagonal estimate (rule "estimate") or on sampled rows ("sampled-rows"), its
threshold rule "uniform" (one threshold) or "calibrated" (a per-head table), its
widening (min_blocks, dense_last), its measured density (mean over layers and heads),
top-1 agreement, KL and perplexity change against dense.

Each setting is timed, bf16, causal, at every scale: SmolLM2-135M's attention (Hq 9
reading Hkv 3, D 64) at the records' length (8K), and Llama-3.1-8B's (Hq 32 reading
Hkv 8, D 128) at 32K and 128K, with the 8K density carried over. Block and stride are the
records' (128 and 8). The inputs are `xattn_jax.demo.synthetic`'s structured q and k
(sinks, a local window, stripes; each query head repeated to its GQA group) and random v
(`bench.attention.structured_qkv`); the setting's own estimate and widening select on
them at the one threshold whose mask keeps the setting's measured density (bisection on
the scalar threshold), so the attention runs on a mask of the model's density with a
real mask's shape: most blocks near the diagonal and in the sink column, per-row counts
set by the threshold rule. Rows per setting (median device time, `bench.common.time_ms`):
- part "xattention": the whole call, the estimate's mask and then `block_sparse_attention`
  on it, jitted as one (`xattention`'s computation: for sampled rows its
  `sampled_block_mass` and `select_blocks`);
- part "estimate": the estimate and its selection alone (`ESTIMATES`);
- part "attention": `block_sparse_attention` alone on that mask;
and per scale cuDNN's dense causal attention (part "dense", `bench.attention.cudnn_call`).
floor_ms: the useful FLOPs at the H200's 753 TFLOP/s (attention: 4 D per allowed visible
pair; the antidiagonal estimate: its strided product; sampled rows: 2 D per visible key
of every sampled row), with the same-run matmul's rate beside it (`matmul_tflops`);
extra_mib: the compiled call's outputs plus temporaries. `density` is the timed mask's
share of the causally allowed blocks (`model_density` the real model's), `pair_density`
its share of the visible (query, key) pairs.

    python -m bench.quality_time --json bench/results/model_quality.json   # GPU
    python -m bench.plot_quality_time bench/results/model_quality.json --md OUT.md --png OUT.png
    python -m bench.quality_time --smoke --json PATH   # CPU, tiny sizes, times meaningless

The rows carry `"benchmark": "quality_time"`: they share bench/results/model_quality.json
with the quality records they were timed from, whose plot (`bench.plot_model_quality`)
shows them below the quality against density.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import pathlib
import sys
from typing import Callable, NamedTuple

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.attention import (FULL, SMOLLM2, attention_flops, cudnn_call,  # noqa: E402
                             impl_label, structured_qkv)
from bench.common import (MODEL_QUALITY, QUALITY_TIME, Sizes, floor_ms, log,  # noqa: E402
                          matmul_tflops, record, report, rows_of, strided_flops, time_ms,
                          write_outputs)
from xattn_jax import (block_sparse_attention, sampled_block_mass, select_blocks,  # noqa: E402
                       xattn_estimate)
from xattn_jax.defaults import SAMPLED_ROWS  # noqa: E402
from xattn_jax.sampled_rows import sampled_positions  # noqa: E402

QUALITY = pathlib.Path(__file__).parent / "results" / "model_quality.json"
TEXT = "licenses"  # the text the settings were checked on, not chosen on
QUALITY_TIME_KEY = ("benchmark", "case", "impl", "gpu")  # what identifies a row (merge_json)
ESTIMATE_OF_RULE = {"estimate": "antidiagonal", "sampled-rows": "sampled-rows"}
BISECTION_STEPS = 24  # halvings of the threshold interval (0, 1]: float32's resolution
DENSITY_TOLERANCE = 0.005  # a timed mask further than this from the model's is logged

# The sampled-rows block scores timed, and their implementation's name in the records
# ("auto": the Triton kernel on a GPU). To time another implementation, change this one
# line, e.g. to ("reference", functools.partial(sampled_block_mass, impl="reference")).
SAMPLED_ROWS_CALL = ("auto", sampled_block_mass)


# --- the settings ----------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Setting:
    """One real-model setting: its name in the quality records, its estimate
    ("antidiagonal" or "sampled-rows") and threshold rule ("uniform" or "calibrated"), the
    estimate's block size and stride, its widening, and `quality`, its record's density,
    top1, kl_mean, ppl_change_pct and length (tokens scored) and where they come from
    (`source`)."""

    name: str
    estimate: str
    threshold_rule: str
    block_size: int
    stride: int
    min_blocks: int
    dense_last: int
    quality: dict

    @property
    def density(self) -> float:
        return self.quality["density"]


def quality_settings(records: list[dict], text: str = TEXT, source: str = "") -> list[Setting]:
    """The settings of `bench.model_quality` records scored on `text` whose rule has an
    estimate (`ESTIMATE_OF_RULE`; dense, the oracle and fp8 keys are left out), in the
    records' order. Raises ValueError naming `text` where no such record exists, and for
    records of several lengths."""
    quality = rows_of(records, MODEL_QUALITY)  # the shared record holds timed rows too
    chosen = [r for r in quality if r.get("text") == text and r.get("rule") in ESTIMATE_OF_RULE]
    if not chosen:
        texts = sorted({r.get("text") for r in quality})
        raise ValueError(f"text: no estimate's record scored on {text!r} (texts: {texts})")
    lengths = sorted({r["length"] for r in chosen})
    if len(lengths) > 1:
        raise ValueError(f"text: the records of {text!r} hold several lengths {lengths}")
    settings = []
    for r in chosen:
        quality = {key: r[key] for key in ("density", "top1", "kl_mean", "ppl_change_pct",
                                           "length")}
        quality["source"] = (f"{source + ': ' if source else ''}{r['text']}, {r['length']} "
                             f"tokens, {r['dtype']}, {r['gpu']}, {r['date']}, commit "
                             f"{r['commit']}")
        rule = "calibrated" if isinstance(r["threshold"], list) else "uniform"
        settings.append(Setting(r["setting"], ESTIMATE_OF_RULE[r["rule"]], rule,
                                r["block_size"], r["stride"], r["min_blocks"],
                                r["dense_last"], quality))
    return settings


def read_settings(path, text: str = TEXT) -> tuple[list[Setting], int]:
    """(`quality_settings` of the records at `path`, the length they were scored at)."""
    path = pathlib.Path(path)
    settings = quality_settings(json.loads(path.read_text()), text, source=path.name)
    return settings, settings[0].quality["length"]


# --- the estimates ---------------------------------------------------------------------

def antidiagonal_scores(q, k, *, block_size: int, stride: int) -> jax.Array:
    return xattn_estimate(q, k, block_size=block_size, stride=stride, causal=True)[0]


def antidiagonal_mask(q, k, threshold, *, block_size: int, stride: int, min_blocks: int,
                      dense_last: int) -> jax.Array:
    """xattn_estimate's mask, as `xattention(estimate="antidiagonal")` selects."""
    return xattn_estimate(q, k, block_size=block_size, stride=stride, threshold=threshold,
                          causal=True, min_blocks=min_blocks, dense_last=dense_last)[1]


def sampled_rows_scores(q, k, *, block_size: int, stride: int) -> jax.Array:
    del stride  # sampled rows have none
    return SAMPLED_ROWS_CALL[1](q, k, block_size=block_size, causal=True)


def sampled_rows_mask(q, k, threshold, *, block_size: int, stride: int, min_blocks: int,
                      dense_last: int) -> jax.Array:
    """select_blocks on the sampled rows' scores, as `xattention(estimate="sampled-rows")`
    selects."""
    return select_blocks(sampled_rows_scores(q, k, block_size=block_size, stride=stride),
                         threshold, causal=True, min_blocks=min_blocks, dense_last=dense_last)


def antidiagonal_flops(sz: Sizes, length: int, stride: int) -> float:
    return strided_flops(sz.q_heads, length, length, stride, sz.head_dim, True)


def sampled_rows_flops(sz: Sizes, length: int, stride: int) -> float:
    """2 D FLOPs per visible key of every sampled row (the product; not the softmax)."""
    del stride
    visible = sampled_positions(length, sz.block, SAMPLED_ROWS).astype(np.int64) + 1
    return 2.0 * sz.head_dim * sz.q_heads * float(visible.sum())


class Estimate(NamedTuple):
    """How one estimate is timed. scores: `(q, k, *, block_size, stride)` -> float32
    `[B, Hq, qb, kb]`; mask: `(q, k, threshold [Hq], *, block_size, stride, min_blocks,
    dense_last)` -> bool `[B, Hq, qb, kb]`, the mask `select_blocks` makes of those scores;
    impl: the name of what computes them; flops: `(sizes, length, stride)` -> the floor's
    FLOPs."""

    scores: Callable
    mask: Callable
    impl: str
    flops: Callable


ESTIMATES = {"antidiagonal": Estimate(antidiagonal_scores, antidiagonal_mask, "auto",
                                      antidiagonal_flops),
             "sampled-rows": Estimate(sampled_rows_scores, sampled_rows_mask,
                                      SAMPLED_ROWS_CALL[0], sampled_rows_flops)}


# --- masks of a density ----------------------------------------------------------------

@jax.jit
def block_density(mask: jax.Array) -> jax.Array:
    """float32 scalar: the share of the causally allowed blocks a bool `[B, Hq, n, n]` mask
    keeps, over batch and heads (`bench.model_quality.density_per_head`'s, averaged)."""
    allowed = jnp.tril(jnp.ones(mask.shape[-2:], bool))
    return (mask & allowed).sum() / (allowed.sum() * mask.shape[0] * mask.shape[1])


def threshold_for(density_at: Callable[[float], float], target: float,
                  steps: int = BISECTION_STEPS) -> tuple[float, float]:
    """(threshold, its density): the threshold in (0, 1] whose density (`density_at`, not
    decreasing in the threshold) is the nearest to `target` of the `steps` halvings'
    midpoints and 1."""
    lo, hi = 0.0, 1.0
    best = (hi, density_at(hi))
    for _ in range(steps):
        mid = (lo + hi) / 2
        density = density_at(mid)
        if abs(density - target) < abs(best[1] - target):
            best = (mid, density)
        lo, hi = (mid, hi) if density < target else (lo, mid)
    return best


# --- timing ----------------------------------------------------------------------------

class Scale(NamedTuple):
    """A model's attention shapes at one length: `name` (the records' `scale`), `model`,
    `sizes` (heads, head dim, block), `length` tokens, `reps` timed batches per row."""

    name: str
    model: str
    sizes: Sizes
    length: int
    reps: int


LLAMA = dataclasses.replace(FULL, lengths=())  # Llama-3.1-8B: Hq 32 reading Hkv 8, D 128
SMOKE_SMOLLM2 = dataclasses.replace(SMOLLM2, block=32, lengths=())
SMOKE_LLAMA = Sizes(q_heads=4, kv_heads=2, head_dim=32, block=32, lengths=())


def scale(prefix: str, model: str, sizes: Sizes, length: int, reps: int) -> Scale:
    tokens = f"{length // 1024}k" if length % 1024 == 0 else str(length)
    return Scale(f"{prefix}-{tokens}", model, sizes, length, reps)


def scales(model_length: int, smoke: bool) -> list[Scale]:
    """SmolLM2-135M's attention at the records' length, Llama-3.1-8B's at 32K and 128K;
    smoke: tiny shapes and lengths, 2 timed batches a row."""
    smol, llama = ("smollm2-135m", "SmolLM2-135M"), ("llama-3.1-8b", "Llama-3.1-8B")
    if smoke:
        return [scale(*smol, SMOKE_SMOLLM2, 256, 2), scale(*llama, SMOKE_LLAMA, 512, 2),
                scale(*llama, SMOKE_LLAMA, 1024, 2)]
    return [scale(*smol, SMOLLM2, model_length, 20), scale(*llama, LLAMA, 32768, 10),
            scale(*llama, LLAMA, 131072, 5)]


def compiled(fn: Callable, *args):
    """fn jitted and compiled for args, ahead of time (one compile serves the timing and
    the memory analysis)."""
    return jax.jit(fn).lower(*args).compile()


def extra_mib(call) -> float:
    """MiB a compiled call allocates beyond its inputs: outputs plus temporaries."""
    stats = call.memory_analysis()
    return (stats.output_size_in_bytes + stats.temp_size_in_bytes) / 2**20


class Calls:
    """A scale's compiled calls, each made once per static configuration (thresholds and
    masks are data): the estimate alone, the attention alone, the whole call; and the
    estimates' block scores of q and k."""

    def __init__(self, sc: Scale, q, k, v):
        self.sc, self.q, self.k, self.v = sc, q, k, v
        self._calls: dict = {}

    def _get(self, key, fn, *args):
        if key not in self._calls:
            call = compiled(fn, *args)
            self._calls[key] = (call, extra_mib(call))
        return self._calls[key]

    def scores(self, s: Setting) -> jax.Array:
        """The setting's estimate's block scores of q and k (what its threshold selects on)."""
        key = ("scores", s.estimate, s.stride)
        if key not in self._calls:
            self._calls[key] = ESTIMATES[s.estimate].scores(
                self.q, self.k, block_size=self.sc.sizes.block, stride=s.stride)
        return self._calls[key]

    def options(self, s: Setting) -> dict:
        return dict(block_size=self.sc.sizes.block, stride=s.stride, min_blocks=s.min_blocks,
                    dense_last=s.dense_last)

    def estimate(self, s: Setting, threshold):
        fn = functools.partial(ESTIMATES[s.estimate].mask, **self.options(s))
        key = ("estimate", s.estimate, *self.options(s).values())
        return self._get(key, fn, self.q, self.k, threshold)

    def attention(self, mask):
        fn = functools.partial(block_sparse_attention, block_size=self.sc.sizes.block,
                               causal=True)
        return self._get(("attention",), fn, self.q, self.k, self.v, mask)

    def whole(self, s: Setting, threshold):
        estimate = functools.partial(ESTIMATES[s.estimate].mask, **self.options(s))
        block = self.sc.sizes.block

        def fn(q, k, v, threshold):
            return block_sparse_attention(q, k, v, estimate(q, k, threshold),
                                          block_size=block, causal=True)

        key = ("whole", s.estimate, *self.options(s).values())
        return self._get(key, fn, self.q, self.k, self.v, threshold)


def row(sc: Scale, case: str, impl: str, call, args: tuple, flops: float, tflops,
        fields: dict) -> dict:
    """One timed row (`bench.common.record`) with the scale's shapes and `fields`."""
    compiled_call, mib = call
    ms = time_ms(compiled_call, [args], warmup=2, reps=sc.reps)
    sz = sc.sizes
    shapes = {"scale": sc.name, "model": sc.model, "length": sc.length,
              "q_heads": sz.q_heads, "kv_heads": sz.kv_heads, "head_dim": sz.head_dim,
              "block_size": sz.block, "dtype": "bfloat16", "data": "structured"}
    return (record(case, impl, ms, floor_ms(flops), mib, tflops) | shapes | fields
            | {"benchmark": QUALITY_TIME})


def setting_rows(calls: Calls, s: Setting, tflops, attention_impl: str) -> list[dict]:
    """The setting's rows at a scale: the threshold whose mask keeps its density, then the
    estimate, the attention on that mask and the whole call, timed."""
    sc, q, k, v = calls.sc, calls.q, calls.k, calls.v
    est = ESTIMATES[s.estimate]
    heads = sc.sizes.q_heads
    per_head = functools.partial(jnp.full, (heads,), dtype=jnp.float32)
    scores = calls.scores(s)

    def density_at(t: float) -> float:
        mask = select_blocks(scores, per_head(t), causal=True, min_blocks=s.min_blocks,
                             dense_last=s.dense_last)
        return float(block_density(mask))

    t, _ = threshold_for(density_at, s.density)
    threshold = per_head(t)
    estimate = calls.estimate(s, threshold)
    mask = estimate[0](q, k, threshold)
    density = float(block_density(mask))
    if abs(density - s.density) > DENSITY_TOLERANCE:
        log(f"{sc.name} {s.name}: the nearest mask keeps {density:.4f} of the blocks, the "
            f"model {s.density:.4f}")
    attention_floor, pair_density = attention_flops(mask, sc.length, sc.length, sc.sizes)
    estimate_flops = est.flops(sc.sizes, sc.length, s.stride)
    fields = {"setting": s.name, "estimate": s.estimate,
              "threshold_rule": s.threshold_rule, "stride": s.stride,
              "min_blocks": s.min_blocks, "dense_last": s.dense_last,
              "estimate_impl": est.impl, "attention_impl": attention_impl,
              "threshold": t, "density": round(density, 4),
              "pair_density": round(pair_density, 4), "model_density": s.density,
              "top1": s.quality["top1"], "kl_mean": s.quality["kl_mean"],
              "ppl_change_pct": s.quality["ppl_change_pct"],
              "quality_length": s.quality["length"],
              "quality_source": s.quality["source"]}
    name = f"{sc.name} {s.name}"
    parts = (("estimate", f"xattn-jax/{est.impl}", estimate, (q, k, threshold),
              estimate_flops),
             ("attention", f"xattn-jax/{attention_impl}", calls.attention(mask),
              (q, k, v, mask), attention_floor),
             ("xattention", f"xattn-jax/{est.impl}+{attention_impl}",
              calls.whole(s, threshold), (q, k, v, threshold),
              estimate_flops + attention_floor))
    rows = [row(sc, f"{name}: {part}", impl, call, args, flops, tflops,
                dict(fields, part=part)) for part, impl, call, args, flops in parts]
    ms = {r["part"]: r["ms"] for r in rows}
    log(f"{name}: xattention {ms['xattention']:.3f} ms (estimate {ms['estimate']:.3f}, "
        f"attention {ms['attention']:.3f}), threshold {t:.6f}, density {density:.3f} "
        f"(model {s.density:.3f})")
    return rows


def dense_row(sc: Scale, tflops) -> dict:
    """cuDNN's dense causal attention at the scale's shapes (XLA's off a GPU)."""
    call = cudnn_call(sc.length, sc.sizes)
    jitted = compiled(call.fn, *call.args)
    out = row(sc, f"{sc.name} dense", call.label, (jitted, extra_mib(jitted)), call.args,
              call.flops, tflops, {"part": "dense", "density": 1.0, "model_density": 1.0})
    log(f"{sc.name} dense ({call.label}): {out['ms']:.3f} ms")
    return out


def time_scale(sc: Scale, settings: list[Setting], tflops) -> list[dict]:
    """Every setting's rows at one scale, and the dense row."""
    q, k, v = structured_qkv(sc.length, sc.sizes)
    calls = Calls(sc, q, k, v)
    attention_impl = impl_label("auto", sc.sizes)
    rows = [dense_row(sc, tflops)]
    for s in settings:
        rows += setting_rows(calls, s, tflops, attention_impl)
    return rows


def check_block_sizes(settings: list[Setting], sizes: Sizes) -> None:
    """The records' block size must be the timed one (a smoke run shrinks it)."""
    other = sorted({s.block_size for s in settings} - {sizes.block})
    if other:
        raise ValueError(f"quality: the records' block size {other} is not the timed "
                         f"{sizes.block}")



def _named(items: list, names: str | None, flag: str) -> list:
    """The `items` whose names the comma-separated `names` list (all where None); a
    ValueError naming `flag` for a name not among them."""
    if not names:
        return items
    wanted = names.split(",")
    unknown = sorted(set(wanted) - {item.name for item in items})
    if unknown:
        raise ValueError(f"{flag}: {unknown} not among {[item.name for item in items]}")
    return [item for item in items if item.name in wanted]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quality", default=str(QUALITY),
                        help="bench.model_quality's records (default: the committed ones)")
    parser.add_argument("--text", default=TEXT, help=f"their text to take (default {TEXT})")
    parser.add_argument("--settings", help="comma-separated setting names (default: all)")
    parser.add_argument("--scales", help="comma-separated scale names (default: all)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, on a CPU")
    parser.add_argument("--json", help="the records' path (bench.common.write_outputs)")
    args = parser.parse_args(argv)
    settings, model_length = read_settings(args.quality, args.text)
    settings = _named(settings, args.settings, "--settings")
    chosen = _named(scales(model_length, args.smoke), args.scales, "--scales")
    if not args.smoke:
        for sc in chosen:
            check_block_sizes(settings, sc.sizes)
    command = " ".join(["python -m bench.quality_time",
                        *(sys.argv[1:] if argv is None else argv)])
    tflops = matmul_tflops()
    records = []
    for i, sc in enumerate(chosen):
        log(f"[{i + 1}/{len(chosen)}] {sc.name}: {sc.model}'s attention, {sc.length} "
            f"tokens, {len(settings)} settings")
        rows = [r | {"command": command} for r in time_scale(sc, settings, tflops)]
        records += rows
        # after every scale, so that a cut-short run keeps what it measured
        write_outputs(records, report(rows), args.json, None, QUALITY_TIME_KEY)


if __name__ == "__main__":
    main()
