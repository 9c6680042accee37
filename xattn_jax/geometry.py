"""Input validation and the derived sizes of one estimate call (ESTIMATE.md, Notation).

Every entry point checks its arguments here, so each rule is written once and each
error names the argument and the rule it broke.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (Triton tiles must have power-of-two sizes)."""
    return 1 << max(0, (n - 1).bit_length())


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Static sizes of one call. Hashable, so it can be a static jit argument.

    Token lengths are `q_len` (Lq) and `k_len` (Lk); "rows" and "cols" are positions in
    the strided (reshaped) space, where one row or column is a group of `stride` tokens.
    """

    batch: int
    q_heads: int
    kv_heads: int
    q_len: int
    k_len: int
    head_dim: int
    stride: int
    block_size: int

    @property
    def group(self) -> int:
        """Query heads per key head (GQA): query head h reads key head h // group."""
        return self.q_heads // self.kv_heads

    @property
    def q_rows(self) -> int:
        """Reshaped query rows that hold at least one real token: ceil(Lq / S)."""
        return -(-self.q_len // self.stride)

    @property
    def k_cols(self) -> int:
        """Reshaped key columns that hold at least one real token: ceil(Lk / S)."""
        return -(-self.k_len // self.stride)

    @property
    def block_rows(self) -> int:
        """A block's size in the reshaped space: block_size / S."""
        return self.block_size // self.stride

    @property
    def q_blocks(self) -> int:
        return -(-self.q_len // self.block_size)

    @property
    def k_blocks(self) -> int:
        return -(-self.k_len // self.block_size)

    @property
    def row_offset(self) -> int:
        """Reshaped key column of the first query row: (Lk - Lq) / S (causal calls only)."""
        return (self.k_len - self.q_len) // self.stride

    @property
    def scale(self) -> float:
        """1 / (sqrt(D) * S * norm) without norm; callers divide by norm."""
        return 1.0 / (math.sqrt(self.head_dim) * self.stride)


def check_qk(q, k, *, stride, block_size, causal) -> Geometry:
    """Validates q `[B, Hq, Lq, D]` and k `[B, Hkv, Lk, D]` and the block layout."""
    if not _is_int(stride) or stride < 1:
        raise ValueError(f"stride must be an integer >= 1, got {stride!r}")
    if not _is_int(block_size) or block_size < 1 or block_size % stride:
        raise ValueError(
            f"block_size must be a positive multiple of stride ({stride}), got {block_size!r}")
    for name, x in (("q", q), ("k", k)):
        if getattr(x, "ndim", None) != 4:
            raise ValueError(
                f"{name} must have rank 4 [batch, heads, length, head_dim], "
                f"got shape {getattr(x, 'shape', None)}")
        if jnp.dtype(x.dtype) not in SUPPORTED_DTYPES:
            raise ValueError(
                f"{name} must be float32, bfloat16 or float16, got {jnp.dtype(x.dtype)}")
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


def check_norm(norm) -> float:
    if isinstance(norm, bool) or not isinstance(norm, (int, float, np.floating)) \
            or not math.isfinite(norm) or norm <= 0:
        raise ValueError(f"norm must be a finite number > 0, got {norm!r}")
    return float(norm)


def check_scratch_bytes(max_scratch_bytes) -> int | None:
    if max_scratch_bytes is not None and (
            isinstance(max_scratch_bytes, bool)
            or not isinstance(max_scratch_bytes, (int, np.integer)) or max_scratch_bytes <= 0):
        raise ValueError(f"max_scratch_bytes must be None or a positive int of bytes, got "
                         f"{max_scratch_bytes!r}")
    return None if max_scratch_bytes is None else int(max_scratch_bytes)


def threshold_per_head(threshold, q_heads: int) -> jax.Array:
    """Returns the threshold as float32 `[Hq]`, checking it lies in (0, 1].

    A float applies to every query head; an array must hold one value per query head.
    Python floats and numpy arrays are checked on the host (and the device copy of a float
    is reused across calls). A jax.Array is checked for its shape only: reading its values
    would wait for the device (or is impossible inside a trace); its values are the
    caller's to keep in (0, 1].
    """
    if isinstance(threshold, bool):
        raise ValueError(f"threshold must be a float or an array of floats, got {threshold!r}")
    if isinstance(threshold, jax.Array):
        t = threshold.astype(jnp.float32)
        if t.ndim == 0:
            return jnp.broadcast_to(t, (q_heads,))
        _check_threshold_shape(t.shape, q_heads)
        return t
    if isinstance(threshold, float):  # the common case, without numpy's ~15 us per call
        value = np.float32(threshold)
        _check_threshold_range(0 < value <= 1, threshold)
        return _device_threshold((float(value),) * q_heads)
    t = np.asarray(threshold, np.float32)
    if t.ndim:
        _check_threshold_shape(t.shape, q_heads)
    _check_threshold_range(np.all((t > 0) & (t <= 1)), t)
    return _device_threshold(tuple(np.broadcast_to(t, (q_heads,)).tolist()))


def _check_threshold_shape(shape, q_heads: int) -> None:
    if shape != (q_heads,):
        raise ValueError(
            f"threshold must be a float or have one value per query head, shape ({q_heads},); "
            f"got shape {shape}")


def _check_threshold_range(inside, shown) -> None:
    if not inside:
        raise ValueError(f"threshold must lie in (0, 1], got {shown}")


@functools.lru_cache(maxsize=64)
def _device_threshold(values: tuple[float, ...]) -> jax.Array:
    # A concrete array even when the first call comes inside a caller's jax.jit trace
    # (else the cache would keep that trace's tracer for every later call).
    with jax.ensure_compile_time_eval():
        return jnp.asarray(values, jnp.float32)
