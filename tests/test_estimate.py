"""The public API `xattn_jax.xattn_estimate` (sections 1-4 in one jitted call): shapes and
dtypes, agreement with the float64 reference and across implementations, compile once,
NaN/inf policy; and GPU-only determinism and uninitialized-memory checks."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import np_reference as npr
from cases import EstimateCase
import xattn_jax
from xattn_jax import partitioning


class ApiCase(EstimateCase):
    def run(self, q, k, threshold, impl: str):
        return xattn_jax.xattn_estimate(q, k, threshold=threshold, impl=impl, **self.options)


CASES = [
    ApiCase("causal_gqa_f32", 1, 4, 2, 131, 131, 16, 8, 32, True),
    ApiCase("noncausal_sink_recent_bf16", 2, 2, 1, 37, 300, 32, 4, 48, False, jnp.bfloat16,
            keep_sink=True, keep_recent=True),
    ApiCase("causal_lq_lt_lk_f16", 1, 4, 1, 44, 300, 16, 16, 128, True, jnp.float16),
]
CAUSAL, NONCAUSAL = CASES[0], CASES[1]


def _ambiguity_rtol(a, b) -> float:
    """A row-relative tolerance covering the measured difference of two block sums."""
    a, b = npr.f64(a), npr.f64(b)
    finite = np.isfinite(a) & np.isfinite(b)
    diff = np.max(np.abs(a - b), where=finite, initial=0.0)
    totals = np.where(np.isfinite(b.sum(-1)), b.sum(-1), np.inf)
    return max(1e-5, 4 * a.shape[-1] * diff / totals.min())


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_estimate_against_float64(impl, case, rand):
    q, k = case.inputs(rand)
    t = rand.thresholds(case.q_heads, 0.5, 0.95)
    sums, mask = case.run(q, k, t, impl.api)
    qb, kb = -(-case.q_len // case.block_size), -(-case.k_len // case.block_size)
    assert sums.shape == mask.shape == (case.batch, case.q_heads, qb, kb)
    assert sums.dtype == jnp.float32 and mask.dtype == jnp.bool_
    sums, mask = np.asarray(sums), np.asarray(mask)
    msg = f"{impl} {case.id} {rand}"
    want = npr.block_sums(q, k, stride=case.stride, block_size=case.block_size,
                          causal=case.causal)
    err = npr.rel_err(sums, want)
    assert err <= case.rtol, f"{msg}: block sums off by {err:.3g}"
    npr.check_mask_rules(mask, sums, t, msg=msg, **case.rules)
    # exactly the float64 rule on the returned sums, and on the float64 sums up to rows
    # where rounding (of sums or of the target) decides
    npr.assert_masks_agree(mask, npr.select(sums, t, **case.rules), sums, t, msg=msg,
                           **case.rules)
    npr.assert_masks_agree(mask, npr.select(want, t, **case.rules), want, t, msg=msg,
                           rtol=_ambiguity_rtol(sums, want), near_ties=True, **case.rules)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_reference_and_triton_agree(case, rand):
    q, k = case.inputs(rand)
    t = rand.thresholds(case.q_heads, 0.5, 0.95)
    ref_sums, ref_mask = map(np.asarray, case.run(q, k, t, "reference"))
    pal_sums, pal_mask = map(np.asarray, case.run(q, k, t, "triton"))
    msg = f"{case.id} {rand}"
    err = npr.rel_err(pal_sums, ref_sums)
    assert err <= case.rtol, f"{msg}: block sums differ by {err:.3g}"
    npr.assert_masks_agree(pal_mask, ref_mask, ref_sums, t, msg=msg, near_ties=True,
                           rtol=_ambiguity_rtol(pal_sums, ref_sums), **case.rules)


def test_auto_is_reference_on_cpu_and_triton_on_gpu(rand):
    case = CAUSAL
    q, k = case.inputs(rand)
    auto = case.run(q, k, 0.9, "auto")
    explicit = case.run(q, k, 0.9, "triton" if jax.default_backend() == "gpu" else "reference")
    for a, b in zip(auto, explicit):
        assert np.array_equal(np.asarray(a), np.asarray(b)), str(rand)


def test_select_blocks_and_strided_scores_api(impl, rand):
    """The public stage functions agree with the float64 reference too."""
    case = CAUSAL
    q, k = case.inputs(rand)
    scores = np.asarray(xattn_jax.strided_scores(q, k, stride=case.stride, impl=impl.api))
    err = npr.rel_err(scores, npr.strided_scores(q, k, stride=case.stride))
    assert err <= case.rtol, f"{impl} {rand}: scores off by {err:.3g}"
    sums = npr.block_sums(q, k, stride=case.stride, block_size=case.block_size, causal=True)
    t = rand.thresholds(case.q_heads)
    mask = np.asarray(xattn_jax.select_blocks(jnp.asarray(sums, jnp.float32), t, causal=True,
                                              impl=impl.api))
    sums32 = sums.astype(np.float32)
    npr.check_mask_rules(mask, sums32, t, causal=True, msg=f"{impl} {rand}")
    npr.assert_masks_agree(mask, npr.select(sums32, t, causal=True), sums32, t, causal=True,
                           msg=f"{impl} {rand}")


def test_per_head_threshold_equals_scalar_calls(impl, rand):
    """A per-head threshold applies each value to its own query head; a larger threshold
    keeps a superset (the selection order does not depend on t)."""
    case = CAUSAL
    q, k = case.inputs(rand)
    values = [0.3, 0.6, 0.9, 1.0]
    sums, mask = map(np.asarray, case.run(q, k, jnp.asarray(values), impl.api))
    previous = None
    for h, value in enumerate(values):
        s_h, m_h = map(np.asarray, case.run(q, k, value, impl.api))
        assert np.array_equal(s_h, sums), f"{impl} {rand}: sums depend on the threshold"
        assert np.array_equal(m_h[:, h], mask[:, h]), f"{impl} head {h} {rand}"
        if previous is not None:
            assert np.all(m_h >= previous), f"{impl} t={value} dropped blocks {rand}"
        previous = m_h
    assert previous.sum() > np.asarray(case.run(q, k, 0.3, impl.api)[1]).sum(), str(rand)


def test_max_scratch_bytes_changes_how_the_call_is_stepped_not_the_result(impl, rand):
    """A bound of one row step of one head (several kernel calls) and one below it (the
    two-pass kernel) give the default's block sums and mask, with less workspace; the
    reference ignores the bound."""
    from xattn_jax.checks import check_qk
    from xattn_jax.triton.plan import TWO_PASS, plan_block_sums

    case = ApiCase("causal_steps_f32", 1, 2, 1, 1560, 1560, 16, 8, 32, True)
    q, k = case.inputs(rand)
    geom = check_qk(q, k, stride=case.stride, block_size=case.block_size, causal=True)

    def plan(bound):
        return plan_block_sums(geom, q.dtype, True, interpret=False, max_scratch_bytes=bound)

    whole = plan(None)
    one_step = whole.head_row_scratch_bytes * math.lcm(whole.block_q, geom.block_rows)
    assert plan(one_step).call_rows < geom.q_rows, "not several steps"
    assert plan(one_step - 1).kernel == TWO_PASS
    t = rand.thresholds(case.q_heads, 0.5, 0.95)

    def estimate(bound):
        return lambda q, k: xattn_jax.xattn_estimate(
            q, k, block_size=case.block_size, stride=case.stride, threshold=t, causal=True,
            impl=impl.api, max_scratch_bytes=bound)

    def workspace(bound):
        return jax.jit(estimate(bound)).lower(q, k).compile().memory_analysis().temp_size_in_bytes

    sums, mask = map(np.asarray, estimate(None)(q, k))
    for bound in (one_step, one_step - 1):
        b_sums, b_mask = map(np.asarray, estimate(bound)(q, k))
        msg = f"{impl} max_scratch_bytes={bound} {rand}"
        assert npr.rel_err(b_sums, sums) <= case.rtol, msg
        npr.assert_masks_agree(b_mask, mask, sums, t, msg=msg, near_ties=True,
                               rtol=_ambiguity_rtol(b_sums, sums), **case.rules)
    spaces = [workspace(bound) for bound in (None, one_step, one_step - 1)]
    if impl.is_kernel:
        assert spaces[0] > max(spaces[1:]), f"the bound did not reach the kernel: {spaces}"
    else:
        assert spaces[0] == spaces[1] == spaces[2], spaces


WORKSPACE_BYTES = 64 << 20  # beyond the outputs, at every length (docs/tuning.md: workspace-bound)


def _scratch(backend: str, geom, causal: bool, bound=None) -> tuple[int, bool]:
    """(the scratch bytes of one kernel call, whether it is the whole call) of
    `backend`'s plan for `geom` within `bound` (None: the default)."""
    if backend == "triton":
        from xattn_jax.triton.plan import ONE_PASS, plan_block_sums

        plan = plan_block_sums(geom, jnp.bfloat16, causal, interpret=False,
                               max_scratch_bytes=bound)
        assert plan.kernel == ONE_PASS, "the bound holds a one-pass step"
        return plan.scratch_bytes, plan.calls == 1
    from xattn_jax.mosaic.estimate.plan import estimate_plan

    plan = estimate_plan(geom, jnp.bfloat16, causal=causal, max_scratch_bytes=bound)
    return plan.scratch_bytes, not plan.call_heads and not plan.call_rows


@pytest.mark.parametrize("backend", ["triton", "mosaic"])
@pytest.mark.parametrize("block_size", [128, 64])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_default_workspace_stays_within_64_mib(backend, block_size, causal):
    """By default both Pallas backends' plans keep each kernel call's scratch within
    64 MiB from 1K to 1M tokens (32 heads, D 128, bf16), the bound of the workspace
    beyond the outputs; a caller raising max_scratch_bytes gets whole calls back."""
    from xattn_jax.geometry import Geometry
    from xattn_jax.row_statistics import DEFAULT_SCRATCH_BYTES

    assert DEFAULT_SCRATCH_BYTES <= WORKSPACE_BYTES
    largest = 0
    for length in [1024 << n for n in range(11)]:
        geom = Geometry(1, 32, 8, length, length, 128, 8, block_size)
        scratch, _ = _scratch(backend, geom, causal)
        assert scratch <= WORKSPACE_BYTES, (backend, length, scratch / 2**20)
        largest = max(largest, scratch)
    assert largest > WORKSPACE_BYTES // 2, "the bound is not what limits these plans"
    geom = Geometry(1, 32, 8, 65536, 65536, 128, 8, block_size)
    assert not _scratch(backend, geom, causal)[1]
    assert _scratch(backend, geom, causal, bound=3 << 29)[1]  # 1.5 GiB: one call


def test_compiles_once_per_shape(impl, rand):
    """New data and new threshold values reuse the compiled estimate; a new shape adds
    exactly one compilation."""
    base = ApiCase("cache", 1, 3, 1, 83, 83, 16, 8, 24, True)  # a shape no other test uses
    cache = partitioning._run._cache_size  # the jitted call around api._estimate
    before = cache()
    q, k = base.inputs(rand)
    base.run(q, k, 0.9, impl.api)[0].block_until_ready()
    assert cache() == before + 1, "first call of a new shape compiles once"
    for threshold in (0.5, np.float32(0.7), [0.2, 0.9, 1.0], jnp.asarray([0.4, 0.5, 0.6])):
        q2, k2 = base.inputs(rand)
        base.run(q2, k2, threshold, impl.api)[1].block_until_ready()
    assert cache() == before + 1, "new data or thresholds recompiled"
    longer = dataclasses.replace(base, q_len=83 + 24, k_len=83 + 24)
    q3, k3 = longer.inputs(rand)
    longer.run(q3, k3, 0.9, impl.api)[0].block_until_ready()
    assert cache() == before + 2, "a new shape compiles exactly once"
    longer.run(q3 * 2, k3, 0.8, impl.api)[0].block_until_ready()
    assert cache() == before + 2


def test_inside_callers_jit(impl, rand):
    """xattn_estimate and select_blocks inside a caller's jax.jit, traced for two shapes,
    give what direct calls give. A threshold first seen inside a trace (a value no other
    test uses) must not leave that trace's tracer in the threshold cache."""
    threshold = 0.8765 + 1e-4 * rand.rng.integers(1000)
    case = CAUSAL

    @jax.jit
    def both(q, k):
        sums, mask = case.run(q, k, threshold, impl.api)
        return sums, mask, xattn_jax.select_blocks(sums, threshold, causal=True,
                                                   impl=impl.api)

    for q_len in (case.q_len, case.q_len + case.block_size):
        shape = dataclasses.replace(case, q_len=q_len, k_len=q_len)
        q, k = shape.inputs(rand)
        sums, mask, again = map(np.asarray, both(q, k))
        direct_sums, direct_mask = map(np.asarray, shape.run(q, k, threshold, impl.api))
        np.testing.assert_allclose(sums, direct_sums, rtol=1e-6, err_msg=f"{impl} {rand}")
        assert np.array_equal(mask, direct_mask), f"{impl} {rand}"
        assert np.array_equal(again, mask), f"{impl} {rand}"


# --- NaN / inf policy (xattn_estimate's docstring) -------------------------------------

def _allowed(case: ApiCase):
    qb, kb = case.geom().q_blocks, case.geom().k_blocks
    return npr.forced_allowed(qb, kb, causal=case.causal)[1]


def _poison_check(case, sums, mask, bad_rows, msg):
    """bad_rows: bool [B, Hq, qb]. Those rows: NaN on every allowed block, mask = allowed;
    every other row finite and following the selection rules."""
    allowed = _allowed(case)
    assert bad_rows.any() and not bad_rows.all(), msg
    for b, h, r in np.argwhere(bad_rows):
        assert np.all(np.isnan(sums[b, h, r, allowed[r]])), f"{msg}: row {(b, h, r)} not NaN"
        assert np.array_equal(mask[b, h, r], allowed[r]), f"{msg}: row {(b, h, r)} mask"
    assert np.all(np.isfinite(sums[~bad_rows])), f"{msg}: NaN leaked into other rows"
    others = np.where(bad_rows[..., None], np.nan, sums)  # the rules on every other row
    npr.check_mask_rules(mask, others, 0.9, msg=msg, **case.rules)


def _compare_untouched_rows(case, sums, mask, q, k, bad_rows, impl, msg):
    """Rows that did not see the NaN equal a clean run (where the NaN was a zero)."""
    clean_sums, clean_mask = map(np.asarray, case.run(q, k, 0.9, impl.api))
    good = ~bad_rows
    np.testing.assert_allclose(sums[good], clean_sums[good], rtol=1e-6, atol=1e-7,
                               err_msg=msg)
    amb = npr.ambiguous_rows(clean_sums, 0.9, near_ties=True, **case.rules)
    differ = np.any(mask != clean_mask, axis=-1) & good & ~amb
    assert not differ.any(), f"{msg}: masks of untouched rows changed {np.argwhere(differ)}"


@pytest.mark.parametrize("case", [CAUSAL, NONCAUSAL], ids=["causal", "noncausal"])
def test_nan_in_one_query_token(impl, case, rand):
    q, k = case.inputs(rand)
    b, h, token = case.batch - 1, 1, 35  # query block 35 // block_size
    q_nan = q.at[b, h, token, 3].set(jnp.nan)
    sums, mask = map(np.asarray, case.run(q_nan, k, 0.9, impl.api))
    bad = np.zeros(sums.shape[:3], bool)
    bad[b, h, token // case.block_size] = True
    msg = f"{impl} {case.id} NaN query {rand}"
    _poison_check(case, sums, mask, bad, msg)
    _compare_untouched_rows(case, sums, mask, q.at[b, h, token, 3].set(0), k, bad, impl, msg)


def test_nan_in_key_token_noncausal_poisons_every_row(impl, rand):
    case = NONCAUSAL  # Hq 2, Hkv 1, batch 2: batch 1 gets the NaN key
    q, k = case.inputs(rand)
    k_nan = k.at[1, 0, 150, 5].set(jnp.nan)
    sums, mask = map(np.asarray, case.run(q, k_nan, 0.9, impl.api))
    bad = np.zeros(sums.shape[:3], bool)
    bad[1] = True
    msg = f"{impl} NaN key non-causal {rand}"
    _poison_check(case, sums, mask, bad, msg)
    assert np.all(mask[1]), msg
    _compare_untouched_rows(case, sums, mask, q, k.at[1, 0, 150, 5].set(0), bad, impl, msg)


@pytest.mark.parametrize("token", [70, 130, 0], ids=["middle", "last", "first"])
def test_nan_in_key_token_causal_spares_earlier_rows(impl, token, rand):
    """Causal, Lq = Lk: a NaN key at token p (reshaped column p // S) reaches query row i
    only if i >= p // S; query blocks all of whose rows are earlier stay finite."""
    case = CAUSAL  # Hq 4, Hkv 2: key head 1 is read by query heads 2 and 3
    q, k = case.inputs(rand)
    k_nan = k.at[0, 1, token, 0].set(jnp.nan)
    sums, mask = map(np.asarray, case.run(q, k_nan, 0.9, impl.api))
    geom = case.geom()
    column = token // case.stride
    bad = np.zeros(sums.shape[:3], bool)
    for blk in range(geom.q_blocks):
        last_row = min(geom.q_rows, (blk + 1) * geom.block_rows) - 1
        bad[0, 2:, blk] = last_row + geom.row_offset >= column
    msg = f"{impl} NaN key token {token} causal {rand}"
    if token == 0:  # every row sees key 0: heads 2 and 3 fully poisoned, 0 and 1 clean
        assert np.all(bad[0, 2:]) and not np.any(bad[0, :2])
    else:
        assert np.any(~bad[0, 2:]), "the construction must leave earlier rows clean"
    _poison_check(case, sums, mask, bad, msg)
    _compare_untouched_rows(case, sums, mask, q, k.at[0, 1, token, 0].set(0), bad, impl, msg)


def test_inf_query_token_keeps_every_allowed_block(impl, rand):
    case = CAUSAL
    q, k = case.inputs(rand)
    q_inf = q.at[0, 0, 100, :].set(jnp.inf)  # inf . k with mixed signs: NaN scores
    sums, mask = map(np.asarray, case.run(q_inf, k, 0.9, impl.api))
    bad = np.zeros(sums.shape[:3], bool)
    bad[0, 0, 100 // case.block_size] = True
    _poison_check(case, sums, mask, bad, f"{impl} inf query {rand}")


def test_inf_key_token_implementations_agree(rand):
    """An inf key entry gives +inf scores (NaN rows) or -inf scores (weight 0, finite rows)
    depending on the sign of the query entry: both implementations must agree on which
    rows are poisoned, and those rows keep every allowed block."""
    case = NONCAUSAL
    q, k = case.inputs(rand)
    k_inf = k.at[0, 0, 120, 2].set(jnp.inf)
    ref_sums, ref_mask = map(np.asarray, case.run(q, k_inf, 0.9, "reference"))
    pal_sums, pal_mask = map(np.asarray, case.run(q, k_inf, 0.9, "triton"))
    ref_bad = ~np.isfinite(ref_sums).all(-1)
    assert np.array_equal(ref_bad, ~np.isfinite(pal_sums).all(-1)), str(rand)
    assert ref_bad.any() and np.all(ref_mask[ref_bad]) and np.all(pal_mask[ref_bad])
    ok = ~ref_bad
    np.testing.assert_allclose(pal_sums[ok], ref_sums[ok], rtol=2e-3, atol=1e-6,
                               err_msg=str(rand))


# --- GPU only --------------------------------------------------------------------------

def _require_gpu():
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU (jax.default_backend() != 'gpu')")


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_gpu_triton_is_deterministic(case, rand):
    _require_gpu()
    q, k = case.inputs(rand)
    t = rand.thresholds(case.q_heads)
    first = [np.asarray(x) for x in case.run(q, k, t, "triton")]
    second = [np.asarray(x) for x in case.run(q, k, t, "triton")]
    for a, b in zip(first, second):
        assert a.tobytes() == b.tobytes(), f"{case.id} {rand}: two runs differ"


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_gpu_output_fully_written_over_nan_memory(causal, rand):
    """Fill freed device memory with NaN first: any output element the kernels forget to
    write would read back as NaN."""
    _require_gpu()
    case = ApiCase("poison", 2, 4, 2, 1000, 1000, 32, 8, 64, causal)
    q, k = case.inputs(rand)
    jax.block_until_ready((q, k))
    poison = jnp.full((1 << 28,), jnp.nan, jnp.float32)  # 1 GiB
    poison.block_until_ready()
    poison.delete()
    del poison
    sums, mask = case.run(q, k, 0.9, "triton")
    sums = np.asarray(sums)
    assert np.all(np.isfinite(sums)), f"{rand}: unwritten (NaN) block sums"
    want = npr.real_rows_per_block(case.q_len, case.stride, case.block_size)
    np.testing.assert_allclose(sums.sum(-1), np.broadcast_to(want, sums.shape[:3]),
                               rtol=1e-4, err_msg=str(rand))
    npr.check_mask_rules(np.asarray(mask), sums, 0.9, causal=causal, msg=str(rand))
