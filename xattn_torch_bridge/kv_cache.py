"""A small paged KV cache for one attention layer, with CPU-offloaded blocks.

Device pages use the layout of vLLM and nano-vllm, `[pages, block_size, Hkv, D]`, so the
estimate reads them in place through a block table (`xattn_jax.kv_block_scores`). A block
is one page: `block_size` is the page size, any size from one token up (vLLM uses 16).

Blocks and handles. `allocate` returns block ids: stable handles, never reused, so a
freed id is told apart from an unknown one. A block is either resident (it has a device
slot, a page of `keys` and `values`) or offloaded (it has a CPU slot, a page of
`cpu_keys` and `cpu_values`); `offload` and `load` move it and keep its id. A sequence is
a list of block ids in order, all full but the last; `append` adds tokens to one.

Memory. `keys` is `[num_blocks + staging_slots, block_size, Hkv, D]` on the device: the
first num_blocks pages hold resident blocks, the last staging_slots pages are where
`stage_keys` and `block_table` copy the keys of offloaded blocks for an estimate (values
are never staged, so `values` is `[num_blocks, block_size, Hkv, D]`). The CPU pool is
pinned (page-locked) memory when the device is CUDA, so its copies can run asynchronously
on a side stream; plain memory otherwise. `copies` counts the pages copied between the
device and the CPU, by kind.

Key shadow. With `key_shadow="fp8"` the cache also keeps, on the device, an fp8 copy of
every live block's keys (`shadow`, a `key_shadow.KeyShadow`), written by `append` and
kept through `offload` and `load`; `shadow_table` addresses it, so an estimate over a
sequence with offloaded blocks reads no CPU page (`XAttentionPolicy.select_blocks` uses
it). Its memory is in the constructor's docstring.

Bookkeeping is held in numpy arrays indexed by block id, so the checks of a sequence of
thousands of small pages are a few vectorized operations, not a Python loop per block.

Errors. Every method checks all of its arguments first and changes nothing unless all
checks pass: a ValueError (TypeError for a non-tensor) names the argument and the rule
(unknown or freed id, repeated id, offloaded or resident block where the other is
needed, wrong dtype, wrong head count or head_dim, out of capacity).

Stream order on CUDA. `append`, `offload` and `load` copy on torch's current stream (with
a key shadow, `append` also quantizes the pages it wrote in one JAX computation ordered
after those copies, and copies the result into the shadow on the same stream);
`offload` and `load` wait for their copies (the CPU side is then complete).
`stage_keys` copies on the cache's side stream and returns an event; `block_table`
stages the same way and makes torch's current stream wait for it; see their docstrings.
"""

from __future__ import annotations

import collections

import numpy as np
import torch
from xattn_jax.checks import check_choice, check_int
from xattn_jax.geometry import cdiv

from xattn_torch_bridge import key_shadow as key_shadow_module
from xattn_torch_bridge.dlpack import current_stream

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INT_TYPES = frozenset({int, np.int32, np.int64})  # what a list of block ids may hold
_NONE = np.zeros(0, np.int64)  # no positions


def _check_device(device) -> torch.device:
    """The cache's device: None (CUDA if torch sees a GPU, else the CPU), or the CPU or a
    CUDA device torch sees; a CUDA device without an index gets the current one."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
        raise TypeError(f"device must be a torch.device, a string such as 'cuda:0', an int "
                        f"(a CUDA index) or None, got {device!r} ({type(device).__name__})")
    given = device
    try:
        device = torch.device(f"cuda:{device}" if isinstance(device, int) else device)
    except RuntimeError:  # an unknown device string, or a negative index
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be the CPU or a CUDA device, got {given!r}")
    if device.type == "cpu":
        return device
    if not torch.cuda.is_available():
        raise ValueError(f"device is {device}, but torch sees no CUDA GPU (torch "
                         f"{torch.__version__}, CUDA {torch.version.cuda}): pass device='cpu'")
    if device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    if device.index >= torch.cuda.device_count():
        raise ValueError(f"device is {device}, but torch sees {torch.cuda.device_count()} "
                         f"CUDA devices")
    return device


class _TableBuffer:
    """A persistent block table of one width: `table`, int32 `[width + 1]` on the device,
    written through its pinned host twin `host` on CUDA (one asynchronous copy per call,
    no allocation); on the CPU the host tensor is the table itself."""

    def __init__(self, width: int, device: torch.device):
        cuda = device.type == "cuda"
        self.index = device.index
        self.host = torch.zeros(width + 1, dtype=torch.int32, pin_memory=cuda)
        self.host_np = self.host.numpy()
        self.table = torch.zeros(width + 1, dtype=torch.int32, device=device) if cuda \
            else self.host
        self.copied = torch.cuda.Event() if cuda else None

    def write(self, pages: np.ndarray, tokens: int) -> None:
        """Fills the table (pages, padded with the first page, then `tokens`), its copy
        queued on torch's current stream."""
        if self.copied is not None:  # the last call's copy has read the host twin
            self.copied.synchronize()
        host, n = self.host_np, len(pages)
        host[:n] = pages
        host[n:-1] = pages[0]
        host[-1] = tokens
        if self.copied is not None:
            self.table.copy_(self.host, non_blocking=True)
            self.copied.record(current_stream(self.index))


def _check_width(width, blocks: int) -> None:
    if isinstance(width, bool) or not isinstance(width, int) or width < blocks:
        raise ValueError(f"width must be an int >= the {blocks} blocks, got {width!r}")


class PagedKVCache:
    """Paged keys and values of one layer: device pages plus optional CPU-offloaded blocks.

    Args:
      num_blocks: device pages for resident blocks.
      block_size: tokens per block (the page size).
      kv_heads, head_dim: Hkv and D of the keys and values.
      dtype: float32, bfloat16 or float16 (what the estimate takes).
      device: where the pages live: the CPU or a CUDA device torch sees (a torch.device,
        a string such as "cuda:0", or a CUDA index); default "cuda" if torch sees a GPU,
        else "cpu".
      num_cpu_blocks: CPU slots for offloaded blocks (0: no offloading).
      staging_slots: device pages for the keys of offloaded blocks during an estimate;
        at most this many offloaded blocks per `stage_keys` or `block_table` call.
      key_shadow: None, or "fp8": keep an fp8 copy of every live block's keys on the
        device (module docstring; `shadow_table`). Memory: (num_blocks + num_cpu_blocks)
        * block_size * Hkv * (D + 4 (D + 1) / group) bytes, group = 16 tokens where it
        divides block_size, else block_size: a quarter of the bytes of K and V in bf16
        for the values, plus the scales and offsets (31% in all at D = 128).

    Attributes: `copies`, a `collections.Counter` of the pages copied between the device
    and the CPU: "offload" (K and V to the CPU), "load" (K and V back), "stage" (keys of
    offloaded blocks into staging pages).
    """

    def __init__(self, num_blocks: int, block_size: int, kv_heads: int, head_dim: int, *,
                 dtype: torch.dtype = torch.bfloat16, device=None, num_cpu_blocks: int = 0,
                 staging_slots: int = 2, key_shadow: str | None = None):
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size),
                            ("kv_heads", kv_heads), ("head_dim", head_dim)):
            check_int(name, value)
        check_int("num_cpu_blocks", num_cpu_blocks, 0)
        check_int("staging_slots", staging_slots, 0)
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
        if key_shadow is not None:
            check_choice("key_shadow", key_shadow, key_shadow_module.CHOICES)
        device = _check_device(device)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.kv_heads, self.head_dim = kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self.staging_slots = staging_slots
        page = (block_size, kv_heads, head_dim)
        self.keys = torch.zeros(num_blocks + staging_slots, *page, dtype=dtype, device=device)
        self.values = torch.zeros(num_blocks, *page, dtype=dtype, device=device)
        pin = device.type == "cuda"
        self.cpu_keys = torch.zeros(num_cpu_blocks, *page, dtype=dtype, pin_memory=pin)
        self.cpu_values = torch.zeros(num_cpu_blocks, *page, dtype=dtype, pin_memory=pin)
        self.shadow = None if key_shadow is None else key_shadow_module.KeyShadow(
            num_blocks + num_cpu_blocks, block_size, kv_heads, head_dim, device)
        self.copies = collections.Counter()
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._free = list(range(num_blocks - 1, -1, -1))  # device slots; pop() -> lowest
        self._free_cpu = list(range(num_cpu_blocks - 1, -1, -1))
        # per block id (ids < _next_id): live, resident, slot (device or CPU), tokens,
        # shadow page (with a key shadow)
        self._alive = np.zeros(0, bool)
        self._resident = np.zeros(0, bool)
        self._slot = np.zeros(0, np.int64)
        self._tokens = np.zeros(0, np.int64)
        self._shadow = np.zeros(0, np.int64)
        self._next_id = 0
        self._tables: dict[tuple[str, int], _TableBuffer] = {}  # by (kind, width)

    # --- queries ------------------------------------------------------------------------

    @property
    def free_blocks(self) -> int:
        """Device slots free for new or loaded blocks."""
        return len(self._free)

    @property
    def free_cpu_blocks(self) -> int:
        """CPU slots free for offloaded blocks."""
        return len(self._free_cpu)

    def tokens(self, block_id: int) -> int:
        """How many of the block's `block_size` positions hold tokens."""
        return int(self._tokens[self._check_ids([block_id], "block_id")[0]])

    def is_resident(self, block_id: int) -> bool:
        """Whether the block has a device slot (False: it is offloaded)."""
        return bool(self._resident[self._check_ids([block_id], "block_id")[0]])

    def slot(self, block_id: int) -> int:
        """The device slot (page of `keys` and `values`) of a resident block."""
        ids = self._check_ids([block_id], "block_id")
        self._require(ids, True, "block_id")
        return int(self._slot[ids[0]])

    def shadow_page(self, block_id: int) -> int:
        """The page of `shadow` holding the block's fp8 keys (a cache with a key shadow)."""
        self._require_shadow()
        return int(self._shadow[self._check_ids([block_id], "block_id")[0]])

    def kv(self, block_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's filled keys and values, each `[tokens, Hkv, D]`: views of the device
        pages of a resident block, of the CPU pool for an offloaded one. Read them only:
        writing through them bypasses the cache's checks."""
        (i,) = self._check_ids([block_id], "block_id")
        slot, n = int(self._slot[i]), int(self._tokens[i])
        if self._resident[i]:
            return self.keys[slot, :n], self.values[slot, :n]
        return self.cpu_keys[slot, :n], self.cpu_values[slot, :n]

    # --- changes ------------------------------------------------------------------------

    def allocate(self, n: int) -> list[int]:
        """n new empty resident blocks; returns their ids."""
        check_int("n", n, 0)
        if n > len(self._free):
            raise ValueError(f"n: out of capacity: {n} blocks asked, {len(self._free)} "
                             f"device blocks free")
        return [self._new_block() for _ in range(n)]

    def append(self, block_ids, k: torch.Tensor, v: torch.Tensor) -> list[int]:
        """Appends tokens to a sequence; returns its block ids, new blocks included.

        block_ids: the sequence's blocks in order (empty for a new sequence); all but the
          last must be full; the last must be resident if it has room.
        k, v: `[T, Hkv, D]` keys and values of T new tokens, in the cache's dtype (any
          device: they are copied, detached). They fill the last block, then new resident
          blocks.
        """
        ids = self._check_ids(block_ids, "block_ids")
        for name, x in (("k", k), ("v", v)):
            self._check_tokens_tensor(name, x)
        if k.shape[0] != v.shape[0]:
            raise ValueError(f"k and v must hold the same number of tokens, got "
                             f"{k.shape[0]} and {v.shape[0]}")
        self._check_full(ids)
        k, v, count = k.detach(), v.detach(), k.shape[0]
        room = self.block_size - int(self._tokens[ids[-1]]) if len(ids) else 0
        if len(ids) and min(room, count):
            self._require(ids[-1:], True, "block_ids (the last block, which has room)")
        new = cdiv(max(count - room, 0), self.block_size)
        if new > len(self._free):
            raise ValueError(f"k: out of capacity: {count} tokens need {new} new blocks, "
                             f"{len(self._free)} device blocks free")
        first = len(ids) - 1 if room and count else len(ids)  # the first block written
        ids = ids.tolist() + [self._new_block() for _ in range(new)]
        start = 0
        for i in ids[first:]:
            filled, slot = int(self._tokens[i]), int(self._slot[i])
            take = min(self.block_size - filled, count - start)
            self.keys[slot, filled:filled + take].copy_(k[start:start + take])
            self.values[slot, filled:filled + take].copy_(v[start:start + take])
            self._tokens[i] = filled + take
            start += take
        written = ids[first:]
        if self.shadow is not None and written:  # the pages' fp8 keys, from their keys
            self.shadow.write(self.keys, self._slot[written].tolist(),
                              self._tokens[written].tolist(), self._shadow[written].tolist())
        return ids

    def free(self, block_ids) -> None:
        """Frees the blocks (resident or offloaded); their ids become invalid."""
        for i in self._check_ids(block_ids, "block_ids").tolist():
            self._alive[i] = False
            (self._free if self._resident[i] else self._free_cpu).append(int(self._slot[i]))
            if self.shadow is not None:
                self.shadow.release(int(self._shadow[i]))

    def offload(self, block_ids) -> None:
        """Moves resident blocks to CPU slots, freeing their device slots."""
        ids = self._check_ids(block_ids, "block_ids")
        self._require(ids, True, "block_ids")
        if len(ids) > len(self._free_cpu):
            raise ValueError(f"block_ids: out of CPU capacity: {len(ids)} blocks to "
                             f"offload, {len(self._free_cpu)} CPU blocks free")
        if self._stream is not None:  # a staging copy may still read a CPU slot
            current_stream(self.device.index).wait_stream(self._stream)
        for i in ids.tolist():
            slot, cpu = int(self._slot[i]), self._free_cpu.pop()
            self.cpu_keys[cpu].copy_(self.keys[slot])
            self.cpu_values[cpu].copy_(self.values[slot])
            self._free.append(slot)
            self._resident[i], self._slot[i] = False, cpu
        self.copies["offload"] += len(ids)

    def load(self, block_ids) -> None:
        """Moves offloaded blocks back to device slots, freeing their CPU slots."""
        ids = self._check_ids(block_ids, "block_ids")
        self._require(ids, False, "block_ids")
        if len(ids) > len(self._free):
            raise ValueError(f"block_ids: out of capacity: {len(ids)} blocks to load, "
                             f"{len(self._free)} device blocks free")
        for i in ids.tolist():
            cpu, slot = int(self._slot[i]), self._free.pop()
            self.keys[slot].copy_(self.cpu_keys[cpu])
            self.values[slot].copy_(self.cpu_values[cpu])
            self._free_cpu.append(cpu)
            self._resident[i], self._slot[i] = True, slot
        self.copies["load"] += len(ids)

    def sequence_length(self, block_ids) -> int:
        """The tokens held by a sequence's blocks (in order, all full but the last, which
        holds at least one): (len(block_ids) - 1) * block_size + tokens of the last."""
        return self._check_sequence(self._check_ids(block_ids, "block_ids"))

    def stage_keys(self, block_ids) -> tuple[list[int], torch.cuda.Event | None]:
        """The page of `keys` holding each block's keys, staging offloaded blocks.

        Resident blocks give their device slot. The keys of offloaded blocks are copied
        into the staging pages (the last `staging_slots` pages of `keys`, reused by every
        call), at most staging_slots of them. On CUDA the copies run on the cache's side
        stream, overlapping work queued on torch's current stream, and the returned event
        is recorded after them: make the reader wait for it
        (`torch.cuda.current_stream().wait_event(event)`), and let it finish before the
        next call overwrites the staging pages. On the CPU the copies are done on return
        and the event is None.
        """
        ids = self._check_ids(block_ids, "block_ids")
        pages, event = self._stage(ids, self._check_staging(ids))
        return pages.tolist(), event

    def block_table(self, block_ids, width: int) -> torch.Tensor:
        """A sequence's block table for one estimate: int32 `[width + 1]` on the device.

        Entries 0..n-1 are the pages of `keys` holding the keys of the n blocks of
        `block_ids` (a sequence: in order, all full but the last, which holds at least
        one token), offloaded blocks staged as by `stage_keys`; entries n..width-1 repeat
        the first page (padding: a reader masks them by the token count); entry `width`
        is the sequence's token count. width >= n.

        Order of work on CUDA: the staging copies are issued first, on the side stream;
        then the table is written into a pinned host buffer and copied, asynchronously,
        into a device buffer on torch's current stream; then the current stream waits for
        the staging copies. Work queued on the current stream afterwards (an estimate
        ordered after it by `to_jax`) sees the staged keys and the table, and the copies
        overlap whatever the current stream was still running. No device or host sync
        (the host waits only if the previous copy of this width's pinned buffer is still
        pending).

        The returned tensor is the cache's buffer for this width, overwritten by the next
        call of the same width: the reader must have finished (or be ordered on the current
        stream before that call's copy) by then, as for the staging pages. On the CPU the
        copies are done on return.
        """
        ids = self._check_ids(block_ids, "block_ids")
        tokens = self._check_sequence(ids)
        offloaded = self._check_staging(ids)
        _check_width(width, len(ids))
        pages, event = self._stage(ids, offloaded)
        return self._table("keys", width, pages, tokens, event)

    def step_args(self, seqs) -> dict:
        """The keyword arguments of `ragged_xattention` for one step over these sequences:
        `cu_seqlens_q`, `max_seqlen_q`, `seqused_k`, `max_seqlen_k` and `block_table`
        (int32 tensors on the cache's device, the page table of device slots).

        seqs: `(block_ids, q_len)` per request, in the order of the step's queries:
        the sequence's blocks (in order, all full but the last, all resident: `load`
        offloaded ones first) and how many of its last tokens are this step's queries
        (the chunk's keys appended already; 1 for a decode row). The table's width is
        the most blocks of a request; entries past a request's blocks repeat its first.
        """
        if not isinstance(seqs, (list, tuple)) or not seqs:
            raise ValueError(f"seqs must be a non-empty list of (block_ids, q_len), got "
                             f"{seqs!r}")
        pages, q_lens, kv_lens = [], [], []
        for i, item in enumerate(seqs):
            if not isinstance(item, (list, tuple)) or len(item) != 2:
                raise ValueError(f"seqs[{i}] must be (block_ids, q_len), got {item!r}")
            ids = self._check_ids(item[0], f"seqs[{i}] block_ids")
            tokens = self._check_sequence(ids)
            self._require(ids, True, f"seqs[{i}] block_ids")
            q_len = check_int(f"seqs[{i}] q_len", item[1], 0)
            if q_len > tokens:
                raise ValueError(f"seqs[{i}] q_len must be at most the sequence's {tokens} "
                                 f"tokens (its queries are its last tokens), got {q_len}")
            pages.append(self._slot[ids])
            q_lens.append(q_len)
            kv_lens.append(tokens)
        width = max(len(p) for p in pages)
        table = np.stack([np.pad(p, (0, width - len(p)), mode="edge") for p in pages])
        cu = np.concatenate([[0], np.cumsum(q_lens)])

        def tensor(x):
            return torch.as_tensor(np.asarray(x, np.int32)).to(self.device, non_blocking=True)

        return dict(cu_seqlens_q=tensor(cu), max_seqlen_q=max(q_lens),
                    seqused_k=tensor(kv_lens), max_seqlen_k=max(kv_lens),
                    block_table=tensor(table))

    def shadow_table(self, block_ids, width: int) -> torch.Tensor:
        """A sequence's block table of its shadow pages: int32 `[width + 1]` on the device.

        As `block_table`, with the pages of `shadow` holding the blocks' fp8 keys (the
        paged layout of `xattn_jax.fp8.Fp8Keys`), resident and offloaded blocks alike:
        nothing is staged or copied but the table. The buffer is this width's shadow
        table, overwritten by the next call of the same width. Needs key_shadow="fp8".
        """
        self._require_shadow()
        ids = self._check_ids(block_ids, "block_ids")
        tokens = self._check_sequence(ids)
        _check_width(width, len(ids))
        return self._table("shadow", width, self._shadow[ids], tokens, None)

    # --- helpers ------------------------------------------------------------------------

    def _table(self, kind: str, width: int, pages: np.ndarray, tokens: int,
               event: torch.cuda.Event | None) -> torch.Tensor:
        """The persistent table buffer of (kind, width), written with pages and tokens;
        torch's current stream then waits for `event` (staging copies), if any."""
        table = self._tables.get((kind, width))
        if table is None:
            table = self._tables[kind, width] = _TableBuffer(width, self.device)
        table.write(pages, tokens)
        if event is not None:
            current_stream(self.device.index).wait_event(event)
        return table.table

    def _require_shadow(self) -> None:
        if self.shadow is None:
            raise ValueError("key_shadow: this cache keeps no key shadow; build it with "
                             "PagedKVCache(..., key_shadow='fp8')")

    def _new_block(self) -> int:
        i, self._next_id = self._next_id, self._next_id + 1
        if i == len(self._alive):  # grow the bookkeeping by doubling
            grow = max(16, i)
            self._alive, self._resident, self._slot, self._tokens, self._shadow = (
                np.concatenate([a, np.zeros(grow, a.dtype)])
                for a in (self._alive, self._resident, self._slot, self._tokens,
                          self._shadow))
        self._alive[i], self._resident[i] = True, True
        self._slot[i], self._tokens[i] = self._free.pop(), 0
        if self.shadow is not None:
            self._shadow[i] = self.shadow.take()
        return i

    def _check_ids(self, block_ids, name: str) -> np.ndarray:
        """`block_ids` as int64 `[n]` of live, distinct ids, or a ValueError naming `name`.
        A list, tuple or range of ints, or a 1-D integer numpy array."""
        if isinstance(block_ids, np.ndarray):
            if block_ids.ndim != 1 or block_ids.dtype.kind not in "iu":
                raise ValueError(f"{name}: a numpy array of block ids must be 1-D integers, "
                                 f"got {block_ids.dtype} {block_ids.shape}")
            ids = block_ids.astype(np.int64, copy=False)
        elif isinstance(block_ids, (list, tuple, range)):
            if not _INT_TYPES.issuperset(map(type, block_ids)):
                bad = next(i for i in block_ids if type(i) not in _INT_TYPES)
                raise ValueError(f"{name}: block ids are ints, got {bad!r}")
            ids = np.fromiter(block_ids, np.int64, len(block_ids))
        else:
            raise ValueError(f"{name} must be a list of block ids, got {block_ids!r}")
        # the usual sequence, increasing ids (distinct, and in range if its ends are), in
        # four vectorized steps; anything else takes the general check
        if len(ids) and not (0 <= ids[0] and ids[-1] < self._next_id
                             and (ids[1:] > ids[:-1]).all() and self._alive[ids].all()):
            self._check_any_ids(ids, name)
        return ids

    def _check_any_ids(self, ids: np.ndarray, name: str) -> None:
        """The ValueError for ids (int64 `[n]`) that are unknown, freed or repeated."""
        known = (ids >= 0) & (ids < self._next_id)
        live = known.copy()
        live[known] = self._alive[ids[known]]
        if not live.all():
            i = int(ids[np.argmin(live)])
            state = "was freed" if 0 <= i < self._next_id else "is unknown"
            raise ValueError(f"{name}: block {i} {state}")
        ordered = np.sort(ids)
        if (ordered[1:] == ordered[:-1]).any():
            raise ValueError(f"{name}: repeated block ids in {ids.tolist()}")

    def _check_full(self, ids: np.ndarray, tokens: np.ndarray | None = None) -> None:
        """ids (tokens: theirs, if read already) all full but the last."""
        partial = (self._tokens[ids[:-1]] if tokens is None else tokens[:-1]) != self.block_size
        if partial.any():
            i = int(ids[:-1][np.argmax(partial)])
            raise ValueError(f"block_ids: block {i} holds {self._tokens[i]} of "
                             f"{self.block_size} tokens but is not the last block")

    def _check_sequence(self, ids: np.ndarray) -> int:
        """The tokens of the sequence `ids` (checked: non-empty, full but the last block,
        which holds at least one)."""
        if not len(ids):
            raise ValueError("block_ids: a sequence holds at least one block")
        tokens = self._tokens[ids]
        self._check_full(ids, tokens)
        last = int(tokens[-1])
        if not last:
            raise ValueError(f"block_ids: the last block {ids[-1]} is empty")
        return (len(ids) - 1) * self.block_size + last

    def _check_staging(self, ids: np.ndarray) -> np.ndarray:
        """The positions in ids of offloaded blocks (int64), at most staging_slots."""
        resident = self._resident[ids]
        if resident.all():
            return _NONE
        offloaded = np.flatnonzero(~resident)
        if len(offloaded) > self.staging_slots:
            raise ValueError(f"block_ids: {len(offloaded)} offloaded blocks but only "
                             f"{self.staging_slots} staging slots: load some blocks first, "
                             f"or build the cache with staging_slots >= {len(offloaded)}")
        return offloaded

    def _stage(self, ids: np.ndarray, offloaded: np.ndarray
               ) -> tuple[np.ndarray, torch.cuda.Event | None]:
        """The pages of `ids` with the offloaded blocks (positions `offloaded`, from
        `_check_staging`) copied into the staging pages: on the side stream and an event
        after the copies on CUDA, done on return and None on the CPU."""
        pages = self._slot[ids]  # a new array (fancy indexing)
        if not len(offloaded):
            return pages, None
        staging = range(self.num_blocks, self.num_blocks + len(offloaded))
        self.copies["stage"] += len(offloaded)
        if self._stream is None:
            for j, page in zip(offloaded.tolist(), staging):
                self.keys[page].copy_(self.cpu_keys[pages[j]])
                pages[j] = page
            return pages, None
        with torch.cuda.stream(self._stream):
            for j, page in zip(offloaded.tolist(), staging):
                self.keys[page].copy_(self.cpu_keys[pages[j]], non_blocking=True)
                pages[j] = page
        event = torch.cuda.Event()
        event.record(self._stream)
        return pages, event

    def _require(self, ids: np.ndarray, resident: bool, name: str) -> None:
        wrong = self._resident[ids] != resident
        if wrong.any():
            state = "offloaded" if resident else "resident"
            raise ValueError(f"{name}: block {ids[np.argmax(wrong)]} is {state}")

    def _check_tokens_tensor(self, name: str, x) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.ndim != 3 or tuple(x.shape[1:]) != (self.kv_heads, self.head_dim):
            raise ValueError(f"{name} must be [T, Hkv={self.kv_heads}, D={self.head_dim}], "
                             f"got shape {tuple(x.shape)}")
        if x.dtype != self.dtype:
            raise ValueError(f"{name} must have the cache's dtype {self.dtype}, got {x.dtype}")
