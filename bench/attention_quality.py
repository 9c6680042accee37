"""XAttention's accuracy, density and speed over thresholds and strides (`python -m
bench.attention --quality`).

On the demo's structured data (`bench.attention.structured_qkv`: causal, Lq = Lk =
`Sizes.quality_length`, block 128, GQA 32:8, D 128), for strides 8 and 16 and thresholds
0.8 to 0.99, `xattention` in bf16 against dense float32 attention of the float32 inputs
(the reference on an all-true mask):
- rel err: ||out - dense||_F / ||dense||_F over the whole output;
- density: the allowed visible (query, key) pairs over all visible pairs;
- ms, and speed-up: dense bf16 attention's time (cuDNN on a GPU, XLA elsewhere) over
  xattention's (estimate included).
Dense bf16 attention's own error is reported too: the part of the error bf16 alone makes.
Prints a markdown report, the quality section of bench/results/attention.md (put it
there in place of the old one), and writes it to `--md PATH` where given; writes a PNG
plot (by default bench/results/attention_quality.png, the section's figure).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from bench.attention import attention_flops, impl_label, structured_qkv
from bench.common import Sizes, gpu_name, log, time_ms, today, versions
from xattn_jax import block_sparse_attention, xattention

THRESHOLDS = (0.8, 0.85, 0.9, 0.95, 0.99)
STRIDES = (8, 16)
REPS = 10
DEFAULT_PNG = "bench/results/attention_quality.png"


def rel_err(out: jax.Array, want: jax.Array) -> float:
    diff = out.astype(jnp.float32) - want
    return float(jnp.linalg.norm(diff) / jnp.linalg.norm(want))


def _dense_bf16(q, k, v):
    """Dense causal attention of bf16 inputs `[B, H, L, D]` in cuDNN's `[B, L, H, D]`
    layout: (the function, its arguments)."""
    implementation = "cudnn" if jax.default_backend() == "gpu" else "xla"

    def fn(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                            implementation=implementation)

    return fn, tuple(x.transpose(0, 2, 1, 3) for x in (q, k, v))


def sweep(sz: Sizes, impl: str) -> tuple[list[dict], dict]:
    """Rows (stride, threshold, density, rel_err, ms, speedup) and the dense baselines."""
    length = sz.quality_length
    q32, k32, v32 = structured_qkv(length, sz, jnp.float32)
    blocks = -(-length // sz.block)
    everything = jnp.ones((1, sz.q_heads, blocks, blocks), bool)
    log(f"dense float32 reference at {length} tokens")
    want = block_sparse_attention(q32, k32, v32, everything, block_size=sz.block,
                                  causal=True, impl="reference")
    q, k, v = (x.astype(jnp.bfloat16) for x in (q32, k32, v32))
    del q32, k32, v32
    dense_fn, dense_args = _dense_bf16(q, k, v)
    dense_ms = time_ms(dense_fn, [dense_args], warmup=2, reps=REPS)
    dense_err = rel_err(dense_fn(*dense_args).transpose(0, 2, 1, 3), want)
    del dense_args
    log(f"dense bf16: {dense_ms:.3f} ms, rel err {dense_err:.2e}")
    rows = []
    for stride in STRIDES:
        for threshold in THRESHOLDS:
            def fn(q, k, v, t, stride=stride):
                return xattention(q, k, v, threshold=t, block_size=sz.block,
                                  stride=stride, causal=True, impl=impl, return_mask=True)

            t = jnp.float32(threshold)
            out, mask = fn(q, k, v, t)
            _, density = attention_flops(mask, length, length, sz)
            ms = time_ms(fn, [(q, k, v, t)], warmup=2, reps=REPS)
            rows.append(dict(stride=stride, threshold=threshold, density=density,
                             rel_err=rel_err(out, want), ms=ms, speedup=dense_ms / ms))
            log(f"stride {stride}, threshold {threshold}: density {density:.3f}, rel err "
                f"{rows[-1]['rel_err']:.2e}, {ms:.3f} ms ({dense_ms / ms:.2f}x dense)")
    return rows, dict(ms=dense_ms, rel_err=dense_err)


def report(rows: list[dict], dense: dict, sz: Sizes, impl: str, png: str) -> str:
    lines = [
        "## XAttention quality: error, density and speed-up over thresholds and strides",
        "",
        f"Written by `python -m bench.attention --quality` on {gpu_name()}, {today()}; "
        f"{versions()}.",
        "",
        f"Structured synthetic data (`xattn_jax.demo.synthetic.structured_qk`, {sz.kv_heads} "
        f"heads, each query head repeated to its {sz.q_heads // sz.kv_heads} GQA query "
        f"heads; v random), causal, Lq = Lk = {sz.quality_length}, Hq {sz.q_heads}, Hkv "
        f"{sz.kv_heads}, D {sz.head_dim}, block {sz.block}, bf16; attention impl "
        f"{impl_label(impl, sz)}. rel err: Frobenius norm of the output's difference from "
        "dense float32 attention of the float32 inputs, relative to its norm. density: "
        "allowed visible (query, key) pairs over all visible pairs. speed-up: dense bf16 "
        "attention's time over xattention's (estimate included).",
        "",
        f"Dense bf16 attention ({'cuDNN' if jax.default_backend() == 'gpu' else 'XLA'}): "
        f"{dense['ms']:.3f} ms, rel err {dense['rel_err']:.2e} (bf16 alone).",
        "",
        "| stride | threshold | density | rel err | ms | speed-up |",
        "|---|---|---|---|---|---|",
    ]
    lines += [f"| {r['stride']} | {r['threshold']} | {r['density']:.3f} | {r['rel_err']:.2e} "
              f"| {r['ms']:.3f} | {r['speedup']:.2f} |" for r in rows]
    lines += ["", f"![error, density and speed-up]({png.rsplit('/', 1)[-1]})", ""]
    return "\n".join(lines)


def plot(rows: list[dict], dense: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for stride in STRIDES:
        mine = [r for r in rows if r["stride"] == stride]
        t = [r["threshold"] for r in mine]
        for ax, key in zip(axes, ("rel_err", "density", "speedup")):
            ax.plot(t, [r[key] for r in mine], marker="o", label=f"stride {stride}")
    axes[0].axhline(dense["rel_err"], color="gray", linestyle="--", label="dense bf16")
    axes[2].axhline(1.0, color="gray", linestyle="--", label="dense bf16")
    titles = ("relative error vs dense float32", "density (visible pairs kept)",
              "speed-up over dense bf16")
    for ax, title in zip(axes, titles):
        ax.set_title(title)
        ax.set_xlabel("threshold")
        ax.grid(alpha=0.3)
        ax.legend()
    axes[0].set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run(sz: Sizes, impl: str, *, smoke: bool, md: str | None, png: str | None) -> None:
    """The sweep; its plot to `png`, its report on stdout and, where given, to `md` (the
    report is a section of bench/results/attention.md, so no record file is
    rewritten by default)."""
    png = png or ("/tmp/attention_quality_smoke.png" if smoke else DEFAULT_PNG)
    rows, dense = sweep(sz, impl)
    plot(rows, dense, png)
    text = report(rows, dense, sz, impl, png)
    if md:
        with open(md, "w") as f:
            f.write(text)
    log(f"wrote {png}" + (f" and {md}" if md else ""))
    print(text)
