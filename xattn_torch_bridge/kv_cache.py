"""A small paged KV cache for one attention layer, with CPU-offloaded blocks.

Device pages use the layout of vLLM and nano-vllm, `[pages, block_size, Hkv, D]`, so the
estimate reads them in place through a block table (`xattn_jax.kv_block_scores`).

Blocks and handles. `allocate` returns block ids: stable handles, never reused, so a
freed id is told apart from an unknown one. A block is either resident (it has a device
slot, a page of `keys` and `values`) or offloaded (it has a CPU slot, a page of
`cpu_keys` and `cpu_values`); `offload` and `load` move it and keep its id. A sequence is
a list of block ids in order, all full but the last; `append` adds tokens to one.

Memory. `keys` is `[num_blocks + staging_slots, block_size, Hkv, D]` on the device: the
first num_blocks pages hold resident blocks, the last staging_slots pages are where
`stage_keys` copies the keys of offloaded blocks for an estimate (values are never
staged, so `values` is `[num_blocks, block_size, Hkv, D]`). The CPU pool is pinned
(page-locked) memory when the device is CUDA, so its copies can run asynchronously on a
side stream; plain memory otherwise.

Errors. Every method checks all of its arguments first and changes nothing unless all
checks pass: a ValueError (TypeError for a non-tensor) names the argument and the rule
(unknown or freed id, repeated id, offloaded or resident block where the other is
needed, wrong dtype, wrong head count or head_dim, out of capacity).

Stream order on CUDA. `append`, `offload` and `load` copy on torch's current stream;
`offload` and `load` wait for their copies (the CPU side is then complete).
`stage_keys` copies on the cache's side stream and returns an event; see its docstring.
"""

from __future__ import annotations

import torch
from xattn_jax.checks import check_int

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class PagedKVCache:
    """Paged keys and values of one layer: device pages plus optional CPU-offloaded blocks.

    Args:
      num_blocks: device pages for resident blocks.
      block_size: tokens per block.
      kv_heads, head_dim: Hkv and D of the keys and values.
      dtype: float32, bfloat16 or float16 (what the estimate takes).
      device: where the pages live; default "cuda" if torch sees a GPU, else "cpu".
      num_cpu_blocks: CPU slots for offloaded blocks (0: no offloading).
      staging_slots: device pages for the keys of offloaded blocks during an estimate;
        at most this many offloaded blocks per `stage_keys` call.
    """

    def __init__(self, num_blocks: int, block_size: int, kv_heads: int, head_dim: int, *,
                 dtype: torch.dtype = torch.bfloat16, device=None, num_cpu_blocks: int = 0,
                 staging_slots: int = 2):
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size),
                            ("kv_heads", kv_heads), ("head_dim", head_dim)):
            check_int(name, value)
        check_int("num_cpu_blocks", num_cpu_blocks, 0)
        check_int("staging_slots", staging_slots, 0)
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
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
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._free = list(range(num_blocks - 1, -1, -1))  # device slots; pop() -> lowest
        self._free_cpu = list(range(num_cpu_blocks - 1, -1, -1))
        self._where: dict[int, tuple[bool, int]] = {}  # id -> (resident, slot)
        self._tokens: dict[int, int] = {}
        self._next_id = 0

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
        return self._tokens[self._check_ids([block_id], "block_id")[0]]

    def is_resident(self, block_id: int) -> bool:
        """Whether the block has a device slot (False: it is offloaded)."""
        return self._where[self._check_ids([block_id], "block_id")[0]][0]

    def slot(self, block_id: int) -> int:
        """The device slot (page of `keys` and `values`) of a resident block."""
        (i,) = self._check_ids([block_id], "block_id")
        self._require([i], True, "block_id")
        return self._where[i][1]

    def kv(self, block_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's filled keys and values, each `[tokens, Hkv, D]`: views of the device
        pages of a resident block, of the CPU pool for an offloaded one. Read them only:
        writing through them bypasses the cache's checks."""
        (i,) = self._check_ids([block_id], "block_id")
        resident, slot = self._where[i]
        n = self._tokens[i]
        if resident:
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
        room = self.block_size - self._tokens[ids[-1]] if ids else 0
        if ids and min(room, count):
            self._require(ids[-1:], True, "block_ids (the last block, which has room)")
        new = -(-max(count - room, 0) // self.block_size)
        if new > len(self._free):
            raise ValueError(f"k: out of capacity: {count} tokens need {new} new blocks, "
                             f"{len(self._free)} device blocks free")
        first = len(ids) - 1 if room and count else len(ids)  # the first block written
        ids = ids + [self._new_block() for _ in range(new)]
        start = 0
        for i in ids[first:]:
            filled, slot = self._tokens[i], self._where[i][1]
            take = min(self.block_size - filled, count - start)
            self.keys[slot, filled:filled + take].copy_(k[start:start + take])
            self.values[slot, filled:filled + take].copy_(v[start:start + take])
            self._tokens[i] = filled + take
            start += take
        return ids

    def free(self, block_ids) -> None:
        """Frees the blocks (resident or offloaded); their ids become invalid."""
        for i in self._check_ids(block_ids, "block_ids"):
            resident, slot = self._where.pop(i)
            del self._tokens[i]
            (self._free if resident else self._free_cpu).append(slot)

    def offload(self, block_ids) -> None:
        """Moves resident blocks to CPU slots, freeing their device slots."""
        ids = self._check_ids(block_ids, "block_ids")
        self._require(ids, True, "block_ids")
        if len(ids) > len(self._free_cpu):
            raise ValueError(f"block_ids: out of CPU capacity: {len(ids)} blocks to "
                             f"offload, {len(self._free_cpu)} CPU blocks free")
        if self._stream is not None:  # a staging copy may still read a CPU slot
            torch.cuda.current_stream(self.device).wait_stream(self._stream)
        for i in ids:
            slot, cpu = self._where[i][1], self._free_cpu.pop()
            self.cpu_keys[cpu].copy_(self.keys[slot])
            self.cpu_values[cpu].copy_(self.values[slot])
            self._free.append(slot)
            self._where[i] = (False, cpu)

    def load(self, block_ids) -> None:
        """Moves offloaded blocks back to device slots, freeing their CPU slots."""
        ids = self._check_ids(block_ids, "block_ids")
        self._require(ids, False, "block_ids")
        if len(ids) > len(self._free):
            raise ValueError(f"block_ids: out of capacity: {len(ids)} blocks to load, "
                             f"{len(self._free)} device blocks free")
        for i in ids:
            cpu, slot = self._where[i][1], self._free.pop()
            self.keys[slot].copy_(self.cpu_keys[cpu])
            self.values[slot].copy_(self.cpu_values[cpu])
            self._free_cpu.append(cpu)
            self._where[i] = (True, slot)

    def sequence_length(self, block_ids) -> int:
        """The tokens held by a sequence's blocks (in order, all full but the last, which
        holds at least one): (len(block_ids) - 1) * block_size + tokens of the last."""
        ids = self._check_ids(block_ids, "block_ids")
        if not ids:
            raise ValueError("block_ids: a sequence holds at least one block")
        self._check_full(ids)
        if not self._tokens[ids[-1]]:
            raise ValueError(f"block_ids: the last block {ids[-1]} is empty")
        return (len(ids) - 1) * self.block_size + self._tokens[ids[-1]]

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
        offloaded = [i for i in ids if not self._where[i][0]]
        if len(offloaded) > self.staging_slots:
            raise ValueError(f"block_ids: {len(offloaded)} offloaded blocks but only "
                             f"{self.staging_slots} staging slots: load some blocks first, "
                             f"or build the cache with staging_slots >= {len(offloaded)}")
        staged = dict(zip(offloaded, range(self.num_blocks, self.num_blocks + len(offloaded))))
        if self._stream is None:
            for i, page in staged.items():
                self.keys[page].copy_(self.cpu_keys[self._where[i][1]])
            event = None
        else:
            with torch.cuda.stream(self._stream):
                for i, page in staged.items():
                    self.keys[page].copy_(self.cpu_keys[self._where[i][1]], non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        return [staged.get(i, self._where[i][1]) for i in ids], event

    # --- helpers ------------------------------------------------------------------------

    def _new_block(self) -> int:
        i, self._next_id = self._next_id, self._next_id + 1
        self._where[i] = (True, self._free.pop())
        self._tokens[i] = 0
        return i

    def _check_ids(self, block_ids, name: str) -> list[int]:
        """`block_ids` as a list of live, distinct ids, or a ValueError naming `name`."""
        if not isinstance(block_ids, (list, tuple, range)):
            raise ValueError(f"{name} must be a list of block ids, got {block_ids!r}")
        ids = list(block_ids)
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, int):
                raise ValueError(f"{name}: block ids are ints, got {i!r}")
            if i not in self._where:
                state = "was freed" if 0 <= i < self._next_id else "is unknown"
                raise ValueError(f"{name}: block {i} {state}")
        if len(set(ids)) != len(ids):
            raise ValueError(f"{name}: repeated block ids in {ids}")
        return ids

    def _check_full(self, ids: list[int]) -> None:
        for i in ids[:-1]:
            if self._tokens[i] != self.block_size:
                raise ValueError(f"block_ids: block {i} holds {self._tokens[i]} of "
                                 f"{self.block_size} tokens but is not the last block")

    def _require(self, ids: list[int], resident: bool, name: str) -> None:
        for i in ids:
            if self._where[i][0] != resident:
                state = "offloaded" if resident else "resident"
                raise ValueError(f"{name}: block {i} is {state}")

    def _check_tokens_tensor(self, name: str, x) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.ndim != 3 or tuple(x.shape[1:]) != (self.kv_heads, self.head_dim):
            raise ValueError(f"{name} must be [T, Hkv={self.kv_heads}, D={self.head_dim}], "
                             f"got shape {tuple(x.shape)}")
        if x.dtype != self.dtype:
            raise ValueError(f"{name} must have the cache's dtype {self.dtype}, got {x.dtype}")
