"""The public functions are forward only: they have no derivative.

`forward_only(fn, name)` is `fn` whose derivative (`jax.grad`, `jax.jvp`, `jax.vjp`,
`jax.linearize`) raises a TypeError naming the public function `name`, instead of a
failure deep inside the Pallas or partitioning machinery. A call whose inputs carry no
tangent (constants, or values under `jax.lax.stop_gradient`) is not differentiated and
runs as it is; the forward computation is `fn`'s, unchanged.
"""

from __future__ import annotations

from collections.abc import Callable

import jax


def forward_only(fn: Callable, name: str) -> Callable:
    """`fn(*arrays)` with a derivative rule that refuses, naming `name`."""
    wrapped = jax.custom_jvp(fn)

    @wrapped.defjvp
    def _no_derivative(primals, tangents):
        del primals, tangents
        raise TypeError(f"{name} is forward only: it has no derivative, so jax.grad, "
                        f"jax.jvp and jax.vjp cannot differentiate it (pass its inputs "
                        f"through jax.lax.stop_gradient where no gradient is meant to "
                        f"flow)")

    return wrapped
