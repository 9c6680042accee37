"""A small Llama forward in JAX on the real model's GGUF weights, for the quality
benchmarks and the cross-framework test (a bench helper, not public API).

SmolLM2-135M-Instruct (`bench.smollm2`) is a Llama: RMSNorm, rotary positions, grouped
query attention, a SiLU-gated MLP, the token embedding tied to the output. The weights
are read with the `gguf` package, which dequantizes them (Q4_1 and Q8_0 -> float32).

GGUF stores the query and key projections in llama.cpp's rotary layout, in which a head's
dimensions 2i and 2i + 1 form a rotated pair (transformers permutes them back to pair i
with i + D/2). Attention reads q and k only through dot products over the head
dimension, which the same permutation of both leaves unchanged, so this forward keeps the
file's layout and rotates adjacent pairs.

Attention is a function the caller passes in: `attention(q, k, v, layer) -> out` with q
`[B, Hq, L, D]`, k and v `[B, Hkv, L, D]` (not repeated), out `[B, Hq, L, D]`, and
`layer` whatever per-layer data the caller scans along with the weights (a threshold row,
say); it may also return `(out, aux)`, whose per-layer `aux` the forward stacks and
returns. The layers run under `lax.scan`, so one layer's attention is traced once.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

_LAYER_TENSORS = {  # our name: (GGUF name, transposed to [in, out])
    "attn_norm": ("attn_norm.weight", False), "wq": ("attn_q.weight", True),
    "wk": ("attn_k.weight", True), "wv": ("attn_v.weight", True),
    "wo": ("attn_output.weight", True), "ffn_norm": ("ffn_norm.weight", False),
    "w_gate": ("ffn_gate.weight", True), "w_up": ("ffn_up.weight", True),
    "w_down": ("ffn_down.weight", True),
}


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    rope_base: float
    eps: float

    @property
    def scale(self) -> float:
        return self.head_dim ** -0.5


def _field(reader, name: str):
    field = reader.fields[name]
    return field.parts[field.data[0]][0]


def read_gguf(path, dtype=jnp.float32) -> tuple[LlamaConfig, dict]:
    """The config and the weights of a Llama GGUF file, dequantized to `dtype`.

    Returns `(config, params)`: params["embed"] `[vocab, hidden]`, params["final_norm"]
    `[hidden]` and params["layers"], each entry stacked over the layers (projections
    `[layers, in, out]`, norms `[layers, hidden]`).
    """
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    cfg = LlamaConfig(layers=int(_field(reader, f"{arch}.block_count")), hidden=hidden,
                      heads=heads,
                      kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv")),
                      head_dim=hidden // heads,
                      vocab=int(_field(reader, f"{arch}.vocab_size")),
                      rope_base=float(_field(reader, f"{arch}.rope.freq_base")),
                      eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")))
    tensors = {t.name: t for t in reader.tensors}

    def load(name: str, transpose: bool) -> np.ndarray:
        t = tensors[name]
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        return w.T if transpose else w

    layers = {ours: jnp.asarray(np.stack([load(f"blk.{i}.{theirs}", transpose)
                                          for i in range(cfg.layers)]), dtype)
              for ours, (theirs, transpose) in _LAYER_TENSORS.items()}
    params = {"embed": jnp.asarray(load("token_embd.weight", False), dtype),
              "final_norm": jnp.asarray(load("output_norm.weight", False), dtype),
              "layers": layers}
    return cfg, params


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * weight.astype(jnp.float32)).astype(x.dtype)


def rotate(x: jax.Array, positions: jax.Array, base: float) -> jax.Array:
    """Rotary positions in the GGUF layout: x `[B, H, L, D]`, dims (2i, 2i + 1) rotated
    by positions * base^(-2i/D); positions int `[L]`."""
    d = x.shape[-1]
    freq = base ** (-jnp.arange(0, d, 2, dtype=jnp.float32) / d)
    angle = positions.astype(jnp.float32)[:, None] * freq[None, :]  # [L, D/2]
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    pairs = x.astype(jnp.float32).reshape(*x.shape[:-1], d // 2, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    out = jnp.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1)
    return out.reshape(x.shape).astype(x.dtype)


def dense_attention(q, k, v, layer=None, *, scale: float):
    """Causal dense attention (the queries are the last Lq keys): jax.nn's, GQA in place."""
    del layer
    out = jax.nn.dot_product_attention(q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3),
                                       v.transpose(0, 2, 1, 3), scale=scale, is_causal=True)
    return out.transpose(0, 2, 1, 3)


def _qkv(cfg: LlamaConfig, w: dict, h: jax.Array, positions: jax.Array):
    b, n, _ = h.shape
    x = rms_norm(h, w["attn_norm"], cfg.eps)

    def heads(y, count):
        return y.reshape(b, n, count, cfg.head_dim).transpose(0, 2, 1, 3)

    q = rotate(heads(x @ w["wq"], cfg.heads), positions, cfg.rope_base)
    k = rotate(heads(x @ w["wk"], cfg.kv_heads), positions, cfg.rope_base)
    return q, k, heads(x @ w["wv"], cfg.kv_heads)


def _finish_layer(cfg: LlamaConfig, w: dict, h: jax.Array, attn: jax.Array) -> jax.Array:
    b, _, n, _ = attn.shape
    h = h + attn.transpose(0, 2, 1, 3).reshape(b, n, -1) @ w["wo"]
    x = rms_norm(h, w["ffn_norm"], cfg.eps)
    return h + (jax.nn.silu(x @ w["w_gate"]) * (x @ w["w_up"])) @ w["w_down"]


def _logits(cfg: LlamaConfig, params: dict, h: jax.Array) -> jax.Array:
    x = rms_norm(h, params["final_norm"], cfg.eps)
    return jnp.einsum("bld,vd->blv", x, params["embed"], preferred_element_type=jnp.float32)


@functools.partial(jax.jit, static_argnames=("cfg", "attention", "keep_cache"))
def prefill(params: dict, tokens: jax.Array, layer_data=None, *, cfg: LlamaConfig,
            attention, keep_cache: bool = False):
    """The forward over a prompt: tokens int `[B, L]` -> float32 logits `[B, L, vocab]`.

    layer_data: a pytree with a leading axis of `cfg.layers`, scanned with the weights
    and passed to `attention` as its `layer` argument (None: None). Returns
    `(logits, aux, cache)`: aux the attention's per-layer extra output stacked (None when
    it returns only out), cache `(k, v)` each `[layers, B, Hkv, L, D]` with keep_cache,
    else None.
    """
    positions = jnp.arange(tokens.shape[1])
    h = params["embed"][tokens]

    def layer(h, xs):
        w, data = xs
        q, k, v = _qkv(cfg, w, h, positions)
        result = attention(q, k, v, data)
        out, aux = result if isinstance(result, tuple) else (result, None)
        return _finish_layer(cfg, w, h, out), (aux, (k, v) if keep_cache else None)

    h, (aux, cache) = jax.lax.scan(layer, h, (params["layers"], layer_data))
    return _logits(cfg, params, h), aux, cache


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",))
def decode_step(params: dict, token: jax.Array, position: jax.Array, cache, *,
                cfg: LlamaConfig):
    """One greedy-decoding step with dense attention over the cache.

    token: int `[B]` at `position` (int `[]`); cache: `(k, v)` each `[layers, B, Hkv,
    capacity, D]`, holding keys 0 .. position - 1. Returns `(logits [B, vocab], cache)`
    with the token's key and value written at `position`.
    """
    h = params["embed"][token][:, None, :]
    group = cfg.heads // cfg.kv_heads

    def layer(h, xs):
        w, k_cache, v_cache = xs
        q, k, v = _qkv(cfg, w, h, position[None])
        k_cache = jax.lax.dynamic_update_slice_in_dim(k_cache, k, position, axis=2)
        v_cache = jax.lax.dynamic_update_slice_in_dim(v_cache, v, position, axis=2)
        b, _, cap, d = k_cache.shape
        qg = q.reshape(b, cfg.kv_heads, group, d).astype(jnp.float32)
        s = jnp.einsum("bkgd,bkjd->bkgj", qg, k_cache.astype(jnp.float32)) * cfg.scale
        s = jnp.where(jnp.arange(cap) <= position, s, -jnp.inf)
        out = jnp.einsum("bkgj,bkjd->bkgd", jax.nn.softmax(s, axis=-1),
                         v_cache.astype(jnp.float32))
        out = out.reshape(b, cfg.heads, 1, d).astype(h.dtype)
        return _finish_layer(cfg, w, h, out), (k_cache, v_cache)

    h, cache = jax.lax.scan(layer, h, (params["layers"], *cache))
    return _logits(cfg, params, h)[:, 0], cache


def generate(params: dict, tokens: jax.Array, steps: int, *, cfg: LlamaConfig, attention,
             layer_data=None) -> np.ndarray:
    """Greedy decoding: the prompt's prefill with `attention`, then `steps` tokens with
    dense attention over the cache. tokens int `[B, L]` -> int `[B, steps]`."""
    b, n = tokens.shape
    logits, _, (k, v) = prefill(params, tokens, layer_data, cfg=cfg, attention=attention,
                                keep_cache=True)
    pad = ((0, 0), (0, 0), (0, 0), (0, steps), (0, 0))
    cache = (jnp.pad(k, pad), jnp.pad(v, pad))
    token = jnp.argmax(logits[:, -1], axis=-1)
    out = [token]
    for i in range(steps - 1):
        logits, cache = decode_step(params, token, jnp.int32(n + i), cache, cfg=cfg)
        token = jnp.argmax(logits, axis=-1)
        out.append(token)
    return np.asarray(jnp.stack(out, axis=1))
