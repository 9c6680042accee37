"""Times the original mit-han-lab/x-attention estimate from a user's checkout.

Nothing of the original is vendored: `load(PATH)` imports `xattn.src.Xattention` from the
checkout at run time. Two adjustments, both outside its files:
- its module imports `block_sparse_attn` (the sparse attention, not the estimate); when
  that package is missing an empty stand-in module is registered so the import succeeds;
- its estimate turns its Triton path off on any GPU whose name lacks "100" (the H200
  included); we time the Triton path, as the project's first H200 measurements did, by letting it
  read a device name that contains "100" during the call.
It takes torch tensors with Hq == Hkv, so GQA keys are repeated per query head first, as
its users do; that copy is part of its time.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import sys
import types

_module = None
_kernels = None
LOG2_E = 1.4426950408889634


class Unsupported(Exception):
    """The original cannot run this case."""


def load(path: str) -> None:
    global _module, _kernels
    sys.path.insert(0, path)
    try:
        import block_sparse_attn  # noqa: F401
    except ImportError:
        stand_in = types.ModuleType("block_sparse_attn")
        stand_in.block_sparse_attn_func = None
        sys.modules["block_sparse_attn"] = stand_in
    import xattn.src.kernels as kernels
    import xattn.src.Xattention as module

    _module, _kernels = module, kernels


@contextlib.contextmanager
def _triton_path_on():
    import torch

    real = torch.cuda.get_device_properties

    class Named100:  # the real properties, but a name containing "100"
        def __init__(self, props):
            self._props = props
            self.name = f"{props.name} (read as 100)"

        def __getattr__(self, attr):
            return getattr(self._props, attr)

    def named_100(device=None):
        return Named100(real(device))

    torch.cuda.get_device_properties = named_100
    try:
        yield
    finally:
        torch.cuda.get_device_properties = real


def time_estimate(q, k, *, block_size: int, stride: int, causal: bool,
                  reps: int) -> tuple[float, float]:
    """Median ms and peak extra MiB of the original estimate on JAX arrays q, k."""
    import torch

    if _module is None:
        raise RuntimeError("call load(PATH) first")
    if q.size >= 2**31:  # seen on the H200 at 1M tokens x 32 heads: it broke the process's
        # CUDA context (an illegal address), failing every later case, so never launch it
        raise Unsupported(f"q has {q.size} >= 2^31 elements: its kernels fault there")
    q_t = torch.from_dlpack(q)
    k_t = torch.from_dlpack(k)
    group = q_t.shape[1] // k_t.shape[1]
    chunk = min(16384, q_t.shape[2])

    def call():
        keys = k_t.repeat_interleave(group, dim=1) if group > 1 else k_t
        return _module.xattn_estimate(q_t, keys, block_size=block_size, stride=stride,
                                      threshold=0.9, chunk_size=chunk, causal=causal,
                                      select_mode="inverse", use_triton=True)

    with _triton_path_on():
        return _median_ms_and_peak_mib(call, reps)


def _median_ms_and_peak_mib(call, reps: int) -> tuple[float, float]:
    """Two warm-up calls, then the median of `reps` CUDA-event timings and the peak
    allocation beyond what was allocated before."""
    import torch

    try:
        for _ in range(2):
            call()
    except Exception as why:  # noqa: BLE001 - any failure of the original skips the case
        raise Unsupported(str(why).splitlines()[0] if str(why) else type(why).__name__)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), (torch.cuda.max_memory_allocated() - base) / 2**20


def time_kv_scores(q, k, *, block_size: int, kv_block_size: int, stride: int,
                   reps: int) -> tuple[float, float]:
    """Median ms and peak extra MiB of the seed engine's KV-block scoring with the
    original kernels: its fused strided GEMM over the whole cache (K repeated to Hq),
    non-causal block sums at `block_size`, summed over the chunk's query blocks and up to
    `kv_block_size` (hierarchical when block_size < kv_block_size). q: the chunk
    `[1, Hq, Lq, D]`, k: the cache `[1, Hkv, Lk, D]`, JAX arrays on the GPU."""
    import torch

    if _kernels is None:
        raise RuntimeError("call load(PATH) first")
    q_t, k_t = torch.from_dlpack(q), torch.from_dlpack(k)
    batch, heads, q_len, head_dim = q_t.shape
    group = heads // k_t.shape[1]
    rows, cols = q_len // stride, k_t.shape[2] // stride
    reshaped = block_size // stride
    scale = LOG2_E / math.sqrt(head_dim) / stride

    def call():
        keys = k_t.repeat_interleave(group, dim=1) if group > 1 else k_t
        scores = _kernels.flat_group_gemm_fuse_reshape(q_t, keys, stride, cols - rows, cols,
                                                       is_causal=False)
        sums = _kernels.softmax_fuse_block_sum(scores, reshaped, min(4096, reshaped),
                                               cols - rows, cols, cols, scale,
                                               is_causal=False)
        per_kv = kv_block_size // block_size
        return sums.float().sum(dim=2).view(batch, heads, -1, per_kv).sum(dim=-1)

    return _median_ms_and_peak_mib(call, reps)
