"""The public functions are forward only (`xattn_jax.forward_only`): a derivative through
them raises a TypeError naming the function; a forward call, jitted, vmapped or sharded,
and a call whose inputs carry no tangent give what the plain call gives."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import xattn_jax

BLOCK = 32
RNG = np.random.default_rng(7)
Q = jnp.asarray(RNG.standard_normal((1, 4, 128, 16)), jnp.float32)
K = jnp.asarray(RNG.standard_normal((1, 2, 128, 16)), jnp.float32)
V = jnp.asarray(RNG.standard_normal((1, 2, 128, 16)), jnp.float32)
MASK = jnp.asarray(RNG.random((1, 4, 4, 4)) < 0.6)

# name -> a function of q alone, float32 output
CALLS = {
    "xattention": lambda q: xattn_jax.xattention(q, K, V, block_size=BLOCK),
    "block_sparse_attention": lambda q: xattn_jax.block_sparse_attention(
        q, K, V, MASK, block_size=BLOCK),
    "xattn_estimate": lambda q: xattn_jax.xattn_estimate(q, K, block_size=BLOCK)[0],
    "strided_scores": lambda q: xattn_jax.strided_scores(q, K),
    "select_blocks": lambda q: xattn_jax.select_blocks(q[:, :, :4, :4]).astype(jnp.float32),
    "kv_block_scores": lambda q: xattn_jax.kv_block_scores(
        q[:, :, :64], K, kv_block_size=64, estimate_block_size=BLOCK),
}
DERIVATIVES = {
    "grad": lambda f: jax.grad(lambda q: f(q).sum())(Q),
    "jit-grad": lambda f: jax.jit(jax.grad(lambda q: f(q).sum()))(Q),
    "jvp": lambda f: jax.jvp(f, (Q,), (Q,)),
    "vjp": lambda f: jax.vjp(f, Q),
    "linearize": lambda f: jax.linearize(f, Q),
}


@pytest.mark.parametrize("derivative", DERIVATIVES)
@pytest.mark.parametrize("name", CALLS)
def test_a_derivative_says_forward_only(name, derivative):
    with pytest.raises(TypeError, match=rf"^{name} is forward only: it has no derivative"):
        DERIVATIVES[derivative](CALLS[name])


@pytest.mark.parametrize("name", CALLS)
def test_forward_calls_are_unchanged(name):
    """jit, vmap and inputs without tangent (stop_gradient) run the forward call."""
    f = CALLS[name]
    want = np.asarray(f(Q))
    # jit may fuse the float32 sums in another order: equal to rounding, not bit for bit
    np.testing.assert_allclose(np.asarray(jax.jit(f)(Q)), want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(jax.vmap(f)(Q[None]))[0], want, rtol=1e-6, atol=1e-6)
    grad = jax.grad(lambda q: f(jax.lax.stop_gradient(q)).sum() + q.sum())(Q)
    np.testing.assert_array_equal(np.asarray(grad), np.ones(Q.shape, np.float32))


def test_sharded_calls_run_and_refuse_derivatives():
    """Heads sharded over 2 devices (the CPU devices tests/conftest.py makes)."""
    mesh = Mesh(np.array(jax.devices()[:2]), ("h",))
    q, k, v = (jax.device_put(x, NamedSharding(mesh, PartitionSpec(None, "h")))
               for x in (Q, K, V))

    def f(q, k, v):
        return xattn_jax.xattention(q, k, v, block_size=BLOCK)

    np.testing.assert_allclose(np.asarray(jax.jit(f)(q, k, v)), np.asarray(f(Q, K, V)),
                               rtol=1e-6, atol=1e-6)
    with pytest.raises(TypeError, match="xattention is forward only"):
        jax.jit(jax.grad(lambda q: f(q, k, v).sum()))(q)
