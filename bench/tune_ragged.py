"""Times the ragged block sums' tiles (docs/tuning.md: ragged-rows) on one chunk of 8192
queries over a 128K context, Llama-3.1-8B shapes (Hq 32, Hkv 8, D 128), 128-token pages
shuffled, random bf16 data, beside the per-request Mosaic estimate of the same chunk.

    python -m bench.tune_ragged

Each row: median device time (`bench.common.time_ms`); a tile that fails to compile or
run is printed as FAILED with the reason.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.common import log, time_ms  # noqa: E402
from xattn_jax import xattn_estimate  # noqa: E402
from xattn_jax.ragged.checks import check_step  # noqa: E402
from xattn_jax.ragged.layout import ragged_blocks  # noqa: E402
from xattn_jax.triton import ragged_block_sums as kernel  # noqa: E402
from xattn_jax.triton.plan import Tiles  # noqa: E402

Q_HEADS, KV_HEADS, HEAD_DIM, PAGE, CONTEXT, QUERIES = 32, 8, 128, 128, 131072, 8192
# (block_q, block_k, block_d, warps, stages), programs (None: as the scratch bound allows)
VARIANTS = (((64, 256, 64, 8, 4), None), ((128, 256, 64, 8, 4), None),
            ((64, 256, 64, 4, 3), None), ((128, 128, 64, 8, 3), None),
            ((128, 256, 64, 8, 4), 264))


def main() -> None:
    keys = jax.random.split(jax.random.PRNGKey(0), 2)
    pages = CONTEXT // PAGE
    cache = jax.random.normal(keys[0], (pages + 1, PAGE, KV_HEADS, HEAD_DIM), jnp.bfloat16)
    order = np.random.default_rng(0).permutation(pages + 1)[:pages].astype(np.int32)
    table = jnp.asarray(order[None])
    q = jax.random.normal(keys[1], (QUERIES, Q_HEADS, HEAD_DIM), jnp.bfloat16)
    kv_lens, cu = jnp.asarray([CONTEXT], jnp.int32), jnp.asarray([0, QUERIES], jnp.int32)
    geom = check_step(q, cache, cache, kv_lens, table, cu, 1, None, block_size=128,
                      stride=8)[0]
    blocks = ragged_blocks(cu, kv_lens, jnp.int32(1), jnp.int32(0), geom)

    def row(name, fn, args):
        try:
            jax.block_until_ready(fn(*args))
            print(f"{name}: {time_ms(fn, [args], reps=10):.3f} ms", flush=True)
        except Exception as error:  # noqa: BLE001 (a tile that does not compile)
            print(f"{name}: FAILED {type(error).__name__}: {str(error)[:300]}", flush=True)

    contiguous = (q.transpose(1, 0, 2)[None],
                  cache[order].reshape(CONTEXT, KV_HEADS, HEAD_DIM).transpose(1, 0, 2)[None])
    row("per request: xattn_estimate mosaic (block sums, selection)",
        jax.jit(lambda q, k: xattn_estimate(q, k, block_size=128, stride=8,
                                            impl="mosaic")[0]), contiguous)
    for (block_q, block_k, block_d, warps, stages), programs in VARIANTS:
        plan = kernel.plan_ragged(geom, jnp.bfloat16, interpret=False,
                                  tiles=Tiles(block_q, block_k, block_d, warps, stages),
                                  max_scratch_bytes=(1 << 30) if programs else None,
                                  programs=programs)
        log(f"{plan}")
        row(f"ragged rows {block_q} cols {block_k} warps {warps} stages {stages} "
            f"programs {plan.programs}",
            jax.jit(lambda q, k, t, plan=plan: kernel.ragged_block_sums(
                q, k, t, blocks, plan=plan, norm=1.0)), (q, cache, table))


if __name__ == "__main__":
    main()
