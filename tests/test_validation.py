"""Bad input is refused with a ValueError that names the argument (nothing compiles here)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import xattn_jax
from xattn_jax.checks import check_qk, threshold_per_head


def _qk(q_shape=(1, 2, 64, 16), k_shape=(1, 1, 64, 16), q_dtype=jnp.float32,
        k_dtype=None):
    return jnp.zeros(q_shape, q_dtype), jnp.zeros(k_shape, k_dtype or q_dtype)


def _estimate(impl, q, k, **kw):
    kw.setdefault("block_size", 16)
    kw.setdefault("stride", 8)
    return xattn_jax.xattn_estimate(q, k, impl=impl.api, **kw)


SHAPE_ERRORS = [
    # (id, q shape, k shape, extra kwargs, regex naming the argument)
    ("q_rank3", (2, 64, 16), (1, 1, 64, 16), {}, r"\bq must have rank 4"),
    ("k_rank5", (1, 2, 64, 16), (1, 1, 1, 64, 16), {}, r"\bk must have rank 4"),
    ("batch", (2, 2, 64, 16), (1, 1, 64, 16), {}, r"batch size"),
    ("head_dim", (1, 2, 64, 16), (1, 1, 64, 32), {}, r"head_dim"),
    ("gqa_heads", (1, 3, 64, 16), (1, 2, 64, 16), {}, r"query heads of q.*key heads of k"),
    ("lq_gt_lk", (1, 2, 65, 16), (1, 1, 64, 16), {"causal": False}, r"\bq\b.*longer.*Lq"),
    ("causal_alignment", (1, 2, 50, 16), (1, 1, 64, 16), {"causal": True},
     r"causal.*Lk - Lq.*block_size"),
    ("causal_alignment_blocks", (1, 2, 40, 16), (1, 1, 64, 16),
     {"causal": True, "block_size": 32}, r"causal.*Lk - Lq.*block_size"),
    ("empty_q", (1, 2, 0, 16), (1, 1, 64, 16), {"causal": False}, r"non-empty"),
]


@pytest.mark.parametrize("case", SHAPE_ERRORS, ids=[c[0] for c in SHAPE_ERRORS])
def test_bad_shapes(impl, case):
    _, q_shape, k_shape, kw, match = case
    q, k = _qk(q_shape, k_shape)
    with pytest.raises(ValueError, match=match):
        _estimate(impl, q, k, **kw)


def test_causal_alignment_rule_only_when_causal():
    """Lk - Lq = 14 is fine without causal masking; with it, only block multiples are."""
    q, k = _qk((1, 2, 50, 16), (1, 1, 64, 16))
    geom = check_qk(q, k, stride=2, block_size=14, causal=True)
    assert geom.q_blocks == 4 and geom.k_blocks == 5
    assert check_qk(q, k, stride=8, block_size=16, causal=False).q_len == 50
    with pytest.raises(ValueError, match="block_size"):
        check_qk(q, k, stride=8, block_size=16, causal=True)


@pytest.mark.parametrize("block_size,stride,error,match", [
    (12, 8, ValueError, r"block_size must be a positive multiple of stride"),
    (0, 8, ValueError, r"block_size"),
    (-16, 8, ValueError, r"block_size"),
    (16.0, 8, TypeError, r"block_size"),
    (16, 0, ValueError, r"stride must be an integer >= 1"),
    (16, -8, ValueError, r"stride"),
    (16, 2.0, TypeError, r"stride"),
    (16, True, TypeError, r"stride"),
])
def test_bad_block_size_or_stride(impl, block_size, stride, error, match):
    q, k = _qk()
    with pytest.raises(error, match=match):
        _estimate(impl, q, k, block_size=block_size, stride=stride)


@pytest.mark.parametrize("threshold", [0.0, -0.1, 1.0001, 2, float("nan"), float("inf"),
                                       [0.5, 0.5, 0.5], [[0.5, 0.5]], [0.5, 0.0]],
                         ids=["zero", "negative", "above_one", "two", "nan", "inf",
                              "wrong_length", "rank2", "one_head_zero"])
def test_bad_threshold(impl, threshold):
    q, k = _qk()  # two query heads
    with pytest.raises(ValueError, match="threshold"):
        _estimate(impl, q, k, threshold=threshold)


@pytest.mark.parametrize("threshold", [True, "0.9", None, ["0.5", "0.5"], [True, True]],
                         ids=["bool", "string", "none", "strings", "bools"])
def test_threshold_of_wrong_type(impl, threshold):
    q, k = _qk()
    with pytest.raises(TypeError, match="threshold must be a float"):
        _estimate(impl, q, k, threshold=threshold)


def test_good_thresholds_are_float32_per_head():
    for good in (1.0, 1e-6, 0.9, np.float64(0.5), [0.25, 1.0], np.array([0.1, 0.2])):
        t = threshold_per_head(good, 2)
        assert t.shape == (2,) and t.dtype == jnp.float32, good
        np.testing.assert_allclose(np.asarray(t), np.broadcast_to(good, (2,)), rtol=1e-7)


@pytest.mark.parametrize("q_dtype,k_dtype,match", [
    (np.float64, np.float64, r"\bq must be float32, bfloat16 or float16"),
    (jnp.int32, jnp.int32, r"\bq must be float32, bfloat16 or float16"),
    (jnp.float32, np.float64, r"\bk must be float32, bfloat16 or float16"),
    (jnp.float32, jnp.bfloat16, r"same dtype"),
    (jnp.float16, jnp.bfloat16, r"same dtype"),
], ids=["float64", "int32", "k_float64", "f32_bf16", "f16_bf16"])
def test_bad_dtypes(impl, q_dtype, k_dtype, match):
    q = np.zeros((1, 2, 64, 16), q_dtype) if q_dtype is np.float64 else \
        jnp.zeros((1, 2, 64, 16), q_dtype)
    k = np.zeros((1, 1, 64, 16), k_dtype) if k_dtype is np.float64 else \
        jnp.zeros((1, 1, 64, 16), k_dtype)
    with pytest.raises(ValueError, match=match):
        _estimate(impl, q, k)


@pytest.mark.parametrize("norm,error", [(0.0, ValueError), (-1.0, ValueError),
                                        (float("inf"), ValueError), (float("nan"), ValueError),
                                        (True, TypeError), ("2", TypeError)])
def test_bad_norm(impl, norm, error):
    q, k = _qk()
    with pytest.raises(error, match="norm must be a finite number > 0"):
        _estimate(impl, q, k, norm=norm)


@pytest.mark.parametrize("value,error", [(0, ValueError), (-1, ValueError), (1.5, TypeError),
                                         (True, TypeError), ("1024", TypeError)])
def test_bad_max_scratch_bytes(impl, value, error):
    q, k = _qk()
    with pytest.raises(error, match="max_scratch_bytes must be an integer >= 1"):
        _estimate(impl, q, k, max_scratch_bytes=value)


def test_bad_impl():
    q, k = _qk()
    with pytest.raises(ValueError, match="impl"):
        xattn_jax.xattn_estimate(q, k, block_size=16, impl="cuda")
    with pytest.raises(ValueError, match="impl must be one of"):
        xattn_jax.select_blocks(jnp.ones((1, 1, 2, 2)), impl="pallas")


def test_select_blocks_validation(impl):
    ok = jnp.ones((1, 2, 3, 4), jnp.float32)
    with pytest.raises(ValueError, match="block_sums must have rank 4"):
        xattn_jax.select_blocks(ok[0], impl=impl.api)
    with pytest.raises(ValueError, match="block_sums may not have more query blocks"):
        xattn_jax.select_blocks(jnp.ones((1, 2, 5, 4)), impl=impl.api)
    with pytest.raises(ValueError, match="threshold"):
        xattn_jax.select_blocks(ok, threshold=1.5, impl=impl.api)
    with pytest.raises(ValueError, match="threshold"):
        xattn_jax.select_blocks(ok, threshold=[0.5, 0.5, 0.5], impl=impl.api)


def test_strided_scores_validation(impl):
    q, k = _qk()
    with pytest.raises(ValueError, match="stride"):
        xattn_jax.strided_scores(q, k, stride=0, impl=impl.api)
    with pytest.raises(ValueError, match=r"\bq must have rank 4"):
        xattn_jax.strided_scores(q[0], k, impl=impl.api)
    with pytest.raises(ValueError, match="norm"):
        xattn_jax.strided_scores(q, k, norm=-2.0, impl=impl.api)
    with pytest.raises(ValueError, match="head_dim"):
        xattn_jax.strided_scores(q, k[..., :8], impl=impl.api)
