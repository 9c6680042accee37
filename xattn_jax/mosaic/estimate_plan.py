"""The static plan of one Mosaic GPU block-sum call (docs/estimate.md sections 1-3) on
Hopper: tiles, pipeline depth, shared memory and scratch. Plain Python (no Mosaic GPU
import), so that a caller can ask `unsupported_reason` anywhere.

The kernel (`xattn_jax.mosaic.tile_stats`) computes the strided scores as one deep-K
product, K = S * D, of the `plan.rows` reshaped query rows of one (batch, query head) a
CTA owns with key chunks of `block_k` reshaped key columns x `block_d` head-dim columns
(one stride member each), streamed through a ring of `stages` slots. Two layouts of the
queries (`queries`, one of QUERY_LAYOUTS), both with two consumer warpgroups computing
the row statistics (`one_pass` of the Triton backend: max, per-unit exp2 sums and totals
per key tile):

- "resident": a CTA holds `WGMMA_ROWS` = 64 rows resident in shared memory (all S stride
  members, `S * D / block_d` chunks of `[64, block_d]`, 128 KiB at S 8, D 128); a ring
  slot holds one key chunk `[block_k, block_d]`. The consumers take the key tiles in
  turns (warpgroup w the tiles t = w mod 2), so that one's statistics overlap the
  other's products. With `cluster` = c > 1, the CTAs of c consecutive row tiles form a
  cluster and share each key chunk (TMA multicast: each loads 1/c of it), dividing the
  key traffic from L2 by c.
- "streamed": a CTA owns `CONSUMERS x 64` = 128 rows and holds none resident; a ring slot
  holds the query chunk `[128, block_d]` and the key chunk `[block_k, block_d]` of one
  step, and consumer w multiplies rows 64w .. 64w + 63 of it (GEMM style: every key byte
  written to shared memory serves 128 rows, and the ring gets the room the resident
  queries took). Both consumers compute every key tile. With `cluster` = c > 1, the
  CTAs of c consecutive row tiles share each key chunk as above (each loads its own
  query chunks). With `stagger` (the default), consumer 1 starts `lag_steps` steps
  after consumer 0, so that each one's statistics may overlap the other's products;
  with `ordered_stats` (the default in non-causal calls), consumer 1 computes a tile's
  statistics only after consumer 0 has, so that the two never compute them at once.
  With `pair_rows` (causal calls only; off by default: measured slower, PAIR_ROWS), a
  CTA walks two row tiles one after the other, i and R - 1 - i of the R row tiles of
  its (batch, query head), so that every CTA walks about the same number of key tiles
  of the causal triangle whatever i (R + 1 with block_k = 128 and Lq = Lk;
  `paired_row_tiles`; an odd R's middle row tile is alone in its CTA) on a grid of
  ceil(R / 2) CTAs per head (`EstimatePlan.row_groups`). The plan does not know
  whether a call is causal: a non-causal call, whose row tiles all walk every key
  tile, ignores the flag (one row tile per CTA).

In either layout, a consumer's masked key tile (its causal diagonal, or the end of the
keys in use) is multiplied and summed only up to the last column its rows see, in steps
of `trim_columns` (`masked_widths`; TRIM_COLUMNS). In causal calls in key groups or on the
persistent grid, a consumer runs a key tile's product steps after the first as a loop
(`step_loop`; CAUSAL_STEP_LOOP), one copy of their code for every masked width.

Beyond the tiles, a plan says how the call reads k (contiguous, or a paged cache whose
pages hold whole key tiles: `page_size`), in how many kernel calls it runs (one, or row
steps of every head, `call_rows`, where its statistics would exceed MAX_SCRATCH_BYTES
or the caller's bound) and on which grid: one CTA per row tile, or per row tile and
key group (`key_groups`, each a span of the key tiles: in causal calls, and where the
row tiles alone leave SMs idle: `_causal_key_groups`, `_key_groups`), or a persistent
grid of one CTA per SM that walks work items of one row tile and one key tile each
(`persistent_ctas`, `work_items`; in a causal call only those its row tiles see,
`listed_items`, per row step `items_table`; causal head steps and row steps of whole
rows, `_default_persistent`),
and in which order the CTAs launch (`launch_group`: in causal calls of one key group,
the row tiles of a few heads interleaved, longest first).

The statistics of a whole causal call are folded (`fold`; `folded_place`): row tile i of
the R of a (batch, query head) and R - 1 - i share one place of `fold_slots` key-tile
slots, the first writing its key tile t at slot t, the second at slot `fold_slots` - 1 -
t, so that the tiles past a row tile's diagonal take no memory (R x T tiles' worth ->
ceil(R / 2) x (T + 1) at Lq = Lk and block_k = 2 x `rows`); the epilogue reads them in
place and unfolds only their row sums (`block_sums._folded_block_sums`).

Tuned values are measured on the H200 with `python -m bench.mosaic_estimate_check`
(`bench/results/mosaic_estimate_h200.md`).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from xattn_jax.geometry import Geometry, cdiv
from xattn_jax.mosaic.plan import SUPPORTED_DTYPES
from xattn_jax.mosaic.smem import SMEM_BYTES, smem_bytes
from xattn_jax.row_statistics import UnitSums, step_start
from xattn_jax.triton.plan import ONE_PASS_WHOLE_CALL_BYTES

WGMMA_ROWS = 64  # reshaped query rows of one consumer's product: one wgmma M tile
CONSUMERS = 2  # consumer warpgroups
# Where a CTA's queries live: all in shared memory ("resident", WGMMA_ROWS rows per CTA,
# the consumers taking the key tiles in turns) or streamed through the ring with the keys
# ("streamed", CONSUMERS x WGMMA_ROWS rows per CTA, each consumer its 64 rows of every tile)
QUERY_LAYOUTS = ("resident", "streamed")
# The defaults, measured on the H200 (bench/results/mosaic_estimate_h200.md, third run):
# streamed queries at block_k 256 with staggered consumers ran causal 32K / 64K and
# non-causal 64K 7-10% under the Triton kernel, the resident queries at block_k 128
# 0-19% over it (block_k 256 spills their registers: 1.4-1.9x slower).
QUERIES = "streamed"
BLOCK_K = {"resident": 128, "streamed": 256}  # reshaped key columns per key tile (wgmma N)
STAGGER = True  # the streamed queries' default
# Consumer 1 computes a key tile's statistics only once consumer 0 has stored its own
# (`EstimatePlan.ordered_stats`, streamed queries), so that the two do not compute them
# at once. H200, kernel alone: with one consumer's statistics left out (timing only) a
# call ran as fast as with none (chunk 4096 over 64K 0.411 / 0.416 ms, none 0.413, both
# 0.435; non-causal 32K block 128 1.711 / 1.736, none 1.714, both 1.833), so the other
# consumer's products hide them and both at once cost the time. Ordered / not, medians
# of 7 rotating rounds: non-causal calls 1.0-1.9% faster (the chunk over 64K 0.4311 /
# 0.4353 ms, 32K block 128 1.7776 / 1.8024, block 4096 1.7334 / 1.7554, 64K block 64
# 7.1750 / 7.3121), causal ones within the rounds' spread (32K 1.0168 / 1.0126, 64K
# 3.8360 / 3.8120): on in non-causal calls (mosaic_estimate_h200.md, session 19).
ORDERED_STATS = True
# Two row tiles per CTA in causal calls (streamed queries): off, measured slower on the
# H200 (mosaic_estimate_h200.md, session 11, kernel alone: causal 32K 1.33 against 1.15
# ms, 64K 4.88 against 4.24; GQA 64K 4.26 against 4.38, within the run's spread)
PAIR_ROWS = False
# A consumer's masked key tile (`EstimatePlan.trim_columns`) is multiplied and summed only
# up to the last column its rows see, rounded up to a multiple of this many columns. In
# a causal call with Lq = Lk at block_k 256, a consumer's diagonal tile holds 64, 128,
# 192 or 256 seen columns; consumer 1's (128 or 256) bound a CTA's time, so 128 takes
# most of the gain with one copy of the tile's code more (64: three). H200, kernel
# alone, medians of 7 rotating rounds, whole tiles / 128 / 64 (session 20, call 5):
# causal 32K block 128 1.0222 / 1.0047 / 0.9968 ms, 64K 3.8321 / 3.8063 / 3.7933, 16K
# block 4096 0.2869 / 0.2783 / 0.2746; the kernel's first call (build and one run)
# 9.9-13.2 / 9.0-9.2 / 15.2-15.6 s; block sums bit-identical (mosaic_estimate_h200.md).
TRIM_COLUMNS = 128
# A causal call in key groups (`_causal_key_groups`: CTAs of a quarter of a row tile's
# key tiles) multiplies a key tile's steps 1 .. n - 1 in a loop unrolled this many times
# at most (`EstimatePlan.step_loop`: the largest divisor of n - 1 up to it), not fully
# unrolled: a causal call holds one copy of a tile's code per masked width, so its kernel
# took 10-14 s to build. H200, kernel alone, medians of 7 rotating rounds, unrolled / loop
# / loop unrolled 5 times (session 21, call 2): causal 32K block 128 1.0048 / 1.0155 /
# 1.0060 ms, 64K 3.7958 / 3.8044 / 3.7640; first call (build and one run) 10.2-10.3 /
# 3.8-3.9 / 3.8-4.5 s. Causal calls whose CTAs walk whole rows stay unrolled: causal 1M
# on such a grid (key groups 1) ran 0.6% slower with the loop (whole block sums 1048.68 /
# 1055.30 ms, every one of 5 alternating rounds; call 8), and non-causal calls 1-3% slower
# (32K block 64 1.8626 / 1.9166 / 1.8832, the chunk over 64K 0.4362 / 0.4414 / 0.4451),
# their unrolled kernels building in 4-5 s (mosaic_estimate_h200.md, tuning.md note 39).
# On the persistent grid (one key tile a work item) causal calls loop too since session
# 31: unrolled / loop (bench.ab, 4 alternating rounds) the whole estimate at causal 1M
# 975.28 / 972.90 ms, every loop round faster; block sums (2 rounds under equal
# sustained load) causal 128K within 64 MiB 15.574 / 15.234, causal 256K 60.655 / 60.157,
# within 64 MiB causal 32K 1.036 / 1.019, 64K 3.931 / 3.848; bit-identical; ptxas built
# 1M's row-step kernel in 1.7 s instead of 7.2 (tuning.md note 55).
CAUSAL_STEP_LOOP = 5
BLOCK_D = 64  # head-dim columns per pipeline step: one 128-byte swizzled bf16 row
MAX_STAGES = 8  # the deepest key ring the default plan takes; to be measured
MIN_STAGES = 2
# CTAs sharing key chunks (TMA multicast): 1, as clusters ran slower on the H200 with
# either layout (mosaic_estimate_h200.md: resident, the first kernel's second run;
# streamed, session 14, kernel alone, cluster 1 / 2 / 4: causal 32K 1.009 / 1.132 /
# 1.308 ms, non-causal 64K 7.158 / 7.402 / 7.742, the chunk over 64K 0.391 / 0.422 /
# 0.914)
CLUSTER = 1
CLUSTERS = (1, 2, 4)
# CTAs sharing a row tile's key tiles, each a span of them (`EstimatePlan.key_groups`):
# a call of fewer CTAs than SMs takes the G of 1 .. MAX_KEY_GROUPS whose CTAs fill their
# waves best (`_key_groups`). H200, half a 4096-query chunk (16 heads, 64 row tiles; the
# chunk sharded over 2 GPUs), 64K / 128K keys: G = 1 0.417 / 0.849 ms, G = 2 (128 CTAs)
# 0.219 / 0.437, G = 3 (192) 0.300 / 0.577, G = 4 (256) 0.237 / 0.474, the Triton kernel
# 0.279 / 0.540 (mosaic_estimate_h200.md, session 13)
MAX_KEY_GROUPS = 4
# The key groups of a causal call (at most its key tiles; cluster 1, no pair_rows, no
# persistent grid), whole or in row steps. G CTAs per row tile take half (G = 2) or a
# quarter (G = 4) of a wave's row tiles, so their queries' working set in L2 shrinks as
# much, and the triangle's long row tiles split into short CTAs. H200, kernel alone,
# medians of 3 alternating rounds, two calls on two machines, G = 1 / 2 / 4 / 8 (ms):
# causal 16K 0.325 / 0.315 / 0.301; 32K 1.147 / 1.071 / 1.023 and 1.141 / 1.095 / 1.059 /
# 1.045; 64K 4.305 / 4.026 / 3.788 and 4.283 / - / 3.900 / 3.939 (G = 16 3.917); causal
# 128K, whole block sums in row steps: 17.51 / - / 16.71 / 16.86; GQA 32:8 64K 3.78-3.88
# every way (mosaic_estimate_h200.md, session 17). ncu, causal 32K, G = 1 / 2 / 4: L2
# hit rate 61 / 75 / 84%, DRAM reads 1.88 / 1.13 / 0.62 GB, SMs active 90 / 94 / 95%
# (G = 4 launching one pair at a time, below LAUNCH_KEY_BYTES). Non-causal calls
# keep one CTA per row tile where it fills a wave (64K: G = 1 / 2 / 4 7.22 / 7.35 /
# 7.21 ms, 5 rounds).
CAUSAL_KEY_GROUPS = 4
# ... where a head's keys take at most this: causal 1M (256 MiB a head, row steps of
# 1024 rows) ran 3.4% slower with G = 4 (1126 against 1089 ms, 3 alternating rounds),
# 512K (128 MiB) 5.2% slower (284.4 against 270.2 ms), 256K (64 MiB) as fast (70.1
# against 70.7 ms, within the rounds' spread; session 18); 128K (32 MiB) is the longest
# measured faster.
CAUSAL_KEY_GROUPS_MAX_BYTES = 32 << 20
# Timing variants that leave one stage of the kernel out (`bench.mosaic_estimate_check`;
# their results are not block sums): the consumers' matrix products (scores read as 0),
# or the statistics past the row maxima.
LEAVE_OUT = ("product", "statistics")
HEAD_DIMS = (64, 128)
MAX_BLOCK_K = 256  # a consumer's float32 accumulator: block_k / 2 registers per thread
COLUMN_TILE = 8  # the wgmma register layout's column tile: unit sums slice at this grain
STAT_BYTES = 4  # float32 statistics
# The statistics of one kernel call: at most the Triton one-pass kernel's whole-call bound.
# A larger call runs in row steps over all heads (`EstimatePlan.call_rows`), each within
# it (a caller's max_scratch_bytes replaces it).
MAX_SCRATCH_BYTES = ONE_PASS_WHOLE_CALL_BYTES
# A causal call in row steps runs its steps' epilogues in this many loops of consecutive
# steps (`EstimatePlan.epilogue_loops`), each reading only the key-tile slots its rows
# see instead of all of them (the kernel writes only those): n loops read about (1 +
# 1/n) / 2 of the slots. H200, causal 1M (128 row steps of 1024 rows, 1.12 GiB of
# statistics each), block sums, medians of 3 rotating rounds, 1 / 2 / 4 / 8 / 16 loops
# (session 29): 994.11 / 978.74 / 972.42 / 969.93 / 968.42 ms, the build 13-17 s in
# every case (the kernel is lowered once, `tile_stats` being jitted).
EPILOGUE_LOOPS = 16
# The epilogue as one Triton-backend kernel over the statistics (`EstimatePlan.
# stats_epilogue`): in whole causal calls, whose folded statistics XLA unfolds in several
# reductions. H200, block sums of the default plans, medians of rotating rounds under
# sustained load, XLA / kernel (session 33, two calls): causal 32K 1.0183 / 1.0035 ms and
# 1.0290 / 1.0129, 64K 3.7939 / 3.7638 and 3.8336 / 3.8003, 128K 15.465 / 15.299 (the
# epilogue's kernels 49.4 -> 29.3 us at 32K, 158.2 -> 100.7 at 64K). Elsewhere within
# the spread or slower, with several key tiles a step (`mosaic.epilogue`): the
# 4096-query chunk over 64K / 128K -0.2 / +0.2-0.3% (its epilogue 12 -> 6.5 us),
# non-causal 64K block 128 / 64 -0.1-+0.1 / +0.7-0.8%, causal 1M's row steps +0.25%.
FOLDED_STATS_EPILOGUE = True
# SMs of an H100 SXM / H200: the SM count where the default device does not say its own
# (`device_sms`), which sizes row steps' waves, key groups and the persistent grid
HOPPER_SMS = 132
# Folded statistics (`EstimatePlan.fold`) where they save at least this share of the
# memory. H200, block sums (kernel and epilogue), medians of 4 rotating rounds, folded /
# unfolded (session 22): causal 32K (47% saved) 1.0185 / 1.0256 ms, 64K 3.8042 / 3.8479,
# GQA 32:8 64K 3.8123 / 3.8162, 128K (one call instead of two row steps) 15.586 /
# 16.133; 4096 causal queries over 64K keys, folded by force (2% saved: its places span
# 63 slots for 32 key tiles), 0.5113 / 0.4651, its row sums' unfolding 55 us.
FOLD_MIN_SAVING = 1 / 4
# The launch order of a causal call's CTAs (`EstimatePlan.launch_group`). Mosaic GPU makes
# the grid's last axis CUDA's x, the first launched. One (batch, head) pair's row tiles
# at a time, longest first, starts the last pairs' long row tiles in the call's last
# wave. H200, causal 32K: the SMs were active 87% of the time (ncu, session 14); list
# scheduling of the row tiles' key tiles on 132 SMs gives 11.5% idle at 32K and 5.1% at
# 64K that way, 1.6% / 0.1% in groups of 8 / 4 pairs (a wave each). A group holds this
# many waves of CTAs:
LAUNCH_GROUP_WAVES = 1
# ... and at most the pairs of the key heads whose keys (all of a CTA's key tiles) fit in
# this, at least one key head's. H200 (session 15, kernel alone, medians of 3
# alternating rounds, against one pair at a time): with Hkv 8, groups of 4-16 pairs (1-4
# key heads, 8-32 MiB of keys) ran causal 32K 21-22% faster, 64K 6-8% (2-8 pairs); with
# Hkv 32, causal 16K 7-9% faster in groups of 4-16, 32K 7% in pairs of 2 (16 MiB) and 3%
# in groups of 8, and causal 64K / 128K 9% / 23% slower in groups of 16 / 8 (256 MiB):
# every head's keys then pass through L2.
LAUNCH_KEY_BYTES = 24 << 20
# A causal call in key groups (CAUSAL_KEY_GROUPS) launches one pair's row groups at a
# time, its long row tiles being cut short already. H200, kernel alone, G = 4, launch
# groups of 1 / 2 (the rule) / 4 / 8 pairs (ms, medians of 3 alternating rounds): causal
# 32K 1.017 / 1.032 / 1.073 / 1.255; GQA 32:8 32K 1.002 / 1.047 / - / 1.009; causal 64K
# 3.948 / 4.222 (mosaic_estimate_h200.md, session 17).
OPERAND_BYTES = 2  # q and k hold bfloat16 or float16 (SUPPORTED_DTYPES)
# Row tiles per block of the persistent grid's item order (`work_items`): the key tiles
# pass by a block's row tiles, whose queries (16 MiB at 128 rows x S 8 x D 128 in bf16)
# stay in L2 meanwhile, as each key tile does while the CTAs share it. H200, whole causal
# calls listed, block sums, blocks of 64 / 32 / 16 (session 27): causal 64K 4.090 / 3.971
# / 4.176 ms, 128K 15.52 / 15.10 / 15.73 (rounds spread 1.5 ms), 32K 1.043 / 1.017 /
# 1.016 (64 and 32 the same kernel): none beats key groups where they run (3.797 at 64K)
ROW_BLOCK_TILES = 64
# The fewest work items per SM for which a causal head step runs on the listed persistent
# grid by default (`_default_persistent`): the smallest step measured, causal 32K within
# 8 MiB (2 heads, 544 items on 132 SMs: 1.314 ms against 1.509 in key groups; session 26).
PERSISTENT_MIN_ITEMS = 4
# "auto" runs the Mosaic block sums on calls of at least this fraction of the SMs in CTAs
# per kernel call (`auto_min_ctas`; `EstimatePlan.ctas`, key groups included): fewer
# leave SMs idle, where the Triton kernel splits the keys among more programs. H200: 128
# CTAs (a 4096-query chunk over 128K on 32 heads) ran 0.86-0.93 ms against Triton's 1.08
# (session 12), 64 (its half on 16 heads, without key groups) 0.85 against 0.54 (session
# 13): the break-even lies near 3/4 of the SMs.
AUTO_MIN_FILL = 3 / 4


@dataclasses.dataclass(frozen=True)
class EstimatePlan(UnitSums):
    """Tiles of one call. Hashable: a static jit argument.

    block_k: reshaped key columns per key tile; block_d: head-dim columns per pipeline
    step; stages: the ring's slots, each a key chunk `[block_k, block_d]` (with the
    streamed queries, and a query chunk `[rows, block_d]`); cluster: CTAs of
    consecutive row tiles sharing the key chunks; leave_out: None, or a stage of
    LEAVE_OUT that the kernel skips (timing only); queries: the layout of the queries,
    one of QUERY_LAYOUTS; stagger (streamed queries only): consumer 1 starts
    `lag_steps` steps late; pair_rows (streamed queries only, ignored by non-causal
    calls and row steps): each CTA of a causal call walks row tiles i and R - 1 - i
    (`paired_row_tiles`); call_rows: the reshaped query rows of every head one kernel
    call covers, 0 for all (one call), else a multiple of `row_quantum`: the call runs in
    row steps (`_call_rows` sizes them); page_size: the tokens per page of a paged k
    (None: a contiguous k), a multiple of block_k x S, so that a key tile lies in one
    page; key_groups: the CTAs of each row tile (cluster 1, no pair_rows), each walking a
    span of `key_span` of its key tiles (more CTAs for a short call on few heads);
    persistent_ctas: 0 (a CTA per row tile and key group), or the CTAs of a persistent
    grid (streamed queries, cluster 1, key_groups 1, no pair_rows) that walk the call's
    work items in turns (`work_items`); head_group: 0 for the rule of `launch_group`, or
    the (batch, query head) pairs whose CTAs launch interleaved (a divisor of B x Hq;
    cluster 1, no persistent grid); ordered_stats (streamed queries, fewer stages than
    `steps_per_tile`): consumer 1 computes each key tile's statistics after consumer 0
    has stored its own; trim_columns: 0, or a divisor of block_k (a multiple of
    COLUMN_TILE): a consumer's masked key tile (its causal diagonal, the end of the keys)
    is multiplied and summed only over its first columns up to the last its rows see,
    rounded up to a multiple of trim_columns (`masked_widths`), the rest being unseen;
    step_loop (streamed queries): 0, a key tile's product steps unrolled, or n >= 1, its
    steps 1 .. steps_per_tile - 1 as a loop unrolled n times (n divides their count);
    fold (causal calls of one kernel call, cluster 1): the statistics folded
    (`folded_place`: `[B, H, fold_slots, stat_planes, fold_places x rows]`), else `[B, H,
    key_tiles, stat_planes, rows_per_call]` (H = `heads`); call_heads: the query heads
    one kernel call covers, 0 for all, else the call runs in head steps: of whole heads'
    rows with call_rows 0 (`_call_heads` sizes them), or of call_rows rows of each head
    (`_head_rows` sizes them, one head a step, where no other step fits);
    epilogue_loops (causal calls in row steps): the row steps' epilogues run in this many
    loops of consecutive steps, each reading only the key-tile slots its rows see
    (`epilogue_steps`), else 1; stats_epilogue: the epilogue as one Triton-backend
    kernel over the statistics (`xattn_jax.mosaic.epilogue`; power-of-two block_k and
    block_rows), else as XLA reductions (`row_statistics.combine`).
    """

    geom: Geometry
    block_k: int
    block_d: int
    stages: int
    cluster: int = CLUSTER
    leave_out: str | None = None
    queries: str = QUERIES
    stagger: bool = False
    pair_rows: bool = PAIR_ROWS
    call_rows: int = 0
    page_size: int | None = None
    key_groups: int = 1
    persistent_ctas: int = 0
    head_group: int = 0
    ordered_stats: bool = False
    trim_columns: int = 0
    step_loop: int = 0
    fold: bool = False
    call_heads: int = 0
    epilogue_loops: int = 1
    stats_epilogue: bool = False

    @property
    def masked_widths(self) -> tuple[int, ...]:
        """The widths a consumer's masked key tile may be computed at (`trim_columns`):
        trim_columns, 2 trim_columns, .. block_k; (block_k,) without trimming."""
        step = self.trim_columns or self.block_k
        return tuple(range(step, self.block_k + 1, step))

    @property
    def heads(self) -> int:
        """The query heads of one kernel call: `call_heads`, or all Hq."""
        return self.call_heads or self.geom.q_heads

    @property
    def pairs(self) -> int:
        """The (batch, query head) pairs of one kernel call, B x `heads`: each has its own
        rows and statistics."""
        return self.geom.batch * self.heads

    @property
    def rows(self) -> int:
        """Reshaped query rows per CTA (a row tile): one wgmma M tile with the resident
        queries, one per consumer with the streamed ones."""
        return WGMMA_ROWS * (CONSUMERS if self.queries == "streamed" else 1)

    @property
    def row_tiles(self) -> int:
        """Row tiles of `rows` rows per (batch, query head), a CTA each unless paired:
        whole clusters."""
        return cdiv(self.geom.q_rows, self.rows * self.cluster) * self.cluster

    def paired(self, causal: bool) -> bool:
        """Whether each CTA walks two row tiles: `pair_rows` in a causal call of one
        kernel call and one key group."""
        return self.pair_rows and causal and not self.call_rows and self.key_groups == 1

    @property
    def row_block_tiles(self) -> int:
        """Row tiles per block of the persistent grid's item order: ROW_BLOCK_TILES, at
        most a kernel call's."""
        return min(ROW_BLOCK_TILES, self.call_row_tiles)

    @property
    def row_blocks(self) -> int:
        """Blocks of `row_block_tiles` row tiles per (batch, head) of a kernel call; the
        last one's row tiles past the call's are empty work items."""
        return cdiv(self.call_row_tiles, self.row_block_tiles)

    def row_groups(self, causal: bool) -> int:
        """The kernel grid's row axis, per (batch, query head): ceil(R / 2) CTAs with
        paired row tiles, else one cluster per `cluster` row tiles of a kernel call
        (R = row_tiles)."""
        if self.paired(causal):
            return cdiv(self.row_tiles, 2)
        return self.call_row_tiles // self.cluster

    def launch_group(self, causal: bool) -> int:
        """The (batch, query head) pairs whose CTAs the grid launches interleaved, row
        group by row group, the longest first (`tile_stats`: a group's pairs, then the
        next group's): `head_group` where given; else in a causal call of one key group
        (unpaired, cluster 1, no persistent grid) the fewest pairs dividing B x Hq whose
        CTAs fill LAUNCH_GROUP_WAVES waves (`device_sms`), so that the long row tiles
        start early, but no more than the pairs of the key heads whose keys
        LAUNCH_KEY_BYTES holds (one at least), so that a wave's keys stay in L2; else 1,
        each pair's row groups in turn (key groups cut the long row tiles short:
        measured, beside LAUNCH_KEY_BYTES)."""
        if self.head_group:
            return self.head_group
        if (not causal or self.key_groups > 1 or self.paired(causal) or self.cluster > 1
                or self.persistent_ctas):
            return 1
        geom = self.geom
        most = max(1, LAUNCH_KEY_BYTES // self.head_key_bytes) * geom.group
        groups = [g for g in range(1, min(most, self.pairs) + 1) if self.pairs % g == 0]
        wave, rows = LAUNCH_GROUP_WAVES * device_sms(), self.grid_rows(causal)
        return next((g for g in groups if g * rows >= wave), groups[-1])

    def grid_rows(self, causal: bool) -> int:
        """The kernel grid's row axis: `row_groups`, each in `key_groups` CTAs, or with
        `compacted` only the CTAs whose span holds a tile their row tile sees."""
        if self.compacted(causal):
            return len(walked_cells(self))
        return self.row_groups(causal) * self.key_groups

    def compacted(self, causal: bool) -> bool:
        """Whether the grid leaves out the CTAs that would walk no key tile: in a causal
        call in key groups made of one kernel call, where the spans past a row tile's
        diagonal are empty (3 CTAs in 8 at G = 4 and Lq = Lk). A row step's empty spans
        depend on its first row, a traced value: its grid keeps them. H200, kernel
        alone, medians of 5 alternating rounds, full / compacted grid (session 18):
        causal 32K 1.070 / 1.029 ms, 64K 3.974 / 3.933, GQA 32:8 64K 3.964 / 3.917, 16K
        0.297 / 0.297."""
        return causal and self.key_groups > 1 and not self.call_rows

    def listed(self, causal: bool) -> bool:
        """Whether a persistent grid walks a list of its work items (`listed_items`)
        instead of all of them: in a causal call, where the items of key tiles past a
        row tile's diagonal are empty and the list leaves them out, so that every CTA
        walks as many real items (one more at most). A call in row steps lists each
        step's (`items_table`: one row per step, the kernel reading its step's)."""
        return causal and bool(self.persistent_ctas)

    def ctas(self, causal: bool) -> int:
        """The CTAs of one kernel call (of a row step with `call_rows`)."""
        if self.persistent_ctas:
            return self.persistent_ctas
        return self.pairs * self.grid_rows(causal) * self.cluster

    def step_ctas(self, rows: int) -> int:
        """The CTAs of an unpaired kernel call covering `rows` reshaped query rows of every
        head (a multiple of `row_quantum`): `ctas` of a row step of that many rows; with
        a persistent grid, the call's work items (all key tiles), which it spreads over
        its CTAs."""
        tiles = self.key_tiles if self.persistent_ctas else self.key_groups
        return self.pairs * rows // self.rows * tiles

    @property
    def key_span(self) -> int:
        """Key tiles per key group: a row tile's CTA g walks tiles g x span .. (g + 1) x
        span - 1 of those it sees."""
        return cdiv(self.key_tiles, self.key_groups)

    @property
    def padded_rows(self) -> int:
        """The reshaped query rows of every row tile; with row steps, at least as many as
        the last step reads (it ends at the last query block)."""
        rows = self.row_tiles * self.rows
        if self.call_rows:
            return max(rows, self.geom.q_blocks * self.geom.block_rows)
        return rows

    @property
    def row_quantum(self) -> int:
        """A row step's rows are a multiple of this: whole clusters of row tiles and
        whole query blocks."""
        return math.lcm(self.rows * self.cluster, self.geom.block_rows)

    @property
    def rows_per_call(self) -> int:
        """The reshaped query rows of every head one kernel call covers."""
        return self.call_rows or self.row_tiles * self.rows

    @property
    def call_row_tiles(self) -> int:
        """The row tiles of every head one kernel call covers (whole clusters)."""
        return self.rows_per_call // self.rows

    @property
    def key_tiles(self) -> int:
        return cdiv(self.geom.k_cols, self.block_k)

    @property
    def padded_cols(self) -> int:
        return self.key_tiles * self.block_k

    @property
    def head_key_bytes(self) -> int:
        """The bytes of one key head's keys, whole key tiles."""
        return self.padded_cols * self.geom.stride * self.geom.head_dim * OPERAND_BYTES

    @property
    def head_parts(self) -> int:
        """Pipeline steps per stride member."""
        return self.geom.head_dim // self.block_d

    @property
    def steps_per_tile(self) -> int:
        """Pipeline steps (key chunks) of one key tile: S x head_parts."""
        return self.geom.stride * self.head_parts

    def smem_bytes(self, itemsize: int) -> int:
        """Shared memory of one CTA as Mosaic GPU counts it (`mosaic.smem`), the scratch
        of `tile_stats.tile_stats`: the queries (resident: all of them; streamed: a ring
        of query chunks), the key ring, one statistics buffer per consumer, and the
        barriers (resident: queries ready, per consumer and slot a chunk ready, per slot
        the slot free; streamed: per slot, the slot ready and the slot free, with
        `stagger` consumer 1's start, with `ordered_stats` consumer 1's turn)."""
        geom = self.geom
        keys = self.stages * self.block_k * self.block_d * itemsize
        stats = CONSUMERS * self.stat_planes * WGMMA_ROWS * STAT_BYTES
        if self.queries == "streamed":
            queries = self.stages * self.rows * self.block_d * itemsize
            barriers = 2 * self.stages + self.stagger + self.ordered_stats
        else:
            queries = self.rows * geom.stride * geom.head_dim * itemsize
            barriers = 1 + CONSUMERS * self.stages + self.stages
        return smem_bytes([queries, keys, stats], barriers=barriers)

    @property
    def lag_steps(self) -> int:
        """Steps consumer 1 starts behind consumer 0 with `stagger` (else 0): half a tile,
        at most stages - 1 (consumer 0 gets no further ahead before consumer 1 releases
        a slot), at least 1."""
        if not self.stagger:
            return 0
        return max(1, min(self.steps_per_tile // 2, self.stages - 1))

    @property
    def row_scratch_bytes(self) -> int:
        """The statistics of one reshaped query row of every head and batch element,
        unfolded."""
        return self.pairs * self.key_tiles * self.stat_planes * STAT_BYTES

    @property
    def fold_places(self) -> int:
        """Places of folded statistics per (batch, query head): ceil(R / 2) (R =
        `call_row_tiles`), place p holding row tiles p and R - 1 - p."""
        return cdiv(self.call_row_tiles, 2)

    @property
    def fold_slots(self) -> int:
        """Key-tile slots of a place of folded statistics: the most key tiles the two
        row tiles of a place see together in a causal call (`visible_tiles`), and at
        least `key_tiles` (the unfolding reads T slots of each)."""
        return _fold_slots(self)

    @property
    def stats_shape(self) -> tuple[int, int, int, int, int]:
        """The kernel's statistics: `[B, heads, slots, stat_planes, rows]`, slots and
        rows `fold_slots` and `fold_places` x `rows` folded, else `key_tiles` and
        `rows_per_call`."""
        if self.fold:
            slots, rows = self.fold_slots, self.fold_places * self.rows
        else:
            slots, rows = self.key_tiles, self.rows_per_call
        return self.geom.batch, self.heads, slots, self.stat_planes, rows

    @property
    def scratch_bytes(self) -> int:
        """One kernel call's statistics (`stats_shape`), in bytes."""
        return math.prod(self.stats_shape) * STAT_BYTES


@functools.lru_cache(maxsize=64)
def walked_cells(plan: EstimatePlan) -> tuple[int, ...]:
    """The grid's row axis of a compacted causal call (`EstimatePlan.compacted`), in
    launch order: for CTA i, its row group g (the row tile R - 1 - g: the longest first,
    as without compaction) and key group j packed as g x key_groups + j, for exactly the
    pairs whose span (tiles j x key_span ..) holds a tile of the row tile's
    `visible_tiles`. The kernel reads its CTA's entry from an int32 operand."""
    groups, span = plan.key_groups, plan.key_span
    seen = row_tiles_seen(plan)[::-1]  # row group g: row tile R - 1 - g
    return tuple(g * groups + j for g in range(len(seen)) for j in range(groups)
                 if j * span < seen[g])


def row_tiles_seen(plan: EstimatePlan) -> tuple[int, ...]:
    """`visible_tiles` of each row tile of a whole causal call, concrete (also while a
    caller traces): the compacted grid's cells, the folded statistics' slots. Computed
    once per geometry and tile, whatever the plan's other fields (head steps, key
    groups, ring)."""
    return _row_tiles_seen(plan.geom, plan.block_k, plan.queries, plan.call_row_tiles)


@functools.lru_cache(maxsize=64)
def _row_tiles_seen(geom: Geometry, block_k: int, queries: str,
                    row_tiles: int) -> tuple[int, ...]:
    plan = EstimatePlan(geom, block_k, BLOCK_D, MIN_STAGES, queries=queries)
    seen = visible_tiles(plan, True, np.arange(row_tiles) * plan.rows)  # numpy
    return tuple(int(n) for n in seen)


@functools.lru_cache(maxsize=64)
def _fold_slots(plan: EstimatePlan) -> int:
    """`EstimatePlan.fold_slots` (concrete, at trace time as `walked_cells`)."""
    seen, tiles = row_tiles_seen(plan), plan.call_row_tiles
    together = [seen[p] + (seen[tiles - 1 - p] if p < tiles - 1 - p else 0)
                for p in range(plan.fold_places)]
    return max(together + [plan.key_tiles])


def folded_place(plan: EstimatePlan, row0, tile):
    """Where a call with folded statistics (`EstimatePlan.fold`) stores those of key tile
    `tile` of the row tile whose first reshaped row is `row0` (int32, traced or not):
    (slot, first row) in `stats_shape`'s axes 2 and 4. Row tile i < `fold_places` at
    place i, slot `tile`; a later one at place R - 1 - i, slot `fold_slots` - 1 - `tile`
    (R = `call_row_tiles`), the two never meeting in a slot, as they see `fold_slots`
    tiles at most together. Unfolded statistics are at (tile, row0)."""
    index = _div(row0, plan.rows)
    late = index >= plan.fold_places
    place = jnp.where(late, plan.call_row_tiles - 1 - index, index)
    return jnp.where(late, plan.fold_slots - 1 - tile, tile), place * plan.rows


def work_items(plan: EstimatePlan, cols=None):
    """The work items of a kernel call with a persistent grid, and the key tiles in use:
    (items, tiles), int32 scalars (traced where `cols` is: the reshaped key columns in
    use, default all k_cols). Item i, in the order the CTAs take them (CTA c the items
    c, c + G, ... of G = `persistent_ctas`): i = (((batch x Hq + head) x row_blocks +
    row block) x tiles + key tile) x row_block_tiles + row tile in the block. A key
    tile's items are consecutive, so that the CTAs working at once share it, and a
    block's row tiles come back for every key tile. Items of a key tile no row of the
    row tile sees (causal), or of a row tile past the call's, are empty."""
    tiles = visible_tiles(plan, False, 0, cols)
    return tiles * (plan.pairs * plan.row_blocks * plan.row_block_tiles), tiles


def step_first_rows(plan: EstimatePlan) -> tuple[int, ...]:
    """The first reshaped query row of each of the call's row steps, in the order
    `row_statistics.in_steps` walks them (the last one moved back to end at the last
    query block); (0,) for a call of whole rows."""
    if not plan.call_rows:
        return (0,)
    geom = plan.geom
    blocks = plan.call_rows // geom.block_rows
    return tuple(step_start(step, geom.q_blocks, blocks) * geom.block_rows
                 for step in range(cdiv(geom.q_blocks, blocks)))


def row_step(plan: EstimatePlan, first_row):
    """The index in `step_first_rows` of the row step whose first row is `first_row` (a
    traced int32 scalar; 0 for a call of whole rows): ceil(first_row / call_rows), the
    last step's too."""
    if not plan.call_rows:
        return 0
    return jax.lax.div(first_row + (plan.call_rows - 1), jnp.int32(plan.call_rows))


def listed_items(plan: EstimatePlan, step: int = 0) -> tuple[int, ...]:
    """The work items of one (batch, query head) pair that a listed persistent grid walks
    (`EstimatePlan.listed`) in row step `step` (`step_first_rows`; 0 for a call of
    whole rows), in `work_items` order: the index within the pair's items (item i of
    the call being pair x (items per pair) + index) of exactly the items whose row tile
    sees their key tile (`visible_tiles`; every pair's are the same). The kernel reads
    them from its step's row of `items_table`, item c + G j of the call for CTA c."""
    row = items_table(plan)[step]
    return tuple(int(i) for i in row[1:1 + row[0]])


def listed_pair_walk(pair, per_pair, cta, ctas: int):
    """Where CTA `cta` of a listed persistent grid of `ctas` CTAs walks in pair `pair`,
    the pair's listed items numbering `per_pair` (int32 arrays or traced scalars, >= 0):
    (first, count), its items there being first, first + ctas, .. (count of them),
    exactly the call's items pair x per_pair + k that are cta modulo ctas (what CTA
    `cta` walks, `listed_items`), found without dividing by the traced per_pair."""
    first = cta - jax.lax.rem(pair * per_pair, jnp.int32(ctas))
    first = jnp.where(first < 0, first + ctas, first)
    return first, _div(per_pair - first + (ctas - 1), ctas)


def items_table(plan: EstimatePlan) -> np.ndarray:
    """The listed items of every row step of a call (`listed_items`), int32 `[row steps,
    1 + n]` (one row for a call of whole rows): row r holds the number of step r's items
    of one pair, then those items, then zeros up to the longest step's n. The kernel
    takes its step's row as an operand. Read-only (cached)."""
    return _items_table(plan, plan.row_block_tiles)


def listed_counts(plan: EstimatePlan) -> np.ndarray:
    """The number of listed items of one pair in each row step (`items_table`'s first
    column), counted without listing them: the key tiles each row tile of the step sees
    (`visible_tiles`), summed. Cheap enough for `_head_rows` to ask of every candidate
    step (causal 4M: 49 steps of 84 row tiles over 2048 key tiles)."""
    return _steps_seen(plan).sum(axis=1)


def _steps_seen(plan: EstimatePlan) -> np.ndarray:
    """`visible_tiles` of each row tile of each row step of a causal call (numpy `[row
    steps, call_row_tiles]`, the steps of `step_first_rows`): what `items_table` lists
    and `listed_counts` counts."""
    first = np.asarray(step_first_rows(plan))[:, None]  # [steps, 1]
    return visible_tiles(plan, True, first + np.arange(plan.call_row_tiles) * plan.rows)


def epilogue_steps(plan: EstimatePlan, causal: bool) -> tuple[tuple[range, int], ...]:
    """The loops a call in row steps runs its epilogues in (`EstimatePlan.
    epilogue_loops`): for each, its row steps (consecutive indices of `step_first_rows`,
    as even in number as they split) and the key-tile slots of the statistics its
    epilogue reads: the most key tiles a row of those steps sees (`visible_tiles`), all
    of them in a non-causal call. A call of whole rows: one loop of its one step."""
    steps, n = len(step_first_rows(plan)), plan.epilogue_loops
    bounds = [steps * i // n for i in range(n + 1)]
    loops = [range(start, stop) for start, stop in zip(bounds, bounds[1:])]
    if not causal:
        return tuple((loop, plan.key_tiles) for loop in loops)
    seen = _steps_seen(plan).max(axis=1)  # [steps]
    return tuple((loop, int(seen[loop.start:loop.stop].max())) for loop in loops)


@functools.lru_cache(maxsize=64)
def _items_table(plan: EstimatePlan, block: int) -> np.ndarray:
    blocks, tiles = plan.row_blocks, plan.key_tiles
    steps_seen = _steps_seen(plan)  # [steps, call_row_tiles]
    seen = np.zeros((len(steps_seen), blocks * block), np.int64)
    seen[:, :plan.call_row_tiles] = steps_seen
    row_tile = (np.arange(blocks)[:, None, None] * block
                + np.arange(block)[None, None, :])  # [blocks, 1, block]
    tile = np.arange(tiles)[None, :, None]  # [1, tiles, 1]
    lists = [np.flatnonzero(tile < step_seen[row_tile])  # [blocks, tiles, block]
             for step_seen in seen]
    table = np.zeros((len(lists), 1 + max(map(len, lists))), np.int32)
    for step, items in enumerate(lists):
        table[step, 0] = len(items)
        table[step, 1:1 + len(items)] = items
    table.flags.writeable = False
    return table


def device_sms() -> int:
    """The SMs of the default device where it is a GPU that says (jax's `core_count`),
    else HOPPER_SMS: one wave of CTAs (row steps, key groups, a persistent grid)."""
    device = jax.devices()[0]
    return (getattr(device, "core_count", 0) if device.platform == "gpu" else 0) or HOPPER_SMS


def auto_min_ctas() -> int:
    """The fewest CTAs per kernel call for which "auto" runs the Mosaic block sums:
    AUTO_MIN_FILL of the SMs (`device_sms`; 99 on an H200)."""
    return int(device_sms() * AUTO_MIN_FILL)


def unsupported_reason(geom: Geometry, dtype, *, key_len: bool = False,
                       causal: bool = False, page_size: int | None = None,
                       queries: str = QUERIES,
                       max_scratch_bytes: int | None = None) -> str | None:
    """Why the Mosaic block-sum kernel cannot run this call (None if it can) with the
    `queries` layout (QUERY_LAYOUTS; ValueError for another). key_len: whether a count of
    keys in use is given; page_size: the tokens per page of a paged k (None: contiguous).

    It needs q and k in bfloat16 or float16, D in HEAD_DIMS, block_size a multiple of
    COLUMN_TILE x stride, key_len in non-causal calls only, pages of a multiple of 64 x
    stride tokens (a key tile of at least 64 columns in one page), the CTA's shared
    memory with a ring of MIN_STAGES slots (resident queries: 64 rows x S x D of them
    besides, which S 16 at D 128 exceeds), and within `max_scratch_bytes` (default
    MAX_SCRATCH_BYTES) the statistics of one row step of every head holding a wave of
    row tiles (`_call_rows`), or of a head step of whole heads in at least
    `auto_min_ctas` CTAs (`_call_heads`), or of a row step of one head holding
    PERSISTENT_MIN_ITEMS work items per SM (`_head_rows`), or, in a causal call, the
    whole call's folded statistics where the default plan folds them (`_fold_saves`).
    Any Lq and Lk otherwise (padded to whole tiles by the caller). The Triton backend
    takes everything else.
    """
    _check_queries(queries)
    dtype = jnp.dtype(dtype)
    if dtype not in SUPPORTED_DTYPES:
        return f"impl='mosaic' needs q and k in bfloat16 or float16; got {dtype}"
    if geom.head_dim not in HEAD_DIMS:
        return f"impl='mosaic' needs head_dim in {HEAD_DIMS}; got {geom.head_dim}"
    if geom.block_rows % COLUMN_TILE:
        return (f"impl='mosaic' needs block_size a multiple of {COLUMN_TILE} x stride = "
                f"{COLUMN_TILE * geom.stride}; got {geom.block_size}")
    if key_len and causal:
        return "impl='mosaic' block sums take key_len in non-causal calls only"
    if page_size is not None and page_size % (64 * geom.stride):
        return (f"impl='mosaic' reads paged caches whose pages hold a multiple of 64 x "
                f"stride = {64 * geom.stride} tokens; got page_size {page_size}")
    plan = EstimatePlan(geom, _default_block_k(queries, page_size, geom.stride), BLOCK_D,
                        MIN_STAGES, queries=queries, stagger=default_stagger(queries),
                        page_size=page_size)
    smem = plan.smem_bytes(dtype.itemsize)
    if smem > SMEM_BYTES:
        return (f"impl='mosaic' with {queries} queries ({plan.rows} rows x stride "
                f"{geom.stride} x head_dim {geom.head_dim} per CTA) needs {smem} bytes of "
                f"shared memory with a ring of {MIN_STAGES} slots, over {SMEM_BYTES}")
    bound = max_scratch_bytes or MAX_SCRATCH_BYTES
    call = dataclasses.replace(  # folded and in key groups as `estimate_plan` makes it
        plan, fold=causal and _fold_saves(plan),
        key_groups=_causal_key_groups(plan) if causal else 1)
    # one kernel call (`_call_rows` 0) or row steps or head steps or row steps of a head
    if (_call_rows(call, bound) is None
            and _call_heads(call, causal, bound, default_groups=True) is None
            and _head_rows(call, causal, bound, default_groups=True,
                           default_grid=_grid_alone(call)) is None):
        return _steps_refused(call, causal, bound)
    return None


def estimate_plan(geom: Geometry, dtype, *, causal: bool = False,
                  block_k: int | None = None,
                  stages: int | None = None, cluster: int | None = None,
                  leave_out: str | None = None, queries: str | None = None,
                  stagger: bool | None = None, pair_rows: bool | None = None,
                  page_size: int | None = None, max_scratch_bytes: int | None = None,
                  call_rows: int | None = None, key_groups: int | None = None,
                  persistent: bool | None = None,
                  head_group: int | None = None,
                  ordered_stats: bool | None = None,
                  trim_columns: int | None = None,
                  step_loop: int | None = None,
                  fold: bool | None = None,
                  call_heads: int | None = None,
                  epilogue_loops: int | None = None,
                  stats_epilogue: bool | None = None) -> EstimatePlan:
    """The plan of one call. causal: whether the call is (its default key groups
    depend on it: `_causal_key_groups`, else `_key_groups`); page_size: the tokens per
    page of a paged k (None: contiguous); max_scratch_bytes: the statistics one kernel
    call may hold (default MAX_SCRATCH_BYTES): a call holding more runs in head steps
    (`_call_heads`) or, where one head's statistics exceed it, in row steps of every head
    (`_call_rows`) or, where no such step of a wave fits either, of one head
    (`_head_rows`).

    block_k (a multiple of 64, at most MAX_BLOCK_K, dividing a page's reshaped columns),
    stages, cluster (in CLUSTERS), queries (in QUERY_LAYOUTS), stagger (the staggered
    consumers, streamed queries only), pair_rows (two row tiles per CTA in causal calls,
    streamed queries only), call_rows (the rows of a row step, a multiple of
    `EstimatePlan.row_quantum`, or 0 for one call) and key_groups (CTAs per row tile, at
    most the key tiles; cluster 1, no pair_rows) and persistent (a persistent grid of
    one CTA per SM, `device_sms`, at most one per work item: streamed queries, cluster
    1, key_groups 1, no pair_rows) and head_group (the (batch, head) pairs launched
    interleaved, dividing B x Hq; cluster 1, no persistent grid) and ordered_stats
    (consumer 1's statistics of a tile after consumer 0's, streamed queries, fewer
    stages than a key tile's steps) and trim_columns (0, or a divisor of block_k and
    multiple of COLUMN_TILE) and step_loop (0, or with the streamed queries a divisor of
    a key tile's steps less one) and fold (causal calls of one kernel call, cluster 1)
    and call_heads (the query heads of a head step, at most Hq, of every row with
    call_rows 0 or None, else of call_rows rows; or 0) and epilogue_loops (at most the
    row steps of a causal call, else 1) and stats_epilogue (power-of-two block_k and
    block_rows) override the defaults (tuning
    runs, tests): QUERIES, BLOCK_K of the layout (with a paged k, the largest multiple
    of 64 up to it that divides a page's columns), STAGGER with the streamed queries,
    PAIR_ROWS, the most stages that fit in shared memory, at most MAX_STAGES,
    `_call_heads` (else `_call_rows`, else `_head_rows`), `_causal_key_groups` or
    `_key_groups`, `_default_persistent` (where no key_groups or
    head_group is given), the rule of `EstimatePlan.launch_group`, and ORDERED_STATS
    with the streamed queries in non-causal calls whose ring is shorter than a key
    tile's steps, `default_trim_columns`, `default_step_loop`, and folded statistics in
    causal calls of one kernel call and cluster 1 where they take less memory
    (`_fold_saves`; a call whose folded statistics fit within the bound runs as one
    kernel call), `default_epilogue_loops`, `default_stats_epilogue`.
    leave_out: a timing variant (LEAVE_OUT).
    Raises ValueError for arguments the kernel does not take (`unsupported_reason`) and
    overrides that do not fit."""
    queries = QUERIES if queries is None else queries
    if stagger is None:
        stagger = default_stagger(queries)
    pair_rows = PAIR_ROWS if pair_rows is None else pair_rows
    reason = unsupported_reason(geom, dtype, causal=causal, queries=queries,
                                page_size=page_size, max_scratch_bytes=max_scratch_bytes)
    if reason is not None:
        raise ValueError(reason)
    if leave_out not in (None, *LEAVE_OUT):
        raise ValueError(f"leave_out must be None or one of {LEAVE_OUT}; got {leave_out!r}")
    cluster = CLUSTER if cluster is None else cluster
    if cluster not in CLUSTERS:
        raise ValueError(f"cluster must be one of {CLUSTERS}; got {cluster}")
    if pair_rows and (queries != "streamed" or cluster > 1):
        raise ValueError("pair_rows needs queries='streamed' and cluster 1 (a CTA walks "
                         f"its two row tiles alone); got queries={queries!r}, cluster="
                         f"{cluster}")
    if stagger and queries != "streamed":
        raise ValueError("stagger needs queries='streamed' (the resident queries' "
                         f"consumers take the key tiles in turns); got {queries!r}")
    default_order = ordered_stats is None
    if default_order:
        ordered_stats = ORDERED_STATS and queries == "streamed" and not causal
    if ordered_stats and queries != "streamed":
        raise ValueError("ordered_stats needs queries='streamed' (both consumers compute "
                         f"every key tile); got {queries!r}")
    if key_groups is not None and (key_groups < 1 or (key_groups > 1
                                                      and (cluster > 1 or pair_rows))):
        raise ValueError(f"key_groups must be at least 1, and 1 with a cluster or pair_rows "
                         f"(a CTA walks its own span of keys); got {key_groups} with cluster "
                         f"{cluster}, pair_rows {pair_rows}")
    block_k = _default_block_k(queries, page_size, geom.stride) if block_k is None else block_k
    if block_k % 64 or not 64 <= block_k <= MAX_BLOCK_K:
        raise ValueError(f"block_k must be a multiple of 64 in [64, {MAX_BLOCK_K}]; got "
                         f"{block_k}")
    if page_size is not None and page_size % (block_k * geom.stride):
        raise ValueError(f"block_k must divide a page's {page_size // geom.stride} reshaped "
                         f"columns (a key tile in one page); got {block_k}")
    if trim_columns is None:
        trim_columns = default_trim_columns(block_k)
    if trim_columns and (trim_columns < 0 or trim_columns % COLUMN_TILE
                         or block_k % trim_columns):
        raise ValueError(f"trim_columns must be 0 or a divisor of block_k {block_k} that is "
                         f"a multiple of {COLUMN_TILE} (the wgmma's column grain); got "
                         f"{trim_columns}")
    itemsize = jnp.dtype(dtype).itemsize

    def deepest(ordered: bool) -> int:
        """The most stages, at most MAX_STAGES, whose shared memory fits."""
        fits = [n for n in range(MIN_STAGES, MAX_STAGES + 1)
                if EstimatePlan(geom, block_k, BLOCK_D, n, cluster, queries=queries,
                                stagger=stagger, ordered_stats=ordered
                                ).smem_bytes(itemsize) <= SMEM_BYTES]
        return fits[-1] if fits else MIN_STAGES

    deepest_ring = stages is None
    if deepest_ring:
        stages = deepest(bool(ordered_stats))
    if stages < MIN_STAGES:
        raise ValueError(f"stages must be at least {MIN_STAGES}; got {stages}")
    steps = EstimatePlan(geom, block_k, BLOCK_D, stages).steps_per_tile
    default_loop = step_loop is None
    if default_loop:
        step_loop = 0  # the rule needs the key groups (below)
    if step_loop and (step_loop < 0 or queries != "streamed" or (steps - 1) % step_loop):
        raise ValueError(f"step_loop must be 0, or with queries='streamed' a divisor of the "
                         f"{steps - 1} steps after a key tile's first (the loop's unroll); "
                         f"got {step_loop} with queries={queries!r}")
    if ordered_stats and stages >= steps:
        if not default_order:
            raise ValueError(f"ordered_stats needs fewer stages than the {steps} steps of "
                             f"a key tile (consumer 0 then cannot finish a second tile's "
                             f"statistics before consumer 1 waits for the first's); got "
                             f"stages {stages}")
        ordered_stats = False  # and its barrier's room goes back to the ring
        stages = deepest(False) if deepest_ring else stages
    grid_alone = _layout_takes_persistent(queries, cluster, pair_rows) and key_groups in (
        None, 1)
    # the default grid is known once the steps are (`_default_persistent`)
    default_grid = (grid_alone and persistent is None and key_groups is None
                    and head_group is None)
    persistent = bool(persistent)
    if persistent and not grid_alone:
        raise ValueError(f"persistent needs queries='streamed', cluster 1, key_groups 1 and "
                         f"no pair_rows; got queries={queries!r}, cluster={cluster}, "
                         f"key_groups={key_groups}, pair_rows={pair_rows}")
    plan = EstimatePlan(geom, block_k, BLOCK_D, stages, cluster, leave_out, queries,
                        bool(stagger), bool(pair_rows), page_size=page_size,
                        key_groups=key_groups or 1, persistent_ctas=int(persistent),
                        head_group=head_group or 0, ordered_stats=bool(ordered_stats),
                        trim_columns=trim_columns, step_loop=step_loop)
    if key_groups is None and causal and cluster == 1 and not pair_rows and not persistent:
        key_groups = _causal_key_groups(plan)
        plan = dataclasses.replace(plan, key_groups=key_groups)
    if default_loop:
        plan = dataclasses.replace(plan, step_loop=default_step_loop(plan, causal))
    if plan.key_groups > plan.key_tiles:
        raise ValueError(f"key_groups must be at most the {plan.key_tiles} key tiles; got "
                         f"{key_groups}")
    smem = plan.smem_bytes(itemsize)
    if smem > SMEM_BYTES:
        raise ValueError(f"plan {plan} needs {smem} bytes of shared memory; the limit is "
                         f"{SMEM_BYTES}")
    if call_heads is not None and not 0 <= call_heads <= geom.q_heads:
        raise ValueError(f"call_heads must be in [0, {geom.q_heads}] (the query heads of "
                         f"a head step); got {call_heads}")
    if call_heads and call_rows is None:  # a head step of every row
        call_rows = 0
    if fold and (not causal or cluster > 1 or call_rows):
        raise ValueError(f"fold needs a causal call of one kernel call (call_rows 0) and "
                         f"cluster 1 (a row tile stores only the tiles it sees); got "
                         f"causal={causal}, call_rows={call_rows}, cluster={cluster}")
    default_fold = fold is None
    if default_fold:
        fold = causal and cluster == 1 and not call_rows and _fold_saves(plan)
    plan = dataclasses.replace(plan, fold=bool(fold))
    bound = max_scratch_bytes or MAX_SCRATCH_BYTES
    if call_rows is None:  # one call, else head steps, else row steps (of every head)
        if plan.scratch_bytes > bound:
            call_heads = _call_heads(plan, causal, bound, key_groups is None)
        call_rows = 0 if call_heads else _call_rows(plan, bound)
        if call_rows is None:  # else row steps of one head
            call_rows = _head_rows(plan, causal, bound, key_groups is None, default_grid)
            call_heads = 1
        if call_rows is None:
            raise ValueError(f"plan {plan}: {_steps_refused(plan, causal, bound)}")
    elif call_rows < 0 or call_rows % plan.row_quantum:
        raise ValueError(f"call_rows must be 0 or a positive multiple of {plan.row_quantum}"
                         f" (whole clusters of row tiles and whole query blocks); got "
                         f"{call_rows}")
    if call_rows and plan.fold and not default_fold:
        raise ValueError(f"fold needs one kernel call; the folded statistics "
                         f"({plan.scratch_bytes} bytes) exceed max_scratch_bytes={bound}")
    plan = dataclasses.replace(plan, call_rows=call_rows, fold=plan.fold and not call_rows,
                               call_heads=call_heads or 0)
    if head_group is not None and (head_group < 1 or plan.pairs % head_group or (
            head_group > 1 and (cluster > 1 or persistent))):
        raise ValueError(f"head_group must divide the {plan.pairs} (batch, head) pairs "
                         f"of a kernel call, and be 1 with a cluster or a persistent grid "
                         f"(their grids' own order); got {head_group} with cluster "
                         f"{cluster}, persistent {bool(persistent)}")
    if default_grid and _default_persistent(plan, causal):
        # one CTA per SM walking the work items, whatever the key groups were (counted next)
        plan = dataclasses.replace(plan, persistent_ctas=1, key_groups=1)
        if default_loop:
            plan = dataclasses.replace(plan, step_loop=default_step_loop(plan, causal))
    if plan.persistent_ctas:
        plan = dataclasses.replace(plan, persistent_ctas=_persistent_ctas(plan, causal))
    elif (key_groups is None and cluster == 1 and not pair_rows
            and (not call_rows or plan.call_heads)):
        plan = dataclasses.replace(plan, key_groups=_key_groups(plan))
    steps = len(step_first_rows(plan))
    if epilogue_loops is None:
        epilogue_loops = default_epilogue_loops(plan, causal)
    if not 1 <= epilogue_loops <= (steps if causal else 1):
        raise ValueError(f"epilogue_loops must be in [1, {steps if causal else 1}] (at most "
                         f"the row steps of a causal call; 1 in a non-causal one, whose "
                         f"rows all see every key tile); got {epilogue_loops}")
    plan = dataclasses.replace(plan, epilogue_loops=epilogue_loops)
    if stats_epilogue is None:
        stats_epilogue = default_stats_epilogue(plan)
    if stats_epilogue and not stats_epilogue_takes(plan):
        raise ValueError(f"stats_epilogue needs block_k ({block_k}) and a block's reshaped "
                         f"rows ({geom.block_rows}) to be powers of two (Triton's tiles)")
    return dataclasses.replace(plan, stats_epilogue=bool(stats_epilogue))


def _default_persistent(plan: EstimatePlan, causal: bool) -> bool:
    """Whether the default plan (`plan`: its steps and key groups final, a layout the
    persistent grid takes) runs on a persistent grid (one CTA per SM walking work items of
    a row tile and a key tile each, its pipeline going on across them) instead: a causal
    call in head steps (its items listed, `EstimatePlan.listed`: every CTA walks as many
    real items, where a step of key-grouped CTAs ends in a part-empty wave), or in row
    steps whose CTAs walk whole rows (one key group; each step's items listed), as a row
    step's last wave of such CTAs is part empty (causal 1M: 256 CTAs a step on 132 SMs);
    and any call in row steps of some heads (call_heads with call_rows: `_head_rows`
    makes them of one).

    H200, block sums, medians of 3 rotating rounds, persistent / a CTA per row tile and
    key group (mosaic_estimate_h200.md). Head steps (session 26): causal 128K within 64
    MiB (steps of 1 head) 15.61 / 16.86 ms (one call 15.86), 64K within 64 MiB (4 heads)
    3.917 / 4.094 (one call 3.863), within 16 MiB (1 head) 4.247 / 5.411, 32K within 64
    MiB (16 heads) 1.031 / 1.062 (one call 1.014), within 8 MiB (2 heads) 1.314 / 1.509;
    at the default bound causal 256K (8 heads) 60.86 / 62.67, 512K (2 heads) 236.6 /
    247.9. Row steps (session 25): causal 1M (1024 rows) 982.6 / 1039.7, every round.
    Not where a whole causal call runs in key groups, even listed (session 26: causal 32K
    0.996 / 1.000, 64K 4.073 / 3.760, GQA 32:8 64K 3.943 / 3.708, 128K 15.52 / 15.71;
    session 27, blocks of 32 row tiles, `ROW_BLOCK_TILES`: 64K 3.971 / 3.797), nor
    in non-causal calls (session 25: within the rounds' spread). A head step of fewer
    than PERSISTENT_MIN_ITEMS listed items per SM keeps its key groups (unmeasured). Row
    steps of one head (`_head_rows`), causal or not, run on it too (session 27: non-causal
    128K within 64 MiB in 2 steps of 8192 rows a head 29.00 ms / 29.99 in 2 key groups,
    block 64 in 4 steps of 4096 rows 31.30 / 31.39 in 4, 64K block 64 within 16 MiB in 3
    steps of 3200 rows 10.20 / 11.01 in 4; one call 28.84, 30.48, 7.38). Causal row
    steps listed per step against walking every item (session 28, alternating processes,
    two medians each, bit-identical block sums): causal 128K within 32 MiB (3 steps of
    5504 rows a head) 16.73, 16.83 / 19.52, 19.69 ms (one call 15.52, session 27); 256K
    within 64 MiB (5 of 6656) 63.23, 63.40 / 64.36, 64.13; 1M at the default bound (128
    steps of 1024 rows of every head) 985.0, 986.1 / 991.0, 992.0; 1M within 64 MiB (74
    of 1792 a head) 1021.7, 1026.7 / 1023.3, 1021.4."""
    if plan.call_rows and plan.call_heads:  # row steps of some heads (`_head_rows`)
        return True
    if not causal:
        return False
    if plan.call_rows:
        return plan.key_groups == 1
    if plan.call_heads:
        items = len(listed_items(plan)) * plan.pairs
        return items >= PERSISTENT_MIN_ITEMS * device_sms()
    return False


def _persistent_ctas(plan: EstimatePlan, causal: bool) -> int:
    """The CTAs of `plan`'s persistent grid (`plan.persistent_ctas` > 0; a kernel call, or
    a step of one): one per SM (`device_sms`), at most one per work item it walks (listed,
    `EstimatePlan.listed`: per real item of its longest row step, so that no CTA walks
    nothing where the steps are as long)."""
    items = (int(listed_counts(plan).max()) * plan.pairs if plan.listed(causal)
             else plan.step_ctas(plan.rows_per_call))
    return min(device_sms(), items)


def _causal_key_groups(plan: EstimatePlan) -> int:
    """The key groups of a causal call (`plan`, key_groups 1): CAUSAL_KEY_GROUPS, at most
    the key tiles, where a head's keys take at most CAUSAL_KEY_GROUPS_MAX_BYTES; else
    1."""
    if plan.head_key_bytes > CAUSAL_KEY_GROUPS_MAX_BYTES:
        return 1
    return min(CAUSAL_KEY_GROUPS, plan.key_tiles)


def _key_groups(plan: EstimatePlan) -> int:
    """The key groups of a whole call of one CTA per row tile (`plan`, key_groups 1):
    1 where its CTAs hold a wave (`device_sms`), else the G of 1 .. MAX_KEY_GROUPS (at
    most the key tiles) whose CTAs fill their waves best (of equals, the smallest: the
    longest spans)."""
    sms, ctas = device_sms(), plan.step_ctas(plan.rows_per_call)
    if ctas >= sms:
        return 1

    def fill(groups: int) -> float:
        return ctas * groups / (cdiv(ctas * groups, sms) * sms)

    return max(range(1, min(MAX_KEY_GROUPS, plan.key_tiles) + 1),
               key=lambda groups: (fill(groups), -groups))


def _fold_saves(plan: EstimatePlan) -> bool:
    """Whether folded statistics (`EstimatePlan.fold`) save at least FOLD_MIN_SAVING of
    the unfolded ones' memory in a causal call of one kernel call (`plan`: call_rows 0):
    about half at Lq = Lk, 2% where every row tile sees nearly every key tile (a chunk
    of 4096 queries over 64K keys: 126 slots for 128)."""
    unfolded = plan.key_tiles * plan.call_row_tiles
    return plan.fold_slots * plan.fold_places <= (1 - FOLD_MIN_SAVING) * unfolded


def _fills_sms(plan: EstimatePlan, rows: int) -> bool:
    """Whether a row step of `rows` rows of every head holds a CTA per SM (`device_sms`)
    without its key groups: a row tile each (with a persistent grid, a work item each).
    Steps of fewer row tiles ran slower than the Triton kernel whatever their key groups
    (H200, causal 128K within 64 MiB: 20.3 ms with G = 1, session 12, and 21.1-23.1 ms
    with G = 2-4, session 17, against 18.0; mosaic_estimate_h200.md)."""
    return plan.step_ctas(rows) // plan.key_groups >= device_sms()


def _wave_rows(plan: EstimatePlan) -> int:
    """The rows of the smallest row step that `_fills_sms`."""
    rows = plan.row_quantum
    while not _fills_sms(plan, rows):
        rows += plan.row_quantum
    return rows


def _default_block_k(queries: str, page_size: int | None, stride: int) -> int:
    """BLOCK_K of the layout or, with a paged k (pages of a multiple of 64 x stride
    tokens), the largest multiple of 64 up to it dividing a page's reshaped columns."""
    if page_size is None:
        return BLOCK_K[queries]
    page_cols = page_size // stride
    return max(n for n in range(64, BLOCK_K[queries] + 1, 64) if page_cols % n == 0)


def _call_rows(plan: EstimatePlan, bound: int) -> int | None:
    """The rows of every head one kernel call covers within `bound` bytes of
    statistics: 0 (all, one call) where they fit, else a multiple of `row_quantum`
    whose row steps keep every SM busy (`_fills_sms`) and take the fewest waves of CTAs
    in all (steps x waves per step: a step's CTAs see about as many key tiles each, so a
    step lasts about its waves); of equals, the one computing the fewest rows twice (the
    last step ends at the last query block, overlapping the one before), then the
    largest (fewer calls). None if no such step fits (smaller steps ran slower than the
    Triton kernel; head steps, `_call_heads`, may fit)."""
    geom = plan.geom
    if plan.scratch_bytes <= bound:  # one call (`plan`: call_rows 0), folded or not
        return 0
    quantum, sms = plan.row_quantum, device_sms()
    extent = geom.q_blocks * geom.block_rows  # the rows the steps cover

    def waves(rows: int) -> int:
        return cdiv(extent, rows) * cdiv(plan.step_ctas(rows), sms)

    fit = min(bound // plan.row_scratch_bytes, cdiv(extent, quantum) * quantum)
    steps = [rows for rows in range(quantum, fit // quantum * quantum + 1, quantum)
             if _fills_sms(plan, rows)]
    if not steps:
        return None
    return min(steps, key=lambda rows: (waves(rows), cdiv(extent, rows) * rows, -rows))


def _call_heads(plan: EstimatePlan, causal: bool, bound: int,
                default_groups: bool) -> int | None:
    """The query heads of each head step of a call whose statistics exceed `bound` bytes
    (`plan`: call_rows 0, its fold and causal key groups the call's), or None where one
    head's exceed it too or the steps' CTAs (in their key groups: with `default_groups`,
    a non-causal step's `_key_groups`) are fewer than "auto" runs on Mosaic
    (`auto_min_ctas`). Of the step sizes that fit and fill, the one computing the fewest
    heads in all (ceil(Hq / n) steps of n heads, the last overlapping the one before),
    then the fewest steps. A head step holds every row of its heads, so a causal step
    keeps the folded statistics and leaves out the tiles past the diagonals (the listed
    persistent grid, or the compacted one).

    Head steps come before row steps (`_call_rows`). H200, block sums, medians of 3
    rotating rounds (mosaic_estimate_h200.md, session 24, the causal steps in key groups;
    since session 26 they run on the persistent grid, `_default_persistent`): causal
    128K, one call (1.1 GiB of statistics) / steps of 1 head (36.6 MiB) / 2 heads (73
    MiB) / row steps of 640 rows (90 MiB) / the Triton kernel within 64 MiB: 16.116 /
    16.752 / 16.400 / 18.701 / 19.625 ms; causal 64K, one call / steps of 4 heads / 6
    heads (36 computed) / row steps of 640 rows / Triton within 64 MiB: 3.915 / 4.069 /
    4.460 / 4.854 / 4.984; non-causal 64K block 64, one call / steps of 1 head / Triton
    within 64 MiB: 7.637 / 7.820 / 8.748. At the default bound, causal 256K in steps of
    8 heads / row steps of 4736 rows: 62.620 / 70.037."""
    most = min(bound // dataclasses.replace(plan, call_heads=1).scratch_bytes,
               plan.geom.q_heads)
    heads = [n for n in range(1, most + 1)
             if _head_step(plan, causal, n, default_groups).ctas(causal) >= auto_min_ctas()]
    if not heads:
        return None
    q_heads = plan.geom.q_heads
    return min(heads, key=lambda n: (cdiv(q_heads, n) * n, cdiv(q_heads, n)))


def _head_rows(plan: EstimatePlan, causal: bool, bound: int, default_groups: bool,
               default_grid: bool) -> int | None:
    """The rows of each row step of one query head (call_heads 1), for a call of which
    neither a head step (`_call_heads`) nor a row step of every head (`_call_rows`) fits
    within `bound` bytes of statistics (`plan`: call_rows 0, its key groups the call's):
    a multiple of `row_quantum` whose statistics fit and whose step has the work
    `_head_row_step` asks; of those, the fewest steps a head, then the fewest work items
    on the busiest SM in all (`_busiest_sm_items`), then the fewest rows computed (the
    last step overlapping the one before), then the largest. None if none fits.
    Non-causal 128K within 64 MiB (72 MiB a head, block 128): 2 steps of 8192 rows on
    the persistent grid (4096 items on 132 CTAs)."""
    geom, quantum = plan.geom, plan.row_quantum
    extent = geom.q_blocks * geom.block_rows  # the rows the steps cover
    one_head = dataclasses.replace(plan, call_heads=1, fold=False)
    fit = min(bound // one_head.row_scratch_bytes, cdiv(extent, quantum) * quantum)
    steps = {}
    for rows in range(quantum, fit // quantum * quantum + 1, quantum):
        step = _head_row_step(plan, causal, rows, default_groups, default_grid)
        if step is not None:
            steps[rows] = _busiest_sm_items(step, causal)
    if not steps:
        return None
    return min(steps, key=lambda rows: (cdiv(extent, rows), steps[rows],
                                        cdiv(extent, rows) * rows, -rows))


def _head_row_step(plan: EstimatePlan, causal: bool, rows: int, default_groups: bool,
                   default_grid: bool) -> EstimatePlan | None:
    """`plan` in row steps of `rows` rows of one head, as `estimate_plan` makes it (with
    `default_grid` on the persistent grid, `_default_persistent`; else with
    `default_groups`, a non-causal step in `_key_groups`), or None where it has too
    little work: on a persistent grid fewer than PERSISTENT_MIN_ITEMS work items per SM
    (all its row tiles' key tiles counted, those a listed grid leaves out included: the
    smallest persistent step measured), else fewer CTAs than
    `auto_min_ctas`."""
    step = _head_step(plan, causal, 1, default_groups, rows)
    if default_grid:
        step = dataclasses.replace(step, key_groups=1, persistent_ctas=1)
        step = dataclasses.replace(step, persistent_ctas=_persistent_ctas(step, causal))
    if step.persistent_ctas:
        enough = step.step_ctas(rows) >= PERSISTENT_MIN_ITEMS * device_sms()
    else:
        enough = step.ctas(causal) >= auto_min_ctas()
    return step if enough else None


def _layout_takes_persistent(queries: str, cluster: int, pair_rows: bool) -> bool:
    """Whether a layout takes a persistent grid (`estimate_plan`'s persistent, with one
    key group): streamed queries, cluster 1, no pair_rows."""
    return queries == "streamed" and cluster == 1 and not pair_rows


def _grid_alone(plan: EstimatePlan) -> bool:
    """`_layout_takes_persistent` of `plan`'s layout."""
    return _layout_takes_persistent(plan.queries, plan.cluster, plan.pair_rows)


def _busiest_sm_items(step: EstimatePlan, causal: bool) -> int:
    """The key tiles (work items) the busiest SM walks in all the row steps of one head
    (`step`: one of them, taking every key tile of its row tiles): per step, a listed
    persistent grid's real items spread over its CTAs (`listed_counts`), or a persistent
    grid's items per CTA (a non-causal step's, all real), or a CTA's span times its
    waves."""
    if step.listed(causal):
        return sum(cdiv(int(items) * step.pairs, step.persistent_ctas)
                   for items in listed_counts(step))
    steps = len(step_first_rows(step))
    if step.persistent_ctas:
        return steps * cdiv(step.step_ctas(step.rows_per_call), step.persistent_ctas)
    return steps * cdiv(step.ctas(causal), device_sms()) * step.key_span


def _head_step(plan: EstimatePlan, causal: bool, heads: int, default_groups: bool,
               rows: int = 0) -> EstimatePlan:
    """`plan` in head steps of `heads` query heads (with `rows`, a row step of them), with
    `default_groups` in a non-causal call's default key groups (`_key_groups`: they
    depend on the step's CTAs)."""
    step = dataclasses.replace(plan, call_heads=heads, call_rows=rows,
                               fold=plan.fold and not rows)
    if step.persistent_ctas:
        return dataclasses.replace(step, persistent_ctas=_persistent_ctas(step, causal))
    if default_groups and not causal and step.cluster == 1 and not step.pair_rows:
        step = dataclasses.replace(step, key_groups=_key_groups(step))
    return step


def _steps_refused(plan: EstimatePlan, causal: bool, bound: int) -> str:
    """Why neither a row step of a wave (`_call_rows`) nor a head step (`_call_heads`)
    nor a row step of one head (`_head_rows`; the default grid) of `plan` fits within
    `bound` bytes of statistics: the smallest of each."""
    rows, head = _wave_rows(plan), _head_step(plan, causal, 1, default_groups=True)
    quantum = plan.row_quantum
    part = next((step for n in range(quantum, plan.padded_rows + quantum, quantum)
                 if (step := _head_row_step(plan, causal, n, True, _grid_alone(plan)))
                 is not None), None)
    part_need = ("no row step of one head has the work a step needs" if part is None
                 else f"{part.scratch_bytes} bytes for a row step of one head "
                      f"({part.call_rows} rows, {part.ctas(causal)} CTAs)")
    return (f"impl='mosaic' block sums need {plan.row_scratch_bytes * rows} bytes of "
            f"statistics for one row step of a wave of row tiles ({rows} rows of every "
            f"head), or {head.scratch_bytes} bytes for a head step of one head's rows "
            f"({head.ctas(causal)} CTAs, of the {auto_min_ctas()} a step needs), or "
            f"{part_need}, over max_scratch_bytes={bound}")


def default_trim_columns(block_k: int) -> int:
    """The default plan's `trim_columns` at `block_k`: TRIM_COLUMNS where it divides
    block_k, else their gcd (block_k 192: 64)."""
    return math.gcd(TRIM_COLUMNS, block_k)


def default_step_loop(plan: EstimatePlan, causal: bool) -> int:
    """The default `step_loop` of `plan` (its other fields final): in causal calls with
    the streamed queries in key groups (short CTAs) or on the persistent grid (a key tile
    a work item), the largest divisor of a key tile's steps less one up to
    CAUSAL_STEP_LOOP; else 0 (unrolled: also for a tile of one step)."""
    steps = plan.steps_per_tile
    splits_rows = plan.key_groups > 1 or plan.persistent_ctas > 0
    if not causal or plan.queries != "streamed" or not splits_rows or steps < 2:
        return 0
    return max(n for n in range(1, CAUSAL_STEP_LOOP + 1) if (steps - 1) % n == 0)


def default_epilogue_loops(plan: EstimatePlan, causal: bool) -> int:
    """EPILOGUE_LOOPS for a causal call in row steps (at most one a step), else 1."""
    return min(EPILOGUE_LOOPS, len(step_first_rows(plan))) if causal else 1


def stats_epilogue_takes(plan: EstimatePlan) -> bool:
    """Whether `xattn_jax.mosaic.epilogue` takes the plan's statistics: its tiles (a key
    tile's units, a row tile's query blocks) have power-of-two sizes where block_k and
    block_rows do."""
    return all(n & (n - 1) == 0 for n in (plan.block_k, plan.geom.block_rows))


def default_stats_epilogue(plan: EstimatePlan) -> bool:
    """FOLDED_STATS_EPILOGUE for folded statistics (a whole causal call) the kernel
    takes (`stats_epilogue_takes`); XLA's reductions elsewhere."""
    return FOLDED_STATS_EPILOGUE and plan.fold and stats_epilogue_takes(plan)


def default_stagger(queries: str) -> bool:
    """Whether the default plan of the `queries` layout staggers its consumers: STAGGER
    with the streamed queries (the resident ones take the key tiles in turns)."""
    return STAGGER and queries == "streamed"


def _check_queries(queries: str) -> None:
    if queries not in QUERY_LAYOUTS:
        raise ValueError(f"queries must be one of {QUERY_LAYOUTS}; got {queries!r}")


def seen_columns(plan: EstimatePlan, causal: bool, row0, rows: int, cols=None):
    """Reshaped key columns 0 .. n - 1 hold every column some of the `rows` rows from
    `row0` (a Python int, a traced int32 scalar or an int32 array) may see (section 2:
    column j <= row + (Lk - Lq) / S with causal, j < cols always). cols: the reshaped key
    columns in use (an int or a traced int32 scalar; default all k_cols). Shared by
    `visible_tiles` (a row tile's rows) and the kernel (a consumer's rows: the width of
    its masked tile, `EstimatePlan.masked_widths`)."""
    geom = plan.geom
    cols = geom.k_cols if cols is None else cols
    xp = _array_module(row0, cols)
    row0, cols = xp.asarray(row0, xp.int32), xp.asarray(cols, xp.int32)
    if not causal:
        return xp.broadcast_to(cols, row0.shape)
    return xp.maximum(xp.minimum(row0 + (rows + geom.row_offset), cols), 0)


def visible_tiles(plan: EstimatePlan, causal: bool, row0, cols=None):
    """Key tiles 0 .. n - 1 hold a column some row of the row tile (`plan.rows` rows)
    starting at `row0` may see (`seen_columns`). Shared by the kernel (the tiles a CTA
    computes; with clusters, those of the cluster's last row tile) and the epilogue
    (which statistics are real)."""
    return _div(seen_columns(plan, causal, row0, plan.rows, cols) + (plan.block_k - 1),
                plan.block_k)


def tail_tile(plan: EstimatePlan, cols):
    """The key tile holding the last of the `cols` reshaped key columns in use (a traced
    int32 scalar; tile 0 for none): in a call with a key count, the one the kernel reads
    from the caller's zeroed copy (shared by `block_sums._tail_tile`, which makes the
    copy, and the kernel, which reads it)."""
    return _div(jnp.maximum(cols - 1, 0), plan.block_k)


def paired_row_tiles(plan: EstimatePlan, group):
    """The row tiles a CTA of a call with paired row tiles (`EstimatePlan.paired`) walks,
    in order: `group` (its index on the grid's row axis, in [0, row_groups): a Python
    int, a traced int32 scalar or an int32 array) and R - 1 - `group` (R = row_tiles),
    which see about as many key tiles together in a causal call whatever `group`. The
    two are the same row tile for the middle one of an odd R, walked once: the last CTA,
    the shortest."""
    group = jnp.asarray(group, jnp.int32)
    return group, plan.row_tiles - 1 - group


def unmasked_tiles(plan: EstimatePlan, causal: bool, row0, cols=None):
    """Key tiles 0 .. n - 1 every row from `row0` on sees in full (they do if row0
    does): the kernel masks only the later ones. cols: as `visible_tiles`."""
    geom = plan.geom
    cols = geom.k_cols if cols is None else cols
    xp = _array_module(row0, cols)
    row0 = xp.asarray(row0, xp.int32)
    whole = _div(xp.asarray(cols, xp.int32), plan.block_k)
    if not causal:
        return xp.broadcast_to(whole, row0.shape)
    return xp.minimum(_div(row0 + (geom.row_offset + 1), plan.block_k), whole)


def _array_module(*values):
    """numpy where every value is concrete host data (Python or numpy ints: a plan's
    tables at trace time, `row_tiles_seen`, computed without compiling XLA ops for each
    new shape: 0.24 s per causal geometry on the CPU), else jax.numpy (the kernel's and
    the epilogue's traced values)."""
    host = all(isinstance(v, (int, np.integer, np.ndarray)) for v in values)
    return np if host else jnp


def _div(x, divisor: int):
    """x // divisor for x >= 0 (traced: lax.div, as jnp's floor division adds sign
    fix-ups)."""
    if isinstance(x, (np.ndarray, np.integer)):
        return x // np.int32(divisor)
    return jax.lax.div(x, jnp.int32(divisor))
