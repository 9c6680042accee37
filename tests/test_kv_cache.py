"""xattn_torch_bridge.PagedKVCache: data round trips are bit-exact, and every refused call
leaves the cache as it was.

The `gpu` tests need torch with CUDA (`pytest -m gpu tests/test_kv_cache.py`).
"""

from __future__ import annotations


import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from cache_state import assert_refused, assert_same, snapshot  # noqa: E402
from cases import PAGE_SIZE, PAGED  # noqa: E402
from xattn_torch_bridge import PagedKVCache  # noqa: E402

BS, HKV, D = PAGE_SIZE, PAGED.kv_heads, PAGED.head_dim

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs torch CUDA")


def tokens(rand, count: int, dtype=torch.float32, heads=HKV, dim=D) -> torch.Tensor:
    """Random `[count, heads, dim]` tokens."""
    return torch.from_numpy(rand.rng.standard_normal((count, heads, dim))).to(dtype)


def make_cache(**kwargs) -> PagedKVCache:
    args = dict(num_blocks=4, block_size=BS, kv_heads=HKV, head_dim=D, dtype=torch.float32,
                device="cpu", num_cpu_blocks=3, staging_slots=2)
    return PagedKVCache(**(args | kwargs))


def contents(cache: PagedKVCache, ids) -> tuple[torch.Tensor, torch.Tensor]:
    """A sequence's keys and values `[L, Hkv, D]`, wherever its blocks live."""
    k, v = zip(*(cache.kv(i) for i in ids))
    return torch.cat([x.cpu() for x in k]), torch.cat([x.cpu() for x in v])


# --- round trips ----------------------------------------------------------------------

def test_append_fills_the_last_block_then_new_ones(rand):
    cache = make_cache()
    k, v = tokens(rand, 150), tokens(rand, 150)
    ids = cache.append([], k[:40], v[:40])
    assert ids == [0] and cache.tokens(0) == 40
    ids = cache.append(ids, k[40:140], v[40:140])
    assert ids == [0, 1, 2] and [cache.tokens(i) for i in ids] == [64, 64, 12]
    ids = cache.append(ids, k[140:], v[140:])
    assert [cache.tokens(i) for i in ids] == [64, 64, 22] and cache.free_blocks == 1
    got_k, got_v = contents(cache, ids)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)
    assert cache.append(ids, k[:0], v[:0]) == ids  # nothing to add
    cache.append(ids, k[:1].requires_grad_(), v[:1])
    assert not cache.keys.requires_grad and cache.tokens(ids[-1]) == 23


def test_append_exactly_fills_then_starts_a_new_block(rand):
    cache = make_cache()
    k = tokens(rand, BS + 1)
    ids = cache.append([], k[:BS], k[:BS])
    assert ids == [0] and cache.tokens(0) == BS
    ids = cache.append(ids, k[BS:], k[BS:])
    assert ids == [0, 1] and cache.tokens(1) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_offload_and_load_round_trip_bit_exact(rand, dtype):
    cache = make_cache(dtype=dtype)
    k, v = tokens(rand, 3 * BS - 5, dtype), tokens(rand, 3 * BS - 5, dtype)
    ids = cache.append([], k, v)
    cache.offload(ids[::2])
    assert [cache.is_resident(i) for i in ids] == [False, True, False]
    assert cache.free_blocks == 3 and cache.free_cpu_blocks == 1
    assert cache.kv(ids[0])[0].device.type == "cpu"
    got_k, got_v = contents(cache, ids)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)
    other = cache.allocate(3)  # takes the freed device slots
    cache.append(other[:1], k[:BS], v[:BS])  # and writes into one of them
    cache.free([ids[1], *other])
    cache.load([ids[0]])
    assert cache.is_resident(ids[0]) and cache.free_cpu_blocks == 2
    assert torch.equal(cache.kv(ids[0])[0], k[:BS]) and torch.equal(cache.kv(ids[2])[1],
                                                                    v[2 * BS:])


def test_free_invalidates_ids_and_recycles_slots(rand):
    cache = make_cache()
    ids = cache.allocate(4)
    assert cache.free_blocks == 0
    cache.offload([ids[3]])
    cache.free([ids[0], ids[3]])
    assert cache.free_blocks == 2 and cache.free_cpu_blocks == 3
    with pytest.raises(ValueError, match="block 0 was freed"):
        cache.tokens(0)
    with pytest.raises(ValueError, match="block 99 is unknown"):
        cache.tokens(99)
    new = cache.allocate(2)
    assert new == [4, 5] and cache.free_blocks == 0  # ids are never reused
    assert {cache.slot(i) for i in new} == {0, 3}


def test_stage_keys_copies_offloaded_keys_into_staging_pages(rand):
    cache = make_cache()
    k = tokens(rand, 3 * BS)
    ids = cache.append([], k, k)
    cache.offload([ids[0], ids[2]])
    pages, event = cache.stage_keys(ids)
    assert event is None and pages == [4, cache.slot(ids[1]), 5]
    for page, i in zip(pages, ids):
        assert torch.equal(cache.keys[page], k[i * BS:(i + 1) * BS])


@pytest.mark.parametrize("as_array", [False, True], ids=["list", "numpy"])
def test_block_table_stages_and_pads(rand, as_array):
    """The table: pages (offloaded blocks staged), the first page as padding, the token
    count; one persistent buffer per width, rewritten by each call."""
    cache = make_cache()
    k = tokens(rand, 3 * BS - 7)
    ids = cache.append([], k, k)
    cache.offload([ids[1]])
    arg = np.array(ids) if as_array else ids
    table = cache.block_table(arg, 4)
    assert table.dtype == torch.int32 and table.device == cache.keys.device
    assert table.tolist() == [cache.slot(ids[0]), 4, cache.slot(ids[2]), cache.slot(ids[0]),
                              3 * BS - 7]
    assert torch.equal(cache.keys[4], k[BS:2 * BS])
    again = cache.block_table(arg[:2], 4)
    assert again.data_ptr() == table.data_ptr()  # the same buffer, rewritten
    assert again.tolist() == [cache.slot(ids[0]), 4, cache.slot(ids[0]), cache.slot(ids[0]),
                              2 * BS]


def test_block_table_refusals(rand):
    cache = make_cache()
    ids = cache.append([], tokens(rand, 2 * BS + 3), tokens(rand, 2 * BS + 3))
    calls = [
        (lambda: cache.block_table(ids, 2), "width must be an int >= the 3 blocks"),
        (lambda: cache.block_table(ids, 4.0), "width must be an int"),
        (lambda: cache.block_table(ids[::-1], 4), "block 2 holds 3 of 64 tokens"),
        (lambda: cache.block_table(np.array(ids, np.float32), 4), "1-D integers"),
        (lambda: cache.block_table([0, np.int64(1), True], 4), "block ids are ints"),
        (lambda: cache.block_table(np.array([0, 1, 1]), 4), "repeated block ids"),
    ]
    for call, message in calls:
        assert_refused(cache, call, message)


def test_random_operations_match_a_model(rand):
    """Random valid and invalid calls; after each, every live block holds what the model
    says, and refused calls change nothing."""
    cache = make_cache(num_cpu_blocks=4)
    model: dict[int, torch.Tensor] = {}  # id -> the block's keys (values are keys + 1)
    seqs: list[list[int]] = []
    outcomes = {True: 0, False: 0}  # accepted, refused
    for _ in range(120):
        op = rand.rng.choice(["append", "offload", "load", "free"])
        live = sorted(model)
        before = snapshot(cache)
        try:
            if op == "append":
                extend = seqs and rand.rng.random() < 0.7
                seq = seqs.pop(rand.rng.integers(len(seqs))) if extend else []
                new = tokens(rand, int(rand.rng.integers(0, 2 * BS)))
                out = cache.append(seq, new, new + 1)
                fill = torch.cat([model[i] for i in seq] + [new])
                for j, i in enumerate(out):
                    model[i] = fill[j * BS:(j + 1) * BS]
                seqs.append(out)
            elif live:
                size = min(len(live), int(rand.rng.integers(1, 3)))
                pick = [int(i) for i in rand.rng.choice(live, size, replace=False)]
                getattr(cache, op)(pick)
                if op == "free":
                    seqs = [s for s in seqs if not set(s) & set(pick)]
                    for i in pick:
                        del model[i]
            outcomes[True] += 1
        except ValueError:
            outcomes[False] += 1
            assert_same(before, snapshot(cache))
            if op == "append" and seq:
                seqs.append(seq)
        for i, k in model.items():
            got_k, got_v = cache.kv(i)
            assert torch.equal(got_k, k) and torch.equal(got_v, k + 1), str(rand)
    assert min(outcomes.values()) >= 10, outcomes


# --- refusals -------------------------------------------------------------------------

def test_refused_calls_leave_the_cache_unchanged(rand):
    cache = make_cache(num_blocks=6, num_cpu_blocks=4)
    assert cache.append([], tokens(rand, 2 * BS + 20), tokens(rand, 2 * BS + 20)) == [0, 1, 2]
    cache.offload(cache.append([], tokens(rand, BS), tokens(rand, BS)))  # 3
    cache.free(cache.allocate(1))  # 4
    cache.offload(cache.append([], tokens(rand, 2 * BS), tokens(rand, 2 * BS)))  # 5, 6
    cache.offload(cache.allocate(1))  # 7; the CPU pool is full, 3 device blocks are free
    k = tokens(rand, 10)
    calls = [
        (lambda: cache.allocate(4), "n: out of capacity: 4 blocks asked, 3"),
        (lambda: cache.allocate(-1), "n must be an integer >= 0"),
        (lambda: cache.append([0, 1, 99], k, k), "block 99 is unknown"),
        (lambda: cache.append([0, 1, 2, 4], k, k), "block 4 was freed"),
        (lambda: cache.append([0, 0], k, k), "repeated block ids"),
        (lambda: cache.append(0, k, k), "block_ids must be a list"),
        (lambda: cache.append([0, 1, 2], k.double(), k), "k must have the cache's dtype"),
        (lambda: cache.append([0, 1, 2], k, k.half()), "v must have the cache's dtype"),
        (lambda: cache.append([0, 1, 2], tokens(rand, 10, heads=3), k), r"k must be \[T, Hkv"),
        (lambda: cache.append([0, 1, 2], k, tokens(rand, 10, dim=8)), r"v must be \[T, Hkv"),
        (lambda: cache.append([0, 1, 2], k, k[:5]), "same number of tokens"),
        (lambda: cache.append([0, 1, 2], k.numpy(), k), "must be a torch.Tensor"),
        (lambda: cache.append([0, 1, 2], tokens(rand, 4 * BS), tokens(rand, 4 * BS)),
         "k: out of capacity: 256 tokens need 4 new blocks, 3"),
        (lambda: cache.append([2, 0], k, k), "block 2 holds 20 of 64 tokens but is not the"),
        (lambda: cache.free([0, 4]), "block 4 was freed"),
        (lambda: cache.free([0, True]), "block ids are ints"),
        (lambda: cache.offload([0, 3]), "block 3 is offloaded"),
        (lambda: cache.offload([0, 1]), "block_ids: out of CPU capacity: 2 blocks"),
        (lambda: cache.load([3, 0]), "block 0 is resident"),
        (lambda: cache.slot(3), "block 3 is offloaded"),
        (lambda: cache.tokens(4), "block 4 was freed"),
        (lambda: cache.sequence_length([]), "at least one block"),
        (lambda: cache.sequence_length([2, 1]), "block 2 holds 20 of 64 tokens"),
        (lambda: cache.stage_keys([3, 6, 7]), "3 offloaded blocks but only 2 staging"),
    ]
    for call, message in calls:
        assert_refused(cache, call, message, (ValueError, TypeError))


def test_load_needs_free_device_slots(rand):
    cache = make_cache()
    ids = cache.allocate(2)
    cache.offload(ids)
    cache.allocate(3)
    assert_refused(cache, lambda: cache.load(ids),
                   "block_ids: out of capacity: 2 blocks to load, 1")


def test_append_to_an_offloaded_last_block(rand):
    cache = make_cache()
    k = tokens(rand, BS + 3)
    ids = cache.append([], k[:BS], k[:BS])
    cache.offload(ids)
    ids = cache.append(ids, k[BS:], k[BS:])  # a full offloaded block needs no write
    assert len(ids) == 2 and not cache.is_resident(ids[0])
    cache.offload(ids[1:])
    assert_refused(cache, lambda: cache.append(ids, k[:1], k[:1]),
                   r"the last block, which has room\): block 1 is offloaded")


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(num_blocks=0), ValueError, "num_blocks must be an integer >= 1"),
    (dict(block_size=2.0), TypeError, "block_size must be an integer >= 1, got 2.0"),
    (dict(staging_slots=-1), ValueError, "staging_slots must be an integer >= 0"),
    (dict(dtype=torch.float64), ValueError, "dtype must be float32, bfloat16 or float16"),
    (dict(device="meta"), ValueError, "device must be the CPU or a CUDA device, got 'meta'"),
    (dict(device="gpu0"), ValueError, "device must be the CPU or a CUDA device, got 'gpu0'"),
    (dict(device=1.5), TypeError, "device must be a torch.device"),
])
def test_constructor_checks(kwargs, error, message):
    args = dict(num_blocks=2, block_size=BS, kv_heads=HKV, head_dim=D, device="cpu") | kwargs
    with pytest.raises(error, match=message):
        PagedKVCache(**args)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without a GPU")
@pytest.mark.parametrize("device", ["cuda", "cuda:1", torch.device("cuda"), 0])
def test_cuda_device_without_a_gpu_is_a_value_error(device):
    with pytest.raises(ValueError, match=r"^device is cuda(:\d)?, but torch sees no CUDA GPU"):
        PagedKVCache(2, BS, HKV, D, device=device)


def test_pool_layout():
    cache = PagedKVCache(3, BS, HKV, D, device="cpu", num_cpu_blocks=2, staging_slots=1)
    assert cache.dtype == torch.bfloat16
    assert cache.keys.shape == (4, BS, HKV, D) and cache.values.shape == (3, BS, HKV, D)
    assert cache.cpu_keys.shape == (2, BS, HKV, D) and not cache.cpu_keys.is_pinned()


# --- CUDA -----------------------------------------------------------------------------

@pytest.mark.gpu
@needs_cuda
def test_cuda_pinned_pool_and_round_trip(rand):
    cache = make_cache(device="cuda", dtype=torch.bfloat16)
    assert cache.device.type == "cuda" and cache.device.index is not None
    assert cache.cpu_keys.is_pinned() and cache.cpu_values.is_pinned()
    k, v = tokens(rand, 2 * BS + 7, torch.bfloat16), tokens(rand, 2 * BS + 7, torch.bfloat16)
    ids = cache.append([], k, v)  # from CPU tensors
    cache.offload(ids[:2])
    cache.load(ids[1:2])
    got_k, got_v = contents(cache, ids)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)


@pytest.mark.gpu
@needs_cuda
def test_cuda_stage_keys_overlaps_the_current_stream(rand):
    """The staging copies finish while torch's current stream is still busy."""
    cache = make_cache(device="cuda")
    k = tokens(rand, 3 * BS).cuda()
    ids = cache.append([], k, k)
    cache.offload(ids[:2])
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second of work on the current stream
    pages, event = cache.stage_keys(ids)
    event.synchronize()
    assert not torch.cuda.current_stream().query(), "the copies waited for the stream"
    assert isinstance(event, torch.cuda.Event) and pages[:2] == [4, 5]
    torch.cuda.current_stream().wait_event(event)
    assert torch.equal(cache.keys[pages].reshape(-1, HKV, D), k)


@pytest.mark.gpu
@needs_cuda
def test_cuda_block_table_is_ordered_without_waiting(rand):
    """block_table returns while torch's current stream is still busy (no host wait), and
    work queued on that stream afterwards reads the staged keys and the table."""
    cache = make_cache(device="cuda")
    k = tokens(rand, 3 * BS).cuda()
    ids = cache.append([], k, k)
    cache.offload(ids[:2])
    cache.block_table(ids, 4)  # allocates this width's buffers
    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000_000)  # about half a second on the current stream
    start = time.perf_counter()
    table = cache.block_table(ids, 4)
    host_s = time.perf_counter() - start
    pages = table[:3].long()
    got = cache.keys[pages].reshape(-1, HKV, D).clone()  # queued after the table
    assert not torch.cuda.current_stream().query() and host_s < 0.1
    assert torch.equal(got, k) and table.tolist() == [4, 5, cache.slot(ids[2]), 4, 3 * BS]
