"""Several devices: every public function partitions under jax.jit over sharded inputs.

Runs on 4 devices of the default backend: on CPU, tests/conftest.py asks XLA for 4 host
devices (--xla_force_host_platform_device_count=4) unless XLA_FLAGS already sets a count.
Each case runs under both partitioners (Shardy, JAX's default, and GSPMD) and checks:
- no collective in the compiled program for batch- or head-sharded inputs;
- every device's shard of the result is bitwise what one device computes on that shard's
  inputs alone, and the whole result is close to one device's whole call (XLA's float
  reductions round differently for other head counts: 2e-7 apart on CPU);
- the cases the rule gathers (sequence-sharded inputs, head counts that are not whole KV
  groups nor inside one group) give the same results, with the documented all-gather.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import xattn_jax
from xattn_jax import partitioning

DEVICES = 4
COLLECTIVES = ("all-gather", "all-reduce", "collective-permute", "all-to-all",
               "reduce-scatter")
STRIDE, BLOCK = 4, 16
pytestmark = pytest.mark.skipif(len(jax.devices()) < DEVICES,
                                reason=f"needs {DEVICES} devices (XLA_FLAGS, conftest.py)")

# mesh shape and axis names, and the sharding of q's (batch, heads)
MESHES = {
    "heads4": ((4,), ("h",), P(None, "h")),
    "batch2-heads2": ((2, 2), ("b", "h"), P("b", "h")),
    "batch4": ((4,), ("b",), P("b")),
    "heads-on-2x2": ((2, 2), ("x", "y"), P(None, ("x", "y"))),
}


def _mesh(name: str) -> tuple[Mesh, P]:
    shape, axes, spec = MESHES[name]
    return Mesh(np.array(jax.devices()[:DEVICES]).reshape(shape), axes), spec


def _put(mesh, x, *spec):
    """x on `mesh`, each axis sharded as `spec` says where that divides it, else whole."""
    spec = [a if a is not None and x.shape[i] % math.prod(mesh.shape[n] for n in (
        (a,) if isinstance(a, str) else a)) == 0 else None for i, a in enumerate(spec)]
    return jax.device_put(x, NamedSharding(mesh, P(*spec)))


def _lead_spec(x) -> tuple:
    """The sharding of x's (batch, heads) axes."""
    return (tuple(x.sharding.spec) + (None, None))[:2]


def _collectives(fn, *args) -> list[str]:
    text = jax.jit(fn).lower(*args).compile().as_text()
    return [c for c in COLLECTIVES if c in text]


def _inputs(batch, q_heads, kv_heads, q_len=64, k_len=64, head_dim=16, seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((batch, q_heads, q_len, head_dim)) * 2, jnp.float32)
    k = jnp.asarray(rng.standard_normal((batch, kv_heads, k_len, head_dim)) * 2, jnp.float32)
    t = jnp.asarray(rng.uniform(0.5, 0.95, q_heads), jnp.float32)
    return q, k, t


def _check_shards(out, whole, on_shard, rtol=1e-6):
    """Each addressable shard of `out` equals `on_shard(batch_slice, head_slice)` bitwise;
    `out` is close to `whole` (one device's call)."""
    for o, w in zip(jax.tree.leaves(out), jax.tree.leaves(whole)):
        w = np.asarray(w, np.float32)
        scale = float(np.abs(w, where=np.isfinite(w), out=np.zeros_like(w)).max())
        np.testing.assert_allclose(np.asarray(o, np.float32), w, rtol=rtol, atol=rtol * scale)
    for i, leaves in enumerate(zip(*(o.addressable_shards for o in jax.tree.leaves(out)))):
        batch, heads = leaves[0].index[:2]
        want = jax.tree.leaves(on_shard(batch, heads))
        for shard, w in zip(leaves, want):
            np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(w),
                                          err_msg=f"shard {i} {shard.index}")


def _kv_slice(heads: slice, q_heads: int, kv_heads: int) -> slice:
    """The KV heads query heads `heads` read."""
    g = q_heads // kv_heads
    start, stop = heads.start or 0, heads.stop or q_heads
    return slice(start // g, (stop - 1) // g + 1)


def _estimate(impl):
    def fn(q, k, t):
        return xattn_jax.xattn_estimate(q, k, block_size=BLOCK, stride=STRIDE, threshold=t,
                                        impl=impl)
    return fn


def _run_estimate(mesh_name, q_heads, kv_heads, impl, kv_spec=None):
    mesh, spec = _mesh(mesh_name)
    q, k, t = _inputs(4, q_heads, kv_heads)
    fn = _estimate(impl)
    args = (_put(mesh, q, *spec), _put(mesh, k, *(spec if kv_spec is None else kv_spec)),
            _put(mesh, t, spec[1] if len(spec) > 1 else None))
    out = jax.jit(fn)(*args)

    def on_shard(b, h):
        return fn(q[b, h], k[b, _kv_slice(h, q_heads, kv_heads)], t[h])
    return out, fn(q, k, t), on_shard, _collectives(fn, *args), spec


@pytest.mark.parametrize("mesh_name", list(MESHES))
@pytest.mark.parametrize("q_heads,kv_heads", [(8, 4), (8, 8)], ids=["gqa8:4", "mha8"])
def test_estimate_partitions_without_collectives(partitioner, mesh_name, q_heads, kv_heads):
    out, whole, on_shard, collectives, spec = _run_estimate(mesh_name, q_heads, kv_heads,
                                                            "reference")
    assert collectives == []
    for o in out:
        assert _lead_spec(o) == (tuple(spec) + (None,))[:2]
    _check_shards(out, whole, on_shard)


@pytest.mark.parametrize("mesh_name", ["heads4", "heads-on-2x2"])
def test_estimate_heads_inside_a_kv_group(partitioner, mesh_name):
    """GQA 8:2 on 4 head shards: each device's 2 query heads read one KV head; k arrives
    replicated, each device slices its head: still no collective."""
    out, whole, on_shard, collectives, spec = _run_estimate(mesh_name, 8, 2, "reference",
                                                            kv_spec=(None, None))
    assert collectives == []
    assert _lead_spec(out[0]) == tuple(spec)
    _check_shards(out, whole, on_shard)


def test_estimate_heads_neither_whole_groups_nor_inside_one_are_gathered(partitioner):
    """12 query heads on 3 KV heads over 4 head shards: a shard's 3 query heads would span
    two KV heads, so the heads are gathered (documented): same result, an all-gather."""
    out, whole, _, collectives, _ = _run_estimate("heads4", 12, 3, "reference",
                                                  kv_spec=(None, None))
    assert "all-gather" in collectives
    _check_shards(out, whole, lambda b, h: [x[b, h] for x in whole])


@pytest.mark.parametrize("axis", [2, 3], ids=["sequence", "head_dim"])
def test_sequence_or_head_dim_sharding_is_gathered(partitioner, axis):
    mesh, _ = _mesh("heads4")
    q, k, t = _inputs(4, 8, 4)
    spec = [None] * 4
    spec[axis] = "h"
    fn = _estimate("reference")
    args = (_put(mesh, q, *spec), _put(mesh, k, *spec), t)
    assert "all-gather" in _collectives(fn, *args)
    whole = fn(q, k, t)
    for o, w in zip(jax.jit(fn)(*args), whole):
        np.testing.assert_array_equal(np.asarray(o), np.asarray(w))


@pytest.mark.parametrize("q_heads,kv_heads", [(8, 4), (8, 2)], ids=["whole-groups",
                                                                    "inside-group"])
@pytest.mark.slow
def test_triton_interpret_partitions(partitioner, q_heads, kv_heads):
    out, whole, on_shard, collectives, _ = _run_estimate(
        "heads4", q_heads, kv_heads, "triton",
        kv_spec=None if kv_heads % DEVICES == 0 else (None, None))
    assert collectives == []
    _check_shards(out, whole, on_shard, rtol=1e-5)


@pytest.mark.parametrize("mesh_name", ["heads4", "batch2-heads2"])
def test_strided_scores_and_select_blocks_partition(partitioner, mesh_name):
    mesh, spec = _mesh(mesh_name)
    q, k, t = _inputs(4, 8, 4)

    def scores(q, k):
        return xattn_jax.strided_scores(q, k, stride=STRIDE, impl="reference")

    def select(sums, t):
        return xattn_jax.select_blocks(sums, t, causal=True, impl="reference")

    args = (_put(mesh, q, *spec), _put(mesh, k, *spec))
    assert _collectives(scores, *args) == []
    _check_shards(jax.jit(scores)(*args), scores(q, k),
                  lambda b, h: scores(q[b, h], k[b, _kv_slice(h, 8, 4)]))
    sums = xattn_jax.xattn_estimate(q, k, block_size=BLOCK, stride=STRIDE,
                                    impl="reference")[0]
    args = (_put(mesh, sums, *spec), _put(mesh, t, spec[-1]))
    assert _collectives(select, *args) == []
    _check_shards(jax.jit(select)(*args), select(sums, t),
                  lambda b, h: select(sums[b, h], t[h]))


def _pages(k, page_size, seed=1):
    """k `[B, Hkv, L, D]` as a shuffled page pool `[num_pages, page_size, Hkv, D]` and
    its block table."""
    b, hkv, length, d = k.shape
    per_seq = length // page_size
    order = np.random.default_rng(seed).permutation(b * per_seq)
    pages = k.transpose(0, 2, 1, 3).reshape(b * per_seq, page_size, hkv, d)
    pool = jnp.zeros_like(pages).at[order].set(pages)
    return pool, jnp.asarray(order.reshape(b, per_seq), jnp.int32)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("impl,mesh_name,kv_heads", [("reference", "heads4", 4),
                                                     ("reference", "batch2-heads2", 4),
                                                     ("reference", "heads4", 2),
                                                     ("triton", "heads4", 4)])
def test_kv_block_scores_partition(partitioner, paged, impl, mesh_name, kv_heads):
    """Head-sharded q with k, or with a page pool sharded over its KV-head axis 2 and the
    block table sharded like the batch: no collective, the pages stay where they are.
    With 2 KV heads on 4 head shards, k or the pool arrives whole (heads inside a group)."""
    mesh, spec = _mesh(mesh_name)
    batch_axis, heads_axis = (tuple(spec) + (None,))[:2]
    q, k, _ = _inputs(2, 8, kv_heads, q_len=32, k_len=128)
    k_len = jnp.int32(100)

    def fn(q, k, k_len, table):
        return xattn_jax.kv_block_scores(q, k, kv_block_size=32, estimate_block_size=16,
                                         stride=STRIDE, k_len=k_len, block_table=table,
                                         impl=impl)

    if paged:
        keys, table = _pages(k, page_size=16)
        args = (_put(mesh, q, *spec), _put(mesh, keys, None, None, heads_axis), k_len,
                _put(mesh, table, batch_axis))
    else:
        keys, table = k, None
        args = (_put(mesh, q, *spec), _put(mesh, k, *spec), k_len, None)
    assert _collectives(fn, *args) == []
    out = jax.jit(fn)(*args)
    assert _lead_spec(out) == (batch_axis, heads_axis)
    _check_shards(out, fn(q, keys, k_len, table),
                  lambda b, h: fn(q[b, h], k[b, _kv_slice(h, 8, kv_heads)], k_len, None),
                  rtol=1e-5)


@pytest.mark.parametrize("per_kv_head", [False, True])
def test_select_kv_blocks_partitions(partitioner, per_kv_head):
    """Plain XLA ops, partitioned by XLA: head-sharded scores need only small all-reduces
    of `[B, n]` (which blocks hold no key in any head; over all heads, the heads' mean),
    no gather of the scores."""
    mesh, spec = _mesh("batch2-heads2")
    scores = jnp.asarray(np.random.default_rng(2).random((4, 8, 16)), jnp.float32)

    def fn(s):
        return xattn_jax.select_kv_blocks(s, threshold=0.8, per_kv_head=per_kv_head,
                                          kv_heads=4)

    arg = _put(mesh, scores, *spec)
    collectives = _collectives(fn, arg)
    assert set(collectives) <= {"all-reduce"}
    np.testing.assert_array_equal(np.asarray(jax.jit(fn)(arg)), np.asarray(fn(scores)))


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_block_sparse_attention_partitions(partitioner, paged):
    """Attention on a head-sharded mask, k and v contiguous or paged (pools sharded over
    their KV-head axis), k_len as data: no collective."""
    mesh, spec = _mesh("batch2-heads2")
    q, k, _ = _inputs(2, 8, 4, q_len=32, k_len=64)
    v = k[..., ::-1] * 0.5
    mask = jnp.asarray(np.random.default_rng(3).random((2, 8, 2, 4)) < 0.6)
    k_len = jnp.int32(50)

    def fn(q, k, v, mask, table):
        return xattn_jax.block_sparse_attention(q, k, v, mask, block_size=BLOCK, k_len=k_len,
                                                block_table=table, return_lse=True,
                                                impl="reference")

    if paged:
        (keys, table), (values, _) = _pages(k, 16), _pages(v, 16)
        kv_spec = (None, None, "h")
        table_arg = _put(mesh, table, "b")
    else:
        keys, values, table, kv_spec, table_arg = k, v, None, spec, None
    args = (_put(mesh, q, *spec), _put(mesh, keys, *kv_spec), _put(mesh, values, *kv_spec),
            _put(mesh, mask, *spec), table_arg)
    assert _collectives(fn, *args) == []
    _check_shards(jax.jit(fn)(*args), fn(q, keys, values, mask, table),
                  lambda b, h: fn(q[b, h], k[b, _kv_slice(h, 8, 4)], v[b, _kv_slice(h, 8, 4)],
                                  mask[b, h], None), rtol=1e-5)


def test_xattention_partitions(partitioner):
    mesh, spec = _mesh("heads4")
    q, k, t = _inputs(2, 8, 4)
    v = k * 0.5

    def fn(q, k, v, t):
        return xattn_jax.xattention(q, k, v, threshold=t, block_size=BLOCK, stride=STRIDE,
                                    return_mask=True, impl="reference")

    args = (_put(mesh, q, *spec), _put(mesh, k, *spec), _put(mesh, v, *spec),
            _put(mesh, t, "h"))
    assert _collectives(fn, *args) == []
    _check_shards(jax.jit(fn)(*args), fn(q, k, v, t),
                  lambda b, h: fn(q[b, h], k[b, _kv_slice(h, 8, 4)], v[b, _kv_slice(h, 8, 4)],
                                  t[h]), rtol=1e-5)


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_inside_shard_map(partitioner, impl):
    """A caller's shard_map (check_vma on, its default) hands each device its heads; the
    call inside runs as on one device (the kernels' outputs vary over the same mesh axes
    as their inputs: `partitioning.kernel_output`)."""
    mesh, spec = _mesh("heads4")
    q, k, t = _inputs(2, 8, 4)
    fn = _estimate(impl)
    # Pallas interpret mode (the CPU) evaluates the kernel as gathers, whose varying-axes
    # check JAX's interpreter fails inside shard_map: there, check_vma=False
    interpreted = impl == "triton" and jax.default_backend() != "gpu"
    mapped = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(spec, spec, P("h")),
                                   out_specs=(spec, spec), check_vma=not interpreted))
    _check_shards(mapped(q, k, t), fn(q, k, t),
                  lambda b, h: fn(q[b, h], k[b, _kv_slice(h, 8, 4)], t[h]))


def test_inside_shard_map_with_automatic_axes(partitioner):
    """shard_map manual over the batch only: the call runs on its batch shard, the head
    axis left automatic is XLA's to partition (Shardy keeps the reference's heads local,
    GSPMD gathers them): the same results either way."""
    mesh, spec = _mesh("batch2-heads2")
    q, k, t = _inputs(4, 8, 4)
    fn = _estimate("reference")
    mapped = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P("b"), P("b"), P()),
                                   out_specs=(P("b"), P("b")), axis_names={"b"}))
    out = mapped(_put(mesh, q, *spec), _put(mesh, k, *spec), t)
    for o, w in zip(out, fn(q, k, t)):
        np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(w, np.float32),
                                   rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_under_vmap(impl):
    """vmap over a leading axis runs the unpartitioned core, batched: equal to a loop."""
    q, k, t = _inputs(1, 4, 2, q_len=32, k_len=32)
    qs, ks = jnp.stack([q, -q]), jnp.stack([k, k * 0.5])
    fn = _estimate(impl)
    got = jax.jit(jax.vmap(fn, in_axes=(0, 0, None)))(qs, ks, t)
    for i in range(2):
        for g, w in zip(got, fn(qs[i], ks[i], t)):
            np.testing.assert_allclose(np.asarray(g[i], np.float32), np.asarray(w, np.float32),
                                       rtol=1e-5, atol=1e-6)


def test_layout_must_fit_the_operand():
    with pytest.raises(ValueError, match="rank 3"):
        partitioning.on_shards(lambda x: x, ("B H . .",), name="identity")(jnp.zeros((1, 2, 3)))
