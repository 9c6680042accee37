"""torch.compile over the bridge: the estimate and the policy's scoring and selection are
custom ops, so `torch.compile(fullgraph=True)` (which raises on any graph break) compiles
a model calling them, and the compiled model gives the eager results.

The CPU tests use the "aot_eager" backend (dynamo's graph capture, the fake-tensor trace
of the custom ops and AOT autograd, with no C++ compile: fast on a small CPU); the `gpu`
test compiles with inductor on CUDA tensors (`pytest -m gpu tests/test_bridge_compile.py`).
"""

from __future__ import annotations

import inspect

import pytest

torch = pytest.importorskip("torch")

import xattn_jax  # noqa: E402
import xattn_torch_bridge as bridge  # noqa: E402
from bridge_inputs import needs_cuda, qk  # noqa: E402
from cases import PAGED, EstimateCase  # noqa: E402
from xattn_torch_bridge import PagedKVCache, XAttentionPolicy  # noqa: E402

MODEL = EstimateCase("compiled-model", 1, 4, 2, 96, 224, 16, 8, 32, True, threshold=0.8)


class EstimateModel(torch.nn.Module):
    """Scales q, estimates, and uses both results in torch ops around the estimate."""

    def forward(self, q, k):
        sums, mask = bridge.xattn_estimate(q * 0.5, k, threshold=MODEL.threshold,
                                           impl="reference", **MODEL.options)
        return sums * mask, mask.sum(dim=-1)


class SelectionModel(torch.nn.Module):
    def __init__(self, policy: XAttentionPolicy, cache: PagedKVCache):
        super().__init__()
        self.policy, self.cache = policy, cache

    def forward(self, q, table):
        scores = self.policy.scores(q, self.cache, table)
        return scores, self.policy.selection(scores, self.cache, table)


def assert_same(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def test_estimate_compiles_without_graph_break(rand):
    q, k = qk(rand, MODEL)
    model = EstimateModel()
    eager = model(q, k)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    assert_same(compiled(q, k), eager)
    explained = torch._dynamo.explain(model)(q, k)
    assert explained.graph_break_count == 0 and explained.graph_count == 1


def test_estimate_op_fake_shapes_match(rand):
    q, k = qk(rand, MODEL)
    args = (q, k, [0.9], MODEL.block_size, MODEL.stride, MODEL.causal, 1.0, False, False,
            2, 1, "reference", None, False)
    real = torch.ops.xattn.estimate(*args)
    torch.library.opcheck(torch.ops.xattn.estimate.default, args,
                          test_utils=("test_schema", "test_faketensor"))
    assert real[0].shape == (1, 4, 3, 7) and real[1].dtype == torch.bool


def test_estimate_op_takes_every_option_of_xattn_estimate():
    """The op's arguments: the threshold, then xattn_jax.xattn_estimate's other keywords in
    its order, then copy."""
    keywords = [name for name, p in inspect.signature(xattn_jax.xattn_estimate).parameters
                .items() if p.kind is inspect.Parameter.KEYWORD_ONLY and name != "threshold"]
    schema = [a.name for a in torch.ops.xattn.estimate.default._schema.arguments]
    assert schema == ["q", "k", "threshold", *keywords, "copy"]


@pytest.mark.parametrize("rule", ["score", "vote"])
def test_policy_scoring_and_selection_compile(rand, rule):
    """The compiled steps give the units `select_blocks` chose, and the ids from them."""
    hq, hkv, d = PAGED.q_heads, PAGED.kv_heads, PAGED.head_dim
    k = torch.from_numpy(rand.rng.standard_normal((300, hkv, d))).float()
    q = torch.from_numpy(rand.rng.standard_normal((hq, 40, d))).float()
    cache = PagedKVCache(24, 16, hkv, d, dtype=torch.float32, device="cpu", num_cpu_blocks=2)
    ids = cache.append([], k, k)
    cache.offload(ids[3:5])
    policy = XAttentionPolicy(0.6, PAGED.stride, PAGED.block_size, selection_unit=64,
                              rule=rule)
    want = policy.select_blocks(q, cache, ids)
    model = SelectionModel(policy, cache)
    table = policy.block_table(q, cache, ids)
    eager = model(q, table)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    table = policy.block_table(q, cache, ids)
    got = compiled(q, table)
    assert_same(got, eager)
    assert policy.chosen_blocks(got[1], cache, ids) == want
    explained = torch._dynamo.explain(model)(q, table)
    assert explained.graph_break_count == 0


@pytest.mark.gpu
@needs_cuda
def test_cuda_estimate_compiled_with_inductor(rand):
    q, k = qk(rand, MODEL, torch.bfloat16, "cuda")
    model = EstimateModel()
    compiled = torch.compile(model, fullgraph=True)
    assert_same(compiled(q, k), model(q, k))
