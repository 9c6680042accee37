"""Partitioning rules: under a caller's `jax.jit` over arrays sharded on several devices,
each kernel call runs on every device's own shard of batch and heads.

XLA cannot split a Pallas call, so without a rule it gathers the call's operands onto
every device and runs the whole call on each. `on_shards` wraps a jitted core (a Pallas
call or the reference) in `jax.experimental.custom_partitioning` with a rule that both
partitioners honour: Shardy (JAX's default) propagates shardings with `sharding_rule`,
GSPMD with the callbacks, and both then partition with the same `partition` callback,
which runs the core on each device's shard. On one device the core runs as it is; inside
a caller's `shard_map`, on that shard_map's local arrays (mesh axes it leaves automatic
are XLA's to partition: a Pallas call is gathered over them; the kernels type their
outputs as varying over their inputs' manual axes, `kernel_output`, so `check_vma` may
stay on, but for Pallas interpret mode, whose gathers JAX's check refuses there); under
`jax.vmap`, batched and unpartitioned (sharded operands are then gathered). Meshes with
`AxisType.Explicit` axes (sharding in types) are not supported.

Layouts. Each operand of a core is described by a string naming its axes: "B" batch,
"H" query heads, "K" KV heads (query head h reads KV head h // G, G = Hq / Hkv), "." any
other axis, a trailing "..." every remaining axis, "" a scalar. For example q
`[B, Hq, Lq, D]` is "B H ...", k `[B, Hkv, Lk, D]` "B K ...", a paged cache
`[num_pages, page_size, Hkv, D]` ". . K .", a block table `[B, pages_per_seq]` "B ...",
a per-head threshold `[Hq]` "H". Every result is `[B, Hq, ...]`.

The rule, from the operands' shardings:
- batch keeps the sharding of the first operand whose batch axis is sharded; heads keep
  that of the first operand whose query- or KV-head axis is sharded, over mesh axes the
  batch does not use. Both stay local: the results are sharded the same way, and no
  collective is needed when the other operands arrive sharded alike (or replicated: a
  replicated operand is sliced locally).
- whole KV groups: when n, the number of head shards, divides Hkv, the KV-head axes
  shard with the query heads (GQA 32:8 on 2, 4 or 8 devices);
- heads split inside a KV group: when n is a multiple of Hkv (and divides Hq), each
  device's query heads read one KV head. The KV operands are then read whole on every
  device (replicated over the head axes; an all-gather of them if they arrive sharded)
  and each device copies out its KV head (1/Hkv of k or of the page pool) before the
  kernel;
- any other head count (n neither divides nor is a multiple of Hkv, or does not divide
  Hq): heads are gathered, every device computes all heads of its batch shard (cost: an
  all-gather of the head-sharded operands, and no speed-up from the head axes);
- every other axis (sequence, head dim, pages, tables' columns) is gathered: a
  sequence-sharded q or k costs an all-gather of it along that axis before the call.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, Sequence

import jax
from jax.experimental.custom_partitioning import (ArrayMapping, CompoundFactor,
                                                  SdyShardingRule, custom_partitioning)
from jax.sharding import NamedSharding, PartitionSpec

from xattn_jax.forward_only import forward_only

BATCH, Q_HEADS, KV_HEADS, OTHER, REST = "B", "H", "K", ".", "..."
FUSED_KV = "F"  # a fused cache's head axis: 2 Hkv entries, K and V of each KV head
RESULT_LAYOUT = "B H ..."
# Shardy factor names of the axes that shard; every other axis gets its own factor that
# needs replication
_FACTORS = {BATCH: "b", Q_HEADS: "hq", KV_HEADS: "hk"}
_PAIR_FACTOR = "kv_pair"  # the K/V pair inside a fused axis: never split


def on_shards(core: Callable, layouts: Sequence[str], *, name: str, geom=None,
              results: str | Sequence[str] = RESULT_LAYOUT, **static) -> Callable:
    """`core` with partitioning rules: returns `fn(*operands)` = `core(*operands, **static)`,
    forward only (`xattn_jax.forward_only`).

    core: a function of arrays (None allowed, passed through) and keyword arguments.
    layouts: one layout string per operand (module docstring).
    results: the layout of every result (default `[B, Hq, ...]`), or one per result in
      the order `jax.tree.flatten` gives them.
    name: the public function that runs core, named by the error a derivative raises.
    geom: a `Geometry` passed to core as `geom=`; on each shard, its batch and head counts
      become the shard's.
    static: the core's other keyword arguments (hashable: flags, sizes), closed over.
    Operands are data (a threshold, a key count): new values do not recompile.
    """
    results = results if isinstance(results, str) else tuple(results)
    return functools.partial(_run, core, tuple(layouts), results, geom,
                             tuple(sorted(static.items())), name)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4, 5))
def _run(core, layouts, result_layouts, geom, static_items, name, *operands):
    """core(*operands) as a custom_partitioning call (None operands stay out of it), in a
    custom_vmap whose batching rule vmaps the core itself, forward only."""
    if len(operands) != len(layouts):
        raise ValueError(f"{len(operands)} operands for {len(layouts)} layouts")
    static = dict(static_items)
    present = [i for i, x in enumerate(operands) if x is not None]
    arrays = [operands[i] for i in present]
    names = [_axis_names(layouts[i], operands[i].ndim) for i in present]

    def call(arrays, geom):
        full = list(operands)
        for i, x in zip(present, arrays):
            full[i] = x
        return core(*full, **static, **({} if geom is None else {"geom": geom}))

    mesh = jax.sharding.get_abstract_mesh()
    if mesh.manual_axes:  # inside a caller's shard_map: the arrays are this shard's; axes
        # left automatic there are XLA's to partition
        return forward_only(lambda *xs: call(xs, geom), name)(*arrays)
    results, result_tree = jax.tree.flatten(jax.eval_shape(lambda *xs: call(xs, geom),
                                                          *arrays))
    if isinstance(result_layouts, str):
        result_layouts = (result_layouts,) * len(results)
    if len(result_layouts) != len(results):
        raise ValueError(f"{len(result_layouts)} result layouts for {len(results)} results")
    result_names = [_axis_names(layout, r.ndim) for layout, r in zip(result_layouts, results)]
    sizes = _factor_sizes(arrays + results, names + result_names)
    plan = functools.partial(_plan, names=names, sizes=sizes)

    def result_shardings(mesh, split):
        return result_tree.unflatten([split.sharding(mesh, n) for n in result_names])

    def infer(mesh, arg_shapes, result_shape):
        return result_shardings(mesh, plan(mesh, arg_shapes))

    def partition(mesh, arg_shapes, result_shape):
        split = plan(mesh, arg_shapes)

        def per_shard(*local):
            if split.inside_groups:
                local = [split.own_kv_head(x, n, sizes) for x, n in zip(local, names)]
            return call(local, None if geom is None else split.local_geometry(geom))

        return (mesh, per_shard, result_shardings(mesh, split),
                tuple(split.sharding(mesh, n) for n in names))

    partitioned = custom_partitioning(lambda *xs: call(xs, geom))
    partitioned.def_partition(partition=partition, infer_sharding_from_operands=infer,
                              sharding_rule=_sdy_rule(names, result_names, sizes))
    batchable = jax.custom_batching.custom_vmap(partitioned)

    @batchable.def_vmap
    def _vmap_rule(axis_size, in_batched, *xs):
        del axis_size
        axes = [0 if b else None for b in in_batched]
        out = jax.vmap(lambda *ys: call(ys, geom), in_axes=axes)(*xs)
        return out, jax.tree.map(lambda _: True, out)

    return forward_only(batchable, name)(*arrays)


def _axis_names(layout: str, rank: int) -> tuple[str, ...]:
    """One name per axis of an array of rank `rank` laid out as `layout`."""
    names = layout.split()
    if names[-1:] == [REST]:
        names = names[:-1] + [OTHER] * (rank - len(names) + 1)
    if len(names) != rank or any(n not in (BATCH, Q_HEADS, KV_HEADS, FUSED_KV, OTHER)
                                 for n in names):
        raise ValueError(f"layout {layout!r} does not describe an array of rank {rank}")
    return tuple(names)


def _factor_sizes(arrays, names) -> dict[str, int]:
    """The size of each named axis ("B", "H", "K"), checked to agree across arrays."""
    sizes = {}
    for x, axis_names in zip(arrays, names):
        for size, name in zip(x.shape, axis_names):
            if name == FUSED_KV:  # pairs of entries per KV head
                name, size = KV_HEADS, size // 2
            if name != OTHER and sizes.setdefault(name, size) != size:
                raise ValueError(f"operands and results disagree on the size of axis "
                                 f"{name}: {sizes[name]} and {size}")
    return sizes


def _sdy_rule(names, result_names, sizes) -> SdyShardingRule:
    """Shardy's rule: batch and heads pass through, every other axis is replicated. A
    fused KV axis is the compound of the KV heads and their K/V pair; where the KV heads
    appear only there, their size (`sizes`) is given."""
    replicated = []
    pairs = {}

    def mapping(axis_names):
        factors = []
        for name in axis_names:
            if name == FUSED_KV:
                factors.append(CompoundFactor(_FACTORS[KV_HEADS], _PAIR_FACTOR))
                pairs[_PAIR_FACTOR] = 2
            elif name == OTHER:
                replicated.append(f"r{len(replicated)}")
                factors.append(replicated[-1])
            else:
                factors.append(_FACTORS[name])
        return ArrayMapping(*factors)

    operands = tuple(mapping(n) for n in names)
    results = tuple(mapping(n) for n in result_names)
    every = [n for axis_names in (*names, *result_names) for n in axis_names]
    if pairs and KV_HEADS not in every:
        pairs[_FACTORS[KV_HEADS]] = sizes[KV_HEADS]
    return SdyShardingRule(operands, results, need_replication_factors=tuple(replicated),
                           **pairs)


def _mesh_axes(entry) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry (None, a name or a tuple of names)."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _first_sharded(arg_shapes, names, wanted: set[str], taken=()) -> tuple[str, ...]:
    """Mesh axes of the first sharded axis named in `wanted`, less those in `taken`."""
    for shape, axis_names in zip(arg_shapes, names):
        spec = tuple(shape.sharding.spec) if shape.sharding is not None else ()
        for name, entry in zip(axis_names, spec):
            axes = tuple(a for a in _mesh_axes(entry) if a not in taken)
            name = KV_HEADS if name == FUSED_KV else name
            if name in wanted and axes:
                return axes
    return ()


@dataclasses.dataclass(frozen=True)
class _Split:
    """How one call is partitioned: the mesh axes of the batch and of the heads."""

    batch: tuple[str, ...]
    batch_shards: int
    heads: tuple[str, ...]
    head_shards: int
    inside_groups: bool  # heads split inside KV groups: KV operands replicated

    def sharding(self, mesh, axis_names) -> NamedSharding:
        def entry(name):
            kv_axes = () if self.inside_groups else self.heads
            axes = {BATCH: self.batch, Q_HEADS: self.heads, KV_HEADS: kv_axes,
                    FUSED_KV: kv_axes}.get(name, ())
            return None if not axes else axes[0] if len(axes) == 1 else axes
        return NamedSharding(mesh, PartitionSpec(*map(entry, axis_names)))

    def own_kv_head(self, x, axis_names, sizes):
        """The one KV head this shard's query heads read, out of a whole KV operand."""
        width = 2 if FUSED_KV in axis_names else 1
        axis = KV_HEADS if width == 1 else FUSED_KV
        if axis not in axis_names:
            return x
        shards_per_kv_head = self.head_shards // sizes[KV_HEADS]
        kv_head = jax.lax.axis_index(self.heads) // shards_per_kv_head
        return jax.lax.dynamic_slice_in_dim(x, kv_head * width, width,
                                            axis_names.index(axis))

    def local_geometry(self, geom):
        """`geom` with the batch and head counts of one shard."""
        return dataclasses.replace(
            geom, batch=geom.batch // self.batch_shards,
            q_heads=geom.q_heads // self.head_shards,
            kv_heads=1 if self.inside_groups else geom.kv_heads // self.head_shards)


def _plan(mesh, arg_shapes, *, names, sizes) -> _Split:
    """The rule of the module docstring, from the operands' shardings on `mesh`."""
    def shards(axes):
        return math.prod(mesh.shape[a] for a in axes)

    batch = _first_sharded(arg_shapes, names, {BATCH})
    if BATCH not in sizes or sizes[BATCH] % shards(batch):
        batch = ()
    heads = _first_sharded(arg_shapes, names, {Q_HEADS, KV_HEADS}, taken=batch)
    n = shards(heads)
    q_heads, kv_heads = sizes.get(Q_HEADS), sizes.get(KV_HEADS)
    inside = False
    if q_heads is None or q_heads % n:
        heads, n = (), 1
    elif kv_heads is not None and kv_heads % n:
        inside = n % kv_heads == 0
        if not inside:
            heads, n = (), 1
    return _Split(batch, shards(batch), heads, n, inside)


def kernel_output(shape: tuple[int, ...], dtype, *inputs) -> jax.ShapeDtypeStruct:
    """The `out_shape` of a kernel call whose output varies over the manual mesh axes
    its inputs vary over. Inside a caller's `jax.shard_map` (with `check_vma`, the
    default) a Pallas call must say so; elsewhere the inputs vary over none and this is a
    plain ShapeDtypeStruct."""
    axis_types = [getattr(jax.typeof(x), "mat", None) for x in inputs if x is not None]
    axis_types = [t for t in axis_types if t is not None and t.varying]
    if not axis_types:
        return jax.ShapeDtypeStruct(shape, dtype)
    varying = frozenset().union(*(t.varying for t in axis_types))
    return jax.ShapeDtypeStruct(shape, dtype,
                                manual_axis_type=axis_types[0].update(varying=varying))

