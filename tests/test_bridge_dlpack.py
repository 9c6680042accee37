"""xattn_torch_bridge.dlpack: zero copy, refusals, device placement, stream order, memory.

The CPU tests run everywhere. The `gpu` tests need torch with CUDA and JAX's CUDA
backend in one process (`pytest -m gpu tests/test_bridge_dlpack.py`).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import xattn_torch_bridge  # noqa: E402
from bridge_inputs import needs_cuda  # noqa: E402
from cases import GPU_SMALL  # noqa: E402
from xattn_torch_bridge import dlpack, to_jax, to_torch  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.int32, torch.bool]

two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
# the stream-order tests run on the current device and on the second GPU, while device 0
# stays torch's current device
CUDA_DEVICES = ["cuda", pytest.param("cuda:1", marks=two_gpus)]


def sample(dtype: torch.dtype, shape=(3, 5, 64), device="cpu") -> torch.Tensor:
    x = torch.arange(int(np.prod(shape)), device=device).reshape(shape)
    return (x % 2 == 0) if dtype == torch.bool else (x % 251).to(dtype)


def same_values(t: torch.Tensor, a: jax.Array) -> bool:
    return np.array_equal(t.cpu().float().numpy(), np.asarray(a.astype(jnp.float32)))


# --- CPU ------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_zero_copy_both_directions(dtype):
    t = sample(dtype)
    a = to_jax(t)
    assert a.unsafe_buffer_pointer() == t.data_ptr()
    assert a.shape == tuple(t.shape) and a.dtype == jnp.dtype(str(dtype).removeprefix("torch."))
    assert same_values(t, a)
    back = to_torch(a)
    assert back.data_ptr() == t.data_ptr() and back.dtype == dtype


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32, jnp.int32, bool],
                         ids=str)
def test_jax_result_to_torch_is_zero_copy(dtype):
    a = (jnp.arange(3 * 64).reshape(3, 64) % 7).astype(dtype)
    t = to_torch(a)
    assert t.data_ptr() == a.unsafe_buffer_pointer()
    assert same_values(t, a)
    assert to_jax(t).unsafe_buffer_pointer() == a.unsafe_buffer_pointer()


def test_cpu_tensor_lands_committed_on_jax_cpu_device():
    a = to_jax(sample(torch.float32))
    assert a.devices() == {jax.devices("cpu")[0]} and a.committed


def test_same_array_as_jax_public_from_dlpack():
    t = sample(torch.float32)
    fast, public = to_jax(t), jax.dlpack.from_dlpack(t, copy=False)
    assert fast.unsafe_buffer_pointer() == public.unsafe_buffer_pointer() == t.data_ptr()
    assert fast.devices() == public.devices()
    assert fast.dtype == public.dtype and fast.shape == public.shape


@pytest.mark.parametrize("make", [lambda t: t.transpose(1, 2), lambda t: t[:, :, ::2],
                                  lambda t: t.expand(2, -1, -1, -1)],
                         ids=["transpose", "strided", "broadcast"])
def test_non_contiguous_is_refused_unless_copy(make):
    t = make(sample(torch.float32))
    with pytest.raises(ValueError, match=r"tensor is not contiguous.*copy=True"):
        to_jax(t)
    a = to_jax(t, copy=True)
    assert a.unsafe_buffer_pointer() != t.data_ptr()
    assert same_values(t, a)


def test_copy_true_always_copies():
    t = sample(torch.float32)
    a = to_jax(t, copy=True)
    assert a.unsafe_buffer_pointer() != t.data_ptr() and same_values(t, a)


def test_unaligned_view_is_refused_unless_copy():
    """JAX's CPU backend views host memory only at 64-byte alignment; with copy=None, its
    own from_dlpack would copy silently. The bridge refuses and names the fix."""
    base = torch.arange(64, dtype=torch.float32)
    assert base.data_ptr() % dlpack.CPU_ALIGN == 0
    aligned = base[16:]  # 64 bytes in: still zero copy
    assert to_jax(aligned).unsafe_buffer_pointer() == aligned.data_ptr()
    unaligned = base[1:]  # contiguous, 4 bytes in
    with pytest.raises(ValueError, match=r"not aligned to 64 bytes.*copy=True"):
        to_jax(unaligned)
    with pytest.raises(Exception, match="aligned"):  # what JAX itself does with copy=False
        jax.dlpack.from_dlpack(unaligned, copy=False)
    a = to_jax(unaligned, copy=True)
    assert a.unsafe_buffer_pointer() != unaligned.data_ptr() and same_values(unaligned, a)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int64, torch.uint8], ids=str)
def test_unsupported_dtype_is_refused(dtype):
    with pytest.raises(ValueError, match=r"tensor must have dtype bfloat16.*got torch\."):
        to_jax(torch.zeros(4, dtype=dtype))


def test_grad_tensor_is_refused():
    with pytest.raises(ValueError, match=r"requires grad.*detach\(\)"):
        to_jax(torch.zeros(4, requires_grad=True))


def test_persistent_views_are_reused_while_the_tensor_is_the_same():
    t = sample(torch.float32)
    place = dlpack.place_of(t, "t", False)[1]
    first = dlpack.persistent_view(t, place)
    assert dlpack.persistent_view(t, place) is first
    t.fill_(7.0)  # new values, same memory: the view sees them
    assert np.all(np.asarray(jax.jit(lambda x: x + 0)(first)) == 7.0)
    t.set_(sample(torch.float32, shape=(2, 64)))  # other memory and shape: a new view
    second = dlpack.persistent_view(t, place)
    assert second is not first and second.shape == (2, 64)
    assert second.unsafe_buffer_pointer() == t.data_ptr()
    count = len(dlpack._persistent)
    del t  # the views hold its memory, not the tensor: the entry goes
    assert len(dlpack._persistent) == count - 1


def test_read_through_torch_is_device_get():
    a = jnp.arange(12, dtype=jnp.float32).reshape(3, 4) * 2
    got = dlpack.read_through_torch(a)
    assert isinstance(got, np.ndarray) and got.dtype == np.float32
    assert np.array_equal(got, jax.device_get(a))


def test_bad_inputs_are_refused():
    with pytest.raises(TypeError, match="tensor must be a torch.Tensor"):
        to_jax(np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="tensor must be on the CPU or a CUDA device, got meta"):
        to_jax(torch.zeros(4, device="meta"))
    with pytest.raises(ValueError, match="dense"):
        to_jax(torch.zeros(4, 4).to_sparse())
    with pytest.raises(TypeError, match="array must be a jax.Array"):
        to_torch(torch.zeros(4))


@pytest.mark.skipif(xattn_torch_bridge.cuda_available(), reason="JAX has CUDA here")
def test_cuda_device_without_jax_cuda_backend_is_refused():
    with pytest.raises(ValueError, match="x is on cuda:0, which needs JAX's CUDA backend"):
        dlpack._new_place(torch.device("cuda", 0), "x")


def test_memory_lives_as_long_as_either_side():
    t = torch.arange(256, dtype=torch.float32)
    a = to_jax(t)
    del t
    assert float(jnp.sum(a)) == 255 * 256 / 2
    b = jnp.arange(256, dtype=jnp.float32) * 2
    u = to_torch(b)
    del b
    assert float(u.sum()) == 255 * 256


def test_preallocation_is_off_unless_the_user_chose():
    assert os.environ[xattn_torch_bridge.PREALLOCATE] == (
        xattn_torch_bridge._user_preallocate or "false")


@pytest.mark.parametrize("initialized,has_gpu,user,allocator,warns", [
    (False, False, None, None, False),  # the usual case: the setting takes effect
    (True, False, None, None, False),  # CPU-only JAX: nothing to reserve
    (True, True, None, None, True),  # started before the import with the default
    (True, True, "true", None, True),
    (True, True, "false", None, False),
    (True, True, None, "platform", False),  # the platform allocator never preallocates
])
def test_preallocation_warning_rule(initialized, has_gpu, user, allocator, warns):
    message = xattn_torch_bridge.preallocation_warning(initialized, has_gpu, user, allocator)
    assert bool(message) == warns
    if warns:
        assert "XLA_PYTHON_CLIENT_PREALLOCATE=false" in message


# --- CUDA -----------------------------------------------------------------------------

class LateWrite:
    """x, which torch fills with `value` on a producer stream after a GPU sleep of about
    0.25 s and hands to JAX there, and y = 2x + 1 computed by JAX. host_s: host time of the
    fill, the hand-off and the dispatch (a host that waited for the GPU would take the
    whole sleep)."""

    def __init__(self, value: float, device: str):
        self.device = torch.device(device)
        double = jax.jit(lambda x: 2 * x + 1)
        self.x = torch.zeros(1 << 20, device=self.device)
        jax.block_until_ready(double(to_jax(self.x)))  # compiled, devices set up
        torch.cuda.synchronize(self.device)
        self.expected = 2 * value + 1
        self._start, self._end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        host = time.perf_counter()
        with torch.cuda.stream(torch.cuda.Stream(self.device)):  # current, and its device too
            self._start.record()
            torch.cuda._sleep(1 << 29)  # cycles: about 0.25 s at 2 GHz
            self._end.record()
            self.x.fill_(value)
            self.y = double(to_jax(self.x))
        self.host_s = time.perf_counter() - host

    def sleep_s(self) -> float:
        torch.cuda.synchronize(self.device)
        return self._start.elapsed_time(self._end) / 1e3


def _run_python(code: str, **env) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != xattn_torch_bridge.PREALLOCATE}
    environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), environ.get("PYTHONPATH", "")])
    environ.update(env)
    return subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.gpu
@needs_cuda
class TestCuda:
    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    def test_zero_copy_both_directions(self, dtype):
        t = sample(dtype, device="cuda")
        a = to_jax(t)
        (device,) = a.devices()
        assert device.platform == "gpu" and device.local_hardware_id == t.device.index
        assert a.unsafe_buffer_pointer() == t.data_ptr() and same_values(t, a)
        back = to_torch(a)
        assert back.data_ptr() == t.data_ptr() and back.device == t.device
        r = ~a if dtype == torch.bool else a + 1
        r_t = to_torch(r)
        assert r_t.data_ptr() == r.unsafe_buffer_pointer() and r_t.device == t.device

    def test_refusals(self):
        t = sample(torch.bfloat16, device="cuda")
        with pytest.raises(ValueError, match="not contiguous"):
            to_jax(t.transpose(0, 2))
        with pytest.raises(ValueError, match="not aligned to 16 bytes"):
            to_jax(t.reshape(-1)[1:])
        a = to_jax(t.reshape(-1)[1:], copy=True)
        assert same_values(t.reshape(-1)[1:], a)

    def test_read_through_torch_waits_for_jax(self):
        """The read is ordered after the JAX computation that makes the array (a long
        one, still running when the read is issued), and JAX's transfer guards do not
        see it: torch makes the copy."""
        x = to_jax(sample(torch.float32, device="cuda"))
        slow = jax.jit(lambda x: jax.lax.fori_loop(0, 200, lambda i, y: jnp.sin(y) + 1, x))
        want = np.asarray(jax.device_get(slow(x)))
        with jax.transfer_guard_device_to_host("disallow_explicit"):
            assert np.array_equal(dlpack.read_through_torch(slow(x)), want)

    def test_cpu_tensor_stays_on_jax_cpu_device(self):
        t = sample(torch.float32)
        a = to_jax(t)
        assert a.devices() == {jax.devices("cpu")[0]}
        assert a.unsafe_buffer_pointer() == t.data_ptr()
        assert to_torch(a).device.type == "cpu"

    @two_gpus
    def test_second_gpu_is_placed_on_its_jax_device(self):
        t = sample(torch.float32, device="cuda:1")
        a = to_jax(t)
        (device,) = a.devices()
        assert device.local_hardware_id == 1 and a.unsafe_buffer_pointer() == t.data_ptr()
        assert to_torch(a + 1).device == torch.device("cuda", 1)

    @two_gpus
    def test_estimate_on_the_second_gpu_stays_there(self):
        """The bridged estimate of tensors on cuda:1 runs on JAX's device 1 and returns
        tensors there, equal to the same call on cuda:0 (torch's current device)."""
        gen = torch.Generator("cuda:0").manual_seed(0)
        q, k = (torch.randn(shape, generator=gen, device="cuda:0", dtype=torch.bfloat16)
                for shape in (GPU_SMALL.q_shape, GPU_SMALL.k_shape))
        on_0 = xattn_torch_bridge.xattn_estimate(q, k, **GPU_SMALL.options)
        on_1 = xattn_torch_bridge.xattn_estimate(q.to("cuda:1"), k.to("cuda:1"),
                                                 **GPU_SMALL.options)
        for a, b in zip(on_0, on_1):
            assert b.device == torch.device("cuda", 1)
            assert torch.equal(a.cpu(), b.cpu())

    @pytest.mark.parametrize("device", CUDA_DEVICES)
    @pytest.mark.parametrize("ordered", [True, False])
    def test_torch_writes_before_jax_reads(self, ordered, device, monkeypatch):
        """JAX must read the late write. Without the ordering step it reads the old zeros,
        which shows the test can fail."""
        if not ordered:
            monkeypatch.setattr(dlpack, "jax_waits_for_torch", lambda place: None)
        late = LateWrite(3.0 if ordered else 5.0, device)
        result = np.asarray(late.y)
        if ordered:
            assert np.all(result == late.expected)
            assert late.host_s < late.sleep_s() / 2, (late.host_s, late.sleep_s())
        else:
            assert not np.all(result == late.expected)

    @pytest.mark.parametrize("device", CUDA_DEVICES)
    @pytest.mark.parametrize("ordered", [True, False])
    def test_jax_result_complete_before_torch_reads(self, ordered, device, monkeypatch):
        """torch reads JAX's result of the late write on another stream. Without waiting
        for JAX (the wait put on an unrelated stream) it reads unwritten memory."""
        unrelated = torch.cuda.Stream(device)
        if not ordered:
            monkeypatch.setattr(dlpack, "consumer_stream", lambda index: unrelated.cuda_stream)
        late = LateWrite(7.0 if ordered else 11.0, device)
        consumer = torch.cuda.Stream(device)
        host = time.perf_counter()
        with torch.cuda.stream(consumer):
            seen = to_torch(late.y).clone()
        host = late.host_s + time.perf_counter() - host
        consumer.synchronize()
        seen = seen.cpu().numpy()
        jax.block_until_ready(late.y)
        if ordered:
            assert np.all(seen == late.expected)
            assert host < late.sleep_s() / 2, (host, late.sleep_s())
        else:
            assert not np.all(seen == late.expected)

    MEMORY_PROBE = """
import json, torch
torch.cuda.init()
free0, total = torch.cuda.mem_get_info()
import xattn_torch_bridge, jax, jax.numpy as jnp
assert jax.default_backend() == "gpu"
jnp.ones(1 << 20).block_until_ready()
free1, _ = torch.cuda.mem_get_info()
x = torch.empty(free1 // 2, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
print(json.dumps({"free0": free0, "free1": free1, "total": total}))
"""

    def test_torch_can_allocate_half_the_free_memory_after_import(self):
        """In a fresh process: the bridge, then JAX's GPU backend starts and takes little of
        the free memory, then torch allocates half of what is free."""
        run = _run_python(self.MEMORY_PROBE)
        assert run.returncode == 0, run.stderr[-3000:]
        mem = json.loads(run.stdout.strip().splitlines()[-1])
        assert mem["free1"] > 0.8 * mem["free0"], mem  # JAX took little on start-up

    def test_preallocation_would_take_most_of_the_memory(self):
        """Control: with preallocation forced on, JAX's start-up takes most of the memory."""
        free, total = torch.cuda.mem_get_info()
        if free < 0.8 * total:
            pytest.skip(f"the GPU is not idle enough for the control: {free} of {total} free")
        run = _run_python(self.MEMORY_PROBE, XLA_PYTHON_CLIENT_PREALLOCATE="true")
        assert run.returncode == 0, run.stderr[-3000:]
        mem = json.loads(run.stdout.strip().splitlines()[-1])
        assert mem["free1"] < 0.5 * mem["free0"], mem

    def test_import_after_jax_started_warns(self):
        """JAX started first, with preallocation on (of a small share, to spare the GPU)."""
        code = ("import warnings, jax\njax.devices()\n"
                "with warnings.catch_warnings(record=True) as caught:\n"
                "    warnings.simplefilter('always')\n"
                "    import xattn_torch_bridge\n"
                "print(any('XLA_PYTHON_CLIENT_PREALLOCATE' in str(w.message) for w in caught))")
        run = _run_python(code, XLA_PYTHON_CLIENT_MEM_FRACTION="0.05")
        assert run.returncode == 0, run.stderr[-3000:]
        assert run.stdout.strip().splitlines()[-1] == "True"
