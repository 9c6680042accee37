"""xattn-jax: the XAttention block-sparse estimate as jit-compiled JAX with Pallas kernels.

Public API: `xattn_estimate` (the whole estimate), and its stages `strided_scores`,
`select_blocks`; `kv_block_scores` and `select_kv_blocks` (chunked prefill over a KV
cache); `block_sparse_attention` (attention on a block mask) and `xattention` (the
estimate, then that attention); `calibrate` (per-head thresholds for a model, from sample
text; it warns with `DensityNotReachedWarning` where its target cannot be reached);
`sampled_block_mass` (block scores from the exact attention of sampled query rows, which
`xattention(estimate="sampled-rows")` selects on); `xattn_jax.reference` is the plain-JAX
source of truth.
`ragged_xattention` runs XAttention for a whole serving step: many sequences' chunks and
decode rows packed in one call over one paged cache (`xattn_jax.ragged`).
`checked(fn)` runs `fn` with the values that are data (traced thresholds, key counts,
block tables) checked too. `quantize_keys` makes `Fp8Keys`, keys in fp8 that the
estimate's functions take in place of k (`xattn_jax.fp8`). `__version__`: the
distribution's version.
"""

from xattn_jax.api import select_blocks, strided_scores, xattn_estimate
from xattn_jax.attention import block_sparse_attention, xattention
from xattn_jax.calibrate import DensityNotReachedWarning, calibrate
from xattn_jax.checks import checked
from xattn_jax.fp8 import Fp8Keys, quantize_keys
from xattn_jax.geometry import Geometry
from xattn_jax.kv_blocks import kv_block_scores, select_kv_blocks
from xattn_jax.ragged import RaggedMask, ragged_xattention
from xattn_jax.sampled_rows import sampled_block_mass


def _version() -> str:
    """The installed distribution's version; in a source checkout that is not installed,
    its pyproject.toml's ("0+unknown" without one)."""
    import pathlib
    import tomllib
    from importlib import metadata

    try:
        return metadata.version("xattn-jax")
    except metadata.PackageNotFoundError:
        pyproject = pathlib.Path(__file__).parent.parent / "pyproject.toml"
        if not pyproject.is_file():
            return "0+unknown"
        with pyproject.open("rb") as f:
            return tomllib.load(f)["project"]["version"]


__version__ = _version()

__all__ = ["DensityNotReachedWarning", "Fp8Keys", "Geometry", "RaggedMask",
           "block_sparse_attention", "calibrate", "checked", "kv_block_scores",
           "quantize_keys", "ragged_xattention", "sampled_block_mass", "select_blocks",
           "select_kv_blocks", "strided_scores", "xattention", "xattn_estimate"]
