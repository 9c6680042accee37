"""Lowering for CUDA on a machine without a GPU, to check that the kernels compile as far
as jax's lowering goes (Mosaic GPU's layout inference included)."""

from __future__ import annotations

import contextlib

import jax


def lower_for_an_h200(fn, *args) -> str:
    """The text of the module jit lowers for CUDA, without a GPU. jax >= 0.11's
    Triton-backend lowering asks the device for its compute capability, which an abstract
    mesh of an H200 answers; older jax assumes compute capability 9.0."""
    target = contextlib.nullcontext()
    if hasattr(jax.sharding, "AbstractDevice"):
        target = jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh(
            (1,), ("one",), axis_types=(jax.sharding.AxisType.Auto,),
            abstract_device=jax.sharding.AbstractDevice("NVIDIA H200", None, "cuda")))
    with target:
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
