"""The public functions' default settings, each value named once.

Two selections differ on purpose. The estimate's own functions (`xattn_estimate`,
`select_blocks`) keep the original XAttention's rule: threshold 0.9 and no widening.
`xattention` and the transformers `register` use the rule chosen for a real model's
quality: threshold 0.95, `min_blocks` 4, `dense_last` 1. The same entry chose the block
size, stride and norm (docs/tuning.md: selection-defaults).
"""

BLOCK_SIZE = 128  # tokens per block; the Mosaic attention kernel's rows per CTA
STRIDE = 8  # tokens per antidiagonal group
NORM = 1.0  # no softmax temperature

# the original XAttention's selection: xattn_estimate's and select_blocks'
ORIGINAL_THRESHOLD = 0.9
NO_WIDENING = 0  # min_blocks and dense_last off

# xattention's and hf.register's selection
THRESHOLD = 0.95
MIN_BLOCKS = 4
DENSE_LAST = 1

# the block scores a selection may rest on: XAttention's strided antidiagonal estimate, or
# the exact attention of sampled query rows (xattn_jax.sampled_rows)
ESTIMATES = ("antidiagonal", "sampled-rows")
SAMPLED_ROWS = 16  # sampled rows per query block (docs/tuning.md: sampled-rows)

# calibrate's and hf.calibrate's mean density (docs/tuning.md: calibration)
TARGET_DENSITY = 0.3

# chunked prefill over a KV cache: kv_block_scores, select_kv_blocks, XAttentionPolicy
KV_BLOCK_SIZE = 4096
ESTIMATE_BLOCK_SIZE = 1024
KV_THRESHOLD = 0.95
