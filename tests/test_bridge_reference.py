"""xattn_torch_bridge.reference against docs/estimate.md and across frameworks.

Cross-framework: on fresh random inputs the pure-torch reference (float64), the JAX
reference and the Pallas kernels (interpret mode off a GPU, Triton on it) give the same
block sums to float32 rounding, and the torch selection applied to each JAX
implementation's block sums gives exactly that implementation's mask. (Masks computed from
slightly different sums may legitimately differ where a running total lands within
rounding of the target, so masks are compared on identical sums.)

The `gpu` tests need torch with CUDA and JAX's CUDA backend in one process
(`pytest -m gpu tests/test_bridge_reference.py`).
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import xattn_jax  # noqa: E402
import xattn_torch_bridge as bridge  # noqa: E402
from bridge_inputs import needs_cuda, qk  # noqa: E402
from cases import BRIDGE, GPU_GQA, EstimateCase  # noqa: E402
from xattn_torch_bridge import reference as ref  # noqa: E402

CROSS = [  # case of cases.BRIDGE, dtype, JAX implementation
    ("causal-gqa", torch.float32, "reference"),
    ("causal-chunk", torch.float32, "reference"),
    ("ragged-noncausal", torch.float32, "reference"),
    ("causal-gqa", torch.bfloat16, "triton"),
    ("ragged-noncausal", torch.float32, "triton"),
]

# the shapes of single tests below
PARTIAL_GROUPS = EstimateCase("partial-stride-groups", 1, 2, 1, 10, 7, 3, 4, 4, False)
HIERARCHY = EstimateCase("block-hierarchy", 1, 2, 2, 128, 128, 8, 4, 16, True)
KV_HIERARCHY = EstimateCase("kv-hierarchy", 2, 4, 2, 64, 320, 8, 8, 32, False)
KV_VS_BLOCK_SUMS = EstimateCase("kv-vs-block-sums", 1, 4, 2, 64, 256, 16, 8, 32, False)
KV_CHUNK = EstimateCase("kv-chunk", 1, 4, 2, 160, 1024, 16, 8, 64, False)  # q_len varies
GPU_NONCAUSAL = EstimateCase("gpu-noncausal", 2, 4, 4, 1000, 1800, 64, 8, 64, False)


def thresholds(rand, heads: int) -> list[float]:
    return rand.rng.uniform(0.3, 0.98, heads).tolist()


def check_agreement(q, k, kwargs, impl, rand):
    """torch reference (float64) vs one JAX implementation through the bridge. Block sums
    agree within 2e-5 of the largest for float32 inputs, 2e-3 for 16-bit inputs (the
    kernels' tolerance in test_block_sums.py: they may round intermediates to 16 bits)."""
    tolerance = 2e-5 if q.dtype == torch.float32 else 2e-3
    kwargs = dict(kwargs, threshold=thresholds(rand, q.shape[1]))
    sums, mask = bridge.xattn_estimate(q, k, impl=impl, **kwargs)
    sums64, _ = ref.xattn_estimate(q.double(), k.double(), **kwargs)
    sums, sums64 = sums.cpu().double(), sums64.cpu()
    np.testing.assert_allclose(sums.numpy(), sums64.numpy(), rtol=0,
                               atol=tolerance * float(sums64.max()), err_msg=str(rand))
    selection = {k: v for k, v in kwargs.items() if k in ("causal", "keep_sink", "keep_recent")}
    again = ref.select_blocks(sums.float(), kwargs["threshold"], **selection)
    assert torch.equal(again, mask.cpu()), f"{rand}: {(again != mask.cpu()).sum()} differ"


@pytest.mark.parametrize("case,dtype,impl", CROSS, ids=lambda x: str(x).removeprefix("torch."))
def test_torch_reference_agrees_with_jax(case, dtype, impl, rand):
    check_agreement(*qk(rand, BRIDGE[case], dtype), BRIDGE[case].options, impl, rand)


# --- section 1 ------------------------------------------------------------------------

def test_strided_scores_follow_the_formula(rand):
    """A[i, j] = sum_s q[i*S + S-1-s] . k[j*S + s] / (sqrt(D) S norm), written as loops;
    lengths 10 and 7 leave partial stride groups, read as zeros; GQA group 2."""
    stride, norm = PARTIAL_GROUPS.stride, 1.5
    q, k = qk(rand, PARTIAL_GROUPS, torch.float64)
    scores = ref.strided_scores(q, k, stride, norm)
    assert scores.shape == (1, 2, 3, 2) and scores.dtype == torch.float64

    def token(x, h, n):
        return x[0, h, n] if n < x.shape[2] else torch.zeros(x.shape[3], dtype=x.dtype)

    for h in range(2):
        for i in range(3):
            for j in range(2):
                total = sum(float(token(q, h, i * stride + stride - 1 - s)
                                  @ token(k, h // 2, j * stride + s)) for s in range(stride))
                expected = total / (math.sqrt(3) * stride * norm)
                assert abs(float(scores[0, h, i, j]) - expected) < 1e-12, str(rand)


# --- sections 2 and 3 -----------------------------------------------------------------

def test_causal_probs_hide_the_future_and_sum_to_one(rand):
    scores = torch.from_numpy(rand.rng.standard_normal((1, 1, 4, 6)))
    probs = ref.attention_probs(scores, causal=True, offset=2)
    assert torch.allclose(probs.sum(-1), torch.ones(1, 1, 4, dtype=torch.float64))
    for i in range(4):
        assert torch.all(probs[0, 0, i, i + 3:] == 0) and torch.all(probs[0, 0, i, :i + 3] > 0)


def test_block_sums_rows_and_hierarchy(rand):
    q, k = qk(rand, HIERARCHY, torch.float64)
    probs = ref.attention_probs(ref.strided_scores(q, k, HIERARCHY.stride), causal=True)
    fine, coarse = ref.block_sums(probs, 4), ref.block_sums(probs, 16)
    assert torch.allclose(fine.sum(-1), torch.full(fine.shape[:-1], 4.0, dtype=torch.float64))
    assert torch.allclose(ref.block_sums(fine, 4), coarse, rtol=0, atol=1e-12)


# --- section 4 ------------------------------------------------------------------------

def select_row(row, threshold, **rules):
    """The selected key blocks of one row, [qb = kb = 1 ... ] given as `[1, 1, 1, kb]`."""
    mask = ref.select_blocks(torch.tensor([[[row]]], dtype=torch.float64), threshold, **rules)
    return [j for j, on in enumerate(mask[0, 0, 0].tolist()) if on]


def test_selection_stops_on_reaching_the_target():
    # T = 10: 4 is below 7, 4 + 3 reaches it exactly, so nothing more is taken.
    assert select_row([1.0, 4.0, 2.0, 3.0], 0.7, causal=False) == [1, 3]
    assert select_row([1.0, 4.0, 2.0, 3.0], 0.71, causal=False) == [1, 2, 3]


def test_selection_ties_take_the_lower_index_first():
    assert select_row([2.0, 3.0, 3.0, 2.0], 0.3, causal=False) == [1]
    assert select_row([2.0, 3.0, 3.0, 2.0], 0.7, causal=False) == [0, 1, 2]


def test_forced_blocks_count_towards_the_target():
    # keep_sink forces block 0 (mass 5 of 10); 0.6 needs 1 more: the largest other, 3.
    assert select_row([5.0, 1.0, 3.0, 1.0], 0.6, causal=False, keep_sink=True) == [0, 2]
    assert select_row([5.0, 1.0, 3.0, 1.0], 0.5, causal=False, keep_sink=True) == [0]
    assert select_row([5.0, 1.0, 3.0, 1.0], 0.5, causal=False, keep_recent=True) == [0, 3]


def test_causal_selection_forces_sink_and_diagonal_and_never_looks_ahead():
    # qb = 2, kb = 4: row 0's diagonal is block 2, row 1's is block 3.
    sums = torch.tensor([[[[0.5, 0.1, 0.4, 0.0], [0.1, 0.6, 0.2, 0.1]]]], dtype=torch.float64)
    mask = ref.select_blocks(sums, 0.1, causal=True)  # the forced blocks suffice
    assert mask[0, 0].tolist() == [[True, False, True, False], [True, False, False, True]]
    sums[0, 0, 0, 3] = 9.0  # mass after the diagonal (impossible from real data) ...
    mask = ref.select_blocks(sums, 1.0, causal=True)  # ... is never selected
    assert mask[0, 0].tolist() == [[True, True, True, False], [True, True, True, True]]


def test_non_finite_rows_select_every_visible_block():
    sums = torch.tensor([[[[1.0, math.nan, 0.0, 0.0], [1.0, 0.0, math.inf, 0.0]]]])
    mask = ref.select_blocks(sums, 0.5, causal=True)
    assert mask[0, 0].tolist() == [[True, True, True, False], [True, True, True, True]]


def test_estimate_refusals():
    q, k = torch.zeros(1, 2, 64, 8), torch.zeros(1, 2, 96, 8)
    with pytest.raises(ValueError, match="multiple of block_size"):
        ref.xattn_estimate(q, k, block_size=64, stride=8, causal=True)
    with pytest.raises(ValueError, match="multiple of stride"):
        ref.xattn_estimate(q, k, block_size=12, stride=8)
    with pytest.raises(ValueError, match="q may not be longer"):
        ref.xattn_estimate(k, q, block_size=32, stride=8, causal=False)
    with pytest.raises(ValueError, match="Hq a multiple of Hkv"):
        ref.xattn_estimate(torch.zeros(1, 3, 64, 8), k, block_size=32, stride=8)
    with pytest.raises(ValueError, match="threshold must be"):
        ref.xattn_estimate(q, k, block_size=32, stride=8, threshold=[0.5], causal=False)


# --- section 5 ------------------------------------------------------------------------

def test_kv_block_scores_hierarchical_equals_direct(rand):
    q, k = qk(rand, KV_HIERARCHY, torch.float64)
    hierarchical = ref.kv_block_scores(q, k, 128, 32, 8, k_len=300)
    direct = ref.kv_block_scores(q, k, 128, 128, 8, k_len=300)
    assert hierarchical.shape == (2, 4, 3)  # ceil(300 / 128) KV blocks
    assert torch.allclose(hierarchical, direct, rtol=0, atol=1e-12)
    assert torch.allclose(hierarchical, ref.kv_block_scores(q, k[:, :, :300], 128, 32, 8),
                          rtol=0, atol=0)
    rows = ref.kv_block_scores(q, k, 128, 32, 8, k_len=300, per_query_block=True)
    assert rows.shape == (2, 4, 1, 3) and torch.allclose(rows.sum(2), hierarchical)
    # every query row's softmax mass is 1: the scores sum to the chunk's rows, 64 / 8
    assert torch.allclose(hierarchical.sum(-1), torch.full((2, 4), 8.0, dtype=torch.float64))


def test_kv_block_scores_agree_with_jax_block_sums(rand):
    """JAX's non-causal block sums at the estimate block size, summed the same way."""
    q, k = qk(rand, KV_VS_BLOCK_SUMS)
    sums, _ = bridge.xattn_estimate(q, k, impl="reference", **KV_VS_BLOCK_SUMS.options)
    from_jax = ref.block_sums(sums.double(), 2).sum(dim=2)  # KV blocks of 64 tokens
    scores = ref.kv_block_scores(q.double(), k.double(), 64, 32, 8)
    np.testing.assert_allclose(from_jax.numpy(), scores.numpy(), rtol=0, atol=1e-5,
                               err_msg=str(rand))


def kv_chunk(rand, q_len: int):
    """A chunk's q (float32 torch `[1, 4, q_len, 16]`) and a cache buffer k of 1024
    tokens (`[1, 2, 1024, 16]`), each with its JAX copy."""
    q, k = qk(rand, dataclasses.replace(KV_CHUNK, q_len=q_len))
    return q, k, jnp.asarray(q.numpy()), jnp.asarray(k.numpy())


@pytest.mark.parametrize("k_len", [1024, 777, 300, 5])
def test_kv_block_scores_agree_with_xattn_jax(k_len, rand):
    """xattn_jax.kv_block_scores (its JAX reference; test_kv_blocks.py checks the kernel
    against float64 numpy) on a buffer filled to k_len: the torch reference's scores, and
    EMPTY_BLOCK for the blocks past them (they hold no key)."""
    q, k, q_jax, k_jax = kv_chunk(rand, 160)
    got = np.asarray(xattn_jax.kv_block_scores(q_jax, k_jax, kv_block_size=256,
                                               estimate_block_size=64, stride=8,
                                               k_len=jnp.int32(k_len), impl="reference"))
    want = ref.kv_block_scores(q.double(), k.double(), 256, 64, 8, k_len=k_len).numpy()
    n = want.shape[-1]
    np.testing.assert_allclose(got[..., :n], want, rtol=1e-5, atol=1e-5 * want.max(),
                               err_msg=str(rand))
    assert np.all(got[..., n:] == xattn_jax.kv_blocks.EMPTY_BLOCK), str(rand)


@pytest.mark.parametrize("rule", ["score", "vote"])
@pytest.mark.parametrize("per_kv_head", [False, True])
def test_kv_selection_agrees_with_xattn_jax(rule, per_kv_head, rand):
    """xattn_jax.select_kv_blocks and the torch reference pick the same blocks from the
    same scores."""
    _, _, q, k = kv_chunk(rand, 256)
    scores = xattn_jax.kv_block_scores(q, k, kv_block_size=128, estimate_block_size=64,
                                       stride=8, per_query_block=rule == "vote",
                                       impl="reference")
    for threshold, num_valid in ((0.9, 8), (0.95, 6), (0.5, 3)):
        got = xattn_jax.select_kv_blocks(scores, threshold=threshold, per_kv_head=per_kv_head,
                                         kv_heads=2, num_valid=num_valid, rule=rule)
        want = ref.select_kv_blocks(torch.from_numpy(np.asarray(scores, np.float64)),
                                    threshold, True, True, 2 if per_kv_head else None,
                                    num_valid, rule)
        assert got.shape == ((1, 2, 8) if per_kv_head else (1, 8))
        assert np.array_equal(np.asarray(got).reshape(want.shape), want.numpy()), \
            f"threshold={threshold}, num_valid={num_valid}, {rand}"


def kv_select(scores, threshold, **kwargs):
    mask = ref.select_kv_blocks(torch.tensor(scores, dtype=torch.float64), threshold, **kwargs)
    return [[n for n, on in enumerate(group) if on] for batch in mask.tolist() for group in batch]


def test_score_rule_takes_shares_until_the_threshold():
    scores = [[[1.0, 4.0, 2.0, 3.0]]]  # shares 0.1 0.4 0.2 0.3
    assert kv_select(scores, 0.7, keep_first=False, keep_last=False) == [[1, 3]]
    assert kv_select(scores, 0.7) == [[0, 1, 3]]  # + first and last (3 already in)
    assert kv_select(scores, 0.3, keep_first=False) == [[1, 3]]  # + last
    # averaged over heads: head means 2.5 2.5 2.5 2.5 -> a tie, lower index first
    assert kv_select([[[1.0, 4.0, 2.0, 3.0], [4.0, 1.0, 3.0, 2.0]]], 0.5,
                     keep_first=False, keep_last=False) == [[0, 1]]


def test_score_rule_per_kv_head_and_valid_blocks():
    scores = [[[0.0, 1.0, 5.0, 9.0], [0.0, 3.0, 1.0, 9.0], [6.0, 1.0, 1.0, 9.0],
               [4.0, 1.0, 1.0, 9.0]]]
    # KV head 0 averages query heads 0-1: 0 2 3 (9 ignored); KV head 1: 5 1 1
    assert kv_select(scores, 0.5, keep_first=False, keep_last=False, per_kv_head=2,
                     num_valid=3) == [[2], [0]]
    mask = ref.select_kv_blocks(torch.tensor(scores * 2), 0.5, per_kv_head=2,
                                num_valid=torch.tensor([3, 4]))
    assert mask.shape == (2, 2, 4)
    assert mask[0, :, 3].tolist() == [False, False] and mask[1, :, 3].tolist() == [True, True]


def test_vote_rule_is_a_strict_majority_of_rows():
    # one head, four query blocks: block 0 wins 3 of 4 rows, block 1 wins 2 (a tie: out)
    rows = [[[[5.0, 1.0, 0.0], [5.0, 1.0, 0.0], [5.0, 1.0, 0.0], [1.0, 5.0, 0.0]]]]
    assert kv_select(rows, 0.5, keep_first=False, keep_last=False, rule="vote") == [[0]]
    assert kv_select(rows, 0.9, keep_first=False, keep_last=False, rule="vote") == [[0, 1]]
    assert kv_select(rows, 0.5, rule="vote") == [[0, 2]]


def test_kv_selection_refusals():
    scores = torch.ones(1, 4, 3)
    with pytest.raises(ValueError, match="rule must be one of"):
        ref.select_kv_blocks(scores, 0.5, rule="max")
    with pytest.raises(ValueError, match="rank 4"):
        ref.select_kv_blocks(scores, 0.5, rule="vote")
    with pytest.raises(ValueError, match="per_kv_head"):
        ref.select_kv_blocks(scores, 0.5, per_kv_head=3)
    with pytest.raises(ValueError, match="num_valid"):
        ref.select_kv_blocks(scores, 0.5, num_valid=4)
    with pytest.raises(ValueError, match="threshold"):
        ref.select_kv_blocks(scores, 0.0)
    with pytest.raises(ValueError, match="k_len"):
        ref.kv_block_scores(torch.ones(1, 4, 8, 4), torch.ones(1, 4, 8, 4), 8, 8, 4, k_len=9)
    with pytest.raises(ValueError, match="divide kv_block_size"):
        ref.kv_block_scores(torch.ones(1, 4, 8, 4), torch.ones(1, 4, 8, 4), 8, 12, 4)


# --- GPU ------------------------------------------------------------------------------

@pytest.mark.gpu
@needs_cuda
class TestCuda:
    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
    @pytest.mark.parametrize("causal", [True, False])
    def test_torch_reference_agrees_with_triton_on_gpu(self, dtype, causal, rand):
        """The torch reference runs on the GPU too; the Pallas kernels compile via Triton."""
        case = dataclasses.replace(GPU_GQA, block_size=64) if causal else GPU_NONCAUSAL
        check_agreement(*qk(rand, case, dtype, device="cuda"), case.options, "triton", rand)
