"""`python -m xattn_jax`: the demo (see `xattn_jax.demo`)."""

from xattn_jax.demo import main

main()
