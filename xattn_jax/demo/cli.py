"""The demo (`python -m xattn_jax`, `xattn-demo`): the estimate on a synthetic long context.

It builds structured q and k (`xattn_jax.demo.synthetic`: attention sinks, a local window,
vertical and diagonal stripes, noise), times the jitted `xattn_estimate`, measures the
mask's density and its exact recall (`xattn_jax.demo.recall`), prints a short report and writes
a PNG of one head's block sums and block mask. The plot needs matplotlib (the `demo` extra):
without it the demo stops before computing anything, saying what to install.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import time

import jax
import numpy as np

from xattn_jax import impls
from xattn_jax.api import xattn_estimate
from xattn_jax.defaults import BLOCK_SIZE, ORIGINAL_THRESHOLD, STRIDE
from xattn_jax.demo.recall import Coverage, coverage
from xattn_jax.demo.synthetic import structured_qk
from xattn_jax.geometry import cdiv


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="xattn-demo",
        description="Run the XAttention block-sparse estimate on a synthetic long-context "
                    "example; report time, mask density and exact recall; plot one head.")
    p.add_argument("--length", type=_positive_int, default=8192, help="tokens (Lq = Lk)")
    p.add_argument("--heads", type=_positive_int, default=4, help="attention heads")
    p.add_argument("--head-dim", type=_positive_int, default=64, help="head dimension D")
    p.add_argument("--stride", type=int, default=STRIDE, help="antidiagonal stride S")
    p.add_argument("--block-size", type=int, default=BLOCK_SIZE,
                   help="block size in tokens, a multiple of the stride")
    p.add_argument("--threshold", type=float, default=ORIGINAL_THRESHOLD,
                   help="share of each row's estimated mass to keep, in (0, 1]")
    p.add_argument("--impl", choices=impls.IMPLS, default="auto", help="estimate implementation")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic example")
    p.add_argument("--head", type=int, default=0, help="which head to plot")
    p.add_argument("--repeats", type=_positive_int, default=5,
                   help="timed calls after the first one")
    p.add_argument("--out", default="xattn_demo.png", help="path of the PNG to write")
    return p


def _timed_estimate(q, k, args) -> tuple[jax.Array, jax.Array, float, float]:
    """Runs the estimate 1 + repeats times: (block_sums, mask, first seconds, median seconds)."""
    def run():
        start = time.perf_counter()
        out = jax.block_until_ready(xattn_estimate(
            q, k, block_size=args.block_size, stride=args.stride, threshold=args.threshold,
            impl=args.impl))
        return out, time.perf_counter() - start

    (sums, mask), first = run()
    steady = statistics.median(run()[1] for _ in range(args.repeats))
    return sums, mask, first, steady


# The block mask panel's three states, in order: (legend label, color).
MASK_STATES = (
    ("after the diagonal (causal attention never reads it)", "#e8e8e8"),
    ("dropped", "white"),
    ("selected", "#1f4e9c"),
)
AFTER_DIAGONAL_COLOR = MASK_STATES[0][1]
SHARE_LABEL = "share of the query block's estimated mass (each row sums to 1)"


def plot_figure(sums: np.ndarray, mask: np.ndarray, title: str):
    """Two panels for one head: block sums float `[qb, kb]` and the block mask bool
    `[qb, kb]`; blocks after the diagonal are grey in both, and the mask panel's legend
    names its three states. Returns the matplotlib Figure.

    The first panel shows each block's share of its query block's estimated mass (log
    color scale), not the block sum itself: a full query block's sums add up to its
    block_size / stride reshaped rows (16 at the defaults), while a share lies in [0, 1]
    and reads against the threshold, which is a share of each row too.
    """
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import ListedColormap, LogNorm
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    qb, kb = sums.shape
    allowed = np.arange(kb)[None, :] <= np.arange(qb)[:, None] + (kb - qb)
    totals = np.where(allowed, sums, 0).sum(axis=1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        shares = np.where(totals > 0, sums / totals, np.nan)  # NaN rows stay NaN
    positive = shares[allowed & (shares > 0)]
    if positive.size == 0:  # NaN inputs: no finite block sum to scale the colors by
        positive = np.ones(1)
    norm = LogNorm(vmin=max(positive.min(), positive.max() * 1e-6), vmax=positive.max())
    fig = Figure(figsize=(12, 5.6), layout="constrained")
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2)
    image = left.imshow(np.where(allowed, np.maximum(shares, norm.vmin), np.nan), norm=norm,
                        cmap=colormaps["viridis"].with_extremes(bad=AFTER_DIAGONAL_COLOR),
                        interpolation="nearest")
    fig.colorbar(image, ax=left, shrink=0.85, label=SHARE_LABEL)
    left.set_title("estimated attention mass per block (log scale)")
    states = np.where(mask, 2, np.where(allowed, 1, 0))  # indices into MASK_STATES
    right.imshow(states, cmap=ListedColormap([color for _, color in MASK_STATES]), vmin=0,
                 vmax=len(MASK_STATES) - 1, interpolation="nearest")
    right.legend(handles=[Patch(facecolor=color, edgecolor="grey", label=label)
                          for label, color in reversed(MASK_STATES)],
                 loc="upper right", fontsize="small")
    right.set_title("block mask")
    for ax in (left, right):
        ax.set_xlabel("key block")
        ax.set_ylabel("query block")
    fig.suptitle(title)
    return fig


def _report(args, q, first: float, steady: float, cov: Coverage, seconds: dict) -> str:
    per_head = lambda x: " ".join(f"{v:.3f}" for v in x)  # noqa: E731
    kb = cdiv(args.length, args.block_size)
    return "\n".join([
        "xattn-jax demo: the XAttention estimate on a synthetic long-context example",
        f"  q, k       {q.dtype} {list(q.shape)} (batch, heads, tokens, head_dim), "
        f"backend {jax.default_backend()}, impl {args.impl} ({impls.resolve(args.impl).name})",
        f"  settings   stride {args.stride}, block_size {args.block_size}, "
        f"threshold {args.threshold}, causal; {kb} x {kb} blocks per head",
        f"  estimate   {first * 1e3:.1f} ms first call (with compile), "
        f"{steady * 1e3:.1f} ms median of {args.repeats} more",
        f"  density    {cov.density.mean():.4f}  share of causal blocks selected "
        f"(per head: {per_head(cov.density)})",
        f"  recall     {cov.recall.mean():.4f}  share of the exact attention mass in them "
        f"(per head: {per_head(cov.recall)})",
        f"  other      generate {seconds['generate']:.1f} s, exact recall "
        f"{seconds['recall']:.1f} s",
        f"  plot       head {args.head} -> {args.out}",
    ])


def main(argv: list[str] | None = None) -> None:
    """Parses `argv` (default: the command line), runs the demo, prints its report."""
    parser = _parser()
    args = parser.parse_args(argv)
    if importlib.util.find_spec("matplotlib") is None:
        parser.error("the demo's plot needs matplotlib: pip install 'xattn-jax[demo]'")
    if not 0 <= args.head < args.heads:
        parser.error(f"--head must lie in [0, {args.heads}), got {args.head}")
    if not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):
        parser.error(f"--out: the directory of {args.out!r} does not exist")
    try:
        start = time.perf_counter()
        example = structured_qk(args.seed, heads=args.heads, length=args.length,
                                head_dim=args.head_dim)
        generated = time.perf_counter()
        sums, mask, first, steady = _timed_estimate(example.q, example.k, args)
    except ValueError as error:
        parser.error(str(error))
    start_recall = time.perf_counter()
    cov = coverage(example.q, example.k, mask, block_size=args.block_size)
    seconds = {"generate": generated - start, "recall": time.perf_counter() - start_recall}
    h = args.head
    fig = plot_figure(np.asarray(sums[0, h]), np.asarray(mask[0, h]),
                      f"head {h}: density {cov.density[h]:.1%}, recall {cov.recall[h]:.1%}  "
                      f"(L={args.length}, S={args.stride}, block {args.block_size}, "
                      f"threshold {args.threshold})")
    fig.savefig(args.out, dpi=110)
    print(_report(args, example.q, first, steady, cov, seconds))
