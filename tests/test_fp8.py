"""Keys in fp8 (`xattn_jax.fp8`, docs/estimate.md "Keys in fp8"): the scheme's rounding
bounds, the estimate on `Fp8Keys` is the estimate on their dequantized keys for every
implementation (contiguous and paged), and bad scales, offsets and layouts are refused.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import np_reference as npr
from cases import LOW_RTOL
import xattn_jax
from xattn_jax import fp8

STRIDE, BLOCK = 8, 32


def keys(rand, shape, *, mean=2.0, dtype=jnp.bfloat16):
    """Random keys with a common offset per channel (what the mean removal is for)."""
    offset = rand.rng.standard_normal(shape[-1]) * mean
    return jnp.asarray(rand.rng.standard_normal(shape) + offset, jnp.float32).astype(dtype)


def to_pages(k: np.ndarray, page: int, rng, spare: int = 2):
    """Contiguous `[1, H, L, D]` (L a multiple of page) as a shuffled pool
    `[L / page + spare, page, H, D]` (spare pages NaN) and its table int32 `[1, L / page]`."""
    per_seq = k.shape[2] // page
    table = rng.permutation(per_seq + spare)[:per_seq]
    pool = np.full((per_seq + spare, page, *k.shape[1:2], k.shape[3]), np.nan, np.float32)
    pool[table] = np.asarray(k[0], np.float32).reshape(k.shape[1], per_seq, page, -1) \
        .transpose(1, 2, 0, 3)
    return pool, table[None].astype(np.int32)


# --- the scheme ---------------------------------------------------------------------------

@pytest.mark.parametrize("length", [64, 300])
def test_rounding_bounds(rand, length):
    """Offsets are the groups' mean keys; scales are the rest's largest magnitude / 448
    rounded up to SCALE_BITS significant bits; each dequantized element is within fp8's
    rounding of the rest (3 mantissa bits: half a step is at most 2^-4 of the magnitude,
    or 2^-10 of the scale below the normals), the largest almost exact."""
    k = keys(rand, (2, 3, length, 16), dtype=jnp.float32)
    q8 = fp8.quantize_keys(k)
    groups = -(-length // fp8.GROUP)
    assert q8.values.dtype == fp8.FP8 and q8.values.shape == k.shape
    assert q8.scales.shape == (2, 3, groups) and q8.offsets.shape == (2, 3, groups, 16)
    x = np.asarray(k, np.float64)
    pad = groups * fp8.GROUP - length
    means = [x[:, :, g * fp8.GROUP:(g + 1) * fp8.GROUP].mean(axis=2) for g in range(groups)]
    np.testing.assert_allclose(np.asarray(q8.offsets), np.stack(means, 2), rtol=1e-5,
                               atol=1e-5, err_msg=str(rand))
    scales = np.asarray(q8.scales)
    assert np.all(scales.view(np.uint32) % (1 << (24 - fp8.SCALE_BITS)) == 0)
    rest = x - np.repeat(np.asarray(q8.offsets), fp8.GROUP, axis=2)[:, :, :length]
    padded = np.pad(np.abs(rest), ((0, 0), (0, 0), (0, pad), (0, 0)))
    amax = padded.reshape(2, 3, groups, -1).max(axis=-1)
    np.testing.assert_allclose(scales, amax / 448, rtol=2.0**(1 - fp8.SCALE_BITS))
    assert np.all(scales * (1 + 1e-6) >= amax / 448)  # the largest element fits
    per_token = np.repeat(scales.astype(np.float64), fp8.GROUP, axis=2)[:, :, :length, None]
    got = np.asarray(fp8.dequantize(q8), np.float64)
    error = np.abs(got - x)
    assert np.all(error <= 2.0**-4 * np.abs(rest) + 2.0**-10 * per_token), str(rand)
    largest = np.abs(rest) == np.repeat(amax, fp8.GROUP, axis=2)[:, :, :length, None]
    assert np.all(error[largest] <= 1e-5 * np.abs(rest[largest])) and error.max() > 0


def test_tokens_past_those_in_use_change_nothing(rand):
    """Tokens at or past `tokens` enter no statistic and are stored as 0; contiguous
    (a traced count too) and paged (a count per page)."""
    k = keys(rand, (1, 2, 200, 16))
    poisoned = k.at[:, :, 150:].set(1e4).at[:, :, 170, 3].set(jnp.nan)
    clean = fp8.quantize_keys(k[:, :, :150])
    for count in (150, jnp.int32(150)):
        got = jax.jit(lambda k, n: fp8.quantize_keys(k, tokens=n))(poisoned, count)
        assert np.array_equal(np.asarray(got.values[:, :, :150], np.float32),
                              np.asarray(clean.values, np.float32))
        assert np.all(np.asarray(got.values[:, :, 150:], np.float32) == 0)
        np.testing.assert_array_equal(np.asarray(got.scales[..., :10]), clean.scales)
        np.testing.assert_array_equal(np.asarray(got.offsets[..., :10, :]), clean.offsets)
    pages = jnp.transpose(poisoned[0, :, :192].reshape(2, 3, 64, 16), (1, 2, 0, 3))
    paged = fp8.quantize_keys(pages, paged=True, tokens=np.array([64, 64, 22]))
    assert paged.scales.shape == (3, 4, 2) and paged.offsets.shape == (3, 4, 2, 16)
    assert np.all(np.asarray(paged.values[2, 22:], np.float32) == 0)
    np.testing.assert_array_equal(np.asarray(paged.scales).reshape(12, 2)[:10].T,
                                  clean.scales[0])


def test_non_finite_keys(rand):
    """A NaN key element stays NaN, an infinite one saturates; the statistics ignore
    both, so the group's other keys quantize as without them."""
    k = keys(rand, (1, 1, 64, 8), dtype=jnp.float32)
    bad = k.at[0, 0, 5, 2].set(jnp.nan).at[0, 0, 9, 1].set(jnp.inf)
    got = fp8.quantize_keys(bad)
    assert np.all(np.isfinite(np.asarray(got.scales))) and \
        np.all(np.isfinite(np.asarray(got.offsets)))
    d = np.asarray(fp8.dequantize(got))
    assert np.isnan(d[0, 0, 5, 2]) and np.isfinite(d[0, 0, 9, 1])
    assert np.isnan(d).sum() == 1


# --- the estimate on fp8 keys --------------------------------------------------------------

@pytest.mark.parametrize("causal, q_len, k_len", [(True, 96, 224), (False, 77, 300)],
                         ids=["causal-chunk", "noncausal-ragged"])
def test_estimate_is_the_reference_on_dequantized_keys(impl, rand, causal, q_len, k_len):
    """Every implementation: the block sums of `Fp8Keys` are those of the float64
    reference on the dequantized keys, the mask its selection up to rounding, and both
    equal the same implementation's on the dequantized keys given as bf16."""
    q = rand.normal((1, 4, q_len, 16), jnp.bfloat16, 1.5)
    q8 = fp8.quantize_keys(keys(rand, (1, 2, k_len, 16)))
    t = 0.8
    options = dict(block_size=BLOCK, stride=STRIDE, causal=causal, threshold=t,
                   impl=impl.api)
    sums, mask = map(np.asarray, xattn_jax.xattn_estimate(q, q8, **options))
    dequantized = fp8.dequantize(q8, jnp.bfloat16)
    want = npr.block_sums(q, dequantized, stride=STRIDE, block_size=BLOCK, causal=causal)
    msg = f"{impl} {rand}"
    assert npr.rel_err(sums, want) <= LOW_RTOL, msg
    npr.assert_masks_agree(mask, npr.select(want, t, causal=causal), want, t, msg=msg,
                           causal=causal, near_ties=True, rtol=1e-4)
    plain = map(np.asarray, xattn_jax.xattn_estimate(q, dequantized, **options))
    for got, same in zip((sums, mask), plain):
        np.testing.assert_array_equal(got, same, err_msg=msg)


def test_estimate_is_near_the_bf16_keys(rand):
    """The scheme's purpose: the block sums of fp8 keys stay within a few percent of a
    row's mass from those of the bf16 keys they were made from."""
    q = rand.normal((1, 4, 256, 64), jnp.bfloat16, 1.5)
    k = keys(rand, (1, 2, 256, 64))
    plain, _ = xattn_jax.xattn_estimate(q, k, block_size=BLOCK)
    got, _ = xattn_jax.xattn_estimate(q, fp8.quantize_keys(k), block_size=BLOCK)
    error = np.abs(np.asarray(got) - np.asarray(plain)).max() / (BLOCK // STRIDE)
    assert 0 < error < 0.03, f"{error} {rand}"


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_kv_block_scores_on_fp8_keys(impl, rand, paged):
    """kv_block_scores of `Fp8Keys`, contiguous or a shuffled page pool (spare pages NaN)
    read through a block table, under jit with a traced k_len: the scores of the
    dequantized contiguous keys, for every implementation."""
    q = rand.normal((1, 4, 64, 16), jnp.bfloat16, 1.5)
    k = keys(rand, (1, 2, 512, 16))
    contiguous = fp8.quantize_keys(k)
    want = xattn_jax.kv_block_scores(q, fp8.dequantize(contiguous, jnp.bfloat16),
                                     kv_block_size=128, estimate_block_size=64,
                                     k_len=333, impl=impl.api)
    table = None
    q8 = contiguous
    if paged:
        pool, table = to_pages(np.asarray(k, np.float32), 128, rand.rng)
        q8 = fp8.quantize_keys(jnp.asarray(pool, jnp.bfloat16), paged=True)
        table = jnp.asarray(table)
    run = jax.jit(lambda q, k8, n, table: xattn_jax.kv_block_scores(
        q, k8, kv_block_size=128, estimate_block_size=64, k_len=n, block_table=table,
        impl=impl.api))
    got = run(q, q8, jnp.int32(333), table)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6,
                               err_msg=f"{impl} {rand}")


# --- refusals ------------------------------------------------------------------------------

def _good(rand):
    return fp8.quantize_keys(keys(rand, (1, 2, 128, 16)))


def _with(k8, **parts):
    fields = dict(values=k8.values, scales=k8.scales, offsets=k8.offsets, group=k8.group,
                  paged=k8.paged) | parts
    return fp8.Fp8Keys(**fields)


@pytest.mark.parametrize("change, error, match", [
    (lambda k8: _with(k8, scales=k8.scales[..., :1]), ValueError,
     r"k\.scales must be float32 \(1, 2, 8\)"),
    (lambda k8: _with(k8, scales=k8.scales.astype(jnp.bfloat16)), ValueError,
     r"k\.scales must be float32"),
    (lambda k8: _with(k8, scales=k8.scales.at[0, 1, 0].set(0.0)), ValueError,
     r"k\.scales must be positive and finite, got \[0\.0\]"),
    (lambda k8: _with(k8, scales=k8.scales.at[0, 0, 1].set(-0.5)), ValueError,
     r"k\.scales must be positive and finite, got \[-0\.5\]"),
    (lambda k8: _with(k8, scales=k8.scales.at[0, 0, 0].set(jnp.nan)), ValueError,
     r"k\.scales must be positive and finite, got \[nan\]"),
    (lambda k8: _with(k8, scales=np.asarray(k8.scales) * np.inf), ValueError,
     r"k\.scales must be positive and finite"),
    (lambda k8: _with(k8, offsets=k8.offsets[..., :4]), ValueError,
     r"k\.offsets must be float32 \(1, 2, 8, 16\)"),
    (lambda k8: _with(k8, offsets=k8.offsets.at[0, 0, 0, 0].set(jnp.inf)), ValueError,
     r"k\.offsets must be finite"),
    (lambda k8: _with(k8, values=k8.values.astype(jnp.bfloat16)), ValueError,
     r"k\.values must be float8_e4m3fn"),
    (lambda k8: _with(k8, group=0), ValueError, r"k\.group must be an integer >= 1"),
    (lambda k8: _with(k8, group=32), ValueError, r"k\.scales must be float32 \(1, 2, 4\)"),
    (lambda k8: k8.values, ValueError, r"k must be float32, bfloat16 or float16 \(keys in "
                                       r"fp8: pass xattn_jax\.fp8\.Fp8Keys"),
    (lambda k8: (k8,), TypeError, "k must be a jax.Array"),
])
def test_bad_fp8_keys_are_refused(rand, change, error, match):
    q = rand.normal((1, 4, 64, 16), jnp.bfloat16)
    bad = change(_good(rand))
    for call in (lambda: xattn_jax.xattn_estimate(q, bad, block_size=BLOCK),
                 lambda: xattn_jax.kv_block_scores(q, bad, kv_block_size=64,
                                                   estimate_block_size=32)):
        with pytest.raises(error, match=match):
            call()


def test_paged_layout_refusals(rand):
    q = rand.normal((1, 4, 64, 16), jnp.bfloat16)
    pool = jnp.zeros((4, 64, 2, 16), jnp.bfloat16)
    paged = fp8.quantize_keys(pool, paged=True)
    table = jnp.asarray([[2, 0]], jnp.int32)
    score = dict(kv_block_size=64, estimate_block_size=32)
    with pytest.raises(ValueError, match="paged Fp8Keys need a block_table"):
        xattn_jax.kv_block_scores(q, paged, **score)
    with pytest.raises(ValueError, match="paged Fp8Keys need a block_table"):
        xattn_jax.xattn_estimate(q, paged)
    with pytest.raises(ValueError, match="contiguous ones none"):
        xattn_jax.kv_block_scores(q, _good(rand), block_table=table, **score)
    with pytest.raises(ValueError, match=r"block_table's page ids must lie in \[0, 4\)"):
        xattn_jax.kv_block_scores(q, paged, block_table=table + 3, **score)
    with pytest.raises(ValueError, match=r"k\.group must divide the page size 64"):
        xattn_jax.kv_block_scores(q, _with(paged, group=48), block_table=table, **score)
    with pytest.raises(ValueError, match=r"k\.scales must be float32 \(4, 2, 2\)"):
        xattn_jax.kv_block_scores(q, _with(paged, group=32), block_table=table, **score)


@pytest.mark.parametrize("call, error, match", [
    (lambda k: fp8.quantize_keys(k.astype(jnp.float8_e4m3fn)), ValueError,
     "k must be float32, bfloat16 or float16"),
    (lambda k: fp8.quantize_keys(k, group=0), ValueError, "group must be an integer >= 1"),
    (lambda k: fp8.quantize_keys(k, group=2.0), TypeError, "group must be an integer"),
    (lambda k: fp8.quantize_keys(k[0]), ValueError, "k must have rank 4"),
    (lambda k: fp8.quantize_keys(k.transpose(0, 2, 1, 3), paged=True, group=48), ValueError,
     "group must divide the page size 128"),
    (lambda k: fp8.quantize_keys(k.transpose(0, 2, 1, 3), paged=True,
                                 tokens=np.array([3, 4])), ValueError,
     r"tokens must be ints \[num_pages\] \(1,\)"),
])
def test_quantize_refusals(rand, call, error, match):
    with pytest.raises(error, match=match):
        call(keys(rand, (1, 2, 128, 16)))


def test_under_jit_only_shapes_are_checked_and_checked_mode_reads_scales(rand):
    """Traced scales are not read: a bad one under jit gives NaN sums (every block kept);
    inside `xattn_jax.checked` the same call reports the rule."""
    q = rand.normal((1, 4, 64, 16), jnp.bfloat16)
    bad = _with(_good(rand), scales=_good(rand).scales.at[0, 0, 0].set(-1.0))

    def estimate(q, k8):
        return xattn_jax.xattn_estimate(q, k8, block_size=BLOCK, causal=False)

    sums, mask = jax.jit(estimate)(q, _with(bad, scales=bad.scales.at[0, 0, 0].set(jnp.nan)))
    assert np.isnan(np.asarray(sums)[0, :2]).all() and np.asarray(mask)[0, :2].all()
    with pytest.raises(ValueError, match=r"k\.scales must be float32"):
        jax.jit(estimate)(q, _with(bad, scales=bad.scales[..., :1]))
    error, _ = jax.jit(xattn_jax.checked(estimate))(q, bad)
    with pytest.raises(ValueError, match=r"k\.scales must be positive and finite"):
        error.throw()
