"""Bad input to xattn_jax's public functions: a TypeError or ValueError naming the argument.

`BAD` lists about 250 bad arguments, each one change to a valid call of one public function
(impl="reference"). Every one is refused with a TypeError or ValueError whose message
names the argument: never another exception from inside JAX, never a result. Hypothesis
draws them on random valid shapes. Then bad inputs that need a call of their own (page
ids, string thresholds, integer sums, blocks longer than the sequence), and the values
that are data (traced or on a device): checked mode (`xattn_jax.checked`) turns
them into errors, and unchecked they give what the docstrings say. Torch-free.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import xattn_jax
from xattn_jax.kv_blocks import EMPTY_BLOCK


@dataclasses.dataclass(frozen=True)
class Shapes:
    """A valid small call: batch, query heads, key heads, length (Lq = Lk), head dim."""

    batch: int = 1
    q_heads: int = 2
    kv_heads: int = 1
    length: int = 64
    head_dim: int = 16

    def q(self, length=None, **changes):
        return jnp.zeros(dataclasses.replace(self, **changes).q_shape(length), jnp.float32)

    def q_shape(self, length=None):
        return (self.batch, self.q_heads, length or self.length, self.head_dim)

    def k(self, **changes):
        s = dataclasses.replace(self, **changes)
        return jnp.zeros((s.batch, s.kv_heads, s.length, s.head_dim), jnp.float32)

    def pages(self):  # a paged cache of 4 pages of 16 tokens
        return jnp.zeros((4, 16, self.kv_heads, self.head_dim), jnp.float32)


SHAPES = st.builds(Shapes, batch=st.integers(1, 2), q_heads=st.sampled_from([2, 4]),
                   kv_heads=st.sampled_from([1, 2]), length=st.sampled_from([64, 96, 128]),
                   head_dim=st.sampled_from([8, 16]))


def _estimate(s: Shapes, **kw):
    return xattn_jax.xattn_estimate(**({"q": s.q(), "k": s.k(), "block_size": 32, "stride": 8,
                                        "impl": "reference"} | kw))


def _scores(s: Shapes, **kw):
    return xattn_jax.strided_scores(**({"q": s.q(), "k": s.k(), "stride": 8,
                                        "impl": "reference"} | kw))


def _select(s: Shapes, **kw):
    sums = jnp.ones((s.batch, s.q_heads, 2, 2), jnp.float32)
    return xattn_jax.select_blocks(**({"block_sums": sums, "impl": "reference"} | kw))


def _kv_scores(s: Shapes, **kw):
    args = {"q": s.q(length=32), "k": s.k(), "kv_block_size": 32, "estimate_block_size": 16,
            "stride": 8, "impl": "reference"}
    if "block_table" in kw:  # a paged cache of 4 pages, two of them per sequence
        args["k"] = s.pages()
    return xattn_jax.kv_block_scores(**(args | kw))


def _kv_select(s: Shapes, **kw):
    scores = jnp.ones((s.batch, s.q_heads, 8), jnp.float32)
    return xattn_jax.select_kv_blocks(**({"scores": scores} | kw))


FUNCTIONS = {"xattn_estimate": _estimate, "strided_scores": _scores, "select_blocks": _select,
             "kv_block_scores": _kv_scores, "select_kv_blocks": _kv_select}


@dataclasses.dataclass(frozen=True)
class Bad:
    """One bad argument: `value(shapes)` for `argument` of `function`; `named` is the
    argument the message must name, and `extra` other arguments the case needs."""

    function: str
    argument: str
    value: Callable[[Shapes], object]
    label: str
    named: str = ""
    extra: tuple = ()

    @property
    def id(self) -> str:
        return f"{self.function}-{self.argument}-{self.label}"

    def call(self, s: Shapes):
        kw = dict(self.extra) | {self.argument: self.value(s)}
        return FUNCTIONS[self.function](s, **kw)


def _const(x):
    return lambda s: x


def _bads(function, argument, values: dict, named="", extra=()):
    return [Bad(function, argument, v if callable(v) else _const(v), label, named, extra)
            for label, v in values.items()]


NOT_INTS = {"str": "8", "none": None, "float": 8.0, "bool": True, "list": [8],
            "numpy_float": np.float32(8), "complex": 8j}
NOT_FLAGS = {"int_1": 1, "int_0": 0, "none": None, "str": "True", "float": 1.0,
             "numpy_int": np.int64(1), "list": [True]}
BAD_SHARES = {"str": "0.9", "none": None, "bool": True, "zero": 0.0, "negative": -0.1,
              "above_one": 1.5, "nan": float("nan"), "inf": float("inf"), "huge_int": 10**400,
              "strings": ["0.5", "0.5"], "dict": {}, "complex": 0.5j,
              "numpy_bool": np.bool_(True), "bool_array": jnp.asarray(True)}
BAD_NORMS = {"zero": 0.0, "negative": -1.0, "nan": float("nan"), "inf": float("inf"),
             "str": "1", "none": None, "bool": True, "list": [1.0], "complex": 1j}
BAD_IMPLS = {"cuda": "cuda", "empty": "", "none": None, "int": 1, "upper": "PALLAS"}


def _qk_cases(function):
    """Bad q and k for a function taking both (`named` "q" or "k"; mismatches name both)."""
    return [
        *_bads(function, "q", {
            "none": None, "str": "q", "float": 3.0, "nested_list": [[[[0.0]]]],
            "rank3": lambda s: jnp.zeros(s.q_shape()[1:]),
            "rank5": lambda s: jnp.zeros((1, *s.q_shape())),
            "scalar": jnp.float32(0), "int32": lambda s: jnp.zeros(s.q_shape(), jnp.int32),
            "float64": lambda s: np.zeros(s.q_shape()),
            "bool": lambda s: jnp.zeros(s.q_shape(), bool),
            "complex": lambda s: jnp.zeros(s.q_shape(), jnp.complex64),
            "bfloat16_vs_float32_k": lambda s: s.q().astype(jnp.bfloat16),
            "empty": lambda s: jnp.zeros((s.batch, s.q_heads, 0, s.head_dim)),
            "batch": lambda s: s.q(batch=s.batch + 1),
            "head_dim": lambda s: s.q(head_dim=s.head_dim * 2),
            "longer_than_k": lambda s: s.q(length=s.length + 8),
        }),
        *_bads(function, "k", {
            "none": None, "str": "k", "rank3": lambda s: s.k()[0],
            "int32": lambda s: s.k().astype(jnp.int32),
            "float16_vs_float32_q": lambda s: s.k().astype(jnp.float16),
            "no_heads": lambda s: s.k(kv_heads=0),
            "heads_not_dividing_q": lambda s: s.k(kv_heads=s.q_heads + 1),
        }),
    ]


BAD = [
    *_qk_cases("xattn_estimate"),
    *_bads("xattn_estimate", "stride", NOT_INTS | {"zero": 0, "negative": -8, "three": 3,
                                                   "huge": 10**30}),
    *_bads("xattn_estimate", "block_size", NOT_INTS | {"zero": 0, "not_multiple": 12,
                                                       "huge": 2**31}),
    *_bads("xattn_estimate", "threshold", BAD_SHARES | {
        "wrong_length": lambda s: [0.5] * (s.q_heads + 1), "rank2": [[0.5, 0.5]],
        "jax_rank2": jnp.full((1, 2), 0.5), "one_head_zero": lambda s: [0.0] * s.q_heads}),
    *_bads("xattn_estimate", "causal", NOT_FLAGS),
    *_bads("xattn_estimate", "keep_sink", NOT_FLAGS),
    *_bads("xattn_estimate", "keep_recent", {"int_1": 1, "none": None}),
    *_bads("xattn_estimate", "norm", BAD_NORMS),
    *_bads("xattn_estimate", "impl", BAD_IMPLS),
    *_bads("xattn_estimate", "max_scratch_bytes", {"zero": 0, "negative": -1, "float": 1.5,
                                                   "str": "1024", "bool": True}),
    *_bads("xattn_estimate", "block_size", {"causal_misaligned": 32},
           extra=(("q", Shapes(length=48).q()), ("k", Shapes(length=64).k()))),
    *_qk_cases("strided_scores"),
    *_bads("strided_scores", "stride", {"zero": 0, "str": "8", "float": 8.0, "huge": 2**20}),
    *_bads("strided_scores", "norm", {"zero": 0.0, "str": "1"}),
    *_bads("strided_scores", "impl", {"cuda": "cuda"}),
    *_bads("select_blocks", "block_sums", {
        "none": None, "list": [[[[1.0]]]], "str": "sums", "rank3": jnp.ones((1, 2, 2)),
        "int32": lambda s: jnp.ones((s.batch, s.q_heads, 2, 2), jnp.int32),
        "bool": lambda s: jnp.ones((s.batch, s.q_heads, 2, 2), bool),
        "more_query_blocks": jnp.ones((1, 2, 3, 2))}),
    *_bads("select_blocks", "threshold", BAD_SHARES | {"wrong_length": [0.5, 0.5, 0.5]}),
    *_bads("select_blocks", "causal", {"int_1": 1, "none": None}),
    *_bads("select_blocks", "impl", {"cuda": "cuda"}),
    *_bads("kv_block_scores", "q", {"none": None, "rank3": jnp.zeros((2, 32, 16)),
                                    "int32": lambda s: s.q(length=32).astype(jnp.int32)}),
    *_bads("kv_block_scores", "k", {
        "none": None, "rank3": lambda s: s.k()[0],
        "paged_without_block_table": lambda s: jnp.zeros((5, 16, s.kv_heads, s.head_dim))}),
    *_bads("kv_block_scores", "kv_block_size", NOT_INTS | {"zero": 0, "not_multiple": 40,
                                                           "huge": 10**9}),
    *_bads("kv_block_scores", "estimate_block_size", {
        "not_stride_multiple": 12, "not_dividing": 64, "zero": 0, "str": "16", "none": None}),
    *_bads("kv_block_scores", "stride", {"zero": 0, "not_dividing": 5, "str": "8"},
           named="stride"),
    *_bads("kv_block_scores", "norm", {"zero": 0.0, "nan": float("nan")}),
    *_bads("kv_block_scores", "k_len", {
        "zero": 0, "negative": -5, "past_capacity": lambda s: s.length + 1, "huge": 10**30,
        "str": "10", "float": 10.0, "bool": True, "numpy_zero": np.int64(0),
        "jax_float": jnp.float32(10), "jax_vector": jnp.asarray([10])}),
    *_bads("kv_block_scores", "block_table", {
        "id_past_pages": lambda s: np.full((s.batch, 2), 99),
        "negative_id": lambda s: np.full((s.batch, 2), -1),
        "cpu_jax_id_past_pages": lambda s: jnp.full((s.batch, 2), 4, jnp.int32),
        "list_id_past_pages": lambda s: [[0, 99]] * s.batch,
        "floats": lambda s: np.zeros((s.batch, 2), np.float32),
        "bools": lambda s: np.zeros((s.batch, 2), bool),
        "rank1": np.zeros(2, np.int32), "rank3": np.zeros((1, 1, 2), np.int32),
        "wrong_batch": lambda s: np.zeros((s.batch + 1, 2), np.int32),
        "str": "table", "ragged": [[0, 1], [2]]}),
    *_bads("kv_block_scores", "per_query_block", {"int_1": 1, "str": "yes"}),
    *_bads("kv_block_scores", "impl", {"cuda": "cuda"}),
    *_bads("select_kv_blocks", "scores", {
        "none": None, "list": [[[1.0]]], "rank2": jnp.ones((1, 8)),
        "int32": lambda s: jnp.ones((s.batch, s.q_heads, 8), jnp.int32)}),
    *_bads("select_kv_blocks", "scores", {"rank3_vote": jnp.ones((1, 2, 8))},
           extra=(("rule", "vote"),)),
    *_bads("select_kv_blocks", "threshold", BAD_SHARES | {"per_head": jnp.full((2,), 0.5)}),
    *_bads("select_kv_blocks", "rule", {"majority": "majority", "none": None, "int": 1}),
    *_bads("select_kv_blocks", "num_valid", {
        "zero": 0, "past_blocks": 9, "negative": -1, "str": "3", "float": 3.0, "bool": True,
        "list_zero": lambda s: [0] * s.batch, "wrong_batch": [1, 2, 3],
        "numpy_past": np.asarray(9), "jax_float": jnp.float32(3),
        "jax_rank2": jnp.asarray([[3]]), "bools": [True]}),
    *_bads("select_kv_blocks", "kv_heads", {
        "none": None, "not_dividing": lambda s: s.q_heads + 1, "zero": 0, "str": "2",
        "float": 2.0, "bool": True}, extra=(("per_kv_head", True),)),
    *_bads("select_kv_blocks", "per_kv_head", {"int_1": 1, "none": None}),
    *_bads("select_kv_blocks", "keep_first", {"int_0": 0, "str": "no"}),
    *_bads("select_kv_blocks", "keep_last", {"int_1": 1}),
]
ALLOWED = (TypeError, ValueError)


def _assert_refused(bad: Bad, s: Shapes) -> None:
    try:
        result = bad.call(s)
    except ALLOWED as e:
        named = bad.named or bad.argument
        assert re.search(rf"\b{named}\b", str(e)), f"{bad.id}: {type(e).__name__}: {e}"
        assert type(e) in ALLOWED, f"{bad.id}: {type(e).__name__} (from inside JAX?): {e}"
    else:
        raise AssertionError(f"{bad.id} was accepted, gave {type(result).__name__}")


def test_about_a_hundred_bad_inputs():
    assert len(BAD) >= 100 and len({b.id for b in BAD}) == len(BAD)


@pytest.mark.parametrize("bad", BAD, ids=[b.id for b in BAD])
def test_each_bad_input_is_refused(bad):
    _assert_refused(bad, Shapes())


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(BAD), SHAPES)
def test_bad_inputs_on_random_shapes(bad, shapes):
    _assert_refused(bad, shapes)


# --- bad inputs that need a call of their own --------------------------------------------

def _paged_scores(table, k_len=None, impl="reference"):
    """kv_block_scores of a chunk of 32 queries over a cache of 10 pages of 16 tokens."""
    q = jnp.asarray(np.random.default_rng(0).standard_normal((1, 2, 32, 16)), jnp.float32)
    pages = jnp.asarray(np.random.default_rng(1).standard_normal((10, 16, 1, 16)),
                        jnp.float32)
    return xattn_jax.kv_block_scores(q, pages, block_table=table, k_len=k_len,
                                     kv_block_size=32, estimate_block_size=16, stride=8,
                                     impl=impl)


@pytest.mark.parametrize("ids", [[99, 0], [-1, 0], [0, 10]])
@pytest.mark.parametrize("kind", ["numpy", "list", "cpu_jax"])
def test_page_id_outside_the_cache_is_refused(ids, kind):
    table = {"numpy": np.asarray([ids]), "list": [ids],
             "cpu_jax": jnp.asarray([ids], jnp.int32)}[kind]
    with pytest.raises(ValueError, match=r"block_table's page ids must lie in \[0, 10\)"):
        _paged_scores(table)


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_traced_page_ids_are_clamped_into_the_cache(impl):
    """A traced table is not read: ids outside the cache read the last page or page 0, in
    the reference and in the kernels (k_len 20: the second page is read masked)."""
    traced = jax.jit(lambda t, n: _paged_scores(t, n, impl))
    for n in (20, 32):
        got = traced(jnp.asarray([[99, -1]], jnp.int32), jnp.int32(n))
        want = _paged_scores(np.asarray([[9, 0]]), n, impl)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)


@pytest.mark.parametrize("call", [
    lambda: xattn_jax.xattn_estimate(Shapes().q(), Shapes().k(), block_size=32,
                                     threshold="0.9", impl="reference"),
    lambda: xattn_jax.select_kv_blocks(jnp.ones((1, 2, 8)), threshold="0.9"),
], ids=["xattn_estimate", "select_kv_blocks"])
def test_threshold_string_is_refused(call):
    with pytest.raises(TypeError, match="threshold must be a float"):
        call()


def test_repeated_selection_remembers_values_by_type():
    """select_kv_blocks reuses a repeated call's checks (`checks.CheckedCalls`): after a
    valid call, equal values of another type (1 for True, 3.0 for 3) are still refused,
    and a changed num_valid still changes the result."""
    scores = jnp.asarray(np.random.default_rng(0).random((1, 2, 8)), jnp.float32)
    good = dict(threshold=0.5, keep_first=True, num_valid=3)
    assert not np.asarray(xattn_jax.select_kv_blocks(scores, **good))[0, 3:].any()
    for argument, value in (("keep_first", 1), ("num_valid", 3.0)):
        with pytest.raises((TypeError, ValueError), match=argument):
            xattn_jax.select_kv_blocks(scores, **{**good, argument: value})
    assert np.asarray(xattn_jax.select_kv_blocks(scores, **{**good, "num_valid": 8}))[0, 7]


def test_integer_block_sums_are_refused():
    with pytest.raises(ValueError, match="block_sums must be floats"):
        xattn_jax.select_blocks(jnp.ones((1, 2, 2, 2), jnp.int32), impl="reference")


@pytest.mark.parametrize("impl", ["reference", "triton"])
@pytest.mark.parametrize("length", [5, 20])
def test_block_longer_than_the_sequence_is_one_block(impl, length):
    """A block of 128 (and a stride of 32) over 5 or 20 tokens: one block holding every
    reshaped query row's mass, always selected; strided_scores has one column per group."""
    rng = np.random.default_rng(length)
    q, k = (jnp.asarray(rng.standard_normal((1, 2, length, 16)), jnp.float32)
            for _ in range(2))
    for causal in (True, False):
        sums, mask = xattn_jax.xattn_estimate(q, k, block_size=128, stride=32,
                                              causal=causal, impl=impl)
        assert sums.shape == mask.shape == (1, 2, 1, 1)
        np.testing.assert_allclose(np.asarray(sums), 1.0, rtol=1e-6)  # ceil(Lq/32) rows
        assert np.all(np.asarray(mask))
    assert xattn_jax.strided_scores(q, k, stride=32, impl=impl).shape == (1, 2, 1, 1)
    with pytest.raises(ValueError, match="block_size must be a positive multiple of stride "
                                         r"\(32\), at most 65536"):
        xattn_jax.xattn_estimate(q, k, block_size=2**17, stride=32, impl=impl)


@pytest.mark.parametrize("rule", ["score", "vote"])
def test_default_selection_never_takes_a_block_past_k_len(rule):
    """k_len 1000 of 2048 with KV blocks of 256: blocks 4-7 hold no key, score EMPTY_BLOCK
    and are never selected; block 3 (the last that holds keys) is "last"."""
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((1, 2, 64, 16)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((1, 1, 2048, 16)), jnp.float32)
    scores = xattn_jax.kv_block_scores(q, k, kv_block_size=256, estimate_block_size=64,
                                       k_len=1000, per_query_block=rule == "vote",
                                       impl="reference")
    assert np.all(np.asarray(scores[..., 4:]) == EMPTY_BLOCK)
    assert np.all(np.asarray(scores[..., :4]) >= 0)
    mask = xattn_jax.select_kv_blocks(scores, rule=rule)
    assert mask.tolist() == [[True] * 4 + [False] * 4]
    small = xattn_jax.select_kv_blocks(scores, rule=rule, threshold=1e-6)
    assert small.tolist()[0][3] and not any(small.tolist()[0][4:])  # "last" is block 3


def test_paged_k_without_block_table_says_so():
    with pytest.raises(ValueError, match="paged cache.*needs its block_table"):
        xattn_jax.kv_block_scores(Shapes().q(length=32), Shapes().pages(), kv_block_size=32,
                                  estimate_block_size=16, impl="reference")


def test_estimate_block_size_is_named():
    with pytest.raises(ValueError, match=r"^estimate_block_size must be a positive multiple "
                                         r"of stride \(8\), at most 65536, got 12"):
        xattn_jax.kv_block_scores(Shapes().q(length=32), Shapes().k(), kv_block_size=48,
                                  estimate_block_size=12, impl="reference")


# --- values that are data: checked mode, and unchecked behaviour ---------------------------

def _chunk():
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((1, 2, 64, 16)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((1, 1, 256, 16)), jnp.float32)
    return q, k


def _traced_estimate(q, k, t):
    return xattn_jax.xattn_estimate(q, k, block_size=32, threshold=t, causal=False,
                                    impl="reference")


def _traced_kv_scores(q, k, n):
    return xattn_jax.kv_block_scores(q, k, kv_block_size=64, estimate_block_size=32, k_len=n,
                                     impl="reference")


def _traced_kv_select(scores, t, n):
    return xattn_jax.select_kv_blocks(scores, threshold=t, num_valid=n)


@pytest.mark.parametrize("t", [0.0, float("nan"), 1.5, -1.0])
def test_checked_threshold(t):
    q, k = _chunk()
    err, _ = jax.jit(xattn_jax.checked(_traced_estimate))(q, k, jnp.float32(t))
    with pytest.raises(ValueError, match=r"threshold must lie in \(0, 1\]"):
        err.throw()
    err, _ = xattn_jax.checked(_traced_kv_select)(jnp.ones((1, 2, 4)), jnp.float32(t),
                                                   jnp.int32(4))
    with pytest.raises(ValueError, match=r"threshold must lie in \(0, 1\]"):
        err.throw()


def test_unchecked_threshold_as_documented():
    """Unchecked traced thresholds: <= 0 or NaN keep only forced blocks (none here), > 1
    keeps every block; the same jitted function, no error."""
    q, k = _chunk()
    run = jax.jit(_traced_estimate)
    for t in (0.0, float("nan")):
        assert not np.any(np.asarray(run(q, k, jnp.float32(t))[1]))
    assert np.all(np.asarray(run(q, k, jnp.float32(1.5))[1]))
    assert np.asarray(run(q, k, jnp.float32(0.5))[1]).any()
    scores = jnp.asarray([[[0.1, 0.6, 0.2, 0.1]]], jnp.float32)
    select = jax.jit(_traced_kv_select)
    assert select(scores, jnp.float32(0.0), jnp.int32(4)).tolist() == [[True, False, False,
                                                                        True]]
    assert select(scores, jnp.float32(1.5), jnp.int32(4)).tolist() == [[True] * 4]


@pytest.mark.parametrize("n", [0, -5, 257])
def test_checked_k_len(n):
    q, k = _chunk()
    err, _ = jax.jit(xattn_jax.checked(_traced_kv_scores))(q, k, jnp.int32(n))
    with pytest.raises(ValueError, match=r"k_len must lie in \[1, 256\]"):
        err.throw()


def test_unchecked_k_len_as_documented():
    """Below 1: every block EMPTY_BLOCK; past the capacity: the capacity."""
    q, k = _chunk()
    run = jax.jit(_traced_kv_scores)
    for n in (0, -5):
        assert np.all(np.asarray(run(q, k, jnp.int32(n))) == EMPTY_BLOCK)
    np.testing.assert_array_equal(np.asarray(run(q, k, jnp.int32(300))),
                                  np.asarray(run(q, k, jnp.int32(256))))


@pytest.mark.parametrize("n", [0, 5])
def test_checked_num_valid(n):
    err, _ = xattn_jax.checked(_traced_kv_select)(jnp.ones((1, 2, 4)), jnp.float32(0.9),
                                                   jnp.int32(n))
    with pytest.raises(ValueError, match=r"num_valid must lie in \[1, 4\]"):
        err.throw()


def test_unchecked_num_valid_as_documented():
    """Below 1 selects nothing; past the blocks counts as all of them."""
    select = jax.jit(_traced_kv_select)
    scores = jnp.ones((1, 2, 4))
    assert not np.any(np.asarray(select(scores, jnp.float32(0.9), jnp.int32(0))))
    assert select(scores, jnp.float32(0.9), jnp.int32(9)).tolist() == \
        select(scores, jnp.float32(0.9), jnp.int32(4)).tolist()


def test_checked_block_table():
    run = jax.jit(xattn_jax.checked(_paged_scores))
    err, _ = run(jnp.asarray([[99, 0]], jnp.int32))
    with pytest.raises(ValueError, match=r"block_table's page ids must lie in \[0, 10\)"):
        err.throw()
    err, _ = run(jnp.asarray([[9, 0]], jnp.int32))
    assert err.get() is None


def test_checked_mode_adds_nothing_outside_it():
    """Good values pass in checked mode; the unchecked call after it (same shapes) still
    compiles and runs without checkify."""
    q, k = _chunk()
    err, (sums, mask) = xattn_jax.checked(_traced_estimate)(q, k, jnp.float32(0.9))
    assert err.get() is None
    again = jax.jit(_traced_estimate)(q, k, jnp.float32(0.9))
    np.testing.assert_array_equal(np.asarray(again[1]), np.asarray(mask))
