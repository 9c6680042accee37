"""xattn_torch_bridge.XAttentionPolicy: the blocks of the float64 pure-torch reference on
the gathered keys, the same blocks whether some are offloaded or not, zero copy, and
clear refusals that leave the cache unchanged.

The `gpu` tests need torch with CUDA and JAX's CUDA backend in one process
(`pytest -m gpu tests/test_policy.py`).
"""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from bridge_inputs import needs_cuda  # noqa: E402
from cache_state import assert_refused, snapshot  # noqa: E402
from cases import PAGE_SIZE, PAGED  # noqa: E402
from xattn_torch_bridge import PagedKVCache, XAttentionPolicy, reference  # noqa: E402
from xattn_torch_bridge import policy as policy_module  # noqa: E402

BS, HKV, HQ, D = PAGE_SIZE, PAGED.kv_heads, PAGED.q_heads, PAGED.head_dim
EBS, STRIDE = PAGED.block_size, PAGED.stride
GPU_EBS = 64  # the estimate block size of the Pallas kernel's GPU tests
EPS = 1e-4  # threshold tolerance: float32 estimate against the float64 reference


def context(rand, length: int, q_len: int = PAGED.q_len):
    """Keys and values `[length, Hkv, D]` and a chunk q `[Hq, q_len, D]`, float32, with
    blocks of different weight: keys lean towards q's common direction by a random
    amount per 32 tokens, so a threshold below 1 selects a strict subset."""
    rng = rand.rng
    u = torch.from_numpy(rng.standard_normal(D))
    lean = torch.from_numpy(rng.uniform(0, 2.5, -(-length // 32))).repeat_interleave(32)
    k = torch.from_numpy(rng.standard_normal((length, HKV, D)))
    k = k + lean[:length, None, None] * u
    q = torch.from_numpy(rng.standard_normal((HQ, q_len, D))) + u
    return k.float(), torch.from_numpy(rng.standard_normal((length, HKV, D))).float(), \
        q.float()


def make_cache(rand, length: int, **kwargs):
    cache = PagedKVCache(**(dict(num_blocks=8, block_size=BS, kv_heads=HKV, head_dim=D,
                                 dtype=torch.float32, device="cpu", num_cpu_blocks=4,
                                 staging_slots=2) | kwargs))
    k, v, q = context(rand, length)
    return cache, cache.append([], k, v), q


def expected(q, cache, ids, policy: XAttentionPolicy, threshold: float) -> set[int]:
    """The reference's selection (float64) on the sequence's gathered keys: the pages of
    the chosen units."""
    keys = torch.cat([cache.kv(i)[0].cpu() for i in ids]).double()
    vote = policy.rule == "vote"
    unit = policy._unit(cache.block_size)
    scores = reference.kv_block_scores(q[None].double().cpu(), keys.permute(1, 0, 2)[None],
                                       unit, policy.estimate_block_size, policy.stride,
                                       per_query_block=vote)
    mask = reference.select_kv_blocks(scores, min(max(threshold, 1e-6), 1.0),
                                      policy.keep_first, policy.keep_last,
                                      HKV if policy.per_kv_head else None, rule=policy.rule)
    per_unit = unit // cache.block_size
    units = torch.nonzero(mask.any(dim=1)[0]).flatten().tolist()
    return {i for u in units for i in ids[u * per_unit:(u + 1) * per_unit]}


def check(q, cache, ids, policy, rand, eps: float = EPS) -> list[int]:
    """select_blocks lies between the reference's selections at threshold -+ eps."""
    got = policy.select_blocks(q, cache, ids)
    assert got == sorted(got, key=ids.index)  # context order
    low = expected(q, cache, ids, policy, policy.threshold - eps)
    high = expected(q, cache, ids, policy, policy.threshold + eps)
    assert low <= set(got) <= high, (got, low, high, str(rand))
    return got


@pytest.mark.parametrize("length", [30, 3 * BS, PAGED.k_len], ids=lambda n: f"L{n}")
@pytest.mark.parametrize("kwargs", [dict(threshold=0.5), dict(threshold=0.9),
                                    dict(threshold=0.7, rule="vote"),
                                    dict(threshold=0.6, per_kv_head=True),
                                    dict(threshold=0.6, keep_first=False, keep_last=False)],
                         ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_matches_the_reference(rand, length, kwargs):
    cache, ids, q = make_cache(rand, length)
    policy = XAttentionPolicy(stride=STRIDE, estimate_block_size=EBS, **kwargs)
    check(q, cache, ids, policy, rand)


@pytest.mark.parametrize("keep", [False, True])
def test_a_hot_block_is_all_a_low_threshold_keeps(rand, keep):
    k, v, q = context(rand, 5 * BS)
    u = q.mean(dim=(0, 1))  # about q's common direction
    k = torch.from_numpy(rand.rng.standard_normal(k.shape)).float() * 0.5
    k[2 * BS:3 * BS] += 3 * u  # block 2 matches the chunk
    cache = PagedKVCache(8, BS, HKV, D, dtype=torch.float32, device="cpu")
    ids = cache.append([], k, v)
    policy = XAttentionPolicy(0.5, STRIDE, EBS, keep_first=keep, keep_last=keep)
    assert check(q, cache, ids, policy, rand) == ([0, 2, 4] if keep else [2])


@pytest.mark.parametrize("length", [30, 5 * BS + 3], ids=lambda n: f"L{n}")
@pytest.mark.parametrize("rule", ["score", "vote"])
def test_chunk_of_several_query_blocks(rand, length, rule):
    """A chunk of 3 query blocks, also longer than the cached context."""
    cache = PagedKVCache(8, BS, HKV, D, dtype=torch.float32, device="cpu")
    k, v, q = context(rand, length, q_len=150)
    ids = cache.append([], k, v)
    check(q, cache, ids, XAttentionPolicy(0.7, STRIDE, EBS, rule=rule), rand)


@pytest.mark.parametrize("page", [16, 32], ids=lambda p: f"page{p}")
def test_small_pages_select_whole_units(rand, page):
    """Pages smaller than the estimate block: units of several pages (64 tokens here, or
    by default the estimate block), the pages of a unit chosen together, the same tokens
    as a cache of 64-token pages."""
    k, v, q = context(rand, PAGED.k_len)
    small = PagedKVCache(-(-len(k) // page), page, HKV, D, dtype=torch.float32, device="cpu")
    ids = small.append([], k, v)
    big = PagedKVCache(8, BS, HKV, D, dtype=torch.float32, device="cpu")
    big_ids = big.append([], k, v)
    for unit in (BS, None):
        policy = XAttentionPolicy(0.6, STRIDE, EBS, selection_unit=unit)
        got = check(q, small, ids, policy, rand)
        per_unit = policy._unit(page) // page
        assert all(set(ids[u:u + per_unit]) <= set(got) or not set(ids[u:u + per_unit]) & set(got)
                   for u in range(0, len(ids), per_unit))
        if unit == BS:
            tokens = {j // (BS // page) for j in got}
            assert tokens == set(policy.select_blocks(q, big, big_ids))
        as_array = policy.select_blocks(q, small, np.array(ids))  # ids as numpy
        assert isinstance(as_array, np.ndarray) and as_array.tolist() == got


@pytest.mark.parametrize("page", [16, 32, 64, 128, 256, 512, 1024, 2048, 4096],
                         ids=lambda p: f"page{p}")
@pytest.mark.slow
def test_defaults_work_for_every_page_size(rand, page):
    """XAttentionPolicy() on caches of 16- to 4096-token pages: units of 1024 tokens up to
    1024-token pages, one page above; the reference's pages either way."""
    k, v, q = context(rand, 5000)
    cache = PagedKVCache(-(-len(k) // page), page, HKV, D, dtype=torch.float32, device="cpu")
    ids = cache.append([], k, v)
    policy = XAttentionPolicy(0.6)
    assert policy._unit(page) == max(page, 1024)
    check(q, cache, ids, policy, rand)


@pytest.mark.parametrize("impl", ["reference", "triton"])
@pytest.mark.parametrize("page", [1, 7], ids=lambda p: f"page{p}")
def test_pages_of_any_size(rand, page, impl):
    """Pages need not hold 16 tokens, nor whole stride groups: pages of 1 and 7 tokens (the
    Triton kernel then reads one table entry per token) in units of the least common
    multiple of the page and the estimate block select the reference's pages."""
    k, v, q = context(rand, PAGED.k_len)
    cache = PagedKVCache(-(-len(k) // page), page, HKV, D, dtype=torch.float32, device="cpu")
    ids = cache.append([], k, v)
    policy = XAttentionPolicy(0.6, STRIDE, EBS, impl=impl)
    assert policy._unit(page) == page * EBS // math.gcd(page, EBS)
    check(q, cache, ids, policy, rand)


def test_offloaded_blocks_give_the_same_selection(rand):
    cache, ids, q = make_cache(rand, PAGED.k_len)
    policy = XAttentionPolicy(0.6, STRIDE, EBS)
    resident = policy.select_blocks(q, cache, ids)
    cache.offload([ids[1], ids[4]])
    before = snapshot(cache)
    assert policy.select_blocks(q[None], cache, ids) == resident  # [1, Hq, Lq, D] too
    after = snapshot(cache)
    assert before[0] == after[0]  # the blocks stay offloaded; only staging pages changed
    assert torch.equal(before[1][0][:8], after[1][0][:8])
    cache.offload([ids[0]])
    cache.load([ids[1], ids[4]])  # other slots, other staging pages
    assert policy.select_blocks(q, cache, ids) == resident


def spy_selection(monkeypatch) -> list:
    """Records the arrays each `_selection` call receives."""
    seen = []
    original = policy_module._selection

    def spy(q_jax, pages_jax, table_jax, **kwargs):
        seen.append((q_jax, pages_jax, np.asarray(table_jax)))
        return original(q_jax, pages_jax, table_jax, **kwargs)

    monkeypatch.setattr(policy_module, "_selection", spy)
    return seen


def test_zero_copy(rand, monkeypatch):
    cache, ids, q = make_cache(rand, 3 * BS)
    cache.offload(ids[1:2])
    seen = spy_selection(monkeypatch)
    XAttentionPolicy(0.9, STRIDE, EBS).select_blocks(q, cache, ids)
    ((q_jax, pages_jax, table),) = seen
    assert q_jax.unsafe_buffer_pointer() == q.data_ptr()
    assert pages_jax.unsafe_buffer_pointer() == cache.keys.data_ptr()
    assert pages_jax.shape == tuple(cache.keys.shape)
    # pages (the offloaded block staged into page 8), padding, then the token count
    assert table.tolist() == [cache.slot(ids[0]), 8, cache.slot(ids[2]), cache.slot(ids[0]),
                              3 * BS]


@pytest.mark.slow
def test_one_computation_one_read_no_upload(rand, monkeypatch):
    """After the first call: one jitted computation, one device-to-host read (torch's),
    no host-to-device transfer (the table travels through the cache's buffer, the token
    count inside it), and no recompilation as the context grows within a power of two."""
    cache, ids, q = make_cache(rand, PAGED.k_len)
    policy = XAttentionPolicy(0.7, STRIDE, EBS)
    policy.select_blocks(q, cache, ids[:5])  # compiles for 8 units (5 blocks)
    compiled = policy_module._selection._cache_size()
    reads = []
    original = policy_module.read_through_torch
    monkeypatch.setattr(policy_module, "read_through_torch",
                        lambda x: reads.append(x) or original(x))
    with jax.transfer_guard("disallow"):
        for n in (5, 6):
            policy.select_blocks(q, cache, ids[:n])
    assert len(reads) == 2 and policy_module._selection._cache_size() == compiled


@pytest.mark.slow
def test_max_context_compiles_once_and_selects_alike(rand, monkeypatch):
    """With max_context every table has its width: contexts of 1 to 6 blocks (powers of
    two 1 to 8 without it) compile the selection once, and select what the policy
    without it selects."""
    cache, ids, q = make_cache(rand, PAGED.k_len)  # 6 blocks
    seen = spy_selection(monkeypatch)
    fixed = XAttentionPolicy(0.7, STRIDE, EBS, max_context=8 * BS)
    grown = XAttentionPolicy(0.7, STRIDE, EBS)
    for n in range(1, len(ids) + 1):
        assert fixed.select_blocks(q, cache, ids[:n]) == grown.select_blocks(q, cache,
                                                                              ids[:n])
    widths = [table.shape[0] - 1 for _, _, table in seen]
    assert widths[0::2] == [8] * len(ids)  # fixed: 8 blocks (units of one block)
    assert widths[1::2] == [1, 2, 4, 4, 8, 8]
    monkeypatch.undo()
    policy_module._selection.clear_cache()
    for n in range(1, len(ids) + 1):
        fixed.select_blocks(q, cache, ids[:n])
    assert policy_module._selection._cache_size() == 1


def test_refusals_leave_the_cache_unchanged(rand):
    cache, ids, q = make_cache(rand, 3 * BS + 5)  # blocks 0-3
    cache.free(cache.allocate(1))  # 4
    cache.offload(ids[:3])
    policy = XAttentionPolicy(0.9, STRIDE, EBS)
    calls = [
        (lambda: policy.select_blocks(q.double(), cache, ids), "cache's dtype"),
        (lambda: policy.select_blocks(q[:3], cache, ids), "multiple of the cache's 2 KV"),
        (lambda: policy.select_blocks(q[..., :8], cache, ids), "head_dim 16"),
        (lambda: policy.select_blocks(q[None].expand(2, -1, -1, -1), cache, ids),
         r"q must be \[Hq, Lq, D\] or \[1, Hq, Lq, D\]"),
        (lambda: policy.select_blocks(q.transpose(0, 1).contiguous().transpose(0, 1), cache,
                                      ids), "q is not contiguous"),
        (lambda: policy.select_blocks(q.numpy(), cache, ids), "q must be a torch.Tensor"),
        (lambda: policy.select_blocks(q, "cache", ids), "cache must be a PagedKVCache"),
        (lambda: policy.select_blocks(q, cache, ids + [99]), "block 99 is unknown"),
        (lambda: policy.select_blocks(q, cache, [4]), "block 4 was freed"),
        (lambda: policy.select_blocks(q, cache, []), "at least one block"),
        (lambda: policy.select_blocks(q, cache, [3, 0]), "block 3 holds 5 of 64 tokens"),
        (lambda: policy.select_blocks(q, cache, [0, 0]), "repeated block ids"),
        (lambda: policy.select_blocks(q, cache, ids), "3 offloaded blocks but only 2"),
        (lambda: XAttentionPolicy(0.9, STRIDE, EBS, selection_unit=96).select_blocks(
            q, cache, ids), r"selection_unit \(96\) must be a multiple of the cache's "
                            r"block_size \(64\)"),
    ]
    for call, message in calls:
        assert_refused(cache, call, message, (ValueError, TypeError))


def test_empty_last_block_is_refused(rand):
    cache, ids, q = make_cache(rand, BS)
    ids += cache.allocate(1)
    with pytest.raises(ValueError, match=f"the last block {ids[-1]} is empty"):
        XAttentionPolicy(0.9, STRIDE, EBS).select_blocks(q, cache, ids)


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(threshold=0), ValueError, r"threshold must lie in \(0, 1\]"),
    (dict(threshold=True), TypeError, r"threshold must be a float in \(0, 1\]"),
    (dict(threshold="0.9"), TypeError, r"threshold must be a float in \(0, 1\]"),
    (dict(stride=0), ValueError, "stride must be an integer >= 1"),
    (dict(estimate_block_size=20), ValueError,
     r"estimate_block_size must be a positive multiple of stride \(8\), at most 65536, got 20"),
    (dict(rule="max"), ValueError, "rule must be one of"),
    (dict(keep_last=1), TypeError, "keep_last must be True or False"),
    (dict(norm=0.0), ValueError, "norm must be a finite number > 0"),
    (dict(impl="cuda"), ValueError, "impl must be one of"),
    (dict(selection_unit=0), ValueError, "selection_unit must be an integer >= 1"),
    (dict(selection_unit=1536), ValueError, r"selection_unit \(1536\) must be a multiple of "
                                            r"estimate_block_size \(1024\)"),
])
def test_constructor_checks(kwargs, error, message):
    with pytest.raises(error, match=message):
        XAttentionPolicy(**kwargs)


# --- CUDA -----------------------------------------------------------------------------

@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_matches_cpu_with_offloaded_blocks(rand, dtype):
    """On CUDA (pinned CPU pool, staging on the side stream, the estimate in Pallas):
    the reference's blocks, as on the CPU, and the same blocks once all are resident."""
    k, v, q = context(rand, 6 * BS + 9)
    caches = {}
    for device in ("cpu", "cuda"):
        cache = PagedKVCache(8, BS, HKV, D, dtype=dtype, device=device, num_cpu_blocks=4,
                             staging_slots=3)
        ids = cache.append([], k.to(dtype).to(device), v.to(dtype).to(device))
        caches[device] = cache, ids
    cache, ids = caches["cuda"]
    cache.offload(ids[1:6:2])
    assert cache.cpu_keys.is_pinned()
    policy = XAttentionPolicy(0.6, STRIDE, GPU_EBS)
    qd, eps = q.to(dtype), EPS if dtype == torch.float32 else 1e-3
    got = check(qd.cuda(), cache, ids, policy, rand, eps)
    check(qd, *caches["cpu"], policy, rand, eps)
    cache.load(ids[1:6:2])
    assert policy.select_blocks(qd.cuda(), cache, ids) == got


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("page", [7, 16, 64], ids=lambda p: f"page{p}")
def test_cuda_small_pages_with_offloaded_pages(rand, page):
    """Small pages on CUDA (16 tokens: units of 4 pages; 7: one table entry per token),
    two of them offloaded and staged: the reference's pages."""
    k, v, q = context(rand, 6 * BS + 9)
    cache = PagedKVCache(-(-len(k) // page), page, HKV, D, dtype=torch.bfloat16,
                         device="cuda", num_cpu_blocks=2, staging_slots=2)
    ids = cache.append([], k.bfloat16().cuda(), v.bfloat16().cuda())
    cache.offload(ids[5:7])
    check(q.bfloat16().cuda(), cache, ids, XAttentionPolicy(0.6, STRIDE, GPU_EBS), rand, 1e-3)


@pytest.mark.gpu
@needs_cuda
def test_cuda_zero_copy(rand, monkeypatch):
    cache = PagedKVCache(4, BS, HKV, D, dtype=torch.bfloat16, device="cuda", num_cpu_blocks=2)
    k, v, q = context(rand, 2 * BS)
    ids = cache.append([], k.bfloat16().cuda(), v.bfloat16().cuda())
    cache.offload(ids[:1])
    seen = spy_selection(monkeypatch)
    XAttentionPolicy(0.9, STRIDE, GPU_EBS).select_blocks(q.bfloat16().cuda(), cache, ids)
    ((_, pages_jax, table),) = seen
    assert pages_jax.unsafe_buffer_pointer() == cache.keys.data_ptr()
    assert table.tolist() == [4, cache.slot(ids[1]), 2 * BS]
