"""PagedKVCache(key_shadow="fp8"): the shadow holds `xattn_jax.quantize_keys` of every
live block's keys through append, offload, load and free, and XAttentionPolicy's
selection on it copies no offloaded page (`cache.copies`) and is the selection of the
dequantized keys.

The `gpu` test needs torch with CUDA and JAX's CUDA backend in one process
(`pytest -m gpu tests/test_key_shadow.py`).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from bridge_inputs import needs_cuda  # noqa: E402
from cache_state import assert_refused  # noqa: E402
from cases import PAGE_SIZE, PAGED  # noqa: E402
from test_policy import context  # noqa: E402
from xattn_jax import fp8  # noqa: E402
from xattn_torch_bridge import PagedKVCache, XAttentionPolicy  # noqa: E402
from xattn_torch_bridge import key_shadow  # noqa: E402

BS, HKV, HQ, D = PAGE_SIZE, PAGED.kv_heads, PAGED.q_heads, PAGED.head_dim
EBS, STRIDE = PAGED.block_size, PAGED.stride
GPU_EBS = 64  # the estimate block of the Pallas kernel's GPU tests (test_policy.py)


def make_cache(**kwargs) -> PagedKVCache:
    args = dict(num_blocks=8, block_size=BS, kv_heads=HKV, head_dim=D, dtype=torch.float32,
                device="cpu", num_cpu_blocks=6, staging_slots=1, key_shadow="fp8")
    return PagedKVCache(**(args | kwargs))


def tokens(rand, count: int) -> torch.Tensor:
    """`[count, Hkv, D]` keys with a common offset (what the shadow's offsets hold)."""
    x = rand.rng.standard_normal((count, HKV, D)) + rand.rng.standard_normal(D) * 3
    return torch.from_numpy(x).float()


def shadow_of(cache: PagedKVCache, block_id: int) -> tuple[np.ndarray, ...]:
    """The block's shadow page: values (uint8 bits), scales, offsets, as numpy."""
    page = cache.shadow_page(block_id)
    s = cache.shadow
    return tuple(x[page].cpu().numpy() for x in (s.values, s.scales, s.offsets))


def expected_shadow(cache: PagedKVCache, block_id: int) -> tuple[np.ndarray, ...]:
    """`xattn_jax.quantize_keys` of the block's keys, wherever the block lives."""
    filled = cache.kv(block_id)[0].cpu()
    page = torch.zeros(BS, HKV, D, dtype=filled.dtype)
    page[:len(filled)] = filled
    keys = jnp.asarray(page.float().numpy(), str(page.dtype).removeprefix("torch."))
    q8 = fp8.quantize_keys(keys[None], group=cache.shadow.group,
                           paged=True, tokens=np.array([len(filled)], np.int32))
    values = np.asarray(q8.values).view(np.uint8)
    return values[0], np.asarray(q8.scales)[0], np.asarray(q8.offsets)[0]


def assert_shadow_in_step(cache: PagedKVCache, ids, msg: str = "") -> None:
    for i in ids:
        if cache.tokens(i):
            for got, want in zip(shadow_of(cache, i), expected_shadow(cache, i)):
                np.testing.assert_array_equal(got, want, err_msg=f"block {i} {msg}")


def test_shadow_kept_in_step_through_append_offload_and_load(rand):
    """Random appends (partial pages filled in several steps), offloads, loads and
    frees: every live block's shadow is the quantization of its keys; offload and load
    copy K and V but leave the shadow as it was."""
    cache = make_cache()
    seqs: list[list[int]] = []
    for _ in range(40):
        op = rand.rng.choice(["append", "append", "offload", "load", "free"])
        live = [i for s in seqs for i in s]
        if op == "append":
            extend = seqs and rand.rng.random() < 0.7
            seq = seqs.pop(rand.rng.integers(len(seqs))) if extend else []
            new = tokens(rand, int(rand.rng.integers(1, BS + 20)))
            try:
                seq = cache.append(seq, new, new + 1)
            except ValueError:  # out of room, or an offloaded last block with room
                pass
            if seq:
                seqs.append(seq)
        else:  # offload picks resident blocks, load offloaded ones, free any
            fits = {"offload": cache.is_resident, "load": lambda i: not cache.is_resident(i),
                    "free": lambda i: True}
            able = [i for i in live if fits[op](i)]
            if not able:
                continue
            pick = [int(i) for i in rand.rng.choice(able, min(len(able), 2), replace=False)]
            before = {i: shadow_of(cache, i) for i in live}
            try:
                getattr(cache, op)(pick)
            except ValueError:
                continue
            if op == "free":
                seqs = [s for s in seqs if not set(s) & set(pick)]
            else:
                for i in live:
                    for a, b in zip(before[i], shadow_of(cache, i)):
                        np.testing.assert_array_equal(a, b, err_msg=f"{op} {rand}")
        assert_shadow_in_step(cache, [i for s in seqs for i in s], str(rand))
    # A full cache may refuse every random load: end with a round trip that cannot fail.
    for seq in seqs:
        cache.free(seq)
    seq = cache.append([], tokens(rand, 2 * BS), tokens(rand, 2 * BS))
    before = [shadow_of(cache, i) for i in seq]
    cache.offload(seq)
    cache.load(seq[:1])
    for i, want in zip(seq, before):
        for a, b in zip(want, shadow_of(cache, i)):
            np.testing.assert_array_equal(a, b, err_msg=f"round trip {rand}")
    assert_shadow_in_step(cache, seq, str(rand))
    assert cache.copies["offload"] >= 2 and cache.copies["load"] >= 1, dict(cache.copies)
    assert cache.shadow.free_pages == cache.free_blocks + cache.free_cpu_blocks  # a page each


def test_shadow_table_addresses_the_shadow_pages(rand):
    cache = make_cache()
    ids = cache.append([], tokens(rand, 2 * BS + 5), tokens(rand, 2 * BS + 5))
    cache.offload(ids[:2])
    table = cache.shadow_table(ids, 4)
    pages = [cache.shadow_page(i) for i in ids]
    assert table.tolist() == pages + [pages[0], 2 * BS + 5] and cache.copies["stage"] == 0
    assert cache.shadow.values.dtype == torch.uint8
    assert cache.shadow.scales.shape == (14, BS // fp8.GROUP, HKV)
    assert cache.shadow.offsets.shape == (14, BS // fp8.GROUP, HKV, D)


def _selection_setup(rand, shadow: str | None = "fp8", device: str = "cpu",
                     dtype=torch.float32):
    k, v, q = context(rand, 6 * BS + 9)
    cache = make_cache(key_shadow=shadow, device=device, dtype=dtype)
    ids = cache.append([], k.to(device, dtype), v.to(device, dtype))
    return cache, ids, q.to(device, dtype)


def test_selection_on_offloaded_blocks_copies_nothing(rand):
    """With the shadow, a selection over a sequence whose blocks are mostly offloaded
    (more than the one staging slot) copies no page, and is the same whatever is
    offloaded; without it, the same call stages (and is refused past the slots)."""
    cache, ids, q = _selection_setup(rand)
    policy = XAttentionPolicy(0.6, STRIDE, EBS)
    resident = policy.select_blocks(q, cache, ids)
    cache.offload(ids[:5])
    before = dict(cache.copies)
    assert policy.select_blocks(q, cache, ids) == resident
    assert dict(cache.copies) == before == {"offload": 5}
    plain, plain_ids, _ = _selection_setup(rand, shadow=None)
    plain.offload(plain_ids[:1])
    policy.select_blocks(q, plain, plain_ids)
    assert plain.copies["stage"] == 1  # the copy the shadow saves
    plain.offload(plain_ids[1:3])
    assert_refused(plain, lambda: policy.select_blocks(q, plain, plain_ids),
                   "3 offloaded blocks but only 1 staging")


@pytest.mark.parametrize("kwargs", [dict(threshold=0.6), dict(threshold=0.8, rule="vote"),
                                    dict(threshold=0.6, per_kv_head=True)],
                         ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_selection_is_that_of_the_dequantized_keys(rand, kwargs):
    """The shadow's selection is the plain cache's on the keys the shadow stands for
    (dequantized, in the cache's dtype): the same estimate, read through pages."""
    cache, ids, q = _selection_setup(rand)
    policy = XAttentionPolicy(stride=STRIDE, estimate_block_size=EBS, impl="reference",
                              **kwargs)
    cache.offload(ids[2:4])
    got = policy.select_blocks(q, cache, ids)
    s = cache.shadow
    q8 = fp8.Fp8Keys(jnp.asarray(s.values.numpy()).view(fp8.FP8), jnp.asarray(s.scales),
                     jnp.asarray(s.offsets), s.group, paged=True)
    pages = torch.from_numpy(np.array(fp8.dequantize(q8)))
    plain = make_cache(key_shadow=None)
    plain_ids = []
    for i in ids:
        n = cache.tokens(i)
        plain_ids = plain.append(plain_ids, pages[cache.shadow_page(i), :n],
                                 cache.kv(i)[1][:n])
    assert [ids.index(i) for i in got] == \
        [plain_ids.index(i) for i in policy.select_blocks(q, plain, plain_ids)]
    assert 0 < len(got) < len(ids) or kwargs.get("rule") == "vote", (got, str(rand))


def test_group_of_the_page():
    assert key_shadow.group_for(16) == key_shadow.group_for(4096) == fp8.GROUP == 16
    assert key_shadow.group_for(8) == 8 and key_shadow.group_for(7) == 7


def test_refusals(rand):
    with pytest.raises(ValueError, match=r"key_shadow must be one of \('fp8',\), got 'int8'"):
        make_cache(key_shadow="int8")
    with pytest.raises(TypeError, match="key_shadow must be one of"):
        make_cache(key_shadow=True)
    plain = make_cache(key_shadow=None)
    ids = plain.append([], tokens(rand, 10), tokens(rand, 10))
    for call in (lambda: plain.shadow_table(ids, 2), lambda: plain.shadow_page(ids[0])):
        assert_refused(plain, call, "this cache keeps no key shadow")
    cache = make_cache()
    ids = cache.append([], tokens(rand, BS + 3), tokens(rand, BS + 3))
    calls = [(lambda: cache.shadow_table(ids, 1), "width must be an int >= the 2 blocks"),
             (lambda: cache.shadow_table(ids[::-1], 2), "holds 3 of 64 tokens"),
             (lambda: cache.append(ids, tokens(rand, 9 * BS), tokens(rand, 9 * BS)),
              "out of capacity"),
             (lambda: cache.shadow_page(99), "block 99 is unknown")]
    for call, match in calls:
        assert_refused(cache, call, match)


@pytest.mark.gpu
@needs_cuda
def test_cuda_selection_on_offloaded_blocks_copies_nothing(rand):
    """On CUDA (pinned CPU pool, the estimate in Pallas): the shadow's selection copies
    no page, is the same with the blocks resident or offloaded, and is the plain cache's
    with every block resident up to pages near the threshold."""
    cache, ids, q = _selection_setup(rand, device="cuda", dtype=torch.bfloat16)
    policy = XAttentionPolicy(0.6, STRIDE, GPU_EBS)
    resident = policy.select_blocks(q, cache, ids)
    cache.offload(ids[:5])
    before = dict(cache.copies)
    assert policy.select_blocks(q, cache, ids) == resident
    torch.cuda.synchronize()
    assert dict(cache.copies) == before == {"offload": 5}
    cache.load(ids[:5])
    assert cache.copies["load"] == 5 and policy.select_blocks(q, cache, ids) == resident
    assert_shadow_in_step(cache, ids, str(rand))
