"""Test helper: the whole state of a PagedKVCache, to prove a refused call changed nothing."""

from __future__ import annotations

import pytest
import torch

from xattn_torch_bridge import PagedKVCache


def snapshot(cache: PagedKVCache):
    """Everything a refused call must leave unchanged: bookkeeping, all four pools and
    the copy counts, and a key shadow's pages and free list."""
    n = cache._next_id
    book = (tuple(a[:n].tolist() for a in (cache._alive, cache._resident, cache._slot,
                                           cache._tokens, cache._shadow)),
            list(cache._free), list(cache._free_cpu), n)
    pools = [x.clone() for x in (cache.keys, cache.values, cache.cpu_keys, cache.cpu_values)]
    if cache.shadow is not None:
        book += (list(cache.shadow._free),)
        pools += [x.clone() for x in (cache.shadow.values, cache.shadow.scales,
                                      cache.shadow.offsets)]
    return book, pools, dict(cache.copies)


def assert_same(before, after) -> None:
    assert before[0] == after[0] and before[2] == after[2]
    assert all(torch.equal(a, b) for a, b in zip(before[1], after[1], strict=True))


def assert_refused(cache: PagedKVCache, call, match: str, errors=ValueError) -> None:
    """call() raises one of `errors` matching `match`, and the cache is left as it was."""
    before = snapshot(cache)
    with pytest.raises(errors, match=match):
        call()
    assert_same(before, snapshot(cache))
