"""Argument checks of every public function of xattn_jax and xattn_torch_bridge.

Each rule is written once here, and each refusal names the argument and the rule it
broke: a TypeError when the argument has the wrong Python type (a string, None, a float
where an integer is meant, a bool where a number is meant), a ValueError when its value,
shape or dtype breaks the rule. Every check runs before any work or state change.

Values that are data rather than Python numbers (a threshold, `k_len`, `num_valid` or a
block table given as a jax.Array, possibly traced inside `jax.jit`) cannot be read without
waiting for the device, or at all while tracing: their types and shapes are checked, their
values only in checked mode (`checked`). Each public docstring says what an unchecked
out-of-range value gives.
"""

from __future__ import annotations

import contextvars
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from xattn_jax.defaults import ESTIMATES, SAMPLED_ROWS
from xattn_jax.geometry import Geometry

SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_SHARE_RULE = "must lie in (0, 1]"
MAX_BLOCK_SIZE = 1 << 16  # tokens: 16x the largest block in use (KV-cache blocks of 4096)

# --- checked mode ------------------------------------------------------------------------

_checked = contextvars.ContextVar("xattn_jax_checked", default=False)


def checked(fn: Callable) -> Callable:
    """`fn` with the values that are data checked too: returns `(error, result)`.

    `checked(fn)(*args)` is `checkify.checkify(fn, errors=checkify.user_checks)(*args)`,
    with xattn_jax's functions called inside `fn` adding a check for each value they cannot
    check on the host: a threshold given as a jax.Array in (0, 1], `k_len` in
    [1, capacity], `num_valid` in [1, n], the page ids of a block table that is traced or
    on a GPU in [0, num_pages). Call `error.throw()` to raise the first failed check as
    `checkify.JaxRuntimeError` (a ValueError) naming the argument and the rule. It
    composes with `jax.jit` from outside: `error, out = jax.jit(checked(fn))(x)`.

    The checks are added while `fn` is traced under `checked`; outside it (the default)
    nothing is added and the compiled functions are those of an unchecked call. A function
    that you jit yourself and call inside `fn` keeps the trace of its first call: wrap
    `checked` around it (as above), not the other way round.

    Raises TypeError at once if `fn` is not callable.
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable (the function to run checked), got {fn!r} "
                        f"({type(fn).__name__})")
    @functools.wraps(fn)
    def in_checked_mode(*args, **kwargs):
        token = _checked.set(True)
        try:
            return fn(*args, **kwargs)
        finally:
            _checked.reset(token)

    return checkify.checkify(in_checked_mode, errors=checkify.user_checks)


def check_traced(holds, message: str, *values) -> None:
    """In checked mode, a check that `holds(*values)` (a boolean array; the values may be
    traced) is true everywhere; `message` formats `values` with `{}`. Outside checked mode
    nothing, not even `holds` (an eager call would pay its operations)."""
    if _checked.get():
        # a debug check: a trace made here and reused outside checkify is a no-op there
        checkify.debug_check(jnp.all(holds(*values)), message, *values)


# --- calls checked before ------------------------------------------------------------------

class CheckedCalls:
    """What a public function derived from its checks (a prepared call), by call
    signature: the arrays' types, shapes, dtypes and shardings, and the other arguments
    with their types (16 and 16.0, or 1 and True, are different signatures). A call that
    repeats an earlier valid one skips the checks, host time comparable to a jitted
    dispatch (docs/tuning.md: checks-host-time). Only concrete jax.Arrays
    and hashable arguments have a signature; any other call is checked every time (a
    tracer, in particular, so checked mode always checks)."""

    def __init__(self, maxsize: int = 256):
        self._calls: dict = {}
        self._maxsize = maxsize

    @staticmethod
    def signature(arrays, options: dict):
        """The call's signature, or None where it has none."""
        parts = []
        for x in arrays:
            if x is None:
                parts.append(None)
            elif isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
                parts.append((type(x), x.shape, x.dtype, x.sharding))
            else:
                return None
        key = (tuple(parts), tuple((name, type(v), v) for name, v in options.items()))
        try:
            hash(key)
        except TypeError:
            return None
        return key

    def prepared(self, key, prepare):
        """The prepared call remembered under `key` (a `signature`, or any hashable key;
        None: nothing is remembered), else `prepare()`'s, remembered (a call whose checks
        raise in `prepare` leaves nothing behind). At most `maxsize` calls: the oldest are
        forgotten all at once."""
        if key is None:
            return prepare()
        found = self._calls.get(key)
        if found is None:
            if len(self._calls) >= self._maxsize:
                self._calls.clear()
            found = self._calls[key] = prepare()
        return found


# --- Python scalars ----------------------------------------------------------------------

def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _is_real(value) -> bool:
    return _is_int(value) or isinstance(value, (float, np.floating))


def check_int(name: str, value, minimum: int = 1) -> int:
    """`value` as an int >= minimum (Python or numpy integers; bools are refused)."""
    if not _is_int(value):
        raise TypeError(f"{name} must be an integer >= {minimum}, got {value!r} "
                        f"({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def check_tokens(name: str, value, unit: int = 1, unit_name: str | None = None) -> int:
    """A stride or block size in tokens: a positive integer, a multiple of `unit` (the
    argument `unit_name`, if given), at most MAX_BLOCK_SIZE.

    A block longer than the sequence is allowed (one block then covers it; padding never
    changes a result); the bound only stops a typo, whose padding would not fit in memory.
    """
    value = check_int(name, value)
    if value % unit or value > MAX_BLOCK_SIZE:
        rule = f"a positive multiple of {unit_name} ({unit})" if unit_name else \
            "an integer >= 1"
        raise ValueError(f"{name} must be {rule}, at most {MAX_BLOCK_SIZE}, got {value}")
    return value


def check_flag(name: str, value) -> bool:
    """`value` as a bool; only `True`/`False` (or numpy bools) are flags, not 0, 1 or None."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")
    return bool(value)


def check_positive_float(name: str, value) -> float:
    """`value` as a finite float > 0 (Python or numpy reals; bools are refused)."""
    if not _is_real(value):
        raise TypeError(f"{name} must be a finite number > 0, got {value!r} "
                        f"({type(value).__name__})")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def check_norm(norm) -> float:
    """The scores' extra divisor (a softmax temperature): a finite float > 0."""
    return check_positive_float("norm", norm)


def check_scale(scale) -> float | None:
    """The softmax's q.k multiplier: None (1 / sqrt(D)) or a finite number > 0."""
    if scale is None:
        return None
    if not _is_real(scale) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be None or a finite number > 0, got {scale!r}")
    return float(scale)


def check_choice(name: str, value, choices: tuple[str, ...]) -> str:
    """`value`, one of the strings `choices`."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be one of {choices}, got {value!r} "
                        f"({type(value).__name__})")
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


def check_estimate(estimate, block_size: int) -> str:
    """The block scores a selection rests on (one of `defaults.ESTIMATES`); sampled rows
    need a block of at least `defaults.SAMPLED_ROWS` tokens."""
    estimate = check_choice("estimate", estimate, ESTIMATES)
    if estimate == "sampled-rows" and block_size < SAMPLED_ROWS:
        raise ValueError(f"block_size must be at least {SAMPLED_ROWS} with "
                         f"estimate='sampled-rows' (its sampled rows per block), got "
                         f"{block_size}")
    return estimate


def check_scratch_bytes(max_scratch_bytes) -> int | None:
    """None, or a positive number of bytes."""
    if max_scratch_bytes is None:
        return None
    return check_int("max_scratch_bytes", max_scratch_bytes)


# --- shares in (0, 1] --------------------------------------------------------------------

def real_host_array(name: str, value) -> np.ndarray:
    """A threshold given on the host (a number, a numpy value or array, a list) as a float32
    array; strings, None, bools and other non-numbers are refused."""
    if not isinstance(value, (bool, np.bool_, str, bytes)):
        try:
            array = np.asarray(value)
        except (TypeError, ValueError):  # ragged lists
            array = None
        if array is not None and array.dtype.kind in "iuf":
            return array.astype(np.float32)
    raise TypeError(f"{name} must be a float or an array of floats, got {value!r} "
                    f"({type(value).__name__})")


def check_shares(name: str, values: float | np.ndarray, shown) -> None:
    """The one range rule of every share (threshold): one float, or a float32 array."""
    if isinstance(values, float):  # without numpy's few microseconds per call
        inside = 0 < values <= 1
    else:
        inside = np.all((values > 0) & (values <= 1))
    if not inside:
        raise ValueError(f"{name} {_SHARE_RULE}, got {shown}")


def check_share(name: str, value) -> float:
    """A share of attention mass on the host: a Python or numpy real in (0, 1], as its
    float32 value."""
    if not _is_real(value):
        raise TypeError(f"{name} must be a float in (0, 1], got {value!r} "
                        f"({type(value).__name__})")
    # clipped first: a huge int would not fit a float32 (NaN stays NaN)
    share = float(np.float32(max(min(value, 2), -1)))
    check_shares(name, share, value)
    return share


def _check_jax_share(name: str, value: jax.Array) -> jax.Array:
    """A share given as a jax.Array, as float32: its dtype checked, its values in checked
    mode only."""
    if not any(jnp.issubdtype(value.dtype, kind) for kind in (jnp.floating, jnp.integer)):
        raise ValueError(f"{name} must hold real numbers, got dtype {value.dtype}")
    t = value if value.dtype == jnp.float32 else value.astype(jnp.float32)
    check_traced(lambda t: (t > 0) & (t <= 1), f"{name} {_SHARE_RULE}, got {{}}", t)
    return t


def threshold_per_head(threshold, q_heads: int) -> jax.Array:
    """The threshold as float32 `[Hq]`, checked to lie in (0, 1].

    A number applies to every query head; an array must hold one value per query head.
    Numbers, numpy values and arrays, and lists are checked on the host (and the device
    copy of a float is reused across calls). A jax.Array is checked for its dtype and shape
    only (its values in checked mode): reading it would wait for the device, or is
    impossible inside a trace.
    """
    # the common case, without numpy (docs/tuning.md: checks-host-time)
    if isinstance(threshold, float):
        return _device_values((check_share("threshold", threshold),) * q_heads)
    if isinstance(threshold, jax.Array):
        t = _check_jax_share("threshold", threshold)
        if t.ndim == 0:
            return jnp.broadcast_to(t, (q_heads,))
        _check_threshold_shape(t.shape, q_heads)
        return t
    t = real_host_array("threshold", threshold)
    if t.ndim:
        _check_threshold_shape(t.shape, q_heads)
    check_shares("threshold", t, threshold)
    return _device_values(tuple(np.broadcast_to(t, (q_heads,)).tolist()))


def scalar_threshold(threshold) -> jax.Array:
    """One threshold for all heads as float32 `[]`, checked like `threshold_per_head`."""
    if isinstance(threshold, float):  # the common case, as in threshold_per_head
        return _device_values(check_share("threshold", threshold))
    if isinstance(threshold, jax.Array):
        if threshold.ndim:
            raise ValueError(f"threshold must be one float, got shape {threshold.shape}")
        return _check_jax_share("threshold", threshold)
    t = real_host_array("threshold", threshold)
    if t.ndim:
        raise ValueError(f"threshold must be one float, got shape {t.shape}")
    check_shares("threshold", t, threshold)
    return _device_values(float(t))


def _check_threshold_shape(shape, q_heads: int) -> None:
    if shape != (q_heads,):
        raise ValueError(
            f"threshold must be a float or have one value per query head, shape ({q_heads},); "
            f"got shape {shape}")


@functools.lru_cache(maxsize=64)
def _device_values(values: tuple[float, ...] | float) -> jax.Array:
    """float32 `[len(values)]`, or `[]` for one float."""
    # A concrete array even when the first call comes inside a caller's jax.jit trace
    # (else the cache would keep that trace's tracer for every later call).
    with jax.ensure_compile_time_eval():
        return jnp.asarray(values, jnp.float32)


# --- arrays ------------------------------------------------------------------------------

def check_array(name: str, x, layout: str) -> None:
    """`x` is an array (jax, numpy, or a shape-and-dtype struct) of the rank of `layout`,
    which names its dimensions ("[B, Hq, n]", maybe followed by a remark)."""
    if not isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)):
        hint = " (torch tensors: use xattn_torch_bridge)" if type(x).__module__ == "torch" \
            else ""
        raise TypeError(f"{name} must be a jax.Array or numpy array {layout}, got "
                        f"{type(x).__name__}{hint}")
    rank = layout.split("]")[0].count(",") + 1  # the dimensions of layout's "[...]"
    if x.ndim != rank:
        raise ValueError(f"{name} must have rank {rank} {layout}, got shape {x.shape}")


def check_qk(q, k, *, stride, block_size, causal) -> Geometry:
    """Validates q `[B, Hq, Lq, D]` and k `[B, Hkv, Lk, D]` and the block layout.

    A stride or block size larger than the sequence is allowed: one block (or stride
    group) covers it all, and the missing tokens are padding, which changes nothing.
    """
    stride = check_tokens("stride", stride)
    block_size = check_tokens("block_size", block_size, stride, "stride")
    causal = check_flag("causal", causal)
    for name, x in (("q", q), ("k", k)):
        check_array(name, x, "[batch, heads, length, head_dim]")
        if jnp.dtype(x.dtype) not in SUPPORTED_DTYPES:
            hint = " (keys in fp8: pass xattn_jax.fp8.Fp8Keys, from quantize_keys)" \
                if name == "k" and jnp.dtype(x.dtype).itemsize == 1 else ""
            raise ValueError(f"{name} must be float32, bfloat16 or float16{hint}, got "
                             f"{jnp.dtype(x.dtype)}")
    if q.dtype != k.dtype:
        raise ValueError(f"q and k must have the same dtype, got {q.dtype} and {k.dtype}")
    (b, hq, lq, d), (bk, hkv, lk, dk) = q.shape, k.shape
    if b != bk:
        raise ValueError(f"q and k must have the same batch size, got {b} and {bk}")
    if d != dk:
        raise ValueError(f"q and k must have the same head_dim, got {d} and {dk}")
    if min(b, hq, hkv, d) < 1 or lq < 1:
        raise ValueError(f"q and k must be non-empty, got shapes {q.shape} and {k.shape}")
    if hq % hkv:
        raise ValueError(
            f"the query heads of q ({hq}) must be a multiple of the key heads of k ({hkv})")
    if lq > lk:
        raise ValueError(
            f"q may not be longer than k: the queries are the last Lq keys (Lq={lq}, Lk={lk})")
    if causal and (lk - lq) % block_size:
        raise ValueError(
            f"with causal=True, Lk - Lq must be a multiple of block_size so that query "
            f"blocks line up with key blocks (Lk={lk}, Lq={lq}, block_size={block_size})")
    return Geometry(b, hq, hkv, lq, lk, d, stride, block_size)


def check_float_array(name: str, x, layout: str) -> None:
    """A non-empty array of the rank of `layout` and a floating dtype (scores, block sums):
    like q and k of the estimate, no dimension may be 0."""
    check_array(name, x, layout)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{name} must be floats (float32, bfloat16, float16 or float64), "
                         f"got dtype {x.dtype}")
    if 0 in x.shape:
        raise ValueError(f"{name} must be non-empty (no dimension 0) {layout}, got shape "
                         f"{x.shape}")


def check_block_sums(block_sums) -> None:
    """Block sums `[B, Hq, qb, kb]` of a floating dtype, no more query than key blocks."""
    check_float_array("block_sums", block_sums, "[B, Hq, qb, kb]")
    if block_sums.shape[-2] > block_sums.shape[-1]:
        raise ValueError(f"block_sums may not have more query blocks than key blocks, "
                         f"got shape {block_sums.shape}")


# --- chunked prefill over a KV cache (kv_blocks) -----------------------------------------

def check_estimate_block_size(estimate_block_size, stride) -> int:
    """The block size of the estimate's block sums: a multiple of stride."""
    return check_tokens("estimate_block_size", estimate_block_size,
                        check_tokens("stride", stride), "stride")


def check_kv_sizes(kv_block_size, estimate_block_size, stride) -> None:
    """kv_block_size: a multiple of estimate_block_size, itself one of stride."""
    check_tokens("kv_block_size", kv_block_size,
                 check_estimate_block_size(estimate_block_size, stride), "estimate_block_size")


def cached_keys(q, k, block_table):
    """The cached keys' contiguous shape `[B, Hkv, capacity, D]` (k itself, or the
    view of a paged cache k through block_table), and the table as int32 (None without).

    A table given on the host (numpy, lists) or as a concrete jax.Array on the CPU has
    its page ids checked to lie in [0, num_pages); a traced table or one on a GPU is not
    read (that would wait for the device, and the bridge hands over tables that JAX may
    not read on their own): its ids are clamped into [0, num_pages), and checked in
    checked mode.
    """
    check_array("q", q, "[batch, heads, length, head_dim]")
    if block_table is None:
        if isinstance(k, (jax.Array, np.ndarray)) and k.ndim == 4 \
                and k.shape[0] != q.shape[0]:
            raise ValueError(
                f"k must be cached keys [B, Hkv, capacity, D] with q's batch size "
                f"({q.shape[0]}), got shape {k.shape}; a paged cache [num_pages, "
                f"page_size, Hkv, D] needs its block_table")
        return k, None
    check_array("k", k, "[num_pages, page_size, Hkv, D] (a paged cache, with block_table)")
    num_pages, page_size, kv_heads, head_dim = k.shape
    table = _check_block_table(block_table, q.shape[0], num_pages)
    keys = jax.ShapeDtypeStruct((q.shape[0], kv_heads, table.shape[1] * page_size, head_dim),
                                k.dtype)
    return keys, table


def _check_block_table(block_table, batch: int, num_pages: int) -> jax.Array:
    if not isinstance(block_table, jax.Array):
        if isinstance(block_table, (str, bytes)) or block_table is None:
            raise TypeError(f"block_table must be integers [batch, pages_per_seq], got "
                            f"{block_table!r}")
        try:
            block_table = np.asarray(block_table)
        except (TypeError, ValueError):  # ragged lists
            raise TypeError("block_table must be integers [batch, pages_per_seq], got a "
                            "ragged or non-numeric sequence") from None
    if block_table.dtype.kind not in "iu" or block_table.ndim != 2:
        raise ValueError(f"block_table must be integers [batch, pages_per_seq], got "
                         f"{block_table.dtype} {block_table.shape}")
    if block_table.shape[0] != batch:
        raise ValueError(f"block_table must have one row per batch element ({batch}), "
                         f"got {block_table.shape[0]}")
    rule = f"block_table's page ids must lie in [0, {num_pages}) (the pages of k)"
    if readable_on_host(block_table) and block_table.size:
        ids = np.asarray(block_table)
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= num_pages:
            raise ValueError(f"{rule}, got ids from {low} to {high}")
    # a jax.Array goes as it is (the jitted callee casts it): no host work per call
    table = block_table if isinstance(block_table, jax.Array) \
        else np.asarray(block_table, np.int32)
    check_traced(lambda table: (table >= 0) & (table < num_pages), rule + ", got {}", table)
    return table


def readable_on_host(x) -> bool:
    """Whether x's values can be read without a trace or a wait for an accelerator."""
    if isinstance(x, np.ndarray):
        return True
    if isinstance(x, jax.core.Tracer):
        return False
    return all(d.platform == "cpu" for d in x.devices())


def key_len(k_len, capacity: int):
    """k_len checked: None (the whole buffer) and an int in [1, capacity] as a Python int,
    or an integer scalar jax.Array (maybe traced; its value is checked in checked mode
    only) as int32. The jitted callee makes the int a device scalar: converting it here
    would cost host time on every call (docs/tuning.md: checks-host-time)."""
    if k_len is None:
        return capacity
    rule = f"k_len must lie in [1, {capacity}] (k's length)"
    if _is_int(k_len):
        if not 1 <= k_len <= capacity:
            raise ValueError(f"{rule}, got {k_len}")
        return int(k_len)
    if not isinstance(k_len, jax.Array):
        raise TypeError(f"k_len must be an int or a scalar integer jax.Array, got {k_len!r} "
                        f"({type(k_len).__name__})")
    if k_len.ndim or not jnp.issubdtype(k_len.dtype, jnp.integer):
        raise ValueError(f"k_len must be a scalar integer jax.Array, got {k_len.dtype} "
                         f"{k_len.shape}")
    # astype only where needed (docs/tuning.md: checks-host-time)
    n = k_len if k_len.dtype == jnp.int32 else k_len.astype(jnp.int32)
    check_traced(lambda n: (n >= 1) & (n <= capacity), rule + ", got {}", n)
    return n


def valid_counts(num_valid, batch: int, blocks: int):
    """Blocks in use per batch element (the first num_valid are), checked: a Python int
    (None: all n blocks), or int32 `[B]` (the jitted callee broadcasts an int).

    num_valid: None, an int, or ints of shape [] or [B] (numpy: checked on the host;
    jax.Array, maybe traced: checked in checked mode only).
    """
    if num_valid is None:
        return blocks
    rule = f"num_valid must lie in [1, {blocks}] (the blocks of scores)"
    if _is_int(num_valid):  # the common case, without numpy's checks
        if not 1 <= num_valid <= blocks:
            raise ValueError(f"{rule}, got {num_valid}")
        return int(num_valid)
    if isinstance(num_valid, jax.Array):
        counts = num_valid
    elif isinstance(num_valid, (np.ndarray, list, tuple)):
        counts = np.asarray(num_valid)
    else:
        raise TypeError(f"num_valid must be an int, or ints of shape [] or [{batch}], got "
                        f"{num_valid!r} ({type(num_valid).__name__})")
    if counts.dtype.kind not in "iu" or counts.shape not in ((), (batch,)):
        raise ValueError(f"num_valid must be an int, or ints of shape [] or [{batch}], got "
                         f"{counts.dtype} {counts.shape}")
    if isinstance(counts, np.ndarray):
        if not np.all((counts >= 1) & (counts <= blocks)):
            raise ValueError(f"{rule}, got {num_valid}")
        return np.broadcast_to(counts.astype(np.int32), (batch,))
    counts = jnp.broadcast_to(counts.astype(jnp.int32), (batch,))
    check_traced(lambda counts: (counts >= 1) & (counts <= blocks), rule + ", got {}",
                 counts)
    return counts


def kv_groups(heads: int, per_kv_head: bool, kv_heads) -> int:
    """G: the selection's groups of query heads (kv_heads of them with per_kv_head, else 1).

    kv_heads, the scores' KV heads, is checked whenever it is given (with per_kv_head or
    not): a positive integer dividing `heads`. per_kv_head needs it.
    """
    if kv_heads is None:
        if per_kv_head:
            raise ValueError(f"per_kv_head=True needs kv_heads, a divisor of the {heads} "
                             f"query heads, got None")
        return 1
    kv_heads = check_int("kv_heads", kv_heads)
    if heads % kv_heads:
        raise ValueError(f"kv_heads must divide the {heads} query heads of scores (query "
                         f"head h reads KV head h // (Hq // kv_heads)), got {kv_heads}")
    return kv_heads if per_kv_head else 1
