"""Structured queries and keys whose exact attention looks like a long-context LLM head's.

`structured_qk` builds q and k, float32 `[1, heads, length, head_dim]` (Hq = Hkv), so that
the exact causal softmax of q.k / sqrt(head_dim) shows, in every head:

- attention sinks: the first `n_sinks` key tokens, attended by every query;
- a local window: each query attends to its recent tokens, decaying with distance;
- vertical stripes: a few short runs of key tokens anywhere, attended by every later query;
- diagonal stripes: in a few spans of queries, each query also attends to the tokens
  around a fixed distance `offset` back (as when a passage repeats an earlier one);
- noise: every pair has a random logit on top.

Construction. Each head's `head_dim` channels are split into four groups, and each group
adds one term to the logit q_i.k_j / sqrt(D) (i, j token positions, j <= i):

    logit(i, j) = sink_logit     * [j < n_sinks]                         (1 channel)
                + vertical_logit * w_j * [j in a vertical stripe]        (1 channel)
                + window_logit   * (p_i + [i in a span] * diagonal_weight * p_{i-offset}) . p_j
                                                           (position: (D - 2) // 2 channels)
                + n_i . m_j                                (noise: the other channels)

p_t is a stationary AR(1) sequence of random vectors with entries N(0, 1/channels) and
correlation exp(-|i - j| / window) between tokens, so p_i . p_j is about
exp(-|i - j| / window): the local window around j = i, and in a span the diagonal stripe
around j = i - offset. n_i and m_j are independent Gaussian vectors scaled so that n_i . m_j
has standard deviation `noise_std`; far apart, p_i . p_j adds noise of standard deviation
1 / sqrt(channels) too. The stripe weights w_j lie in [0.75, 1]. Each head scales the four
terms by its own factors in [1 - head_spread, 1 + head_spread]; q and k carry the square
root of each factor (and of D^(1/2)), so neither dominates the other in norm.

The features are several tokens wide on purpose: the estimate reads one antidiagonal of
every stride x stride tile, so a feature one token wide adds only 1/stride of its logit to
the estimate (vertical stripes here are 1 to `vertical_width` tokens wide).

Everything is drawn from `numpy.random.default_rng(seed)`: the same arguments give the same
arrays.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Structure:
    """The attention pattern's knobs; logits are in units of q.k / sqrt(head_dim)."""

    n_sinks: int = 4
    sink_logit: float = 10.0
    vertical_per_1k: float = 0.75     # vertical stripes per 1024 tokens (at least 2)
    vertical_width: int = 16          # stripe widths are drawn from 1..vertical_width tokens
    vertical_logit: float = 6.0
    window: float = 128.0             # correlation length of the position code, tokens
    window_logit: float = 8.0
    n_diagonals: int = 3              # query spans with a diagonal stripe
    diagonal_weight: float = 1.0      # its logit relative to the local window's
    noise_std: float = 1.0            # standard deviation of the noise logit
    head_spread: float = 0.1


class SyntheticQK(NamedTuple):
    """q, k: float32 `[1, H, L, D]`, and where the structure is (token positions)."""

    q: jnp.ndarray
    k: jnp.ndarray
    sinks: np.ndarray      # int `[n_sinks]`
    vertical: np.ndarray   # int `[n]`, sorted: the key tokens of all vertical stripes
    diagonals: np.ndarray  # int `[n_diagonals, 3]`, rows (start, stop, offset): query
                           # tokens start <= i < stop attend to tokens near i - offset


def _ar1(rng: np.random.Generator, heads: int, length: int, channels: int,
         corr_length: float) -> np.ndarray:
    """A stationary AR(1) sequence float64 `[heads, length, channels]`, entries N(0, 1/channels),
    correlation exp(-|i - j| / corr_length) between tokens i and j."""
    rho = np.exp(-1.0 / corr_length)
    eps = rng.standard_normal((length, heads, channels)) / np.sqrt(channels)
    eps[1:] *= np.sqrt(1.0 - rho**2)
    for t in range(1, length):
        eps[t] += rho * eps[t - 1]
    return eps.transpose(1, 0, 2)


def _diagonals(rng: np.random.Generator, length: int, count: int) -> np.ndarray:
    """Non-overlapping query spans int `[count, 3]` (start, stop, offset) in the last three
    quarters of the sequence, each half of its share, offset by at least length / 16
    tokens (well outside the local window)."""
    edges = np.linspace(length // 4, length, count + 1).astype(int)
    rows = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        span = (hi - lo) // 2
        start = int(rng.integers(lo, hi - span + 1))
        offset = int(rng.integers(max(1, length // 16), max(2, start + 1)))
        rows.append((start, start + span, offset))
    return np.array(rows, dtype=int).reshape(count, 3)


def _vertical(rng: np.random.Generator, length: int, s: Structure) -> np.ndarray:
    """Sorted unique int `[n]`: the tokens of a few runs of 1..vertical_width tokens."""
    count = max(2, round(s.vertical_per_1k * length / 1024))
    starts = rng.choice(length, size=min(count, length), replace=False)
    widths = rng.integers(1, s.vertical_width + 1, size=starts.size)
    tokens = np.concatenate([np.arange(a, a + w) for a, w in zip(starts, widths)])
    return np.unique(tokens[tokens < length])


def _channels(head_dim: int) -> tuple[int, int]:
    """(position, noise) channel counts; 2 more channels hold the sink and stripe terms."""
    if head_dim < 4:
        raise ValueError(f"head_dim must be at least 4 for the synthetic example, got {head_dim}")
    n_pos = (head_dim - 2) // 2
    return n_pos, head_dim - 2 - n_pos


def structured_qk(seed: int = 0, *, heads: int = 4, length: int = 8192, head_dim: int = 64,
                  structure: Structure = Structure()) -> SyntheticQK:
    """Builds the example described in the module docstring (deterministic in `seed`).

    Returns q, k float32 `[1, heads, length, head_dim]` and the structure's positions.
    """
    if heads < 1 or length < 1:
        raise ValueError(f"heads and length must be >= 1, got heads={heads}, length={length}")
    s = structure
    rng = np.random.default_rng(seed)
    n_pos, n_noise = _channels(head_dim)
    sinks = np.arange(min(s.n_sinks, length))
    vertical = _vertical(rng, length, s)
    diagonals = _diagonals(rng, length, s.n_diagonals)

    sink_k = np.zeros(length)
    sink_k[sinks] = 1.0
    stripe_k = np.zeros(length)
    stripe_k[vertical] = rng.uniform(0.75, 1.0, size=vertical.size)
    position = _ar1(rng, heads, length, n_pos, s.window)
    looking = position.copy()  # the query's position code: where it looks
    for start, stop, offset in diagonals:
        looking[:, start:stop] += s.diagonal_weight * position[:, start - offset:stop - offset]
    noise_scale = np.sqrt(s.noise_std) / n_noise**0.25  # q.k noise has std noise_std
    noise_q, noise_k = noise_scale * rng.standard_normal((2, heads, length, n_noise))

    spread = rng.uniform(1 - s.head_spread, 1 + s.head_spread, (heads, 4))
    gain = np.sqrt(np.array([s.sink_logit, s.vertical_logit, s.window_logit, 1.0]) * spread)
    ones = np.ones((heads, length, 1))
    q = _assemble([ones, ones, looking, noise_q], gain)
    k = _assemble([ones * sink_k[:, None], ones * stripe_k[:, None], position, noise_k], gain)
    return SyntheticQK(q, k, sinks, vertical, diagonals)


def _assemble(groups: list[np.ndarray], gain: np.ndarray) -> jnp.ndarray:
    """float32 `[1, H, L, D]` from the four channel groups float64 `[H, L, channels]`, each
    scaled by its gain `[H, 4]` and by D^(1/4): q.k / sqrt(D) is then the logit."""
    x = np.concatenate([g * gain[:, None, i:i + 1] for i, g in enumerate(groups)], axis=-1)
    return jnp.asarray(x[None] * x.shape[-1] ** 0.25, jnp.float32)
