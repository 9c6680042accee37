"""xattn_torch_bridge: the XAttention estimate of `xattn_jax` for torch tensors.

Public API:
- `to_jax(tensor, copy=False)` / `to_torch(array)`: zero-copy, stream-ordered hand-off of
  one tensor (`xattn_torch_bridge.dlpack`); `cuda_available()` says whether CUDA tensors
  can be handed over in this process.
- `xattn_estimate(q, k, **kwargs)`: `xattn_jax.xattn_estimate` on torch tensors
  (`xattn_torch_bridge.estimate`).
- `block_sparse_attention(q, k, v, mask, **kwargs)` and `xattention(q, k, v, **kwargs)`:
  `xattn_jax`'s attention on a block mask and XAttention end to end, on torch tensors
  (`xattn_torch_bridge.attention`).
- `ragged_xattention(q, k, v, cu_seqlens_q=..., seqused_k=..., block_table=..., ...)`:
  XAttention for a whole serving step (packed chunks and decode rows over a paged cache)
  in the terms of vLLM's varlen call (`xattn_torch_bridge.ragged`).
- `PagedKVCache`: a paged KV cache of one layer (any page size, CPU offload, staging and
  a persistent device block table); `XAttentionPolicy`: the chunked-prefill selection of
  its pages in one jitted computation (`xattn_torch_bridge.policy`).
- torch.compile: the estimate and the policy's scoring and selection are torch custom
  ops (`torch.ops.xattn.estimate`, `.policy_scores`, `.policy_selection`), called by the
  public functions inside a compiled region, so `fullgraph=True` compiles them.
- `xattn_torch_bridge.reference`: an independent pure-torch reference of docs/estimate.md
  sections 1-5.

GPU memory. JAX's GPU client reserves 75% of the GPU's memory when it starts, which leaves
torch little room in the same process. Importing this package sets
XLA_PYTHON_CLIENT_PREALLOCATE=false (`os.environ.setdefault`), so JAX allocates on demand.
The variable is read when JAX initializes its GPU backend, which happens at its first
computation or device query, not at `import jax`: import the bridge before any JAX work.
If JAX's GPU backend was already started with preallocation on, the import warns
(RuntimeWarning) instead of failing, since nothing in-process can undo it; the fix is to
import the bridge earlier or to export XLA_PYTHON_CLIENT_PREALLOCATE=false. A value the
user set explicitly is respected.
"""

from __future__ import annotations

import os
import warnings

try:
    import torch  # noqa: F401  (the bridge's one dependency beyond xattn_jax's)
except ModuleNotFoundError as error:
    if error.name != "torch":  # torch is there but broken: its own error says why
        raise
    raise ModuleNotFoundError(
        "xattn_torch_bridge needs torch, which is not installed: pip install "
        "'xattn-jax[torch]'", name="torch") from error

PREALLOCATE = "XLA_PYTHON_CLIENT_PREALLOCATE"
_user_preallocate = os.environ.get(PREALLOCATE)
os.environ.setdefault(PREALLOCATE, "false")


def preallocation_warning(initialized: bool, has_gpu: bool, user_value: str | None,
                          allocator: str | None) -> str | None:
    """The warning to give when JAX's GPU client already reserved most of the GPU, else None.

    initialized / has_gpu: whether JAX's backends were started before this import, and
    with a GPU. user_value: XLA_PYTHON_CLIENT_PREALLOCATE as it was before this import.
    allocator: XLA_PYTHON_CLIENT_ALLOCATOR ("platform" never preallocates).
    """
    preallocated = user_value not in ("false", "False", "0") and allocator != "platform"
    if not (initialized and has_gpu and preallocated):
        return None
    return ("JAX's GPU backend was initialized before xattn_torch_bridge was imported, with "
            f"{PREALLOCATE} unset or true: JAX holds a fixed share of the GPU memory (75% "
            "by default) and torch allocations in this process may fail. Import "
            f"xattn_torch_bridge before any JAX computation, or export {PREALLOCATE}=false.")


def _warn_if_preallocated() -> None:
    import jax
    from jax._src import xla_bridge

    initialized = xla_bridge.backends_are_initialized()
    has_gpu = initialized and any(d.platform == "gpu" for d in jax.devices())
    message = preallocation_warning(initialized, has_gpu, _user_preallocate,
                                    os.environ.get("XLA_PYTHON_CLIENT_ALLOCATOR"))
    if message:
        warnings.warn(message, RuntimeWarning, stacklevel=2)


_warn_if_preallocated()

from xattn_torch_bridge import reference  # noqa: E402
from xattn_torch_bridge.attention import block_sparse_attention, xattention  # noqa: E402
from xattn_torch_bridge.dlpack import cuda_available, to_jax, to_torch  # noqa: E402
from xattn_torch_bridge.estimate import xattn_estimate  # noqa: E402
from xattn_torch_bridge.kv_cache import PagedKVCache  # noqa: E402
from xattn_torch_bridge.policy import XAttentionPolicy  # noqa: E402
from xattn_torch_bridge.ragged import ragged_xattention  # noqa: E402

__all__ = ["PagedKVCache", "XAttentionPolicy", "block_sparse_attention", "cuda_available",
           "ragged_xattention", "reference", "to_jax", "to_torch", "xattention",
           "xattn_estimate"]


def __dir__() -> list[str]:
    """The public names only; the helpers above and the submodules stay importable."""
    return sorted(__all__)
