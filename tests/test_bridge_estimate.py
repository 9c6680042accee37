"""xattn_torch_bridge.xattn_estimate: the same results as xattn_jax.xattn_estimate, for
torch tensors, compiled once per shape.

The `gpu` tests need torch with CUDA and JAX's CUDA backend in one process
(`pytest -m gpu tests/test_bridge_estimate.py`).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import xattn_jax  # noqa: E402
import xattn_torch_bridge as bridge  # noqa: E402
from bridge_inputs import jax_of, needs_cuda, qk  # noqa: E402
from cases import BRIDGE, GPU_GQA, GPU_SMALL, EstimateCase  # noqa: E402
from xattn_jax.reference.backend import ReferenceBackend  # noqa: E402
from xattn_torch_bridge import estimate  # noqa: E402

GQA = BRIDGE["causal-gqa"]
COMPILE_ONCE = EstimateCase("compile-once", 1, 2, 1, 64, 128, 16, 8, 32, True)


def assert_same(bridged, plain, rand):
    (sums, mask), (sums_j, mask_j) = bridged, plain
    assert isinstance(sums, torch.Tensor) and sums.dtype == torch.float32
    assert isinstance(mask, torch.Tensor) and mask.dtype == torch.bool
    np.testing.assert_array_equal(sums.cpu().numpy(), np.asarray(sums_j), err_msg=str(rand))
    np.testing.assert_array_equal(mask.cpu().numpy(), np.asarray(mask_j), err_msg=str(rand))


@pytest.mark.parametrize("case", BRIDGE.values(), ids=lambda case: case.id)
def test_matches_xattn_jax_reference(case, rand):
    kwargs = dict(case.options, threshold=case.threshold)
    q, k = qk(rand, case)
    bridged = bridge.xattn_estimate(q, k, impl="reference", **kwargs)
    assert bridged[0].device.type == "cpu"
    assert_same(bridged, xattn_jax.xattn_estimate(jax_of(q), jax_of(k), impl="reference",
                                                  **kwargs), rand)


def test_matches_xattn_jax_triton_bf16(rand):
    """The Triton-backend kernels (interpret mode on CPU tensors) through the bridge,
    bfloat16 inputs."""
    kwargs = GQA.options
    q, k = qk(rand, GQA, torch.bfloat16)
    assert_same(bridge.xattn_estimate(q, k, impl="triton", threshold=0.7, **kwargs),
                xattn_jax.xattn_estimate(jax_of(q), jax_of(k), impl="triton", threshold=0.7,
                                         **kwargs), rand)


def test_compiled_once_per_shape(rand):
    kwargs = dict(COMPILE_ONCE.options, impl="reference")
    q, k = qk(rand, COMPILE_ONCE)
    # the bridge's jit, for the implementation it resolves for CPU tensors
    compiled = estimate.compiled_estimate(dict(kwargs, impl=ReferenceBackend()))
    before = compiled._cache_size()
    first = bridge.xattn_estimate(q, k, **kwargs)
    assert compiled._cache_size() == before + 1
    for threshold in (0.5, 0.95, [0.6, 0.9]):  # thresholds are data: no recompilation
        q, k = qk(rand, COMPILE_ONCE)
        bridge.xattn_estimate(q, k, threshold=threshold, **kwargs)
    assert compiled._cache_size() == before + 1
    assert first[0].shape == (1, 2, 2, 4)


def test_threshold_tensor_equals_list(rand):
    kwargs = GQA.options
    q, k = qk(rand, GQA)
    per_head = [0.5, 0.9, 0.7, 0.99]
    a = bridge.xattn_estimate(q, k, threshold=torch.tensor(per_head), impl="reference", **kwargs)
    b = bridge.xattn_estimate(q, k, threshold=per_head, impl="reference", **kwargs)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_forward_only(rand):
    """An input that requires grad is refused while grad mode is on, naming it; under
    no_grad it is read as it is."""
    kwargs = GQA.options
    q, k = qk(rand, GQA)
    want = bridge.xattn_estimate(q, k, impl="reference", **kwargs)
    with pytest.raises(ValueError, match=r"k requires grad, but this call is forward only"):
        bridge.xattn_estimate(q, k.requires_grad_(), impl="reference", **kwargs)
    with torch.no_grad():
        sums, mask = bridge.xattn_estimate(q.requires_grad_(), k, impl="reference",
                                           **kwargs)
    assert not sums.requires_grad
    assert torch.equal(sums, want[0]) and torch.equal(mask, want[1])


def test_non_contiguous_needs_copy(rand):
    kwargs = GQA.options
    q, k = qk(rand, GQA)
    q_t = q.transpose(2, 3).contiguous().transpose(2, 3)  # same values, strided layout
    with pytest.raises(ValueError, match=r"q is not contiguous.*copy=True"):
        bridge.xattn_estimate(q_t, k, impl="reference", **kwargs)
    copied = bridge.xattn_estimate(q_t, k, impl="reference", copy=True, **kwargs)
    direct = bridge.xattn_estimate(q, k, impl="reference", **kwargs)
    assert torch.equal(copied[0], direct[0]) and torch.equal(copied[1], direct[1])


def test_argument_errors_name_the_argument(rand):
    kwargs = GQA.options
    q, k = qk(rand, GQA)
    with pytest.raises(ValueError, match="k must be on the CPU or a CUDA device"):
        bridge.xattn_estimate(q, k.to("meta"), **kwargs)
    with pytest.raises(ValueError, match="block_size must be a positive multiple"):
        bridge.xattn_estimate(q, k, block_size=12, stride=8)
    with pytest.raises(ValueError, match="threshold must lie in"):
        bridge.xattn_estimate(q, k, threshold=1.5, **kwargs)


def test_cpu_tensors_where_jax_defaults_to_a_gpu(rand, monkeypatch):
    """CPU tensors where JAX's default backend is a GPU (simulated off a GPU) run on JAX's
    CPU device, and the implementation follows them there: "auto" means the reference,
    "triton" interpret mode."""
    if jax.default_backend() == "cpu":
        monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    kwargs = GQA.options
    q, k = qk(rand, GQA)
    sums, mask = bridge.xattn_estimate(q, k, **kwargs)
    assert sums.device.type == "cpu"
    assert_same((sums, mask), xattn_jax.xattn_estimate(jax_of(q), jax_of(k),
                                                       impl="reference", **kwargs), rand)
    monkeypatch.undo()
    interpreted = xattn_jax.xattn_estimate(jax_of(q), jax_of(k), impl="triton", **kwargs)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert_same(bridge.xattn_estimate(q, k, impl="triton", **kwargs), interpreted, rand)


@pytest.mark.gpu
@needs_cuda
class TestCuda:
    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
    def test_matches_xattn_jax_on_gpu(self, dtype, rand):
        kwargs = dict(GPU_GQA.options, threshold=GPU_GQA.threshold)
        q, k = qk(rand, GPU_GQA, dtype, device="cuda")
        sums, mask = bridge.xattn_estimate(q, k, **kwargs)
        assert sums.device == q.device and mask.device == q.device
        assert_same((sums, mask), xattn_jax.xattn_estimate(jax_of(q), jax_of(k), **kwargs),
                    rand)

    @pytest.mark.parametrize("late", ["q", "k", "qk"])
    def test_inputs_written_on_a_side_stream(self, late, rand):
        """q, k or both written on a side stream after a long sleep: the estimate sees
        them (only q's view carries the stream order; k's rides on it)."""
        kwargs = GPU_SMALL.options
        q_src, k_src = qk(rand, GPU_SMALL, torch.bfloat16, device="cuda")
        expected = xattn_jax.xattn_estimate(jax_of(q_src), jax_of(k_src), **kwargs)
        bridge.xattn_estimate(q_src, k_src, **kwargs)  # compile
        q = torch.zeros_like(q_src) if "q" in late else q_src.clone()
        k = torch.zeros_like(k_src) if "k" in late else k_src.clone()
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            torch.cuda._sleep(1 << 29)
            if "q" in late:
                q.copy_(q_src)
            if "k" in late:
                k.copy_(k_src)
            sums, mask = bridge.xattn_estimate(q, k, **kwargs)
            sums, mask = sums.clone(), mask.clone()
        side.synchronize()
        assert_same((sums, mask), expected, rand)
