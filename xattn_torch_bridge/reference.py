"""Pure-torch reference of docs/estimate.md sections 1-5, written from the spec alone.

It shares no code with `xattn_jax.reference`, so agreement between the two is evidence.
One function per section, composed by `xattn_estimate` (sections 1-4) and
`kv_block_scores` (section 5):

1. `strided_scores`: one matrix product per antidiagonal offset s, summed.
2. `attention_probs`: causal mask and row softmax.
3. `block_sums`: zero-pad, then sum square tiles.
4. `select_blocks`: the threshold rule, row by row in plain Python.
5. `kv_block_scores`, `select_kv_blocks`: chunked-prefill scores over KV-cache blocks and
   their selection by score (or by the engine's earlier majority vote).

Sections 1-3 compute in float32, or in float64 when the inputs are float64 (pass float64
tensors for a float64 reference). Selections read the sums to the host and add masses in
Python floats (float64). Tensors may live on any device; results come back on it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from xattn_jax.defaults import BLOCK_SIZE, NORM, ORIGINAL_THRESHOLD, STRIDE

RULES = ("score", "vote")


# --- section 1 ------------------------------------------------------------------------

def strided_scores(q: torch.Tensor, k: torch.Tensor, stride: int,
                   norm: float = NORM) -> torch.Tensor:
    """Antidiagonal scores A, `[B, Hq, ceil(Lq/S), ceil(Lk/S)]`.

    A[b, h, i, j] = sum_s q[b, h, i*S + S-1-s] . k[b, h // g, j*S + s] / (sqrt(D) * S * norm)
    for q `[B, Hq, Lq, D]`, k `[B, Hkv, Lk, D]`, g = Hq // Hkv. Tokens missing from a last,
    partial stride group count as zeros.
    """
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    group = q.shape[1] // k.shape[1]
    q = _pad_length(q.to(dtype), stride)
    k = _pad_length(k.to(dtype), stride).repeat_interleave(group, dim=1)
    scores = sum(q[:, :, stride - 1 - s::stride] @ k[:, :, s::stride].transpose(-1, -2)
                 for s in range(stride))
    return scores / (math.sqrt(q.shape[-1]) * stride * norm)


def _pad_length(x: torch.Tensor, multiple: int) -> torch.Tensor:
    """Zero-pads dimension 2 (the sequence) of `[B, H, L, D]` to a multiple of `multiple`."""
    return F.pad(x, (0, 0, 0, -x.shape[2] % multiple))


# --- section 2 ------------------------------------------------------------------------

def attention_probs(scores: torch.Tensor, causal: bool, offset: int = 0) -> torch.Tensor:
    """Row softmax of `[..., rows, cols]` scores over the visible columns.

    causal: row i sees column j only if j <= i + offset, where offset is the reshaped key
    column of the first query row, (Lk_pad - Lq_pad) / S. Otherwise every column is visible.
    """
    if causal:
        rows, cols = scores.shape[-2:]
        i = torch.arange(rows, device=scores.device)[:, None]
        j = torch.arange(cols, device=scores.device)[None, :]
        scores = scores.masked_fill(j > i + offset, -math.inf)
    return torch.softmax(scores, dim=-1)


# --- section 3 ------------------------------------------------------------------------

def block_sums(probs: torch.Tensor, block_rows: int) -> torch.Tensor:
    """Sums of `block_rows x block_rows` tiles of `[..., rows, cols]`:
    `[..., ceil(rows/block_rows), ceil(cols/block_rows)]`, missing rows and columns of the
    last tiles counting as zeros. With probs P and block_rows = block_size / S these are the
    block sums; applied to block sums with block_rows = m, the hierarchical sums at m times
    the block size."""
    rows, cols = probs.shape[-2:]
    row_blocks, col_blocks = -(-rows // block_rows), -(-cols // block_rows)
    padded = F.pad(probs, (0, col_blocks * block_rows - cols, 0, row_blocks * block_rows - rows))
    tiles = padded.reshape(*probs.shape[:-2], row_blocks, block_rows, col_blocks, block_rows)
    return tiles.sum(dim=(-3, -1))


# --- section 4 ------------------------------------------------------------------------

def select_blocks(block_sums: torch.Tensor, threshold, causal: bool, keep_sink: bool = False,
                  keep_recent: bool = False) -> torch.Tensor:
    """Threshold selection: bool mask `[B, Hq, qb, kb]` for block sums `[B, Hq, qb, kb]`.

    Per row (b, h, I) with total T: the forced blocks (key block 0 if causal or keep_sink;
    the diagonal block I + kb - qb if causal or keep_recent) are selected and count towards
    the target t * T; then the visible others (causal: up to the diagonal) are taken in
    descending order of their sum, lower index first among equals, while the selected mass
    is below the target. A row with a non-finite total selects every visible block.
    threshold: a float in (0, 1] or `Hq` of them.
    """
    batch, heads, q_blocks, k_blocks = block_sums.shape
    if q_blocks > k_blocks:
        raise ValueError(f"block_sums may not have more query blocks than key blocks, got "
                         f"shape {tuple(block_sums.shape)}")
    shares = _per_head(threshold, heads)
    values = block_sums.tolist()
    mask = []
    for b in range(batch):
        for h in range(heads):
            for row_index, row in enumerate(values[b][h]):
                diagonal = row_index + k_blocks - q_blocks
                visible = range(diagonal + 1) if causal else range(k_blocks)
                forced = {j for j, keep in ((0, causal or keep_sink),
                                            (diagonal, causal or keep_recent)) if keep}
                total = sum(row)
                if math.isfinite(total):
                    chosen = _smallest_set(row, shares[h] * total, forced,
                                           [j for j in visible if j not in forced])
                else:
                    chosen = set(visible)
                mask.append([j in chosen for j in range(k_blocks)])
    return torch.tensor(mask, device=block_sums.device).reshape(block_sums.shape)


def _smallest_set(values: list[float], target: float, forced: set[int],
                  candidates: Iterable[int]) -> set[int]:
    """`forced`, then candidates in descending order of value (ties: lower index first)
    while the mass selected so far is below `target`."""
    chosen = set(forced)
    mass = sum(values[j] for j in forced)
    for j in sorted(candidates, key=lambda j: (-values[j], j)):
        if mass >= target:
            break
        chosen.add(j)
        mass += values[j]
    return chosen


def _per_head(threshold, heads: int) -> list[float]:
    """The threshold as one float per head, each checked to lie in (0, 1]."""
    values = threshold.tolist() if isinstance(threshold, torch.Tensor) else threshold
    values = [float(values)] * heads if isinstance(values, (int, float)) else list(values)
    if len(values) != heads or not all(0 < t <= 1 for t in values):
        raise ValueError(f"threshold must be a float in (0, 1] or {heads} of them, "
                         f"got {threshold!r}")
    return values


# --- sections 1-4 ---------------------------------------------------------------------

def xattn_estimate(q: torch.Tensor, k: torch.Tensor, block_size: int = BLOCK_SIZE,
                   stride: int = STRIDE, threshold=ORIGINAL_THRESHOLD, causal: bool = True,
                   norm: float = NORM,
                   keep_sink: bool = False,
                   keep_recent: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Sections 1-4: `(block_sums, mask)`, `[B, Hq, ceil(Lq/block_size), ceil(Lk/block_size)]`.

    q `[B, Hq, Lq, D]` are the last Lq of the Lk positions of k `[B, Hkv, Lk, D]`.
    block_sums is float32 (float64 for float64 inputs), mask bool.
    """
    _check_qk(q, k)
    q_len, k_len = q.shape[2], k.shape[2]
    if block_size % stride:
        raise ValueError(f"block_size ({block_size}) must be a multiple of stride ({stride})")
    if q_len > k_len:
        raise ValueError(f"q may not be longer than k (Lq={q_len}, Lk={k_len})")
    if causal and (k_len - q_len) % block_size:
        raise ValueError(f"with causal=True, Lk - Lq ({k_len - q_len}) must be a multiple "
                         f"of block_size ({block_size})")
    padded = [-(-n // block_size) * block_size for n in (q_len, k_len)]
    probs = attention_probs(strided_scores(q, k, stride, norm), causal,
                            offset=(padded[1] - padded[0]) // stride)
    sums = block_sums(probs, block_size // stride)
    return sums, select_blocks(sums, threshold, causal, keep_sink, keep_recent)


def _check_qk(q: torch.Tensor, k: torch.Tensor) -> None:
    if q.ndim != 4 or k.ndim != 4:
        raise ValueError(f"q and k must have rank 4 [B, H, L, D], got shapes "
                         f"{tuple(q.shape)} and {tuple(k.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3] or q.shape[1] % k.shape[1]:
        raise ValueError(f"q [B, Hq, Lq, D] and k [B, Hkv, Lk, D] must share B and D, with "
                         f"Hq a multiple of Hkv; got {tuple(q.shape)} and {tuple(k.shape)}")


# --- section 5 ------------------------------------------------------------------------

def kv_block_scores(q: torch.Tensor, k: torch.Tensor, kv_block_size: int,
                    estimate_block_size: int, stride: int, norm: float = NORM,
                    k_len: int | None = None, per_query_block: bool = False) -> torch.Tensor:
    """Softmax mass of a chunk's queries in each KV-cache block: `[B, Hq, N]`.

    q `[B, Hq, Lq, D]`: the chunk, after every cached key (so no causal mask). k
    `[B, Hkv, L, D]`: the cache; only its first `k_len` positions (default all) hold keys.
    N = ceil(k_len / kv_block_size). Computed hierarchically: block sums at
    `estimate_block_size` (a multiple of stride dividing kv_block_size), then summed over
    tiles of kv_block_size / estimate_block_size blocks and over all query blocks.
    per_query_block: keep the query blocks (of kv_block_size tokens) instead of summing
    them: `[B, Hq, ceil(Lq / kv_block_size), N]`, the rows of the "vote" rule.
    """
    _check_qk(q, k)
    k_len = k.shape[2] if k_len is None else k_len
    if not 1 <= k_len <= k.shape[2]:
        raise ValueError(f"k_len must lie in [1, {k.shape[2]}] (k's length), got {k_len}")
    if estimate_block_size % stride or kv_block_size % estimate_block_size:
        raise ValueError(f"estimate_block_size ({estimate_block_size}) must be a multiple of "
                         f"stride ({stride}) and divide kv_block_size ({kv_block_size})")
    probs = attention_probs(strided_scores(q, k[:, :, :k_len], stride, norm), causal=False)
    fine = block_sums(probs, estimate_block_size // stride)
    sums = block_sums(fine, kv_block_size // estimate_block_size)
    return sums if per_query_block else sums.sum(dim=2)


def select_kv_blocks(scores: torch.Tensor, threshold: float, keep_first: bool = True,
                     keep_last: bool = True, per_kv_head: int | None = None,
                     num_valid=None, rule: str = "score") -> torch.Tensor:
    """Selection of KV-cache blocks for a chunk: bool `[B, G, N]`, G = 1 or per_kv_head.

    scores: `[B, Hq, N]` from `kv_block_scores` (rule "score"), or `[B, Hq, R, N]` from
      `kv_block_scores(..., per_query_block=True)` (rule "vote").
    threshold: the share of the mass to keep, in (0, 1].
    per_kv_head: None selects once for all heads (G = 1); Hkv selects once per KV head,
      from its query heads h (h // (Hq // Hkv) == the KV head).
    num_valid: the KV blocks in use, an int or `[B]` ints (default N); later blocks are
      never selected and their scores are ignored.
    rule:
      "score": average the scores over the group's heads, normalize them over the valid
        blocks, take blocks in descending order of share (lower index first among equals)
        until the cumulative share reaches the threshold.
      "vote" (the engine's earlier rule): each row (head, query block) of the group keeps
        the smallest set of blocks reaching the threshold of its valid mass, as in section
        4 without forced blocks; a block is selected if a strict majority of the group's
        rows kept it.
    keep_first / keep_last: then also select block 0 (attention sink) / the last valid
      block (most recent context); they do not count towards the threshold.
    A group (score) or row (vote) whose mass is not finite or not positive selects every
    valid block.
    """
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    if scores.ndim != (3 if rule == "score" else 4):
        raise ValueError(f"rule={rule!r} takes scores of rank {3 if rule == 'score' else 4}, "
                         f"got shape {tuple(scores.shape)}")
    (share,) = _per_head(threshold, 1)
    batch, heads, n_blocks = scores.shape[0], scores.shape[1], scores.shape[-1]
    groups = _head_groups(heads, per_kv_head)
    valid_counts = _valid_counts(num_valid, batch, n_blocks)
    values = scores.tolist()
    mask = []
    for b, valid in enumerate(valid_counts):
        for group in groups:
            if rule == "score":
                mean = [sum(values[b][h][n] for h in group) / len(group) for n in range(valid)]
                chosen = _threshold_set(mean, share)
            else:
                rows = [values[b][h][r][:valid] for h in group for r in range(scores.shape[2])]
                votes = [0] * valid
                for row in rows:
                    for n in _threshold_set(row, share):
                        votes[n] += 1
                chosen = {n for n in range(valid) if 2 * votes[n] > len(rows)}
            chosen |= {n for n, keep in ((0, keep_first), (valid - 1, keep_last)) if keep}
            mask.append([n in chosen for n in range(n_blocks)])
    return torch.tensor(mask, device=scores.device).reshape(batch, len(groups), n_blocks)


def _threshold_set(values: list[float], share: float) -> set[int]:
    """The smallest set of indices, by descending value, reaching `share` of the total;
    every index if the total is not finite or not positive."""
    total = sum(values)
    if not (math.isfinite(total) and total > 0):
        return set(range(len(values)))
    return _smallest_set([v / total for v in values], share, set(), range(len(values)))


def _head_groups(heads: int, per_kv_head: int | None) -> list[range]:
    if per_kv_head is None:
        return [range(heads)]
    if isinstance(per_kv_head, bool) or not isinstance(per_kv_head, int) \
            or per_kv_head < 1 or heads % per_kv_head:
        raise ValueError(f"per_kv_head must be None or a number of KV heads dividing the "
                         f"{heads} query heads, got {per_kv_head!r}")
    size = heads // per_kv_head
    return [range(g * size, (g + 1) * size) for g in range(per_kv_head)]


def _valid_counts(num_valid, batch: int, n_blocks: int) -> list[int]:
    if num_valid is None:
        return [n_blocks] * batch
    counts = num_valid.tolist() if isinstance(num_valid, torch.Tensor) else num_valid
    counts = [counts] * batch if isinstance(counts, int) else list(counts)
    if len(counts) != batch or not all(1 <= c <= n_blocks for c in counts):
        raise ValueError(f"num_valid must be an int or {batch} ints in [1, {n_blocks}], "
                         f"got {num_valid!r}")
    return counts
