"""The tuned rules that shape a Mosaic block-sum call (`plan.EstimatePlan`): its
key tile and ring, its key groups, whether its statistics fold, in which steps it runs
within the scratch bound, and on which grid. Each rule names its docs/tuning.md entry.
"""

from __future__ import annotations

import dataclasses

import jax

from xattn_jax.geometry import cdiv
from xattn_jax.mosaic.estimate import grid
from xattn_jax.mosaic.smem import SMEM_BYTES

BLOCK_K = 256  # reshaped key columns per key tile (docs/tuning.md: mosaic-streamed-queries)
MIN_STAGES, MAX_STAGES = 2, 8  # the ring's slots (docs/tuning.md: mosaic-ring)
# CTAs per row tile of a non-causal call of fewer CTAs than SMs, at most (docs/tuning.md:
# mosaic-key-groups)
MAX_KEY_GROUPS = 4
# a causal call's key groups, where a head's keys take at most CAUSAL_KEY_GROUPS_MAX_BYTES
# (docs/tuning.md: mosaic-causal-key-groups)
CAUSAL_KEY_GROUPS, CAUSAL_KEY_GROUPS_MAX_BYTES = 4, 32 << 20
# a whole causal call's statistics fold where that saves this share (docs/tuning.md:
# mosaic-fold)
FOLD_MIN_SAVING = 1 / 4
# the fewest work items per SM of a persistent step (docs/tuning.md: mosaic-persistent-grid)
PERSISTENT_MIN_ITEMS = 4
# "auto" runs calls of at least this share of the SMs in CTAs on Mosaic (docs/tuning.md:
# mosaic-auto-min-ctas)
AUTO_MIN_FILL = 3 / 4
HOPPER_SMS = 132  # an H200's SMs, where the device does not say (docs/tuning.md: mosaic-sms)


def device_sms() -> int:
    """The SMs of jax's default device where it is a GPU that says, else HOPPER_SMS."""
    device = jax.devices()[0]
    return (getattr(device, "core_count", 0) if device.platform == "gpu" else 0) or HOPPER_SMS


def auto_min_ctas(sms: int) -> int:
    """The fewest CTAs per kernel call for which "auto" runs the Mosaic block sums."""
    return int(sms * AUTO_MIN_FILL)


def block_k(page_size: int | None, stride: int) -> int:
    """BLOCK_K, or with pages (a multiple of 64 x stride tokens) the largest multiple of
    64 up to it that divides a page's reshaped columns: a key tile within a page."""
    if page_size is None:
        return BLOCK_K
    return max(n for n in range(64, BLOCK_K + 1, 64) if page_size // stride % n == 0)


def deepest_ring(plan, itemsize: int):
    """`plan` with the most stages up to MAX_STAGES whose shared memory fits (counted
    with ordered statistics in non-causal calls; without, where the ring holds a tile)."""
    def deepest(ordered: bool) -> int:
        return max(n for n in range(MIN_STAGES, MAX_STAGES + 1) if dataclasses.replace(
            plan, stages=n).smem_bytes(itemsize, ordered) <= SMEM_BYTES)

    stages = deepest(not plan.causal)
    if not plan.causal and stages >= plan.steps_per_tile:
        stages = deepest(False)
    return dataclasses.replace(plan, stages=stages)


def call_shape(plan, bound: int):
    """`plan` (one whole call) with its key groups, fold, steps and grid for statistics
    of at most `bound` bytes a kernel call, or the reason no step fits."""
    if plan.causal:
        plan = dataclasses.replace(plan, key_groups=_causal_key_groups(plan))
        plan = dataclasses.replace(plan, fold=_fold_saves(plan))
    steps = _steps(plan, bound)
    if steps is None:
        return _steps_refused(plan, bound)
    heads, rows = steps
    plan = dataclasses.replace(plan, call_heads=heads, call_rows=rows,
                               fold=plan.fold and not rows)
    if _default_persistent(plan):
        return _persistent(plan)
    if not plan.causal and not rows:
        return dataclasses.replace(plan, key_groups=_key_groups(plan))
    return plan


def _steps(plan, bound: int) -> tuple[int, int] | None:
    """(call_heads, call_rows): one call where it fits, else head steps, else row steps
    of every head, else row steps of one head (docs/tuning.md: mosaic-head-steps,
    mosaic-row-steps, mosaic-head-row-steps)."""
    if plan.scratch_bytes <= bound:
        return 0, 0
    heads = _call_heads(plan, bound)
    if heads:
        return heads, 0
    rows = _call_rows(plan, bound)
    if rows is not None:
        return 0, rows
    rows = _head_rows(plan, bound)
    return None if rows is None else (1, rows)


def _causal_key_groups(plan) -> int:
    if plan.head_key_bytes > CAUSAL_KEY_GROUPS_MAX_BYTES:
        return 1
    return min(CAUSAL_KEY_GROUPS, plan.key_tiles)


def _key_groups(plan) -> int:
    """1 where a call's CTAs hold a wave, else the G up to MAX_KEY_GROUPS whose CTAs fill
    their waves best (of equals the smallest)."""
    sms, ctas = plan.sms, plan.step_ctas(plan.rows_per_call)
    if ctas >= sms:
        return 1

    def fill(groups: int) -> float:
        return ctas * groups / (cdiv(ctas * groups, sms) * sms)

    return max(range(1, min(MAX_KEY_GROUPS, plan.key_tiles) + 1),
               key=lambda groups: (fill(groups), -groups))


def _fold_saves(plan) -> bool:
    unfolded = plan.key_tiles * plan.call_row_tiles
    return plan.fold_slots * plan.fold_places <= (1 - FOLD_MIN_SAVING) * unfolded


def _default_persistent(plan) -> bool:
    """A persistent grid (docs/tuning.md: mosaic-persistent-grid): row steps of one head;
    a causal call's row steps of one key group; its head steps of PERSISTENT_MIN_ITEMS
    listed items per SM."""
    if plan.call_rows and plan.call_heads:
        return True
    if not plan.causal:
        return False
    if plan.call_rows:
        return plan.key_groups == 1
    if plan.call_heads:
        items = len(grid.listed_items(plan)) * plan.pairs
        return items >= PERSISTENT_MIN_ITEMS * plan.sms
    return False


def _persistent(plan):
    """`plan` on a persistent grid of one CTA per SM, at most one per work item (listed:
    per visible item of its longest row step)."""
    plan = dataclasses.replace(plan, key_groups=1, persistent_ctas=1)
    items = (int(grid.listed_counts(plan).max()) * plan.pairs if plan.listed
             else plan.step_ctas(plan.rows_per_call))
    return dataclasses.replace(plan, persistent_ctas=min(plan.sms, items))


def _head_step(plan, heads: int, rows: int = 0):
    """`plan` in steps of `heads` heads (with `rows`, row steps of them); a non-causal
    step in its own key groups."""
    step = dataclasses.replace(plan, call_heads=heads, call_rows=rows,
                               fold=plan.fold and not rows)
    if not plan.causal:
        step = dataclasses.replace(step, key_groups=_key_groups(step))
    return step


def _call_heads(plan, bound: int) -> int | None:
    """The heads of a head step: of those whose statistics fit and whose CTAs "auto"
    runs on Mosaic, the size computing the fewest heads in all, then the fewest steps."""
    q_heads = plan.geom.q_heads
    most = min(bound // dataclasses.replace(plan, call_heads=1).scratch_bytes, q_heads)
    heads = [n for n in range(1, most + 1)
             if _head_step(plan, n).ctas >= auto_min_ctas(plan.sms)]
    if not heads:
        return None
    return min(heads, key=lambda n: (cdiv(q_heads, n) * n, cdiv(q_heads, n)))


def _fills_sms(plan, rows: int) -> bool:
    """A row step of `rows` rows of every head holds a CTA per SM without key groups."""
    return plan.step_ctas(rows) // plan.key_groups >= plan.sms


def _call_rows(plan, bound: int) -> int | None:
    """The rows of a row step of every head: a multiple of `row_quantum` that fits and
    `_fills_sms`, with the fewest waves of CTAs in all, then the fewest rows computed
    twice (the last step overlaps the one before), then the largest."""
    quantum = plan.row_quantum
    extent = plan.geom.q_blocks * plan.geom.block_rows

    def waves(rows: int) -> int:
        return cdiv(extent, rows) * cdiv(plan.step_ctas(rows), plan.sms)

    fit = min(bound // plan.row_scratch_bytes, cdiv(extent, quantum) * quantum)
    steps = [rows for rows in range(quantum, fit // quantum * quantum + 1, quantum)
             if _fills_sms(plan, rows)]
    if not steps:
        return None
    return min(steps, key=lambda rows: (waves(rows), cdiv(extent, rows) * rows, -rows))


def _head_row_step(plan, rows: int):
    """A row step of `rows` rows of one head on the persistent grid, or None with fewer
    than PERSISTENT_MIN_ITEMS work items per SM."""
    step = _persistent(dataclasses.replace(plan, call_heads=1, call_rows=rows, fold=False))
    return step if step.step_ctas(rows) >= PERSISTENT_MIN_ITEMS * plan.sms else None


def _busiest_sm_items(step) -> int:
    """Work items the busiest SM walks in all the row steps of one head."""
    if step.listed:
        return sum(cdiv(int(items) * step.pairs, step.persistent_ctas)
                   for items in grid.listed_counts(step))
    steps = len(grid.step_first_rows(step))
    return steps * cdiv(step.step_ctas(step.rows_per_call), step.persistent_ctas)


def _head_rows(plan, bound: int) -> int | None:
    """The rows of a row step of one head: of those that fit and `_head_row_step` takes,
    the fewest steps a head, then the fewest items on the busiest SM, then the fewest
    rows computed, then the largest."""
    quantum = plan.row_quantum
    extent = plan.geom.q_blocks * plan.geom.block_rows
    one_head = dataclasses.replace(plan, call_heads=1, fold=False)
    fit = min(bound // one_head.row_scratch_bytes, cdiv(extent, quantum) * quantum)
    steps = {}
    for rows in range(quantum, fit // quantum * quantum + 1, quantum):
        step = _head_row_step(plan, rows)
        if step is not None:
            steps[rows] = _busiest_sm_items(step)
    if not steps:
        return None
    return min(steps, key=lambda rows: (cdiv(extent, rows), steps[rows],
                                        cdiv(extent, rows) * rows, -rows))


def _steps_refused(plan, bound: int) -> str:
    """Why no step of `plan` fits within `bound` bytes: the smallest of each kind."""
    rows = plan.row_quantum
    while not _fills_sms(plan, rows):
        rows += plan.row_quantum
    head, quantum = _head_step(plan, 1), plan.row_quantum
    part = next((step for n in range(quantum, plan.padded_rows + quantum, quantum)
                 if (step := _head_row_step(plan, n)) is not None), None)
    part_need = ("no row step of one head has the work a step needs" if part is None
                 else f"{part.scratch_bytes} bytes for a row step of one head "
                      f"({part.call_rows} rows, {part.ctas} CTAs)")
    return (f"impl='mosaic' block sums need {plan.row_scratch_bytes * rows} bytes of "
            f"statistics for one row step of a wave of row tiles ({rows} rows of every "
            f"head), or {head.scratch_bytes} bytes for a head step of one head's rows "
            f"({head.ctas} CTAs, of the {auto_min_ctas(plan.sms)} a step needs), or "
            f"{part_need}, over max_scratch_bytes={bound}")
