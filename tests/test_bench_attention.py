"""bench.attention on the CPU: FlexAttention on our block mask computes what
block_sparse_attention computes (flex's eager path), a wrong conversion is reported, and
the smoke run records every row (the SmolLM2 shapes' cuDNN peer, the flex peers)."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from bench import attention, flex
from xattn_jax import block_sparse_attention

HQ, HKV, D, BLOCK = 4, 2, 16, 16
HAS_FLEX = flex.unavailable(smoke=True) is None
needs_flex = pytest.mark.skipif(not HAS_FLEX, reason="needs torch with flex_attention")


def inputs(rand, q_len: int, k_len: int, density: float = 0.5):
    """float32 q `[1, Hq, Lq, D]`, k, v `[1, Hkv, Lk, D]` and a random bool mask
    `[1, Hq, Lq / BLOCK, Lk / BLOCK]` (blocks the causal rule hides included: the
    conversion must drop them)."""
    q = rand.rng.standard_normal((1, HQ, q_len, D)).astype(np.float32)
    k, v = (rand.rng.standard_normal((1, HKV, k_len, D)).astype(np.float32)
            for _ in range(2))
    mask = rand.rng.random((1, HQ, q_len // BLOCK, k_len // BLOCK)) < density
    return jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), mask


def listed_blocks(mask: np.ndarray, q_len: int, k_len: int) -> np.ndarray:
    """The blocks of `mask` holding a causally visible (query, key) pair, from the token
    grid (independent of `flex.block_reach`)."""
    rows = np.arange(q_len)[:, None] + (k_len - q_len)
    visible = np.arange(k_len)[None, :] <= rows
    any_pair = visible.reshape(q_len // BLOCK, BLOCK, k_len // BLOCK, BLOCK).any(axis=(1, 3))
    return mask & any_pair


def flex_output(q, k, v, block_mask) -> np.ndarray:
    import xattn_torch_bridge as bridge

    tq, tk, tv = (bridge.to_torch(x) for x in (q, k, v))
    return flex.attention_call(tq, tk, tv, block_mask, compiled=False)().numpy()


@needs_flex
@pytest.mark.parametrize("q_len, k_len", [(128, 128), (48, 128)])
def test_flex_on_the_converted_mask_is_our_attention(rand, q_len, k_len):
    """Lq = Lk, and a chunk of the last queries; float32, so the outputs agree closely.
    The block lists, which flex's eager path does not read, are checked apart."""
    q, k, v, mask = inputs(rand, q_len, k_len)
    mask[..., 0] = True  # no empty rows: a row with no key is zeros in ours
    block_mask = flex.to_block_mask(mask, q_len, k_len, BLOCK, "cpu")
    want = block_sparse_attention(q, k, v, jnp.asarray(mask), block_size=BLOCK, causal=True,
                                  impl="reference")
    np.testing.assert_allclose(flex_output(q, k, v, block_mask), np.asarray(want),
                               rtol=1e-5, atol=1e-5, err_msg=str(rand))
    listed = block_mask.to_dense().bool().numpy()
    np.testing.assert_array_equal(listed, listed_blocks(mask, q_len, k_len))
    assert flex.wrong_blocks(block_mask, mask, q_len, k_len, BLOCK) == 0


@needs_flex
def test_a_wrong_conversion_is_reported(rand, monkeypatch):
    """The peer row's check: a conversion of the transposed mask gives a record that
    disagrees, through both its output and its block lists."""
    q, k, v, mask = inputs(rand, 128, 128)
    mask |= np.eye(mask.shape[-1], dtype=bool)
    ours = block_sparse_attention(q, k, v, jnp.asarray(mask), block_size=BLOCK, causal=True,
                                  impl="reference")
    right = flex.peer_row("case", q, k, v, mask, ours, BLOCK, 1.0, {}, reps=1)
    assert right["agrees"] and right["wrong_blocks"] == 0 and right["max_abs_error"] < 1e-4
    convert = flex.to_block_mask
    monkeypatch.setattr(flex, "to_block_mask",
                        lambda m, *args: convert(np.swapaxes(m, -1, -2).copy(), *args))
    wrong = flex.peer_row("case", q, k, v, mask, ours, BLOCK, 1.0, {}, reps=1)
    assert not wrong["agrees"] and wrong["wrong_blocks"] > 0
    assert wrong["max_abs_error"] > 10 * flex.ATOL


@pytest.mark.slow
def test_smoke_run_records_every_row(tmp_path, capsys):
    """The SmolLM2 case has cuDNN's (on the CPU, XLA's) dense attention as a peer; each
    contiguous attention on a mask has a flex peer that agrees with it (where torch has
    flex_attention); the xattention case adds its attention alone."""
    path, md = tmp_path / "rows.json", tmp_path / "rows.md"
    names = ["attention-d0.25-causal-16k", "smollm2-causal-8k", "xattention-causal-128k",
             "attention-d0.25-chunk4096-ctx64k-paged128"]
    assert attention.main(["--smoke", "--cases", ",".join(names), "--json", str(path),
                           "--md", str(md)]) == 0
    records = json.loads(path.read_text())
    peer = ("flexattention",) if HAS_FLEX else ()
    want = [("attention-d0.25-causal-16k", impl) for impl in ("xattn-jax", *peer)]
    want += [("smollm2-causal-8k", impl) for impl in ("xla", "xattn-jax", *peer)]
    want += [("xattention-causal-128k", "xattn-jax")]
    want += [("xattention-causal-128k-attention", impl) for impl in ("xattn-jax", *peer)]
    want += [("attention-d0.25-chunk4096-ctx64k-paged128", "xattn-jax")]
    assert [(r["case"], r["impl"].split("/")[0]) for r in records] == want
    smollm2 = [r for r in records if r["case"] == "smollm2-causal-8k"]
    assert smollm2[1]["density"] == 1.0
    whole, masked = (next(r for r in records if r["case"] == name) for name in (
        "xattention-causal-128k", "xattention-causal-128k-attention"))
    assert 0 < masked["density"] == whole["density"] < 1
    flex_rows = [r for r in records if r["impl"] == flex.IMPL]
    for r in flex_rows:
        assert r["agrees"] and r["wrong_blocks"] == 0 and r["mode"] == "eager"
        assert r["max_abs_error"] < flex.ATOL + flex.RTOL
    report, printed = md.read_text(), capsys.readouterr().out
    assert "| smollm2-causal-8k | xla |" in report and "| smollm2-causal-8k | xla |" in printed
    assert report.count(": agrees") == len(flex_rows)
