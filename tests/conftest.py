"""Shared fixtures: the implementations every test runs against, and seeded random inputs.

Implementations (the `impl` fixture):
- "reference": `xattn_jax.reference` (jitted), public API with impl="reference";
- "interpret": the Pallas kernels with interpret=True (CPU), public API with impl="pallas"
  (which runs interpret mode by itself off a GPU);
- "gpu": the Pallas kernels compiled through Triton, public API with impl="pallas";
  marked `gpu` and skipped unless `jax.default_backend() == "gpu"`.

Randomness: every test that draws data takes the `rand` fixture, seeded from a fresh
`np.random.default_rng()` (or from the environment variable XATTN_TEST_SEED). The seed is
in every assertion message built with `str(rand)` and in the report of a failed test.
"""

from __future__ import annotations

import math
import os
import pathlib
import sys

import numpy as np
import pytest

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU
ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from xattn_jax import reference  # noqa: E402
from xattn_jax.geometry import Geometry  # noqa: E402

SEED_ENV = "XATTN_TEST_SEED"


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


# --- random inputs ---------------------------------------------------------------------

class Rand:
    """A numpy Generator with its seed, for reproducible failures."""

    def __init__(self, seed: int):
        self.seed = seed
        self.rng = np.random.default_rng(seed)

    def __str__(self) -> str:
        return f"seed={self.seed} (rerun with {SEED_ENV}={self.seed})"

    def normal(self, shape, dtype=jnp.float32, scale: float = 1.0) -> jax.Array:
        return jnp.asarray(self.rng.standard_normal(shape) * scale, jnp.float32).astype(dtype)

    def qk(self, batch, q_heads, kv_heads, q_len, k_len, head_dim, *, stride,
           dtype=jnp.float32):
        """q `[B, Hq, Lq, D]`, k `[B, Hkv, Lk, D]` scaled so the scores A have a standard
        deviation near 2 (peaked but not degenerate softmax rows)."""
        scale = (2.0 * math.sqrt(stride)) ** 0.5
        q = self.normal((batch, q_heads, q_len, head_dim), dtype, scale)
        k = self.normal((batch, kv_heads, k_len, head_dim), dtype, scale)
        return q, k

    def block_sums(self, shape, *, zeros: float = 0.0) -> jax.Array:
        """Random non-negative block sums with a heavy tail (and some exact zeros)."""
        x = np.exp(self.rng.standard_normal(shape) * 1.5)
        if zeros:
            x = np.where(self.rng.random(shape) < zeros, 0.0, x)
        return jnp.asarray(x, jnp.float32)

    def thresholds(self, heads: int, low: float = 0.3, high: float = 0.98) -> jax.Array:
        return jnp.asarray(self.rng.uniform(low, high, heads), jnp.float32)



def new_seed() -> int:
    env = os.environ.get(SEED_ENV)
    if env:
        return int(env)
    return int(np.random.default_rng().integers(0, 2**63 - 1))


@pytest.fixture
def rand(request) -> Rand:
    seed = new_seed()
    request.node.user_properties.append(("seed", seed))
    return Rand(seed)


@pytest.fixture
def rand_factory():
    """`Rand` itself, for seeds drawn elsewhere (hypothesis)."""
    return Rand


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        seeds = [v for key, v in item.user_properties if key == "seed"]
        if seeds:
            report.sections.append(
                ("random seed", f"seed={seeds[-1]}; reproduce with {SEED_ENV}={seeds[-1]}"))


# --- implementations -------------------------------------------------------------------

_ref_block_sums = jax.jit(reference.block_sums, static_argnums=(2,),
                          static_argnames=("causal", "norm"))
_ref_select = jax.jit(reference.select_blocks,
                      static_argnames=("causal", "keep_sink", "keep_recent"))
_ref_scores = jax.jit(reference.strided_scores, static_argnums=(2, 3))


def _tile_pair(tile) -> tuple[int, int]:
    return (tile, tile) if isinstance(tile, int) else tuple(tile)


def pallas_block_sums(q, k, geom: Geometry, *, causal: bool, norm: float, tile,
                      interpret: bool, passes: int | None = None) -> jax.Array:
    """Calls the Pallas block-sum kernel with a (rows, cols) or square tile, the head dim
    in two pipeline steps where that leaves 16 columns or more; `passes` picks the one- or
    two-pass kernel (None: the default choice)."""
    from xattn_jax.geometry import next_pow2
    from xattn_jax.triton.block_sums import block_sums
    from xattn_jax.triton.tiling import Tiling

    rows, cols = _tile_pair(tile)
    depth = next_pow2(geom.head_dim) // 2
    return block_sums(q, k, geom=geom, causal=causal, norm=norm,
                      tiling=Tiling(rows=rows, cols=cols, depth=depth if depth >= 16 else None),
                      passes=passes, interpret=interpret)


class Impl:
    """One implementation of the estimate's stages, returning numpy arrays.

    name: "reference", "interpret" or "gpu", optionally with the block-sum kernel's pass
    count ("interpret/1", "gpu/2").
    """

    def __init__(self, name: str):
        self.name = name
        backend, _, passes = name.partition("/")
        self.passes = int(passes) if passes else None
        self.pallas = backend != "reference"
        self.interpret = backend == "interpret"
        self.api = "reference" if backend == "reference" else "pallas"

    def __repr__(self) -> str:
        return f"Impl({self.name})"

    def block_sums(self, q, k, geom: Geometry, *, causal: bool, norm: float = 1.0,
                   tile=32) -> np.ndarray:
        if not self.pallas:
            out = _ref_block_sums(q, k, geom, causal=causal, norm=norm)
        else:
            out = pallas_block_sums(q, k, geom, causal=causal, norm=norm, tile=tile,
                                    interpret=self.interpret, passes=self.passes)
        assert out.dtype == jnp.float32
        return np.asarray(out)

    def select(self, sums, threshold, *, causal: bool, keep_sink: bool = False,
               keep_recent: bool = False) -> np.ndarray:
        sums = jnp.asarray(sums, jnp.float32)
        t = jnp.broadcast_to(jnp.asarray(threshold, jnp.float32), (sums.shape[1],))
        if not self.pallas:
            out = _ref_select(sums, t, causal=causal, keep_sink=keep_sink,
                              keep_recent=keep_recent)
        else:
            from xattn_jax.triton import select_blocks as mod
            out = mod.select_blocks(sums, t, causal=causal, keep_sink=keep_sink,
                                    keep_recent=keep_recent, interpret=self.interpret)
        assert out.dtype == jnp.bool_ and out.shape == sums.shape
        return np.asarray(out)

    def scores(self, q, k, geom: Geometry, *, norm: float = 1.0, tile: int = 16):
        if not self.pallas:
            out = _ref_scores(q, k, geom, norm)
        else:
            from xattn_jax.triton import strided_scores as mod
            out = mod.strided_scores(q, k, geom=geom, norm=norm, tile=tile,
                                     interpret=self.interpret)
        return np.asarray(out)


IMPL_PARAMS = ["reference", "interpret", pytest.param("gpu", marks=pytest.mark.gpu)]
PALLAS_PARAMS = ["interpret", pytest.param("gpu", marks=pytest.mark.gpu)]
# the block-sum kernels, each pass count on its own
KERNEL_PARAMS = ["interpret/1", "interpret/2", pytest.param("gpu/1", marks=pytest.mark.gpu),
                 pytest.param("gpu/2", marks=pytest.mark.gpu)]


def _make_impl(name: str) -> Impl:
    if name.startswith("gpu") and not on_gpu():
        pytest.skip("needs a GPU (jax.default_backend() != 'gpu')")
    return Impl(name)


@pytest.fixture(params=IMPL_PARAMS)
def impl(request) -> Impl:
    """Every implementation: reference, Pallas interpret, Pallas on GPU."""
    return _make_impl(request.param)


@pytest.fixture(params=PALLAS_PARAMS)
def pallas_impl(request) -> Impl:
    """The Pallas implementations only (tile-dependent properties)."""
    return _make_impl(request.param)


@pytest.fixture(params=["reference"] + KERNEL_PARAMS)
def kernel_impl(request) -> Impl:
    """The reference and both block-sum kernels (one pass, two passes) on each backend."""
    return _make_impl(request.param)


@pytest.fixture(params=KERNEL_PARAMS)
def kernel_pallas_impl(request) -> Impl:
    """Both block-sum kernels on each Pallas backend."""
    return _make_impl(request.param)


@pytest.fixture
def reference_impl() -> Impl:
    return Impl("reference")

