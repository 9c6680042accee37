"""The demo and what it is built from: a structured synthetic long context
(`synthetic`), the exact recall of a block mask (`recall`) and the command line
(`cli`: `python -m xattn_jax`, the `xattn-demo` console script)."""

from xattn_jax.demo.cli import main

__all__ = ["main"]
