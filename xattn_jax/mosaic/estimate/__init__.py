"""The estimate's block sums on Hopper (docs/estimate.md sections 1-3): `plan` (the
call's plan, plain Python; its tuned rules in `heuristics`, its walk over tiles in
`grid`), `kernel` (the Mosaic GPU statistics kernel), `stats_epilogue` (their
normalization, one Triton-backend Pallas kernel) and `block_sums` (the jitted call)."""
