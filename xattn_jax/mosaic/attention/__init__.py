"""Block-sparse attention on Hopper (docs/estimate.md section 6): `plan` (the call's
tiles, plain Python), `kernel` (the Mosaic GPU kernel) and `block_sparse_attention` (the
jitted call: key-tile lists from the mask, padding, the kernel)."""
