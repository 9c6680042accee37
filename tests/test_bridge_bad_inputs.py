"""Bad input to the bridge's `xattn_estimate` and `XAttentionPolicy`: a TypeError or
ValueError naming the argument, never an error from inside JAX or torch and never a result;
a refused `select_blocks` leaves the cache as it was. Hypothesis draws the bad arguments."""

from __future__ import annotations

import re

import pytest

torch = pytest.importorskip("torch")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import xattn_torch_bridge as bridge  # noqa: E402
from cache_state import assert_refused  # noqa: E402
from cases import PAGE_SIZE, PAGED, EstimateCase  # noqa: E402
from xattn_torch_bridge import PagedKVCache, XAttentionPolicy  # noqa: E402

ALLOWED = (TypeError, ValueError)
VALID = EstimateCase("valid-call", 1, 2, 1, 64, 64, 16, 8, 16, True)  # bad arguments spoil it


def _qk(dtype=torch.float32):
    return torch.zeros(VALID.q_shape, dtype=dtype), torch.zeros(VALID.k_shape, dtype=dtype)


ESTIMATE_BAD = {  # argument -> bad values (q and k replace the tensors)
    "q": [None, "q", [[0.0]], torch.zeros(64, 16), torch.zeros((1, 2, 64, 16), dtype=torch.int64),
          torch.zeros((1, 2, 64, 16), dtype=torch.int32),
          torch.zeros((1, 2, 64, 16), dtype=torch.float64),
          torch.zeros((1, 2, 64, 16), dtype=torch.bool),
          torch.zeros((1, 2, 16, 64)).transpose(2, 3), torch.zeros((2, 2, 64, 16)),
          torch.zeros((1, 3, 64, 16)).to(torch.bfloat16)],
    "k": [None, torch.zeros((1, 1, 64, 16), dtype=torch.int64), torch.zeros((1, 64, 16)),
          torch.zeros((1, 1, 64, 16)).to("meta")],
    "threshold": ["0.9", None, True, 0.0, 1.5, float("nan"), torch.tensor([0.5, 0.5, 0.5]),
                  torch.tensor([0.5, 0.0]), [0.5, "0.5"]],
    "block_size": [12, 0, "16", 16.0, None, 2**20],
    "stride": [0, "8", 3, True],
    "causal": [1, "yes", None],
    "keep_sink": [0],
    "norm": [0.0, "1", float("inf")],
    "impl": ["cuda", None],
    "max_scratch_bytes": [0, "1"],
    "copy": ["yes", 1, None],
    "nonsense": [1],  # not an argument at all
}


def _estimate_call(argument, value):
    q, k = _qk()
    kwargs = {"block_size": VALID.block_size, "stride": VALID.stride, "impl": "reference"}
    if argument == "q":
        q = value
    elif argument == "k":
        k = value
    else:
        kwargs[argument] = value
    return lambda: bridge.xattn_estimate(q, k, **kwargs)


def _assert_refused(call, argument):
    try:
        result = call()
    except ALLOWED as e:
        assert type(e) in ALLOWED, f"{argument}: {type(e).__name__}: {e}"
        assert re.search(rf"\b{argument}\b", str(e)), f"{argument}: {type(e).__name__}: {e}"
    else:
        raise AssertionError(f"bad {argument} was accepted, gave {type(result).__name__}")


ESTIMATE_CASES = [(a, v) for a, values in ESTIMATE_BAD.items() for v in values]


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(ESTIMATE_CASES))
def test_bridge_estimate_refuses_bad_arguments(case):
    argument, value = case
    _assert_refused(_estimate_call(argument, value), argument)


def test_a_repeated_call_does_not_serve_equal_values_of_other_types():
    """After a valid call, the same arguments with a value equal to its own but of
    another type (16.0 for 16, 1 for True) are still refused: the bridge remembers
    prepared calls by value and type."""
    q, k = _qk()
    good = dict(block_size=16, stride=8, causal=True, impl="reference", threshold=0.9)
    bridge.xattn_estimate(q, k, **good)
    for argument, value in (("block_size", 16.0), ("causal", 1)):
        _assert_refused(lambda: bridge.xattn_estimate(q, k, **{**good, argument: value}),
                        argument)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_integer_tensors_get_the_rule_of_the_estimate(dtype):
    """The message lists what the estimate accepts (not int32, which the hand-off takes)."""
    q, k = _qk(dtype=dtype)
    with pytest.raises(ValueError, match=r"^q must have dtype bfloat16, float16 or float32, "
                                         rf"got {dtype}$"):
        bridge.xattn_estimate(q, k, block_size=VALID.block_size, impl="reference")


def _attention_call(function, **changes):
    """A valid call of the bridge's block_sparse_attention or xattention, with changes."""
    q, k = _qk()
    blocks = VALID.k_len // VALID.block_size
    args = dict(q=q, k=k, v=k.clone(), block_size=VALID.block_size, impl="reference")
    if function == "block_sparse_attention":
        args["mask"] = torch.ones((1, 2, blocks, blocks), dtype=torch.bool)
    return lambda: getattr(bridge, function)(**(args | changes))


@pytest.mark.parametrize("function,argument,value", [
    ("xattention", "return_mask", "no"), ("xattention", "return_mask", 1),
    ("xattention", "causal", 1), ("xattention", "copy", "yes"),
    ("block_sparse_attention", "return_lse", "yes"), ("block_sparse_attention", "causal", 1),
    ("block_sparse_attention", "copy", None),
])
def test_bridge_attention_flags_must_be_bools(function, argument, value):
    with pytest.raises(TypeError, match=rf"^{argument} must be True or False, got "
                                        rf"{re.escape(repr(value))}"):
        _attention_call(function, **{argument: value})()


@pytest.mark.parametrize("argument,value,allowed", [
    ("v", torch.zeros(VALID.k_shape, dtype=torch.float64), "bfloat16, float16 or float32"),
    ("v", torch.zeros(VALID.k_shape, dtype=torch.int32), "bfloat16, float16 or float32"),
    ("mask", torch.ones((1, 2, 4, 4), dtype=torch.int32), "bool"),
    ("k_len", torch.tensor(64, dtype=torch.int64), "int32"),
])
def test_bridge_attention_dtype_message_lists_what_the_argument_takes(argument, value,
                                                                       allowed):
    """The message lists the dtypes of that argument, not every dtype the hand-off takes."""
    with pytest.raises(ValueError, match=rf"^{argument} must have dtype {allowed}, "
                                         rf"got {value.dtype}$"):
        _attention_call("block_sparse_attention", **{argument: value})()


POLICY_BAD = {
    "threshold": ["0.9", None, True, 0, 1.5, float("nan"), [0.5]],
    "stride": [0, -8, "8", 8.0, None, True],
    "estimate_block_size": [12, 0, "64", None, 2**20],
    "rule": ["majority", None, 1],
    "keep_first": [1, "no"],
    "keep_last": [0, None],
    "per_kv_head": [1],
    "norm": [0.0, "1", None],
    "impl": ["cuda", None, 0],
    "max_context": [0, -64, 64.0, "4096", True],
}
POLICY_CASES = [(a, v) for a, values in POLICY_BAD.items() for v in values]


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(POLICY_CASES))
def test_policy_refuses_bad_arguments(case):
    argument, value = case
    _assert_refused(lambda: XAttentionPolicy(**{argument: value}), argument)


BS, HKV, D = PAGE_SIZE, PAGED.kv_heads, PAGED.head_dim


@pytest.fixture
def cache_and_ids():
    cache = PagedKVCache(4, BS, HKV, D, dtype=torch.float32, device="cpu", num_cpu_blocks=2)
    k = torch.randn(2 * BS + 5, HKV, D)
    return cache, cache.append([], k, k)


@pytest.mark.parametrize("argument,call", [
    ("q", lambda p, c, ids: p.select_blocks(None, c, ids)),
    ("q", lambda p, c, ids: p.select_blocks(torch.zeros(4, 32, D).numpy(), c, ids)),
    ("q", lambda p, c, ids: p.select_blocks(torch.zeros(32, D), c, ids)),
    ("q", lambda p, c, ids: p.select_blocks(torch.zeros(2, 4, 32, D), c, ids)),
    ("q", lambda p, c, ids: p.select_blocks(torch.zeros(3, 32, D), c, ids)),
    ("q", lambda p, c, ids: p.select_blocks(torch.zeros(4, 32, 8), c, ids)),
    ("q", lambda p, c, ids: p.select_blocks(torch.zeros(4, 0, D), c, ids)),
    ("q", lambda p, c, ids: p.select_blocks(torch.zeros(4, 32, D).double(), c, ids)),
    ("q", lambda p, c, ids: p.select_blocks(torch.zeros(4, D, 32).transpose(1, 2), c, ids)),
    ("cache", lambda p, c, ids: p.select_blocks(torch.zeros(4, 32, D), None, ids)),
    ("block_ids", lambda p, c, ids: p.select_blocks(torch.zeros(4, 32, D), c, [])),
    ("block_ids", lambda p, c, ids: p.select_blocks(torch.zeros(4, 32, D), c, "0,1")),
    ("block_ids", lambda p, c, ids: p.select_blocks(torch.zeros(4, 32, D), c, [0, 99])),
    ("block_ids", lambda p, c, ids: p.select_blocks(torch.zeros(4, 32, D), c, [0, 0])),
    ("block_ids", lambda p, c, ids: p.select_blocks(torch.zeros(4, 32, D), c, ids[::-1])),
    ("selection_unit", lambda p, c, ids: XAttentionPolicy(
        0.9, 8, 32, selection_unit=96).select_blocks(torch.zeros(4, 32, D), c, ids)),
    ("max_context", lambda p, c, ids: XAttentionPolicy(  # 3 blocks of 64 in 128 tokens
        0.9, 8, 32, max_context=2 * BS).select_blocks(torch.zeros(4, 32, D), c, ids)),
    ("max_context", lambda p, c, ids: XAttentionPolicy(  # a chunk longer than it
        0.9, 8, 32, max_context=3 * BS).select_blocks(torch.zeros(4, 3 * BS + 1, D), c,
                                                      ids)),
])
def test_policy_select_blocks_refuses_and_keeps_the_cache(cache_and_ids, argument, call):
    cache, ids = cache_and_ids
    policy = XAttentionPolicy(0.9, 8, 32)
    assert_refused(cache, lambda: call(policy, cache, ids), rf"\b{argument}\b", ALLOWED)
