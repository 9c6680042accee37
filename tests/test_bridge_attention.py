"""xattn_torch_bridge.block_sparse_attention and .xattention: the results of xattn_jax's,
for torch tensors, through the zero-copy hand-off.

The `gpu` tests need torch with CUDA and JAX's CUDA backend in one process
(`pytest -m gpu tests/test_bridge_attention.py`).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import xattn_jax  # noqa: E402

import xattn_torch_bridge as bridge  # noqa: E402
from bridge_inputs import jax_of, needs_cuda  # noqa: E402
from cases import GPU_GQA, GPU_SMALL, EstimateCase  # noqa: E402

SHAPE = EstimateCase("attention-gqa", 1, 4, 2, 40, 96, 16, 4, 16, True, v_head_dim=8)
BLOCK = SHAPE.block_size
LONGER = dataclasses.replace(SHAPE, q_len=64, k_len=128)  # the xattention tests'


def qkv_mask(rand, dtype=torch.float32, device="cpu", shape=SHAPE):
    """q, k, v of `shape` and a random bool block mask `[B, Hq, qb, kb]` at its block
    size."""
    normal = rand.rng.standard_normal
    q = torch.from_numpy(normal(shape.q_shape) * 1.5).to(dtype).to(device)
    k = torch.from_numpy(normal(shape.k_shape) * 1.5).to(dtype).to(device)
    v = torch.from_numpy(normal(shape.v_shape)).to(dtype).to(device)
    blocks = (shape.batch, shape.q_heads, -(-shape.q_len // shape.block_size),
              -(-shape.k_len // shape.block_size))
    mask = torch.from_numpy(rand.rng.random(blocks) < 0.5).clone().to(device)  # aligned
    return q, k, v, mask


def assert_same(bridged, plain, rand):
    for got, want in zip(bridged, plain):
        assert isinstance(got, torch.Tensor)
        values = got.cpu().float().numpy() if got.dtype == torch.bfloat16 else got.cpu().numpy()
        np.testing.assert_array_equal(values, np.asarray(want, values.dtype), err_msg=str(rand))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_block_sparse_attention_matches_xattn_jax(dtype, rand):
    q, k, v, mask = qkv_mask(rand, dtype)
    out, lse = bridge.block_sparse_attention(q, k, v, mask, block_size=BLOCK, return_lse=True)
    assert out.dtype == dtype and out.device.type == "cpu" and lse.dtype == torch.float32
    want = xattn_jax.block_sparse_attention(*(jax_of(t) for t in (q, k, v, mask)),
                                            block_size=BLOCK, return_lse=True)
    assert_same((out, lse), want, rand)
    alone = bridge.block_sparse_attention(q, k, v, mask, block_size=BLOCK)
    assert_same((alone,), want[:1], rand)


def test_paged_cache_with_tensor_k_len(rand):
    """A paged cache and block table as torch tensors, k_len a 0-d int32 tensor."""
    hkv, lk, d, dv = SHAPE.kv_heads, SHAPE.k_len, SHAPE.head_dim, SHAPE.v_head_dim
    q, k, v, mask = qkv_mask(rand)
    page = 8
    per_seq = lk // page
    order = torch.from_numpy(rand.rng.permutation(per_seq + 2)[:per_seq].reshape(1, -1))
    table = order.to(torch.int32)
    k_pool = torch.full((per_seq + 2, page, hkv, d), float("nan"))
    v_pool = torch.full((per_seq + 2, page, hkv, dv), float("nan"))
    k_pool[order[0]] = k[0].reshape(hkv, per_seq, page, d).permute(1, 2, 0, 3)
    v_pool[order[0]] = v[0].reshape(hkv, per_seq, page, dv).permute(1, 2, 0, 3)
    kwargs = dict(block_size=BLOCK, return_lse=True, causal=True)
    got = bridge.block_sparse_attention(q, k_pool, v_pool, mask, block_table=table,
                                        k_len=torch.tensor(70, dtype=torch.int32), **kwargs)
    want = xattn_jax.block_sparse_attention(*(jax_of(t) for t in (q, k, v, mask)),
                                            k_len=70, **kwargs)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.numpy(), np.asarray(w), rtol=1e-6, atol=1e-6,
                                   err_msg=str(rand))


def test_xattention_matches_xattn_jax(rand):
    q, k, v, _ = qkv_mask(rand, shape=LONGER)
    kwargs = dict(block_size=BLOCK, stride=LONGER.stride, return_mask=True)
    out, mask = bridge.xattention(q, k, v, threshold=torch.tensor([0.5, 0.7, 0.9, 0.95]),
                                  **kwargs)
    assert mask.dtype == torch.bool and out.device.type == "cpu"
    want = xattn_jax.xattention(*(jax_of(t) for t in (q, k, v)),
                                threshold=[0.5, 0.7, 0.9, 0.95], **kwargs)
    assert_same((out, mask), want, rand)


def test_xattention_on_sampled_rows_matches_xattn_jax(rand):
    q, k, v, _ = qkv_mask(rand, shape=LONGER)
    kwargs = dict(block_size=BLOCK, threshold=0.8, return_mask=True, estimate="sampled-rows")
    want = xattn_jax.xattention(*(jax_of(t) for t in (q, k, v)), **kwargs)
    assert_same(bridge.xattention(q, k, v, **kwargs), want, rand)


def test_repeated_xattention_calls_skip_the_checks(rand, monkeypatch):
    """xattn_jax.xattention (and its checks) runs once, when the bridge's compiled call is
    traced; later calls, with another float threshold too, reuse that call. A value equal
    to an earlier one but of another type is still refused."""
    traced = []

    def counted(*args, **kwargs):
        traced.append(kwargs["threshold"])
        return xattn_jax_xattention(*args, **kwargs)

    xattn_jax_xattention = xattn_jax.xattention
    monkeypatch.setattr(xattn_jax, "xattention", counted)
    shape = dataclasses.replace(LONGER, q_len=80, k_len=112)  # traced by this test only
    q, k, v, _ = qkv_mask(rand, shape=shape)
    kwargs = dict(block_size=BLOCK, stride=shape.stride, return_mask=True)
    for threshold in (0.5, 0.5, 0.8):
        got = bridge.xattention(q, k, v, threshold=threshold, **kwargs)
        assert_same(got, xattn_jax_xattention(*(jax_of(t) for t in (q, k, v)),
                                              threshold=threshold, **kwargs), rand)
    assert len(traced) == 1
    with pytest.raises((TypeError, ValueError), match="block_size"):
        bridge.xattention(q, k, v, **dict(kwargs, block_size=float(BLOCK)))
    with pytest.raises((TypeError, ValueError), match="norm must"):  # unhashable
        bridge.xattention(q, k, v, **dict(kwargs, norm=[1.0]))


def test_forward_only(rand):
    """Inputs that require grad are refused while grad mode is on (the output could carry
    no graph), naming the input; under no_grad or inference_mode they are read as they
    are."""
    q, k, v, mask = qkv_mask(rand)
    want = bridge.block_sparse_attention(q, k, v, mask, block_size=BLOCK)
    q.requires_grad_()
    with pytest.raises(ValueError, match=r"q requires grad, but this call is forward only.*"
                                         r"torch\.no_grad\(\) or torch\.inference_mode\(\)"):
        bridge.block_sparse_attention(q, k, v, mask, block_size=BLOCK)
    with pytest.raises(ValueError, match="v requires grad.*forward only"):
        bridge.xattention(q.detach(), k, v.detach().requires_grad_(), block_size=BLOCK,
                          causal=False)
    with pytest.raises(ValueError, match="q requires grad.*forward only"):
        bridge.xattention(q, k, v, block_size=BLOCK, causal=False)
    with torch.no_grad():
        got = bridge.block_sparse_attention(q, k, v, mask, block_size=BLOCK)
    with torch.inference_mode():
        out = bridge.xattention(q, k, v, block_size=BLOCK, causal=False)
    assert not got.requires_grad and not out.requires_grad
    assert out.shape == (*q.shape[:3], v.shape[-1])
    assert_same((got,), (want,), rand)


def test_non_contiguous_needs_copy(rand):
    q, k, v, mask = qkv_mask(rand)
    v_t = v.transpose(2, 3).contiguous().transpose(2, 3)  # same values, other strides
    with pytest.raises(ValueError, match="v is not contiguous"):
        bridge.block_sparse_attention(q, k, v_t, mask, block_size=BLOCK)
    with pytest.raises(ValueError, match="v is not contiguous"):
        bridge.xattention(q, k, v_t, block_size=BLOCK, stride=SHAPE.stride, causal=False)
    got = bridge.block_sparse_attention(q, k, v_t, mask, block_size=BLOCK, copy=True)
    assert_same((got,), (bridge.block_sparse_attention(q, k, v, mask, block_size=BLOCK),),
                rand)


def test_argument_errors_name_the_argument(rand):
    q, k, v, mask = qkv_mask(rand)
    with pytest.raises(ValueError, match="^mask must have dtype bool, got torch.float32$"):
        bridge.block_sparse_attention(q, k, v, mask.float(), block_size=BLOCK)
    with pytest.raises(TypeError, match="mask must be a torch.Tensor"):
        bridge.block_sparse_attention(q, k, v, mask.numpy(), block_size=BLOCK)
    with pytest.raises(ValueError, match="k_len must lie in"):
        bridge.block_sparse_attention(q, k, v, mask, block_size=BLOCK, k_len=10)


def test_cpu_tensors_where_jax_defaults_to_a_gpu(rand, monkeypatch):
    """CPU tensors where JAX's default backend is a GPU (simulated off a GPU) run on JAX's
    CPU device with the references; "mosaic" is refused."""
    if jax.default_backend() == "cpu":
        monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    q, k, v, _ = qkv_mask(rand, shape=LONGER)
    kwargs = dict(block_size=BLOCK, stride=LONGER.stride, return_mask=True)
    out, mask = bridge.xattention(q, k, v, **kwargs)
    want = xattn_jax.xattention(*(jax_of(t) for t in (q, k, v)), impl="reference", **kwargs)
    assert_same((out, mask), want, rand)
    with pytest.raises(ValueError, match="impl='mosaic' needs an NVIDIA Hopper GPU"):
        bridge.block_sparse_attention(q, k, v, mask, block_size=BLOCK, impl="mosaic")


@pytest.mark.gpu
@needs_cuda
class TestCuda:
    def test_xattention_on_gpu(self, rand):
        q, k, v, _ = qkv_mask(rand, torch.bfloat16, "cuda", shape=GPU_GQA)
        kwargs = dict(block_size=GPU_GQA.block_size, stride=GPU_GQA.stride,
                      causal=GPU_GQA.causal, return_mask=True)
        out, mask = bridge.xattention(q, k, v, **kwargs)
        assert out.device == q.device and mask.device == q.device
        assert_same((out, mask), xattn_jax.xattention(*(jax_of(t) for t in (q, k, v)),
                                                      **kwargs), rand)

    def test_values_written_on_a_side_stream(self, rand):
        """v written on a side stream after a long sleep: the attention sees it (q's view
        carries the stream order for all)."""
        shape = dataclasses.replace(GPU_SMALL, block_size=BLOCK)
        q, k, v_src, mask = qkv_mask(rand, torch.bfloat16, "cuda", shape=shape)
        expected = bridge.block_sparse_attention(q, k, v_src, mask, block_size=BLOCK).clone()
        v = torch.zeros_like(v_src)
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            torch.cuda._sleep(1 << 29)
            v.copy_(v_src)
            out = bridge.block_sparse_attention(q, k, v, mask, block_size=BLOCK).clone()
        side.synchronize()
        assert torch.equal(out, expected)
