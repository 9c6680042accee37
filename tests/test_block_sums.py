"""docs/estimate.md sections 1-3: strided scores and block sums, every implementation against
the float64 numpy reference (and the Pallas kernels against the JAX reference)."""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import np_reference as npr
from cases import F32_RTOL, GPU_SLACK, QKCase
from xattn_jax.checks import check_qk
from xattn_jax.geometry import Geometry
from xattn_jax.triton.block_sums import block_sums as triton_block_sums
from xattn_jax.triton.plan import ONE_PASS, TWO_PASS, Plan, Tiles, plan_block_sums

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16


@dataclasses.dataclass(frozen=True)
class Case(QKCase):
    tile: int | tuple = 16
    norm: float = 1.0

    def expected(self, q, k):
        return npr.block_sums(q, k, stride=self.stride, block_size=self.block_size,
                              causal=self.causal, norm=self.norm)


# block_rows = block_size / stride, compared with the (reshaped) tile of the Pallas kernel.
CASES = [
    # odd length, GQA 2:1, block (8 rows) smaller than the tile (16)
    Case("c131_s8_bs64_gqa1", 1, 2, 1, 131, 131, 16, 8, 64, True),
    # Lq < Lk non-causal with any lengths, GQA 4:2, block_size 12 (3 rows, not a power of 2)
    Case("nc37x131_s4_bs12_gqa2", 1, 4, 2, 37, 131, 32, 4, 12, False),
    # block (16 rows) equal to the tile, length 300 (not a multiple of the block)
    Case("c300_s8_bs128_eq_tile", 1, 4, 2, 300, 300, 16, 8, 128, True),
    # block (32 rows) larger than the tile (16)
    Case("nc300_s4_bs128_gt_tile", 1, 2, 2, 300, 300, 16, 4, 128, False),
    # block_size 48 with stride 8 (6 rows), causal Lq < Lk (Lk - Lq = 2 blocks), GQA 4:1
    Case("c204x300_s8_bs48_gqa4", 1, 4, 1, 204, 300, 16, 8, 48, True),
    # stride 1 (plain attention), tile 32
    Case("c100_s1_bs16", 1, 2, 1, 100, 100, 16, 1, 16, True, tile=32),
    # stride 16, bfloat16, length not a multiple of the stride
    Case("nc257_s16_bs64_bf16", 1, 2, 1, 257, 257, 32, 16, 64, False, BF16),
    # bfloat16 causal with Lq < Lk and GQA 4:2
    Case("c37x101_s8_bs32_bf16", 1, 4, 2, 37, 101, 16, 8, 32, True, BF16),
    # float16
    Case("c131_s4_bs16_f16", 1, 2, 1, 131, 131, 16, 4, 16, True, F16),
    # bfloat16 non-causal, GQA 4:1, tile 32
    Case("nc128x256_s8_bs64_bf16", 1, 4, 1, 128, 256, 32, 8, 64, False, BF16, tile=32),
    # batch 2
    Case("c200_b2_s8_bs64", 2, 2, 2, 200, 200, 16, 8, 64, True, tile=32),
    # one query token, shorter than a stride group; block of one reshaped row
    Case("nc1x5_s4_bs4", 1, 1, 1, 1, 5, 16, 4, 4, False),
    # Lq = Lk = 130: the last stride group half padding
    Case("c130_s8_bs16", 1, 2, 1, 130, 130, 16, 8, 16, True),
    # causal Lq < Lk by one block of 256 (32 rows, larger than the tile of 16): only 6 real
    # rows, so the second row tile is all padding
    Case("c44x300_s8_bs256_gt_tile", 1, 2, 2, 44, 300, 16, 8, 256, True),
    # block_size 12 with stride 4 causal, a softmax temperature, head_dim 24 (not a power
    # of two: the kernel masks its padded columns)
    Case("c61_s4_bs12_norm2_d24", 1, 2, 2, 61, 61, 24, 4, 12, True, norm=2.0),
    # cases the Mosaic block sums take too (bfloat16 / float16, D 64 or 128, blocks of
    # a multiple of 8 rows): causal 600 over 2 key tiles (4 key groups' grid compacted),
    # non-causal GQA in batch 2 with a temperature, causal Lq < Lk at D 128 in float16
    Case("c600_s2_bs32_bf16_d64", 1, 2, 1, 600, 600, 64, 2, 32, True, BF16, tile=32),
    Case("nc190x251_b2_s2_bs16_bf16_d64", 2, 2, 1, 190, 251, 64, 2, 16, False, BF16,
         tile=32, norm=2.0),
    Case("c128x384_s2_bs128_f16_d128", 1, 4, 2, 128, 384, 128, 2, 128, True, F16, tile=32),
]
CASE_IDS = [c.id for c in CASES]


def _run(impl, case: Case, q, k, **kw):
    return impl.block_sums(q, k, case.geom(), causal=case.causal, norm=case.norm,
                           tile=kw.pop("tile", case.tile), **kw)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_block_sums_match_float64_reference(kernel_impl, reference_impl, case, rand):
    q, k = case.inputs(rand)
    got = _run(kernel_impl, case, q, k)
    want = case.expected(q, k)
    qb, kb = -(-case.q_len // case.block_size), -(-case.k_len // case.block_size)
    assert got.shape == (case.batch, case.q_heads, qb, kb), f"{rand}"
    assert np.all(np.isfinite(got)), f"{rand}: non-finite block sums"
    err = npr.rel_err(got, want)
    assert err <= case.rtol, \
        f"{kernel_impl} {case.id} {rand}: relative error {err:.3g} > {case.rtol}"
    if kernel_impl.is_kernel:  # the kernel against the JAX reference on the same inputs
        want32 = reference_impl.block_sums(q, k, case.geom(), causal=case.causal,
                                           norm=case.norm)
        err32 = npr.rel_err(got, want32)
        assert err32 <= case.rtol, f"{kernel_impl} vs reference {case.id} {rand}: {err32:.3g}"


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_row_sums_count_real_rows(kernel_impl, case, rand):
    """Each softmax row sums to 1: a full query block's row sums to block_size / stride,
    the partial last block to the number of its reshaped rows holding a real token."""
    q, k = case.inputs(rand)
    got = _run(kernel_impl, case, q, k).astype(np.float64)
    want = npr.real_rows_per_block(case.q_len, case.stride, case.block_size)
    rows = got.sum(axis=-1)
    np.testing.assert_allclose(rows, np.broadcast_to(want, rows.shape), rtol=1e-5,
                               err_msg=f"{kernel_impl} {case.id} {rand}")
    assert want[0] == min(case.block_size // case.stride, -(-case.q_len // case.stride))
    if case.causal:  # nothing after the diagonal
        qb, kb = got.shape[-2:]
        after = np.arange(kb)[None, :] > np.arange(qb)[:, None] + (kb - qb)
        assert np.all(got[..., after] == 0), f"{kernel_impl} {case.id} {rand}: mass after diagonal"


def test_row_whose_every_score_is_minus_inf_is_nan(kernel_impl, rand):
    """Causal, Lq = Lk: reshaped row 0 sees key column 0 only. An inf in every key of that
    column against negative query entries makes its one score -inf: the row has no
    softmax, and every implementation makes its query block NaN (docs/estimate.md,
    "Numerics"). Every later row gives column 0 weight 0 and stays finite."""
    # causal, 200 tokens: whole stride groups (a padded query token, 0, times inf is NaN)
    case = next(c for c in CASES if c.id == "c200_b2_s8_bs64")
    q, k = case.inputs(rand)
    q = q.at[..., 2].set(-jnp.abs(q[..., 2]) - 0.5)
    k = k.at[:, :, :case.stride, 2].set(jnp.inf)
    got = _run(kernel_impl, case, q, k)
    assert np.isnan(got[:, :, 0, 0]).all(), f"{kernel_impl} {rand}: {got[:, :, 0]}"
    assert np.isfinite(got[:, :, 1:]).all(), f"{kernel_impl} {rand}"


# --- padding never changes a result ----------------------------------------------------

TILE_CASES = [CASES[4], CASES[1]]  # causal bs48 (Lq < Lk), non-causal bs12 GQA


@pytest.mark.parametrize("case", TILE_CASES, ids=[c.id for c in TILE_CASES])
def test_pallas_tile_size_does_not_change_result(kernel_pallas_impl, case, rand):
    """The kernel pads to whole tiles: tiles of 16, 32 and 64 (and non-square ones where
    the kernel takes them) give the same block sums to float32 rounding."""
    q, k = case.inputs(rand)
    tiles = [16, 32, 64] if case is CASES[4] else [16, 32]
    results = {t: _run(kernel_pallas_impl, case, q, k, tile=t) for t in tiles}
    want = case.expected(q, k)
    for t, got in results.items():
        assert npr.rel_err(got, want) <= F32_RTOL, f"tile {t} vs float64 {rand}"
        err = npr.rel_err(got, results[16])
        assert err <= 2e-6 * GPU_SLACK, f"tile {t} vs tile 16: {err:.3g} {rand}"


@pytest.mark.parametrize("tile", [(16, 32), (32, 16)], ids=["16x32", "32x16"])
def test_pallas_non_square_tiles(kernel_pallas_impl, tile, rand):
    case = CASES[4]
    q, k = case.inputs(rand)
    got = _run(kernel_pallas_impl, case, q, k, tile=tile)
    err = npr.rel_err(got, case.expected(q, k))
    assert err <= F32_RTOL, f"tile {tile}: {err:.3g} {rand}"


@pytest.mark.parametrize("depth", [16, 32, 64, None])
def test_head_dim_steps_do_not_change_result(kernel_pallas_impl, depth, rand):
    """Head dim 24 (padded to 32 and masked) fed in steps of 16 columns, or in one step
    (32, a depth beyond the padded head dim, or None): the same block sums."""
    case = next(c for c in CASES if c.id == "c61_s4_bs12_norm2_d24")
    q, k = case.inputs(rand)
    plan = plan_block_sums(case.geom(), q.dtype, case.causal,
                           interpret=kernel_pallas_impl.interpret,
                           tiles=Tiles(16, 16, block_d=depth), kernel=kernel_pallas_impl.kernel)
    assert plan.block_d == min(depth or 32, 32) and plan.head_parts == 32 // plan.block_d
    got = triton_block_sums(q, k, plan=plan, causal=case.causal, norm=case.norm)
    err = npr.rel_err(np.asarray(got), case.expected(q, k))
    assert err <= F32_RTOL, f"depth {depth}: {err:.3g} {rand}"


@pytest.mark.parametrize("depth", [8, 48, 0])
def test_tiles_refuse_a_block_d_that_is_not_a_power_of_two_of_16_or_more(depth):
    with pytest.raises(ValueError, match="block_d must be None or a power of two"):
        Tiles(16, 16, block_d=depth)


SPLIT_CASES = [CASES[2], CASES[3], CASES[5]]  # GQA 4:2, MHA 2, GQA 4:1
STEPS = {  # kind: (rows, row step) -> (the bound in rows of one head, the call shape)
    "heads": lambda rows, step: (rows, (1, rows)),
    "heads and rows": lambda rows, step: (step, (1, step)),
    "head pairs": lambda rows, step: (2 * rows, (2, rows)),
}


SPLITS = [(case, steps) for case in SPLIT_CASES for steps in STEPS
          if steps != "head pairs" or case.q_heads > 2]  # 2 heads: one call


@pytest.mark.parametrize("case, steps", SPLITS, ids=[f"{c.id}-{s}" for c, s in SPLITS])
def test_one_pass_in_several_calls(pallas_impl, case, steps, rand):
    """With a scratch bound below the whole call's, the one-pass kernel covers the heads,
    and if need be each head's rows, in several calls one after another (GQA's key heads
    picked for each call's heads): the same block sums as one call."""
    q, k = case.inputs(rand)
    geom = case.geom()

    def plan(**bound):
        return plan_block_sums(geom, q.dtype, case.causal, interpret=pallas_impl.interpret,
                               tiles=Tiles(case.tile, case.tile), kernel=ONE_PASS, **bound)

    whole = plan()
    rows, step = whole.padded_rows, math.lcm(case.tile, geom.block_rows)
    bound_rows, shape = STEPS[steps](rows, step)
    bound = whole.head_row_scratch_bytes * bound_rows
    split = plan(max_scratch_bytes=bound)
    assert (split.call_heads, split.call_rows) == shape, steps
    assert split.calls > 1 and whole.calls == 1, "not several calls"
    assert split.scratch_bytes <= bound < whole.scratch_bytes

    def run(p):
        return np.asarray(triton_block_sums(q, k, plan=p, causal=case.causal, norm=case.norm))

    got, want = run(split), run(whole)
    assert got.shape == want.shape
    assert npr.rel_err(got, case.expected(q, k)) <= F32_RTOL, f"{case.id} {rand}"
    assert npr.rel_err(got, want) <= 2e-6 * GPU_SLACK, f"{case.id} {rand}"
    if steps == "heads and rows":
        with pytest.raises(ValueError, match="max_scratch_bytes"):
            plan(max_scratch_bytes=bound - 1)
        fallback = plan_block_sums(geom, q.dtype, case.causal, interpret=True,
                                   tiles=Tiles(case.tile, case.tile), max_scratch_bytes=bound - 1)
        assert fallback.kernel == TWO_PASS and fallback.scratch_bytes == 0


def _bf16_plan(geom: Geometry, fit_rows: int) -> Plan:
    """The one-pass plan of `geom` (tiles 16 x 64) with a bound of `fit_rows` rows of one
    head."""
    tiles = Tiles(16, 64)
    whole = plan_block_sums(geom, jnp.bfloat16, False, interpret=True, tiles=tiles)
    return plan_block_sums(geom, jnp.bfloat16, False, interpret=True, tiles=tiles,
                           max_scratch_bytes=whole.head_row_scratch_bytes * fit_rows)


@pytest.mark.parametrize("fit_steps", [1, 2, 3, 5, 12, 13, 15])
def test_row_steps_are_as_few_and_as_small_as_possible(fit_steps):
    """Row steps are as few as the bound allows, and each as small as that many calls
    allow: the last call starts early enough to end on the last block, so every row a
    call holds beyond need is work done twice (a 64K-token call at block 4096 whose bound
    held 12 of 16 steps once ran 2 calls of 12, redoing 8 steps; now 2 calls of 8)."""
    geom = Geometry(1, 2, 2, 8192, 8192, 64, 8, 256)
    step = math.lcm(16, geom.block_rows)  # 32 rows; q_rows = 1024 = 32 steps
    plan = _bf16_plan(geom, step * fit_steps)
    heads, call_rows = plan.call_heads, plan.call_rows
    calls = -(-geom.q_rows // call_rows)
    assert heads == 1 and call_rows % step == 0 and call_rows <= step * fit_steps
    assert calls == -(-geom.q_rows // (step * fit_steps)), "more calls than needed"
    assert (call_rows - step) * calls < geom.q_rows, f"{calls} calls of {call_rows} rows"
    assert plan.calls == geom.q_heads * calls


@pytest.mark.parametrize("fit_heads, heads", [(1, 1), (2, 2), (10, 8), (11, 11), (31, 16),
                                              (32, 32), (40, 32)])
def test_head_steps_cover_whole_heads_evenly(fit_heads, heads):
    """Where every row of some heads fits, a call covers every row of as many heads as the
    fewest calls need (32 heads, 10 fitting: 4 calls of 8, not 3 of 10 and one that
    repeats 8 heads)."""
    geom = Geometry(1, 32, 8, 4096, 4096, 64, 8, 256)
    rows = -(-geom.q_rows // 16) * 16
    plan = _bf16_plan(geom, rows * fit_heads)
    assert (plan.call_heads, plan.call_rows) == (heads, rows)
    assert plan.calls == -(-32 // heads)


PAD_CASES = [CASES[12], CASES[1]]  # c130 (-> 136), nc37x131 s4 (-> 40 x 132)


@pytest.mark.parametrize("case", PAD_CASES, ids=[c.id for c in PAD_CASES])
def test_explicit_zero_padding_to_stride_changes_nothing(kernel_impl, case, rand):
    """Zero tokens appended up to a whole stride group are exactly what a partly padded
    group reads: the block sums must not change."""
    q, k = case.inputs(rand)
    s = case.stride
    qp = jnp.pad(q, ((0, 0), (0, 0), (0, -case.q_len % s), (0, 0)))
    kp = jnp.pad(k, ((0, 0), (0, 0), (0, -case.k_len % s), (0, 0)))
    padded = dataclasses.replace(case, q_len=qp.shape[2], k_len=kp.shape[2])
    assert padded.q_len != case.q_len or padded.k_len != case.k_len
    got = _run(kernel_impl, case, q, k)
    got_padded = _run(kernel_impl, padded, qp, kp)
    assert got.shape == got_padded.shape
    err = npr.rel_err(got_padded, got)
    assert err <= 1e-6 * GPU_SLACK, \
        f"{kernel_impl} {case.id} {rand}: explicit padding changed sums by {err:.3g}"


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_padded_query_rows_add_nothing(kernel_impl, causal, rand):
    """Causal Lq = Lk = 131, block 64, stride 8: the last query block holds one real
    reshaped row (tokens 128..130, which sees every key) and 7 padded rows. It must equal
    a call (causal, or non-causal: the row sees every key either way) with only those 3
    query tokens, whose single block is one real row and 7 padded rows too."""
    case = CASES[0]  # c131_s8_bs64_gqa1, causal
    q, k = case.inputs(rand)
    full = _run(kernel_impl, case, q, k)
    tail = dataclasses.replace(case, q_len=3, causal=causal)
    last = _run(kernel_impl, tail, q[:, :, 128:], k)
    assert full.shape[-2] == 3 and last.shape[-2] == 1
    np.testing.assert_allclose(last[..., 0, :].sum(-1), 1.0, rtol=1e-5, err_msg=str(rand))
    np.testing.assert_allclose(full[..., 2, :], last[..., 0, :], rtol=1e-5, atol=1e-7,
                               err_msg=f"{kernel_impl} causal={causal} {rand}")


# --- hierarchical sums -----------------------------------------------------------------

HIER = [
    # causal Lq < Lk (Lk - Lq = 128, a multiple of every block size used)
    (Case("hier_c172x300_s8", 1, 2, 1, 172, 300, 16, 8, 32, True), [4]),
    # non-causal, block 12 at stride 4 and 3 x 12 = 36 (9 rows: not a power of two)
    (Case("hier_nc37x300_s4", 1, 2, 2, 37, 300, 16, 4, 12, False), [3]),
]


@pytest.mark.parametrize("case,factors", HIER, ids=[c.id for c, _ in HIER])
def test_hierarchical_block_sums(kernel_impl, case, factors, rand):
    """Block sums at m * block_size are the m x m tile sums of those at block_size."""
    q, k = case.inputs(rand)
    small = _run(kernel_impl, case, q, k)
    for m in factors:
        big_case = dataclasses.replace(case, block_size=m * case.block_size)
        big = _run(kernel_impl, big_case, q, k)
        want = npr.tile_sums(small, m)
        assert big.shape == want.shape, f"m={m}: {big.shape} vs {want.shape}"
        err = npr.rel_err(big, want)
        assert err <= 2e-6 * GPU_SLACK, \
            f"{kernel_impl} m={m} {rand}: hierarchical sums off by {err:.3g}"
        assert npr.rel_err(big, big_case.expected(q, k)) <= F32_RTOL, f"m={m} {rand}"


# --- section 1 alone -------------------------------------------------------------------

SCORE_CASES = [
    Case("s8_gqa_odd", 1, 4, 2, 37, 131, 16, 8, 8, False),
    Case("s4_bf16_norm2", 1, 2, 1, 61, 61, 32, 4, 4, False, BF16, norm=2.0),
    Case("s1_f16_d20", 1, 2, 2, 20, 45, 20, 1, 1, False, F16),
]


@pytest.mark.parametrize("case", SCORE_CASES, ids=[c.id for c in SCORE_CASES])
def test_strided_scores(impl, case, rand):
    q, k = case.inputs(rand)
    got = impl.scores(q, k, case.geom(), norm=case.norm, tile=16)
    rows, cols = -(-case.q_len // case.stride), -(-case.k_len // case.stride)
    want = npr.strided_scores(q, k, stride=case.stride, norm=case.norm)
    assert got.shape == want.shape == (case.batch, case.q_heads, rows, cols)
    err = npr.rel_err(got, want)
    assert err <= case.rtol, f"{impl} {case.id} {rand}: {err}"


def test_strided_scores_by_hand(rand):
    """Section 1's formula for one entry, written out (stride 2, D 1): row 0 reads
    q[1], q[0] against k[2j], k[2j+1]."""
    q = rand.normal((1, 1, 4, 1))
    k = rand.normal((1, 1, 6, 1))
    a = npr.strided_scores(q, k, stride=2)
    qn, kn = np.asarray(q, np.float64)[0, 0, :, 0], np.asarray(k, np.float64)[0, 0, :, 0]
    for i in range(2):
        for j in range(3):
            want = (qn[2 * i + 1] * kn[2 * j] + qn[2 * i] * kn[2 * j + 1]) / 2.0
            assert a[0, 0, i, j] == pytest.approx(want, rel=1e-12), f"{rand} ({i},{j})"


# --- random shapes ---------------------------------------------------------------------

@st.composite
def shapes(draw):
    stride = draw(st.sampled_from([1, 2, 4, 8, 16]))
    block_size = stride * draw(st.sampled_from([1, 2, 3, 4, 6, 8]))
    causal = draw(st.booleans())
    k_len = draw(st.integers(1, 300 if stride > 1 else 96))
    if causal:
        q_len = k_len - block_size * draw(st.integers(0, (k_len - 1) // block_size))
    else:
        q_len = draw(st.integers(1, k_len))
    kv_heads = draw(st.sampled_from([1, 2]))
    q_heads = kv_heads * draw(st.sampled_from([1, 2]))
    tile = draw(st.sampled_from([16, 32]))
    seed = draw(st.integers(0, 2**32 - 1))
    return Case("hyp", 1, q_heads, kv_heads, q_len, k_len, 16, stride, block_size, causal,
                tile=tile), seed


def test_random_shapes_against_float64(kernel_impl, rand_factory):

    @settings(max_examples=4 if kernel_impl.is_kernel else 8, deadline=None, derandomize=False,
              suppress_health_check=[HealthCheck.too_slow])
    @given(shapes())
    def check(drawn):
        case, seed = drawn
        rand = rand_factory(seed)
        q, k = case.inputs(rand)
        check_qk(q, k, stride=case.stride, block_size=case.block_size, causal=case.causal)
        got = _run(kernel_impl, case, q, k)
        err = npr.rel_err(got, case.expected(q, k))
        assert err <= F32_RTOL, f"{kernel_impl} {case} {rand}: {err:.3g}"
        rows = got.astype(np.float64).sum(-1)
        want = npr.real_rows_per_block(case.q_len, case.stride, case.block_size)
        np.testing.assert_allclose(rows, np.broadcast_to(want, rows.shape), rtol=1e-5,
                                   err_msg=f"{case} {rand}")

    check()
