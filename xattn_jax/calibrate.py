"""Per-head thresholds calibrated on sample text: a `[layers, Hq]` table for `xattention`
(one row per layer) and `xattn_torch_bridge.hf.register`.

One threshold for every head of every layer spends blocks where they buy little: heads
whose attention is local or sink-bound reach any share with few blocks, others need many,
and the estimate ranks some heads' blocks worse than others'. A calibration measures, on
a dense forward over sample text, each head's curve of density against output error over
a grid of thresholds, then gives each head the threshold that minimizes the summed squared
errors for a mean density (a Lagrangian: every head at the point where one more block buys
the same error reduction). `docs/tuning.md: calibration` holds the figures that chose it.

    table = calibrate(layers_qkv, target_density=0.3)  # layers_qkv: [(q, k, v), ...]
    out = xattention(q, k, v, threshold=table[layer])

A target that the sparsest thresholds cannot reach (a short sample, whose few blocks the
widening `min_blocks` and `dense_last` keep whatever the threshold) gives the sparsest
table and a `DensityNotReachedWarning` naming the mean density it keeps.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np

from xattn_jax import impls
from xattn_jax.api import select_blocks, xattn_estimate
from xattn_jax.attention import block_sparse_attention, check_v
from xattn_jax.checks import (check_choice, check_int, check_norm, check_positive_float,
                              check_qk, check_scale, check_shares, check_tokens,
                              real_host_array)
from xattn_jax.defaults import (BLOCK_SIZE, DENSE_LAST, ESTIMATES, MIN_BLOCKS, NORM,
                                STRIDE, TARGET_DENSITY)
from xattn_jax.reference.estimate import forced_and_allowed
from xattn_jax.sampled_rows import sampled_block_mass

# the threshold grid a calibration chooses from; 1.0 is dense (docs/tuning.md: calibration)
THRESHOLDS = (0.8, 0.9, 0.95, 0.97, 0.98, 0.99, 0.995, 0.999, 1.0)
_BISECTION_STEPS = 100  # on the Lagrange multiplier: far below one head's density step


class DensityNotReachedWarning(UserWarning):
    """A calibration whose sparsest thresholds keep more than its target density."""


def head_curves(q: jax.Array, k: jax.Array, v: jax.Array, *, thresholds=THRESHOLDS,
                block_size: int = BLOCK_SIZE, stride: int = STRIDE, norm: float = NORM,
                min_blocks: int = MIN_BLOCKS, dense_last: int = DENSE_LAST,
                scale: float | None = None, impl: str = "auto",
                estimate: str = "antidiagonal", block_scores: jax.Array | None = None):
    """One layer's curves: float32 numpy `(density, error)`, each `[len(thresholds), Hq]`.

    q `[B, Hq, L, D]`, k and v `[B, Hkv, L, D]` (causal, the queries are the last L keys),
    from a dense forward over sample text. For each threshold t and query head: density,
    the share of causally visible blocks `xattention` with t (and these settings) computes;
    error, its output's distance from dense attention's, ||out - dense|| / ||dense|| over
    every row of the head. estimate: the block scores selected on, as in `xattention`;
    block_scores: float32 `[B, Hq, qb, kb]` to select on instead (the exact block mass,
    say, to see what the estimate costs). impl: the attention's, as in `xattention`, whose
    rule picks the estimate's too.
    """
    options = dict(block_size=block_size, causal=True, scale=scale, impl=impl)
    estimate_impl = impls.resolve_xattention(impl, q).estimate  # as xattention runs it
    qb, kb = -(-q.shape[2] // block_size), -(-k.shape[2] // block_size)
    _, allowed = forced_and_allowed(qb, kb, causal=True, keep_sink=False, keep_recent=False)
    dense = block_sparse_attention(q, k, v, jnp.broadcast_to(allowed, (*q.shape[:2], qb, kb)),
                                   **options).astype(jnp.float32)
    dense_norm = jnp.sqrt(jnp.sum(jnp.square(dense), axis=(0, 2, 3)))
    if block_scores is not None:
        sums = block_scores
    elif check_choice("estimate", estimate, ESTIMATES) == "sampled-rows":
        sums = sampled_block_mass(q, k, block_size=block_size, causal=True, scale=scale,
                                  impl=estimate_impl)
    else:
        sums, _ = xattn_estimate(q, k, block_size=block_size, stride=stride, norm=norm,
                                 causal=True, impl=estimate_impl)
    density, error = [], []
    for t in thresholds:
        mask = select_blocks(sums, float(t), causal=True, min_blocks=min_blocks,
                             dense_last=dense_last)
        out = block_sparse_attention(q, k, v, mask, **options).astype(jnp.float32)
        error.append(jnp.sqrt(jnp.sum(jnp.square(out - dense), axis=(0, 2, 3))) / dense_norm)
        density.append(mask.sum(axis=(0, 2, 3)) / (allowed.sum() * q.shape[0]))
    return (np.asarray(jnp.stack(density), np.float32),
            np.asarray(jnp.stack(error), np.float32))


def allocate(density, error, *, target_density: float, thresholds=THRESHOLDS) -> np.ndarray:
    """The table minimizing the summed squared errors at a mean density of at most
    `target_density`: float32 `[layers, Hq]` of values from `thresholds`.

    density, error: `[layers, len(thresholds), Hq]` (`head_curves` per layer). Each head
    takes the threshold minimizing error^2 + lam * density, lam the smallest multiplier
    whose table meets the target (found by bisection); where even the sparsest threshold
    of every head exceeds it, the sparsest, with a `DensityNotReachedWarning` naming the
    mean density it keeps.
    """
    density, error = np.asarray(density, np.float64), np.asarray(error, np.float64)
    if density.shape != error.shape or density.ndim != 3 or density.shape[1] != len(thresholds):
        raise ValueError(f"density and error must both be [layers, {len(thresholds)}, Hq], "
                         f"got {density.shape} and {error.shape}")
    target_density = check_positive_float("target_density", target_density)
    cost = np.square(np.nan_to_num(error, nan=np.inf))

    def pick(lam: float) -> np.ndarray:  # [layers, Hq] indices into thresholds
        return np.argmin(cost + lam * density, axis=1)

    def mean_density(idx) -> float:
        return float(np.take_along_axis(density, idx[:, None, :], axis=1).mean())

    lo, hi = 0.0, 1.0
    while mean_density(pick(hi)) > target_density and hi < 1e12:
        lo, hi = hi, hi * 4
    for _ in range(_BISECTION_STEPS):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mean_density(pick(mid)) > target_density else (lo, mid)
    reached = mean_density(pick(hi))
    if reached > target_density:
        warnings.warn(
            f"target_density {target_density} cannot be reached: the sparsest thresholds "
            f"keep a mean density of {reached:.3f}, and the table holds them (a longer "
            f"sample, lower thresholds or less widening by min_blocks and dense_last keep "
            f"fewer blocks)", DensityNotReachedWarning, stacklevel=2)
    return np.asarray(thresholds, np.float32)[pick(hi)]


# the settings `calibrate` passes to `head_curves`, and their defaults
SETTINGS = ("block_size", "stride", "norm", "min_blocks", "dense_last", "scale", "impl",
            "estimate")
_DEFAULTS = {name: p.default for name, p in inspect.signature(head_curves).parameters.items()
             if name in SETTINGS}


def calibrate(layers: Iterable, *, target_density: float = TARGET_DENSITY,
              thresholds=THRESHOLDS, **settings) -> np.ndarray:
    """A threshold per layer and query head for a mean density of `target_density`.

    layers: one `(q, k, v)` per layer (`head_curves`' shapes, the same Hq in every layer)
    from a dense forward over sample text (a few thousand tokens of the kind the model
    will read). thresholds: the grid to choose from, floats in (0, 1]. settings: those of
    `head_curves` (`SETTINGS`: block_size, stride, norm, min_blocks, dense_last, scale,
    impl, estimate), which the table is then for: pass the same ones to `xattention`.

    Returns float32 `[layers, Hq]`. Raises TypeError or ValueError naming the argument
    before any work: a target outside (0, 1], an empty grid, a layer that is not three
    arrays of those shapes, an unknown setting. A target the sparsest thresholds cannot
    reach gives their table and a `DensityNotReachedWarning` with the density they keep.
    """
    target_density, thresholds, settings = check_calibration(
        target_density=target_density, thresholds=thresholds, **settings)
    layers = _checked_layers(layers, settings)
    curves = [head_curves(q, k, v, thresholds=thresholds, **settings) for q, k, v in layers]
    density, error = (np.stack(c) for c in zip(*curves))
    return allocate(density, error, target_density=target_density, thresholds=thresholds)


def check_calibration(*, target_density, thresholds=THRESHOLDS,
                      **settings) -> tuple[float, tuple[float, ...], dict]:
    """`calibrate`'s arguments other than the layers, checked before any work:
    `(target_density, thresholds as floats, settings)`. Raises TypeError or ValueError
    naming the argument and the rule."""
    target_density = check_positive_float("target_density", target_density)
    if target_density > 1:
        raise ValueError(f"target_density must lie in (0, 1], got {target_density}")
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        raise TypeError(f"calibrate takes the settings {SETTINGS}, got unknown {unknown}")
    s = {**_DEFAULTS, **settings}
    stride = check_tokens("stride", s["stride"])
    check_tokens("block_size", s["block_size"], stride, "stride")
    check_norm(s["norm"])
    check_int("min_blocks", s["min_blocks"], 0)
    check_int("dense_last", s["dense_last"], 0)
    check_scale(s["scale"])
    check_choice("impl", s["impl"], impls.IMPLS)
    check_choice("estimate", s["estimate"], ESTIMATES)
    return target_density, _checked_thresholds(thresholds), settings


def _checked_thresholds(thresholds) -> tuple[float, ...]:
    rule = "thresholds must be a non-empty sequence of floats in (0, 1]"
    try:
        values = real_host_array("thresholds", thresholds)
    except TypeError:
        raise TypeError(f"{rule}, got {thresholds!r} ({type(thresholds).__name__})") from None
    if values.ndim != 1 or values.size == 0:
        raise ValueError(f"{rule}, got shape {values.shape}")
    check_shares("thresholds", values, thresholds)
    return tuple(values.tolist())


def _checked_layers(layers, settings: dict) -> list[tuple]:
    """The layers as a list of `(q, k, v)`, each checked as `head_curves` takes it."""
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Iterable):
        raise TypeError(f"layers must be an iterable of (q, k, v), one per layer, got "
                        f"{type(layers).__name__}")
    layers = list(layers)
    if not layers:
        raise ValueError("layers must hold at least one (q, k, v)")
    s = {**_DEFAULTS, **settings}
    for i, layer in enumerate(layers):
        if not isinstance(layer, (tuple, list)) or len(layer) != 3:
            what = f"a {type(layer).__name__} of {len(layer)}" \
                if isinstance(layer, (tuple, list)) else type(layer).__name__
            raise TypeError(f"layers[{i}] must be a (q, k, v) tuple of three arrays, got "
                            f"{what}")
        q, k, v = layer
        try:
            check_qk(q, k, stride=s["stride"], block_size=s["block_size"], causal=True)
            check_v(v, k, None)
        except (TypeError, ValueError) as error:
            raise type(error)(f"layers[{i}]: {error}") from None
        if q.shape[1] != layers[0][0].shape[1]:
            raise ValueError(f"layers[{i}]: q must have the query heads of layers[0]'s q "
                             f"({layers[0][0].shape[1]}): the table is [layers, Hq], got "
                             f"shape {q.shape}")
    return layers
