"""Shared fixtures: the implementations every test runs against, and seeded random inputs.

Implementations (the `impl` fixture and its kin): the names of `xattn_jax.impls`
available where the tests run: "reference" (plain JAX) everywhere; "triton" in Pallas
interpret mode on a CPU, compiled and marked `gpu` on a GPU; "mosaic" joins for the block
sums (`kernel_impl`), compiled on Hopper and in GPU interpret mode on a CPU.

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
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    # 4 CPU devices for tests/test_partitioning.py (other tests use the first device);
    # read when JAX starts its backends, so it must be set before any test touches JAX
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=4").strip()
ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import mosaic_interpret  # noqa: E402
from bench.cases import paged_pools  # noqa: E402
from xattn_jax import impls, reference  # noqa: E402
from xattn_jax.geometry import Geometry, next_pow2  # noqa: E402
from xattn_jax.mosaic.backend import MosaicBackend  # noqa: E402
from xattn_jax.triton.backend import TritonBackend  # noqa: E402
from xattn_jax.triton.block_sums import block_sums as triton_block_sums  # noqa: E402
from xattn_jax.triton.plan import (BLOCK_SUM_KERNELS, MIN_SIDE, Plan, Tiles,  # noqa: E402
                                   plan_block_sums, plan_strided_scores)
from xattn_jax.triton.strided_scores import strided_scores as triton_strided_scores  # noqa: E402

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

    def paged(self, page_size: int, *caches):
        """`bench.cases.paged_pools` with this generator, 3 spare pages holding NaN."""
        return paged_pools(self.rng, page_size, *caches, spare_pages=3, spare=jnp.nan)


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


# --- the slow cases ----------------------------------------------------------------------

# parameter values naming a kernel implementation, or its interpret mode, as the tests
# parametrize them: off a GPU those run in Pallas' interpret modes
INTERPRETED = ("triton", "mosaic", "interpret")


def pytest_collection_modifyitems(config, items):
    """Off a GPU, every case of a kernel implementation (a parameter naming one of
    INTERPRETED, as the `impl` fixtures and the tests' own parametrizations do) is marked
    slow: Pallas interpret mode takes seconds per call. The README's `pytest -q` leaves
    them out; `pytest -m slow` (and .ci/run) runs them."""
    if on_gpu():
        return
    for item in items:
        callspec = getattr(item, "callspec", None)
        values = callspec.params.values() if callspec else ()
        if any(isinstance(v, str) and v.split("/")[0] in INTERPRETED for v in values):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True, scope="module")
def _fresh_compilation_caches():
    """JAX's compiled functions dropped after each test module: one process runs the
    whole suite, and their memory would otherwise only grow."""
    yield
    jax.clear_caches()


# --- implementations -------------------------------------------------------------------

_ref_block_sums = jax.jit(reference.block_sums, static_argnums=(2,),
                          static_argnames=("causal", "norm"))
_ref_select = jax.jit(reference.select_blocks,
                      static_argnames=("causal", "keep_sink", "keep_recent"))
_ref_scores = jax.jit(reference.strided_scores, static_argnums=(2, 3))


def _tile_pair(tile) -> tuple[int, int]:
    return (tile, tile) if isinstance(tile, int) else tuple(tile)


def small_tiles(geom: Geometry, tile) -> Tiles:
    """A (block_q, block_k) or square tile, the head dim in two pipeline steps where that
    leaves 16 columns or more (so that tests reach the head-dim loop)."""
    rows, cols = _tile_pair(tile)
    depth = next_pow2(geom.head_dim) // 2
    return Tiles(block_q=rows, block_k=cols, block_d=depth if depth >= MIN_SIDE else None)


class Impl:
    """One implementation of the estimate's stages (`xattn_jax.impls`), returning numpy
    arrays, with small tiles so that tests on tiny shapes cross tile borders.

    name: "reference" or "triton" (Pallas interpret mode off a GPU), optionally with the
    block-sum kernel ("triton/one_pass", "triton/two_pass"; default: the plan's choice),
    or "mosaic" (the Mosaic GPU block sums with their default plan: on Hopper, or in
    Pallas' GPU interpret mode on a CPU; a case they do not take is skipped with the
    reason).
    """

    def __init__(self, name: str):
        self.name = name
        self.api, _, kernel = name.partition("/")
        self.kernel = kernel or None
        self.is_kernel = self.api != "reference"
        self.interpret = self.is_kernel and not on_gpu()
        if self.api == "mosaic":
            self.impl = MosaicBackend(companion=TritonBackend.for_device(None))
        else:
            self.impl = impls.resolve(self.api)

    def __repr__(self) -> str:
        return f"Impl({self.name})"

    def plan(self, geom: Geometry, dtype, *, causal: bool, tile=32, **overrides) -> Plan:
        """The block-sum plan this implementation runs for `geom` with `tile`."""
        return plan_block_sums(geom, dtype, causal, interpret=self.interpret,
                               tiles=small_tiles(geom, tile), kernel=self.kernel, **overrides)

    def block_sums(self, q, k, geom: Geometry, *, causal: bool, norm: float = 1.0,
                   tile=32) -> np.ndarray:
        if self.api == "mosaic":
            return self._mosaic_block_sums(q, k, geom, causal=causal, norm=norm)
        if not self.is_kernel:
            out = _ref_block_sums(q, k, geom, causal=causal, norm=norm)
        else:
            out = triton_block_sums(q, k, plan=self.plan(geom, q.dtype, causal=causal,
                                                         tile=tile),
                                    causal=causal, norm=norm)
        assert out.dtype == jnp.float32
        return np.asarray(out)

    def _mosaic_block_sums(self, q, k, geom: Geometry, *, causal: bool,
                           norm: float) -> np.ndarray:
        from xattn_jax import mosaic
        from xattn_jax.mosaic.estimate.plan import unsupported_reason

        reason = (mosaic_interpret.unsupported_reason() if self.interpret
                  else mosaic.available())
        reason = reason or unsupported_reason(geom, q.dtype, causal=causal)
        if reason is not None:
            pytest.skip(reason)
        if not self.interpret:
            out = self.impl.block_sums(q, k, geom=geom, causal=causal, norm=norm)
            return np.asarray(out)
        with mosaic_interpret.interpret_kernel() as races_found:
            out = np.asarray(self.impl.block_sums(q, k, geom=geom, causal=causal, norm=norm))
            assert not races_found(), "the Mosaic kernel raced in GPU interpret mode"
        assert out.dtype == np.float32
        return out

    def select(self, sums, threshold, *, causal: bool, keep_sink: bool = False,
               keep_recent: bool = False) -> np.ndarray:
        sums = jnp.asarray(sums, jnp.float32)
        t = jnp.broadcast_to(jnp.asarray(threshold, jnp.float32), (sums.shape[1],))
        out = self.impl.select_blocks(sums, t, causal=causal, keep_sink=keep_sink,
                                      keep_recent=keep_recent)
        assert out.dtype == jnp.bool_ and out.shape == sums.shape
        return np.asarray(out)

    def scores(self, q, k, geom: Geometry, *, norm: float = 1.0, tile: int = 16):
        if not self.is_kernel:
            out = _ref_scores(q, k, geom, norm)
        else:
            plan = plan_strided_scores(geom, q.dtype, interpret=self.interpret, tile=tile)
            out = triton_strided_scores(q, k, plan=plan, norm=norm)
        return np.asarray(out)


def _kernel_param(name: str):
    """A kernel implementation's parameter: compiled and marked `gpu` on a GPU, Pallas
    interpret mode elsewhere."""
    return pytest.param(name, marks=pytest.mark.gpu) if on_gpu() else name


# The implementations available where the tests run, each kernel variant on its own.
IMPL_PARAMS = ["reference", _kernel_param("triton")]
KERNEL_IMPL_PARAMS = [_kernel_param("triton")]
BLOCK_SUM_KERNEL_PARAMS = [_kernel_param(f"triton/{kernel}") for kernel in BLOCK_SUM_KERNELS]


@pytest.fixture(params=IMPL_PARAMS)
def impl(request) -> Impl:
    """Every implementation available here."""
    return Impl(request.param)


@pytest.fixture(params=KERNEL_IMPL_PARAMS)
def pallas_impl(request) -> Impl:
    """The kernel implementations only (tile-dependent properties)."""
    return Impl(request.param)


@pytest.fixture(params=["reference"] + BLOCK_SUM_KERNEL_PARAMS + [_kernel_param("mosaic")])
def kernel_impl(request) -> Impl:
    """The reference and each block-sum kernel: the Triton one-pass and two-pass kernels,
    and the Mosaic GPU block sums where they take the case."""
    return Impl(request.param)


@pytest.fixture(params=BLOCK_SUM_KERNEL_PARAMS)
def kernel_pallas_impl(request) -> Impl:
    """Each block-sum kernel."""
    return Impl(request.param)


@pytest.fixture
def reference_impl() -> Impl:
    return Impl("reference")


@pytest.fixture(params=["shardy", pytest.param("gspmd", marks=pytest.mark.slow)])
def partitioner(request):
    """Runs the test under one partitioner, restoring JAX's setting afterwards (GSPMD,
    JAX's earlier default, among the slow cases)."""
    before = jax.config.jax_use_shardy_partitioner
    jax.config.update("jax_use_shardy_partitioner", request.param == "shardy")
    yield request.param
    jax.config.update("jax_use_shardy_partitioner", before)

