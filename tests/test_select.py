"""docs/estimate.md section 4: threshold selection ("find blocks"), every implementation, on
random block sums and on real ones, checked by its rules and against the float64 loop."""

from __future__ import annotations

import numpy as np
import pytest

import np_reference as npr
from xattn_jax.geometry import Geometry
from xattn_jax.triton import select_blocks as triton_select
from xattn_jax.triton.plan import narrowest_width, plan_select_blocks

# (id, shape [B, Hq, qb, kb], causal, keep_sink, keep_recent)
CONFIGS = [
    ("causal_square", (2, 2, 7, 7), True, False, False),
    ("causal_rect", (1, 4, 5, 9), True, False, False),
    ("noncausal", (1, 4, 6, 13), False, False, False),
    ("noncausal_sink_recent", (1, 4, 6, 13), False, True, True),
    # several Pallas programs per head (rows x next_pow2(kb) > 4096 elements)
    ("noncausal_many_rows", (1, 2, 100, 128), False, False, False),
    ("causal_wide", (1, 2, 40, 200), True, False, False),
    ("single_block", (1, 2, 1, 1), True, False, False),
    # causal rows of two padded widths, each its own kernel call (256 and 512 blocks)
    ("causal_widths", (1, 2, 300, 300), True, False, False),
    ("causal_widths_rect", (1, 2, 150, 300), True, True, True),
]
CAUSAL_WIDTHS = CONFIGS[-2]
CAUSAL_RECT, NONCAUSAL = CONFIGS[1], CONFIGS[2]


def _rules(config):
    _, _, causal, sink, recent = config
    return dict(causal=causal, keep_sink=sink, keep_recent=recent)


def _causal_zeros(sums, causal: bool) -> np.ndarray:
    """Causal block sums hold no mass after the diagonal (as real ones): zero it there."""
    sums = np.array(sums, np.float32)
    if causal:
        _, allowed = npr.forced_allowed(*sums.shape[2:], causal=True)
        sums[..., ~allowed] = 0.0
    return sums


@pytest.mark.parametrize("config", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_random_sums(impl, reference_impl, config, rand):
    """Rules hold on every row; the mask equals the float64 loop and (for Pallas) the JAX
    reference, except on rows where float rounding decides (which must be rare)."""
    shape, rules = config[1], _rules(config)
    sums = _causal_zeros(rand.block_sums(shape), rules["causal"])
    t = rand.thresholds(shape[1])
    mask = impl.select(sums, t, **rules)
    msg = f"{impl} {config[0]} {rand}"
    assert npr.check_mask_rules(mask, sums, t, msg=msg, **rules) == np.prod(shape[:3])
    npr.assert_masks_agree(mask, npr.select(sums, t, **rules), sums, t, msg=msg, **rules)
    if impl.is_kernel:
        ref = reference_impl.select(sums, t, **rules)
        npr.assert_masks_agree(mask, ref, sums, t, msg=msg + " vs reference", **rules)


REAL = [
    # (id, geometry, causal, keep_sink, keep_recent)
    ("causal_gqa", Geometry(1, 4, 2, 300, 300, 16, 8, 32), True, False, False),
    ("noncausal_recent", Geometry(1, 4, 1, 131, 300, 16, 4, 16), False, False, True),
]


@pytest.mark.parametrize("real", REAL, ids=[r[0] for r in REAL])
def test_real_block_sums(impl, reference_impl, real, rand):
    name, geom, causal, sink, recent = real
    rules = dict(causal=causal, keep_sink=sink, keep_recent=recent)
    q, k = rand.qk(geom.batch, geom.q_heads, geom.kv_heads, geom.q_len, geom.k_len,
                   geom.head_dim, stride=geom.stride)
    sums = reference_impl.block_sums(q, k, geom, causal=causal)
    t = rand.thresholds(geom.q_heads, 0.5, 0.95)
    mask = impl.select(sums, t, **rules)
    msg = f"{impl} {name} {rand}"
    npr.check_mask_rules(mask, sums, t, msg=msg, **rules)
    npr.assert_masks_agree(mask, npr.select(sums, t, **rules), sums, t, msg=msg, **rules)
    if impl.is_kernel:
        ref = reference_impl.select(sums, t, **rules)
        npr.assert_masks_agree(mask, ref, sums, t, msg=msg + " vs reference", **rules)
    # a real estimate is sparse somewhere: not every allowed block is kept everywhere
    _, allowed = npr.forced_allowed(*sums.shape[2:], causal=causal)
    assert mask.sum() < np.broadcast_to(allowed, mask.shape).sum(), msg


# --- constructed rows ------------------------------------------------------------------

# 33/64 is exact in float32, and t*T never equals a partial sum of quarters below T = 16,
# so every row below has one exact answer.
TIE_THRESHOLD = 0.515625


def test_ties_by_hand(impl):
    """Non-causal row [0.5, 1, 0.5, 1, 1, 0.5, 0.25, 1]: T = 5.75, t*T = 2.96..., four 1s
    tie; taking them lowest index first, 1 (idx 1), 2 (idx 3), 3 (idx 4) >= 2.96: stop."""
    sums = np.zeros(NONCAUSAL[1], np.float32)
    sums[:] = 0.25
    sums[0, 0, 0, :8] = [0.5, 1, 0.5, 1, 1, 0.5, 0.25, 1]
    sums[0, 0, 0, 8:] = 0.0
    mask = impl.select(sums, TIE_THRESHOLD, causal=False)
    want = np.zeros(13, bool)
    want[[1, 3, 4]] = True
    assert np.array_equal(mask[0, 0, 0], want), f"{impl}: {mask[0, 0, 0].astype(int)}"
    # a row of 13 equal values: ceil(t * 13) = 7 blocks, the first seven
    assert np.array_equal(mask[0, 1, 0], np.arange(13) < 7), mask[0, 1, 0].astype(int)


@pytest.mark.parametrize("config", [CAUSAL_RECT, NONCAUSAL, CONFIGS[0]],
                         ids=["causal_rect", "noncausal", "causal_square"])
def test_exact_ties_break_by_lower_index(impl, config, rand):
    shape, rules = config[1], _rules(config)
    sums = _causal_zeros(rand.rng.integers(1, 5, shape) * 0.25, rules["causal"])  # ties
    assert np.all(sums.sum(-1) < 16)
    mask = impl.select(sums, TIE_THRESHOLD, **rules)
    msg = f"{impl} ties {config[0]} {rand}"
    amb = npr.ambiguous_rows(sums, TIE_THRESHOLD, rtol=1e-6, **rules)
    assert not amb.any(), f"{msg}: the construction should leave no ambiguous row"
    npr.check_mask_rules(mask, sums, TIE_THRESHOLD, msg=msg, rtol=0.0, **rules)
    assert np.array_equal(mask, npr.select(sums, TIE_THRESHOLD, **rules)), msg


@pytest.mark.parametrize("config", [CAUSAL_RECT, NONCAUSAL], ids=["causal", "noncausal"])
def test_threshold_one_keeps_every_allowed_block(impl, config, rand):
    """t >= 1 is dense: every allowed block, also those whose share rounds below float32
    resolution or is 0."""
    shape, rules = config[1], _rules(config)
    _, allowed = npr.forced_allowed(*shape[2:], **rules)
    allowed = np.broadcast_to(allowed, shape)
    sums = _causal_zeros(rand.rng.uniform(0.5, 1.0, shape), rules["causal"])
    sums[rand.rng.random(shape) < 0.3] = 1e-12  # below float32 resolution of the total
    sums[rand.rng.random(shape) < 0.2] = 0.0
    for t in (1.0, 1.5):
        mask = impl.select(sums, t, **rules)
        assert np.array_equal(mask, allowed), f"{impl} {rand}: a block dropped at t={t}"
        npr.check_mask_rules(mask, sums, t, msg=f"{impl} t={t} {rand}", **rules)
    mask = impl.select(sums, [1.0, 0.5, 1.0, 0.5], **rules)
    assert np.array_equal(mask[:, 0], allowed[:, 0]) and not np.array_equal(mask, allowed)


@pytest.mark.parametrize("config", [CAUSAL_RECT, CONFIGS[0], CONFIGS[3]],
                         ids=["causal_rect", "causal_square", "noncausal_sink_recent"])
def test_forced_blocks_alone_reach_threshold(impl, config, rand):
    """When the forced blocks (block 0, the diagonal) hold >= t of the mass, nothing else
    is selected. (causal_square: in row 0 block 0 is the diagonal, one forced block.)"""
    shape, rules = config[1], _rules(config)
    forced, _ = npr.forced_allowed(*shape[2:], **rules)
    forced = np.broadcast_to(forced, shape)
    sums = _causal_zeros(rand.rng.uniform(0.0, 1e-3, shape), rules["causal"])
    sums[forced] = 1.0
    mask = impl.select(sums, 0.9, **rules)
    assert np.array_equal(mask, forced), f"{impl} {config[0]} {rand}"
    # just below: one more block is needed, the largest candidate
    row = sums[0, 0, -1]
    row[:] = rand.rng.uniform(0.01, 0.02, row.shape)  # the last row has no block after

    row[forced[0, 0, -1]] = 0.1 / forced[0, 0, -1].sum()
    mask = impl.select(sums, 0.9, **rules)
    assert mask[0, 0, -1].sum() > forced[0, 0, -1].sum(), f"{impl} {rand}"
    npr.check_mask_rules(mask, sums, 0.9, msg=f"{impl} {rand}", **rules)


def test_causal_structure(impl, rand):
    """Causal: block 0 and the diagonal I + kb - qb always, nothing after the diagonal,
    even when those blocks hold (almost) nothing."""
    shape = CAUSAL_RECT[1]
    qb, kb = shape[2:]
    sums = _causal_zeros(rand.rng.uniform(1.0, 2.0, shape), True)
    diag = np.arange(qb) + kb - qb
    sums[..., 0] = 1e-6
    sums[..., np.arange(qb), diag] = 1e-6
    mask = impl.select(sums, rand.thresholds(shape[1], 0.2, 0.6), causal=True)
    assert np.all(mask[..., 0]), f"{impl} {rand}: block 0 dropped"
    assert np.all(mask[..., np.arange(qb), diag]), f"{impl} {rand}: diagonal dropped"
    after = np.arange(kb)[None, :] > diag[:, None]
    assert after.any() and not np.any(mask[..., after]), f"{impl} {rand}: after diagonal"


@pytest.mark.parametrize("sink,recent", [(False, False), (True, False), (False, True),
                                         (True, True)])
def test_keep_sink_keep_recent_noncausal(impl, sink, recent, rand):
    """Non-causal, block 0 and the diagonal I + kb - qb hold the least mass: they are kept
    exactly when keep_sink / keep_recent ask for them."""
    shape = NONCAUSAL[1]
    qb, kb = shape[2:]
    diag = np.arange(qb) + kb - qb
    sums = rand.rng.uniform(1.0, 2.0, shape).astype(np.float32)
    sums[..., 0] = 1e-3
    sums[..., np.arange(qb), diag] = 1e-3
    mask = impl.select(sums, 0.5, causal=False, keep_sink=sink, keep_recent=recent)
    msg = f"{impl} sink={sink} recent={recent} {rand}"
    assert np.all(mask[..., 0] == sink), msg
    assert np.all(mask[..., np.arange(qb), diag] == recent), msg
    npr.check_mask_rules(mask, sums, 0.5, causal=False, keep_sink=sink, keep_recent=recent,
                         msg=msg)


@pytest.mark.parametrize("config", [CAUSAL_RECT, NONCAUSAL], ids=["causal", "noncausal"])
def test_non_finite_rows_keep_every_allowed_block(impl, config, rand):
    shape, rules = config[1], _rules(config)
    _, allowed = npr.forced_allowed(*shape[2:], **rules)
    sums = _causal_zeros(rand.block_sums(shape), rules["causal"])
    sums[0, 0, 1, 0] = np.nan
    sums[0, 1, 2, 1] = np.inf
    sums[0, 2, 0, :] = np.nan
    t = rand.thresholds(shape[1], 0.3, 0.6)
    mask = impl.select(sums, t, **rules)
    msg = f"{impl} {config[0]} {rand}"
    for h, r in [(0, 1), (1, 2), (2, 0)]:
        assert np.array_equal(mask[0, h, r], allowed[r]), f"{msg}: row ({h}, {r})"
    npr.check_mask_rules(mask, sums, t, msg=msg, **rules)  # the finite rows keep the rules
    npr.assert_masks_agree(mask, npr.select(sums, t, **rules), sums, t, msg=msg, **rules)


@pytest.mark.parametrize("config", [CAUSAL_RECT, NONCAUSAL], ids=["causal", "noncausal"])
def test_all_zero_row_keeps_forced_only(impl, config, rand):
    """T = 0: the forced blocks (none non-causal) already reach t * T = 0."""
    shape, rules = config[1], _rules(config)
    forced, _ = npr.forced_allowed(*shape[2:], **rules)
    sums = _causal_zeros(rand.block_sums(shape), rules["causal"])
    sums[0, 3, 2] = 0.0
    mask = impl.select(sums, 0.9, **rules)
    assert np.array_equal(mask[0, 3, 2], forced[2]), f"{impl} {rand}"
    # every other row as usual (the zero row itself counts as ambiguous: t*T = 0 = the
    # forced mass, checked exactly above)
    npr.assert_masks_agree(mask, npr.select(sums, 0.9, **rules), sums, 0.9,
                           msg=f"{impl} {rand}", **rules)


@pytest.mark.parametrize("config", [CAUSAL_WIDTHS, CAUSAL_RECT], ids=["widths", "rect"])
def test_causal_total_counts_every_block(impl, config, rand):
    """The row total is over every block of the row, those past the diagonal included
    (which real causal block sums leave at 0): a row whose narrower kernel call holds
    only its allowed blocks still counts the rest, and a NaN past its diagonal makes it
    non-finite (every allowed block kept)."""
    shape, rules = config[1], _rules(config)
    sums = np.array(rand.block_sums(shape), np.float32)  # mass past the diagonal too
    sums[0, 1, 3, -1] = np.nan
    t = rand.thresholds(shape[1], 0.3, 0.9)
    mask = impl.select(sums, t, **rules)
    msg = f"{impl} {config[0]} {rand}"
    _, allowed = npr.forced_allowed(*shape[2:], **rules)
    assert np.array_equal(mask[0, 1, 3], allowed[3]), msg
    npr.assert_masks_agree(mask, npr.select(sums, t, **rules), sums, t, msg=msg, **rules)


@pytest.mark.parametrize("shape, causal, widths", [
    ((1, 32, 8192, 8192), True, None), ((1, 2, 300, 300), True, None),
    ((1, 2, 150, 300), True, 2), ((1, 2, 37, 45), True, 5), ((2, 2, 7, 7), True, 1),
    ((1, 32, 8192, 8192), False, None)])
def test_select_plan_calls_hold_each_row_up_to_its_diagonal(shape, causal, widths):
    """The selection's kernel calls take the row tiles in order, each once; a causal row
    tile runs at the narrowest power of two, down to `narrowest_width` (or W / 2^(widths
    - 1) where given), that holds its rows' allowed blocks (up to the diagonal i + kb -
    qb); a non-causal call is one call at W (kb padded to a power of two). Causal 1M at
    block 128 (8192 x 8192 blocks): 2048 rows at 2048 blocks, 2048 at 4096, 4096 at
    8192."""
    plan = plan_select_blocks(shape, causal=causal, interpret=True, widths=widths)
    qb, kb = shape[2:]
    narrowest = (narrowest_width(plan.width) if widths is None
                 else max(1, plan.width >> (widths - 1)))
    assert plan.width == 1 << (kb - 1).bit_length() and plan.row_tiles * plan.rows >= qb
    tiles = [t for call in plan.calls for t in range(call.first_tile,
                                                     call.first_tile + call.tiles)]
    assert tiles == list(range(plan.row_tiles))
    if not causal:
        assert [c.width for c in plan.calls] == [plan.width]
    for call in plan.calls:
        assert call.width & (call.width - 1) == 0 and call.width <= plan.width
        needs = [min(kb, min((t + 1) * plan.rows, qb) + kb - qb)
                 for t in range(call.first_tile, call.first_tile + call.tiles)]
        assert max(needs) <= call.width  # every allowed block held
        if causal:  # and no narrower width would do
            assert call.width == narrowest or max(needs) > call.width // 2
    if shape == (1, 32, 8192, 8192) and causal:
        assert [(c.tiles, c.width) for c in plan.calls] == [(2048, 2048), (2048, 4096),
                                                             (4096, 8192)]
    with pytest.raises(ValueError, match="widths must be at least 1"):
        plan_select_blocks(shape, causal=causal, interpret=True, widths=0)


@pytest.mark.parametrize("widths", [1, 2, 3, 4])
def test_kernel_calls_of_any_widths_select_the_same(impl, widths, rand):
    """The Triton kernel in 1 to 4 calls by width (rows of 300 x 300 causal blocks at 512
    down to 64 blocks: the columns past a call's width summed into the total in up to 3
    pieces): on causal sums (zero past the diagonal) the rules on every row, and with
    mass past the diagonal too, the float64 loop's mask but where rounding decides."""
    if impl.api != "triton":
        pytest.skip("the Triton kernel's calls")
    shape, rules = CAUSAL_WIDTHS[1], _rules(CAUSAL_WIDTHS)
    plan = plan_select_blocks(shape, causal=True, interpret=impl.interpret,
                              widths=widths)
    assert len(plan.calls) == widths
    t = rand.thresholds(shape[1])
    everywhere = np.array(rand.block_sums(shape), np.float32)
    for sums in (_causal_zeros(everywhere, True), everywhere):
        mask = np.asarray(triton_select.select_blocks(sums, t, plan=plan, **rules))
        msg = f"{impl} widths {widths} {rand}"
        if sums is not everywhere:
            assert npr.check_mask_rules(mask, sums, t, msg=msg, **rules) == np.prod(
                shape[:3])
        npr.assert_masks_agree(mask, npr.select(sums, t, **rules), sums, t, msg=msg,
                               **rules)
