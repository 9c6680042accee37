"""bench.fp8_schemes: the fp8-row query quantization an fp8-product kernel would apply,
and the center-group key scheme."""

import jax
import jax.numpy as jnp
import numpy as np

from bench import fp8_schemes


def test_query_rows_round_trip_one_scale_per_reshaped_row():
    stride = 8
    key = jax.random.PRNGKey(0)
    # 2 heads, 44 tokens (the last reshaped row half filled), rows of very different sizes
    q = jax.random.normal(key, (1, 2, 44, 16)) * jnp.exp2(jnp.arange(44) % 9 - 4.0)[:, None]
    q = q.astype(jnp.bfloat16)
    values, scales = fp8_schemes.quantize_query_rows(q, stride)
    assert values.dtype == jnp.float8_e4m3fn and values.shape == (1, 2, 6, stride, 16)
    assert scales.shape == (1, 2, 6, 1, 1)  # one scale per (head, reshaped row)

    back = np.asarray(fp8_schemes.round_trip_queries(q, stride))
    assert back.dtype == np.float32 and back.shape == q.shape
    x = np.asarray(q, np.float32)
    rows = np.pad(x, ((0, 0), (0, 0), (0, 4), (0, 0))).reshape(1, 2, 6, stride, 16)
    amax = np.abs(rows).max(axis=(3, 4))
    np.testing.assert_allclose(np.asarray(scales)[..., 0, 0], amax / 448, rtol=1e-6)
    # each reshaped row's largest element lands on +-448: kept to float32's rounding
    back_rows = np.pad(back, ((0, 0), (0, 0), (0, 4), (0, 0))).reshape(rows.shape)
    np.testing.assert_allclose(np.abs(back_rows).max(axis=(3, 4)), amax, rtol=1e-6)
    # every element within e4m3's rounding: half a step of 3 mantissa bits, or of the
    # subnormals' 2^-9 (in units of the row's scale)
    s = np.asarray(scales)
    assert np.all(np.abs(back_rows - rows) <= np.maximum(np.abs(rows) / 16, s * 2.0 ** -10))
    # the dequantized row is its fp8 values times that one scale (to float32's rounding:
    # jax versions differ in how they fold the product)
    np.testing.assert_allclose(back_rows, np.asarray(values, np.float32) * s, rtol=1e-6)


def test_center_group_is_group_on_centered_keys():
    k = (jax.random.normal(jax.random.PRNGKey(1), (1, 2, 64, 8)) + 3.0).astype(jnp.bfloat16)
    centered = fp8_schemes.round_trip(k, "center-group", 16, jnp.float32, center_tokens=32)
    c = fp8_schemes.center(k, 32)
    assert c.shape == (1, 2, 1, 8)
    np.testing.assert_allclose(c, np.asarray(k, np.float32)[:, :, :32].mean(2, keepdims=True),
                               rtol=1e-6)
    plain = fp8_schemes.round_trip((k.astype(jnp.float32) - c), "group", 16, jnp.float32)
    np.testing.assert_allclose(centered, plain + c, rtol=1e-6, atol=1e-6)
