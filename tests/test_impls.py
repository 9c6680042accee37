"""The backends by name (`xattn_jax.impls`): names, where each runs, and the refusal of a
backend that cannot run where the inputs live."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import np_reference as npr
import xattn_jax
from xattn_jax import impls, mosaic
from xattn_jax.mosaic.backend import MosaicBackend, block_sums_plan
from xattn_jax.reference.backend import ReferenceBackend
from xattn_jax.triton.backend import TritonBackend

ON_GPU = jax.default_backend() == "gpu"


def _qk():
    q = jnp.asarray(np.random.default_rng(0).standard_normal((1, 2, 64, 16)), jnp.float32)
    return q, q[:, :1]


def test_names():
    assert impls.IMPLS == ("auto", "reference", "triton", "mosaic")
    with pytest.raises(ValueError, match=r"impl must be one of .*got 'pallas'"):
        impls.resolve("pallas")


def _gpu_auto():
    """What "auto" resolves to for the estimate on this machine's first GPU."""
    if mosaic.available(jax.devices("gpu")[0]) is None:
        return MosaicBackend(companion=TritonBackend(), fallback=True)
    return TritonBackend()


def test_auto_follows_the_device_the_inputs_live_on():
    """CPU-resident inputs get the reference even where JAX's default backend is a GPU;
    GPU-resident ones get the compiled kernels: Mosaic GPU's on Hopper (with the Triton
    kernels for the calls they do not take), Triton's elsewhere."""
    q, _ = _qk()
    on_cpu = jax.device_put(q, jax.devices("cpu")[0])
    assert impls.resolve("auto", on_cpu) == ReferenceBackend()
    assert impls.resolve("triton", on_cpu) == TritonBackend(interpret=True)
    assert impls.resolve("reference", q) == ReferenceBackend()
    if ON_GPU:
        on_gpu = jax.device_put(q, jax.devices("gpu")[0])
        assert impls.resolve("auto", on_gpu) == _gpu_auto()


def test_inside_a_trace_the_default_backend_decides():
    seen = []

    @jax.jit
    def f(q):
        seen.append(impls.resolve("auto", q))
        return q

    f(_qk()[0])
    assert seen == [_gpu_auto() if ON_GPU else ReferenceBackend()]


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
def test_mosaic_estimate_on_hopper():
    """impl="mosaic": the Mosaic block sums (the Triton kernels for the other ops) give
    the Triton kernel's block sums and mask; a call they do not take is a ValueError that
    says what they need."""
    if mosaic.available() is not None:
        pytest.skip(mosaic.available())
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((1, 4, 1024, 128)) * 2, jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((1, 2, 1024, 128)) * 2, jnp.bfloat16)
    got = xattn_jax.xattn_estimate(q, k, block_size=128, impl="mosaic")
    want = xattn_jax.xattn_estimate(q, k, block_size=128, impl="triton")
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=5e-5,
                               atol=5e-5 * float(want[0].max()))
    near_ties = npr.ambiguous_rows(np.asarray(want[0]), 0.9, near_ties=True, causal=True)
    differ = np.any(np.asarray(got[1]) != np.asarray(want[1]), axis=-1)
    assert not (differ & ~near_ties).any(), np.argwhere(differ & ~near_ties)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        xattn_jax.xattn_estimate(q.astype(jnp.float32), k.astype(jnp.float32),
                                 block_size=128, impl="mosaic")
    with pytest.raises(ValueError, match="multiple of 8 x stride"):
        xattn_jax.xattn_estimate(q, k, block_size=32, impl="mosaic")
    # the chunk scores: keys in use ending inside a stride group
    got, want = (xattn_jax.kv_block_scores(q, k, kv_block_size=512, estimate_block_size=128,
                                           k_len=1001, impl=impl) for impl in ("mosaic",
                                                                                "triton"))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=5e-5,
                               atol=5e-5 * float(want.max()))


@pytest.mark.parametrize("fallback", [True, False])
def test_calls_the_mosaic_block_sums_do_not_take(fallback):
    """The Mosaic implementation "auto" resolves to on Hopper (`fallback`) runs the Triton
    kernel for a call its block sums do not take (float32 inputs and a key count here;
    the Triton kernel in interpret mode off a GPU) and gives the reference's block sums;
    "mosaic" asked for by name refuses it, naming the rule. No Mosaic GPU code runs."""
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.standard_normal((1, 2, 64, 16)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((1, 1, 256, 16)), jnp.float32)
    geom = xattn_jax.checks.check_qk(q, k, stride=8, block_size=64, causal=False)
    key_len = jnp.int32(200)
    impl = MosaicBackend(companion=TritonBackend(interpret=not ON_GPU), fallback=fallback)

    def block_sums():
        return impl.block_sums(q, k, geom=geom, causal=False, norm=1.0, key_len=key_len)

    if not fallback:
        with pytest.raises(ValueError, match="bfloat16 or float16"):
            block_sums()
        return
    want = xattn_jax.reference.block_sums(q, k, geom, causal=False, norm=1.0,
                                          key_len=key_len)
    np.testing.assert_allclose(np.asarray(block_sums()), np.asarray(want), rtol=2e-5,
                               atol=2e-5 * float(want.max()))


@pytest.mark.parametrize("fallback", [True, False])
def test_attention_calls_the_mosaic_kernel_does_not_take(fallback):
    """The Mosaic backend "auto" resolves to on Hopper (`fallback`) runs an attention call
    its kernel does not take (float32 here) on the reference; "mosaic" asked for by name
    refuses it, naming the rule. No Mosaic GPU code runs."""
    rng = np.random.default_rng(4)
    q = jnp.asarray(rng.standard_normal((1, 2, 128, 64)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((1, 1, 256, 64)), jnp.float32)
    mask = jnp.asarray(rng.random((1, 2, 1, 2)) < 0.7)
    impl = MosaicBackend(companion=TritonBackend(interpret=not ON_GPU), fallback=fallback)
    options = dict(block_size=128, causal=True, scale=None, return_lse=False)
    if not fallback:
        with pytest.raises(ValueError, match="bfloat16 or float16.*'reference' or 'auto'"):
            impl.block_sparse_attention(q, k, k, mask, **options)
        return
    want = ReferenceBackend().block_sparse_attention(q, k, k, mask, **options)
    np.testing.assert_array_equal(np.asarray(impl.block_sparse_attention(q, k, k, mask,
                                                                         **options)),
                                  np.asarray(want))


def test_auto_gives_calls_of_few_ctas_to_the_triton_kernel():
    """A call the Mosaic block sums take, but in fewer CTAs than `auto_min_ctas` (one row
    tile of 128 reshaped rows x 2 heads here): "auto"'s Mosaic implementation runs the
    Triton kernel (interpret mode off a GPU), which gives the reference's block sums. No
    Mosaic GPU code runs."""
    from xattn_jax.mosaic.estimate import heuristics, plan as estimate_plan

    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.standard_normal((1, 2, 256, 128)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((1, 1, 256, 128)), jnp.bfloat16)
    geom = xattn_jax.checks.check_qk(q, k, stride=8, block_size=64, causal=True)
    assert estimate_plan.unsupported_reason(geom, jnp.bfloat16, causal=True) is None
    plan = estimate_plan.estimate_plan(geom, jnp.bfloat16, causal=True)
    assert plan.ctas == 2 < heuristics.auto_min_ctas(plan.sms)
    impl = MosaicBackend(companion=TritonBackend(interpret=not ON_GPU), fallback=True)
    got = impl.block_sums(q, k, geom=geom, causal=True, norm=1.0)
    want = xattn_jax.reference.block_sums(q, k, geom, causal=True, norm=1.0)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=5e-5,
                               atol=5e-5 * float(want.max()))
    # a chunk of 4096 queries on 32 heads fills a GPU's SMs; on 16 heads (two GPUs), its
    # 64 row tiles do in 2 key groups
    for heads, groups in ((32, 1), (16, 2)):
        chunk = xattn_jax.geometry.Geometry(1, heads, heads // 4, 4096, 131072, 128, 8, 1024)
        plan, reason = block_sums_plan(chunk, jnp.bfloat16, False, True, None, None,
                                       auto=True)
        assert reason is None and (plan.key_groups, plan.ctas) == (groups, 128)
    assert 64 < heuristics.auto_min_ctas(plan.sms) <= 128
