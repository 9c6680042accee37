"""FlexAttention (torch) as a peer of `block_sparse_attention` in `bench.attention`: our
block mask as a flex `BlockMask`, the call on the same q, k, v, its time, and the check
that it computes what ours computes.

The conversion (`to_block_mask`): a bool mask `[B, Hq, qb, kb]` of `block_size` blocks,
causal, the queries being the last Lq of the Lk keys. The kept blocks the causal rule
shows whole become the BlockMask's full blocks (no mask_mod inside them); the kept blocks
it cuts (the diagonal ones) its partial blocks, where mask_mod applies. mask_mod is the
causal rule and the block mask itself: flex's eager path (the CPU smoke run) applies
mask_mod alone and ignores the block lists, so there the output checks mask_mod, and
`wrong_blocks` checks the lists (which the compiled kernel reads) against the mask.

On CUDA flex_attention runs compiled (`torch.compile`, as its documentation asks), timed
with CUDA events after a warm-up; on the CPU (`--smoke`) it runs eagerly, to check the
conversion at tiny sizes (its times mean nothing). GQA: `enable_gqa` where this torch has
it, else k and v repeated to the query heads outside the timed region (the record says so).
"""

from __future__ import annotations

import inspect
import statistics
import time
import warnings

import jax
import numpy as np

from bench.common import BATCH_MS, MAX_BATCH, floor_ms, log, record

IMPL = "flexattention"
# bf16 outputs of two kernels: |flex - ours| <= ATOL + RTOL |ours|, the tolerance of the
# Mosaic kernel's bf16 tests (tests/test_mosaic_attention.py)
ATOL = RTOL = 2e-2
EAGER_REPS = 2  # timed calls of the eager path (the CPU smoke run), whose times mean nothing


def unavailable(smoke: bool) -> str | None:
    """Why the flex rows cannot run here (None where they can): they need torch with
    flex_attention, and outside a smoke run torch's CUDA with JAX's GPU backend."""
    try:
        import torch
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError as error:
        return f"torch with flex_attention is not installed ({error})"
    if not smoke and not (torch.cuda.is_available() and jax.default_backend() == "gpu"):
        return "torch has no CUDA device or JAX no GPU backend"
    return None


def block_reach(qb: int, kb: int, q_len: int, k_len: int, block_size: int):
    """bool `[qb, kb]` twice: whether the causal rule lets some (query, key) pair of each
    block through, and whether it lets every pair through (queries the last q_len of the
    k_len keys)."""
    q_first = np.arange(qb) * block_size + (k_len - q_len)
    q_last = np.minimum(q_first + block_size, k_len) - 1
    k_first = np.arange(kb) * block_size
    k_last = np.minimum(k_first + block_size, k_len) - 1
    return (k_first[None, :] <= q_last[:, None]), (k_last[None, :] <= q_first[:, None])


def to_block_mask(mask: np.ndarray, q_len: int, k_len: int, block_size: int, device):
    """The flex BlockMask of bool `mask` `[B, Hq, ceil(Lq / bs), ceil(Lk / bs)]`, causal,
    the queries the last q_len of the k_len keys, on torch `device`."""
    import torch
    from torch.nn.attention.flex_attention import BlockMask

    visible, whole = block_reach(*mask.shape[-2:], q_len, k_len, block_size)
    kept = mask & visible
    full = torch.as_tensor(kept & whole, device=device)
    partial = torch.as_tensor(kept & ~whole, device=device)
    blocks = torch.tensor(mask, device=device)
    offset = k_len - q_len

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx + offset) & blocks[b, h, q_idx // block_size,
                                                   kv_idx // block_size]

    def lists(chosen):  # each row's count, then its block indices, the chosen ones first
        order = torch.argsort((~chosen).to(torch.int8), dim=-1, stable=True)
        return chosen.sum(-1, dtype=torch.int32), order.to(torch.int32)

    return BlockMask.from_kv_blocks(*lists(partial), *lists(full), BLOCK_SIZE=block_size,
                                    mask_mod=mask_mod, seq_lengths=(q_len, k_len))


def wrong_blocks(block_mask, mask: np.ndarray, q_len: int, k_len: int,
                 block_size: int) -> int:
    """How many (batch, head, query block, key block) cells the BlockMask's block lists
    get wrong: they should list exactly the kept blocks the causal rule lets a pair of
    through."""
    visible, _ = block_reach(*mask.shape[-2:], q_len, k_len, block_size)
    listed = block_mask.to_dense().bool().cpu().numpy()
    return int(np.sum(listed != (mask & visible)))


def has_gqa() -> bool:
    """Whether this torch's flex_attention reads grouped KV heads in place."""
    from torch.nn.attention.flex_attention import flex_attention

    return "enable_gqa" in inspect.signature(flex_attention).parameters


def attention_call(q, k, v, block_mask, compiled: bool):
    """A function of no arguments running flex_attention on torch q `[B, Hq, Lq, D]`,
    k, v `[B, Hkv, Lk, D]` (`[B, Hq, Lk, D]` where this torch has no GQA): compiled, or
    eagerly (without the warning that eager flex materializes the scores)."""
    import torch
    from torch.nn.attention.flex_attention import flex_attention

    options = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
    if compiled:
        # compiled code is cached per function, flex_attention, and each case brings a new
        # mask_mod: start afresh rather than reach dynamo's recompile limit (past which it
        # would run the eager path silently)
        torch._dynamo.reset()
        fn = torch.compile(flex_attention, dynamic=False)
        return lambda: fn(q, k, v, block_mask=block_mask, **options)

    def eager():
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "flex_attention called without torch.compile")
            return flex_attention(q, k, v, block_mask=block_mask, **options)

    return eager


def time_ms(fn, device, warmup: int, reps: int) -> float:
    """Median time in ms of one call of fn on torch `device`: on CUDA, CUDA events around
    batches of about BATCH_MS of back-to-back calls (as `bench.common.time_ms` batches
    JAX's calls); on the CPU, the wall time of single calls."""
    import torch

    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - start))
        return statistics.median(times)

    def batch_ms(calls: int) -> float:
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / calls

    calls = max(1, min(MAX_BATCH, round(BATCH_MS / batch_ms(1))))
    return statistics.median(batch_ms(calls) for _ in range(reps))


def extra_mib(fn, device) -> float:
    """MiB torch allocates on CUDA `device` for one call beyond what it held before: the
    output and the temporaries. NaN on the CPU, where torch does not count them."""
    import torch

    if device.type != "cuda":
        return float("nan")
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - before) / 2**20


def max_error(got, want) -> tuple[float, bool]:
    """(max |got - want|, whether every element is within ATOL + RTOL |want|), for torch
    tensors `[B, H, L, D]`, a head at a time (float32 copies of one head only)."""
    worst, within = 0.0, True
    for h in range(want.shape[1]):
        g, w = got[:, h].float(), want[:, h].float()
        diff = (g - w).abs()
        worst = max(worst, float(diff.max()))
        within &= bool((diff <= ATOL + RTOL * w.abs()).all())
    return worst, within


def peer_row(case: str, q, k, v, mask, ours, block_size: int, flops: float, extra: dict,
             reps: int) -> dict:
    """The flex row of `case`: flex_attention on JAX arrays q `[B, Hq, Lq, D]`, k, v
    `[B, Hkv, Lk, D]` and bool mask `[B, Hq, qb, kb]` (as `to_block_mask` converts it),
    checked against `ours` (our output `[B, Hq, Lq, D]`, a JAX array), then timed.
    flops: the case's useful FLOPs (its floor's); extra: more fields for the record.
    The record's `agrees` is False where the output or the block lists differ."""
    from xattn_torch_bridge import to_torch

    q_len, k_len = q.shape[2], k.shape[2]
    tq, tk, tv = (to_torch(x) for x in (q, k, v))
    fields = dict(extra)
    if tk.shape[1] != tq.shape[1] and not has_gqa():
        groups = tq.shape[1] // tk.shape[1]
        tk, tv = (x.repeat_interleave(groups, dim=1) for x in (tk, tv))
        fields["gqa"] = "k and v repeated to the query heads, outside the timed region"
    mask = np.asarray(mask)
    block_mask = to_block_mask(mask, q_len, k_len, block_size, tq.device)
    wrong = wrong_blocks(block_mask, mask, q_len, k_len, block_size)
    compiled = tq.device.type == "cuda"
    fn = attention_call(tq, tk, tv, block_mask, compiled)
    error, within = max_error(fn(), to_torch(ours))
    fields.update(mode="compiled" if compiled else "eager", wrong_blocks=wrong,
                  max_abs_error=round(error, 5), agrees=within and not wrong)
    ms = time_ms(fn, tq.device, warmup=2 if compiled else 0,
                 reps=reps if compiled else EAGER_REPS)
    floor = floor_ms(flops)
    row = record(case, IMPL, ms, floor, extra_mib(fn, tq.device)) | fields
    log(f"{case} {IMPL} ({fields['mode']}): {ms:.3f} ms, {ms / floor:.2f} x floor, max abs "
        f"error {error:.2e} against ours, {wrong} wrong blocks"
        + ("" if row["agrees"] else ": DISAGREES with ours"))
    return row
