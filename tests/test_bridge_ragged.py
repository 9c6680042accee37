"""`xattn_torch_bridge.ragged_xattention`: a vLLM-style varlen call of torch tensors.

The same results as `xattn_jax.ragged_xattention` on the same step; `out` written; the
flash-attn options honoured, ignored or refused by name; one compilation for the steps of
a bucket; a `PagedKVCache`'s `step_args` feed the call.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import jax  # noqa: E402
import xattn_jax  # noqa: E402
from xattn_jax import defaults, impls  # noqa: E402
import xattn_torch_bridge as xb  # noqa: E402
from ragged_steps import make_step, random_lengths  # noqa: E402
from xattn_torch_bridge import ragged as bridge_ragged  # noqa: E402

BLOCK = 32


def _torch_args(step):
    tensors = dict(q=torch.tensor(step.q), k=torch.tensor(step.k), v=torch.tensor(step.v))
    meta = dict(cu_seqlens_q=torch.tensor(step.cu_q_lens), max_seqlen_q=64,
                seqused_k=torch.tensor(step.kv_lens), max_seqlen_k=1024,
                block_table=torch.tensor(step.page_indices))
    return tensors, meta


def test_equals_the_jax_call_and_writes_out(rand):
    step = make_step(rand.rng, [(64, 100), (1, 30), (40, 72)])
    tensors, meta = _torch_args(step)
    out = torch.full_like(tensors["q"], float("nan"))
    result = xb.ragged_xattention(**tensors, **meta, out=out, block_size=BLOCK)
    want = xattn_jax.ragged_xattention(*step.args(), block_size=BLOCK, impl="reference")
    assert result is out
    np.testing.assert_allclose(out.numpy(), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_sampled_rows_equal_the_jax_call(rand):
    step = make_step(rand.rng, [(64, 100), (1, 30), (40, 72)])
    tensors, meta = _torch_args(step)
    result = xb.ragged_xattention(**tensors, **meta, block_size=BLOCK,
                                  estimate="sampled-rows")
    want = xattn_jax.ragged_xattention(*step.args(), block_size=BLOCK, impl="reference",
                                       estimate="sampled-rows")
    np.testing.assert_allclose(result.numpy(), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_one_compilation_per_bucket(rand):
    """Steps of 100 rows and 3-4 live requests over one cache pad to one bucket (112
    rows, 4 slots, 4 table columns)."""
    compiled = bridge_ragged._compiled(None, BLOCK, 8, defaults.MIN_BLOCKS,
                                       defaults.DENSE_LAST, "antidiagonal",
                                       impls.resolve_ragged("auto", device=jax.devices("cpu")[0]),
                                       4)
    before = compiled._cache_size()
    for _ in range(4):
        lengths = random_lengths(rand.rng, int(rand.rng.integers(3, 5)), block_size=BLOCK,
                                 max_kv=25)
        step = make_step(rand.rng, lengths, pages_per_seq=4, spare_slots=4 - len(lengths),
                         spare_tokens=100 - sum(q for q, _ in lengths))
        tensors, meta = _torch_args(step)
        result = xb.ragged_xattention(**tensors, **meta, block_size=BLOCK)
        want = xattn_jax.ragged_xattention(*step.args(), block_size=BLOCK,
                                           impl="reference")
        np.testing.assert_allclose(result.numpy(), np.asarray(want), rtol=1e-6, atol=1e-6)
    assert compiled._cache_size() - before <= 1


@pytest.mark.parametrize("option, value, error", [
    ("window_size", (128, 0), ValueError), ("softcap", 30.0, ValueError),
    ("alibi_slopes", torch.ones(4), ValueError), ("s_aux", torch.zeros(4), ValueError),
    ("k_descale", torch.ones(1), ValueError), ("return_softmax_lse", True, ValueError),
    ("causal", False, ValueError), ("rotary", True, TypeError)])
def test_unsupported_options_are_refused_by_name(rand, option, value, error):
    step = make_step(rand.rng, [(64, 100)])
    tensors, meta = _torch_args(step)
    with pytest.raises(error, match=option):
        xb.ragged_xattention(**tensors, **meta, block_size=BLOCK, **{option: value})


def test_tuning_options_are_ignored(rand):
    step = make_step(rand.rng, [(64, 100)])
    tensors, meta = _torch_args(step)
    plain = xb.ragged_xattention(**tensors, **meta, block_size=BLOCK)
    tuned = xb.ragged_xattention(**tensors, **meta, block_size=BLOCK, num_splits=4,
                                 fa_version=3, scheduler_metadata=None,
                                 window_size=(-1, -1), softcap=0.0)
    assert torch.equal(plain, tuned)


def test_bad_tensors_name_the_argument(rand):
    step = make_step(rand.rng, [(64, 100)])
    tensors, meta = _torch_args(step)
    with pytest.raises(ValueError, match="k is not contiguous"):
        xb.ragged_xattention(**dict(tensors, k=tensors["k"].transpose(1, 2)), **meta)
    with pytest.raises(ValueError, match="seqused_k must have dtype int32"):
        xb.ragged_xattention(**tensors, **dict(meta, seqused_k=meta["seqused_k"].long()))
    with pytest.raises(ValueError, match="cu_seqlens_q must hold S \\+ 1"):
        xb.ragged_xattention(**tensors, **dict(meta, cu_seqlens_q=meta["cu_seqlens_q"][:-1]))
    with pytest.raises(TypeError, match="max_seqlen_q"):
        xb.ragged_xattention(**tensors, **dict(meta, max_seqlen_q=None))
    with pytest.raises(ValueError, match="estimate"):
        xb.ragged_xattention(**tensors, **meta, estimate="exact")


def test_a_paged_cache_builds_the_step(rand):
    """Two prompts and a decode row appended to a PagedKVCache of 16-token pages: the
    step's arguments from `step_args` give each request its own attention."""
    cache = xb.PagedKVCache(num_blocks=40, block_size=16, kv_heads=2, head_dim=16,
                            dtype=torch.float32, device="cpu")
    lengths = [(64, 96), (40, 72), (1, 33)]
    seqs, queries, contexts = [], [], []
    for q_len, kv_len in lengths:
        k, v = (torch.tensor(rand.rng.standard_normal((kv_len, 2, 16)), dtype=torch.float32)
                for _ in range(2))
        seqs.append((cache.append([], k, v), q_len))
        queries.append(torch.tensor(rand.rng.standard_normal((q_len, 4, 16)),
                                    dtype=torch.float32))
        contexts.append((k, v))
    q = torch.cat(queries)
    step_args = cache.step_args(seqs)
    assert step_args["block_table"].shape == (3, 6)
    assert step_args["seqused_k"].tolist() == [96, 72, 33]
    assert step_args["cu_seqlens_q"].tolist() == [0, 64, 104, 105]
    out = xb.ragged_xattention(q, cache.keys, cache.values, **step_args, block_size=BLOCK)
    start = 0
    for (q_len, kv_len), (k, v) in zip(lengths, contexts):
        # the request alone, its keys as one page
        want = xattn_jax.ragged_xattention(
            q[start:start + q_len].numpy(), k[None].numpy(), v[None].numpy(),
            np.array([kv_len], np.int32), np.zeros((1, 1), np.int32),
            np.array([0, q_len], np.int32), 1, block_size=BLOCK, impl="reference")
        np.testing.assert_allclose(out[start:start + q_len].numpy(), np.asarray(want),
                                   rtol=1e-5, atol=1e-5)
        start += q_len


def test_step_args_refuse_bad_sequences(rand):
    cache = xb.PagedKVCache(num_blocks=8, block_size=16, kv_heads=2, head_dim=16,
                            dtype=torch.float32, device="cpu")
    pages = cache.append([], torch.zeros(20, 2, 16), torch.zeros(20, 2, 16))
    with pytest.raises(ValueError, match="q_len must be at most"):
        cache.step_args([(pages, 21)])
    with pytest.raises(ValueError, match="seqs"):
        cache.step_args([])
    with pytest.raises(ValueError, match=r"seqs\[0\]"):
        cache.step_args([pages])


def test_token_buckets_pad_at_most_a_quarter():
    sizes = [bridge_ragged.token_bucket(t) for t in range(1, 5000)]
    assert sizes[:16] == [16] * 16 and sorted(set(sizes))[:6] == [16, 20, 24, 28, 32, 40]
    assert all(t <= size < 1.25 * t + 16 for t, size in zip(range(1, 5000), sizes))
