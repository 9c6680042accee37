"""The implementation table (`xattn_jax.impls`): names, where each runs, and the refusal
of an implementation that cannot run where the inputs live."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import xattn_jax
from xattn_jax import impls, mosaic

ON_GPU = jax.default_backend() == "gpu"


def _qk():
    q = jnp.asarray(np.random.default_rng(0).standard_normal((1, 2, 64, 16)), jnp.float32)
    return q, q[:, :1]


def test_names():
    assert impls.IMPLS == ("auto", "reference", "triton", "mosaic")
    with pytest.raises(ValueError, match=r"impl must be one of .*got 'pallas'"):
        impls.resolve("pallas")


def test_auto_follows_the_device_the_inputs_live_on():
    """CPU-resident inputs get the reference even where JAX's default backend is a GPU;
    GPU-resident ones get the compiled Triton kernels."""
    q, _ = _qk()
    on_cpu = jax.device_put(q, jax.devices("cpu")[0])
    assert impls.resolve("auto", on_cpu) == impls.Implementation("reference")
    assert impls.resolve("triton", on_cpu) == impls.Implementation("triton", interpret=True)
    assert impls.resolve("reference", q) == impls.Implementation("reference")
    if ON_GPU:
        on_gpu = jax.device_put(q, jax.devices("gpu")[0])
        assert impls.resolve("auto", on_gpu) == impls.Implementation("triton")


def test_inside_a_trace_the_default_backend_decides():
    seen = []

    @jax.jit
    def f(q):
        seen.append(impls.resolve("auto", q))
        return q

    f(_qk()[0])
    assert seen == [impls.Implementation("triton" if ON_GPU else "reference")]


@pytest.mark.skipif(mosaic.available() is None, reason="Mosaic GPU runs here")
def test_mosaic_where_it_cannot_run_says_what_it_needs():
    q, k = _qk()
    scores = jnp.ones((1, 2, 4), jnp.float32)
    calls = [lambda: xattn_jax.xattn_estimate(q, k, block_size=16, impl="mosaic"),
             lambda: xattn_jax.strided_scores(q, k, impl="mosaic"),
             lambda: xattn_jax.select_blocks(jnp.ones((1, 2, 4, 4)), impl="mosaic"),
             lambda: xattn_jax.kv_block_scores(q, k, kv_block_size=32, estimate_block_size=16,
                                               impl="mosaic"),
             lambda: xattn_jax.select_kv_blocks(scores, impl="mosaic")]
    for call in calls:
        with pytest.raises(ValueError, match=r"impl='mosaic' needs an NVIDIA Hopper GPU"):
            call()


@pytest.mark.gpu
def test_mosaic_on_hopper_has_no_estimate_kernels_yet():
    if mosaic.available() is not None:
        pytest.skip(mosaic.available())
    q, k = _qk()
    with pytest.raises(ValueError, match="no kernels for the estimate"):
        xattn_jax.xattn_estimate(q, k, block_size=16, impl="mosaic")
