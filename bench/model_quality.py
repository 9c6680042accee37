"""XAttention's quality on a real model and real text: `python -m bench.model_quality`.

The model is SmolLM2-135M-Instruct (`bench.smollm2`) run by the JAX forward of
`bench.llama` (equal to the transformers model: tests/test_real_model.py), on the first
`--length` tokens of a real text (`bench.texts`). Every setting replaces the prefill's
attention in all layers; the reference is the same forward with dense attention. Scored
over the second half of the text (each position predicting the next token):
- ppl: perplexity change against dense, in %;
- top-1: the share of positions whose most likely next token is dense's;
- KL: KL(dense || setting) per position, mean and 99th percentile;
- density: the share of the causally visible (query block, key block) pairs computed,
  mean over layers and heads (per layer in the JSON records);
- the passkey grid (`--passkey`): a needle at depths 10-90% of a `--passkey-length`
  prompt; the answer's log-probability when prefilled (teacher-forced), and whether
  greedy decoding (dense attention over the cache after the prefill) writes it.

Settings (`SETTINGS`, or `--settings a,b`): "dense"; the estimate's rule at a threshold
and stride; `xattention`'s defaults (`xattn_jax.attention`: threshold, min_blocks,
dense_last), on the antidiagonal estimate and on sampled rows ("sampled-rows",
`xattn_jax.sampled_block_mass`); "estimate-fp8", the estimate on the keys in fp8 (`xattn_jax.fp8.quantize_keys`,
what an offloaded cache's key shadow holds); "oracle" rows, which apply the same selection
rule to the exact block mass of the true attention (what no estimate can beat: the loss the
rule itself causes); and with `--calibrate-on TEXT`, per-head tables from
`xattn_jax.calibrate` on the other text's dense forward at each `--targets` density (so
that nothing is tuned to the text scored), for each of `--calibrate-rules` (the
antidiagonal estimate, sampled rows, and the oracle: the same allocation on the exact
block mass, the best any estimate's table can do). `--fp8-agreement` also reports, per
layer on the dense model's activations, the share of the causally allowed block pairs on
which the estimate on fp8 keys selects as the estimate on the bf16 keys, beside the same
share for bf16 keys against the float32 keys they were rounded from (a rounding 16 times
finer).

    python -m bench.model_quality --text licenses --calibrate-on python-docs --passkey
    python -m bench.plot_model_quality RESULTS.json OUT.png   # KL against density
    python -m bench.model_quality --smoke        # CPU, a few settings at 512 tokens
    python -m bench.model_quality --length 4096 --settings dense --fp8-agreement
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import xattn_jax
from bench import llama, smollm2, texts
from xattn_jax import fp8
from xattn_jax.calibrate import allocate, head_curves
from xattn_jax.defaults import DENSE_LAST, MIN_BLOCKS, THRESHOLD
from bench.common import MODEL_QUALITY, commit, gpu_name, log, today, versions, write_outputs

QUALITY_KEY = ("benchmark", "setting", "text", "gpu")  # what identifies a row (merge_json)
PASSKEY_DEPTHS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
PASSKEY_KEYS = (71432, 38517, 90264, 46871, 25309, 63148, 17952, 84036, 52790)
KEPT_NATS = 1.0  # a passkey is kept when its log-prob is at most this below dense's


@dataclasses.dataclass(frozen=True)
class Setting:
    """One way to run the prefill's attention.

    rule: "dense", "estimate" (xattn_estimate's block sums), "estimate-fp8" (the same on
    the keys in fp8, `xattn_jax.fp8.quantize_keys`), "sampled-rows" (the exact mass of
    16 sampled query rows per block, `xattn_jax.sampled_block_mass`) or "oracle" (the
    exact block mass of the true attention), selected by xattn_jax's threshold rule, on blocks of
    `block_size` tokens (the estimate with `stride` and `norm`). Levers, passed as data
    (no recompilation): threshold, a float or a `[layers, Hq]` table; dense_last, the
    last query blocks keep every block they may see; min_blocks, each row keeps at least
    its highest-scoring blocks; dense_layers, layers run densely.
    """

    name: str
    rule: str = "estimate"
    threshold: float | tuple = 0.9
    stride: int = 8
    block_size: int = 128
    norm: float = 1.0
    dense_last: int = 0
    min_blocks: int = 0
    dense_layers: tuple = ()

    @property
    def kernel(self) -> tuple:
        """What the compiled prefill depends on (the rest is data)."""
        return self.rule, self.stride, self.block_size, self.norm

    def layer_data(self, cfg: llama.LlamaConfig) -> dict:
        """The levers per layer: threshold float32 `[layers, Hq]` (above 1 in the dense
        layers: every allowed block), dense_last and min_blocks int32 `[layers]`."""
        t = np.broadcast_to(np.asarray(self.threshold, np.float32), (cfg.layers, cfg.heads))
        t = t.copy()
        t[list(self.dense_layers)] = 2.0
        per_layer = functools.partial(np.full, cfg.layers, dtype=np.int32)
        return {"threshold": jnp.asarray(t), "dense_last": per_layer(self.dense_last),
                "min_blocks": per_layer(self.min_blocks)}


def grid(rule: str, thresholds, **kw) -> list[Setting]:
    tag = "" if not kw else " " + " ".join(f"{k}={v}" for k, v in kw.items())
    return [Setting(f"{rule} {t}{tag}", rule, t, **kw) for t in thresholds]


DEFAULTS = Setting("xattention defaults", threshold=THRESHOLD, min_blocks=MIN_BLOCKS,
                   dense_last=DENSE_LAST)
SAMPLED_DEFAULTS = dataclasses.replace(DEFAULTS, name="sampled-rows defaults",
                                       rule="sampled-rows")
SETTINGS = ([Setting("dense", "dense"), DEFAULTS, SAMPLED_DEFAULTS]
            + grid("estimate", (0.8, 0.9, 0.95, 0.97, 0.99))
            + grid("sampled-rows", (0.9, 0.95, 0.97))
            + grid("estimate", (0.9, 0.95), stride=16)
            + grid("estimate-fp8", (0.9, 0.95))
            + grid("oracle", (0.8, 0.9, 0.95, 0.97, 0.99)))
SMOKE = [Setting("dense", "dense"), dataclasses.replace(DEFAULTS, block_size=64),
         Setting("estimate 0.9", block_size=64, stride=8),
         Setting("sampled-rows 0.9", "sampled-rows", block_size=64),
         Setting("oracle 0.9", "oracle", block_size=64)]


# --- masks -----------------------------------------------------------------------------

def exact_block_mass(q, k, block_size: int, scale: float) -> jax.Array:
    """The true causal attention's mass per (query block, key block): float32
    `[B, Hq, qb, kb]` for q `[B, Hq, L, D]`, k `[B, Hkv, L, D]` (Lq = Lk)."""
    b, hq, n, d = q.shape
    hkv = k.shape[1]
    qg = q.reshape(b, hkv, hq // hkv, n, d).astype(jnp.float32)
    s = jnp.einsum("bkgid,bkjd->bkgij", qg, k.astype(jnp.float32)) * scale
    s = jnp.where(jnp.tril(jnp.ones((n, n), bool)), s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1).reshape(b, hq, n, n)
    blocks = -(-n // block_size)
    pad = blocks * block_size - n
    p = jnp.pad(p, ((0, 0), (0, 0), (0, pad), (0, pad)))
    return p.reshape(b, hq, blocks, block_size, blocks, block_size).sum(axis=(3, 5))


def causal_allowed(blocks: int) -> jax.Array:
    return jnp.tril(jnp.ones((blocks, blocks), bool))


def apply_levers(mask, sums, levers: dict) -> jax.Array:
    """dense_last and min_blocks (int32 scalars, data) on a selected mask
    `[B, Hq, qb, kb]`; sums: the scores it was selected on."""
    qb = mask.shape[-2]
    allowed = causal_allowed(qb)
    ranked = jnp.where(allowed, sums, -1.0)
    descending = -jnp.sort(-ranked, axis=-1)
    kth = jnp.take(descending, jnp.maximum(levers["min_blocks"] - 1, 0), axis=-1)[..., None]
    mask = mask | (allowed & (ranked >= kth) & (levers["min_blocks"] > 0))
    last = jnp.arange(qb)[:, None] >= qb - levers["dense_last"]
    return mask | (allowed & last)


def select(q, k, levers: dict, kernel: tuple, scale: float):
    """The mask `[B, Hq, qb, kb]` of a (rule, stride, block_size, norm) and its levers."""
    rule, stride, bs, norm = kernel
    if rule in ("oracle", "sampled-rows"):
        sums = exact_block_mass(q, k, bs, scale) if rule == "oracle" else \
            xattn_jax.sampled_block_mass(q, k, block_size=bs, scale=scale)
        mask = xattn_jax.select_blocks(sums, levers["threshold"], causal=True)
    else:
        keys = fp8.quantize_keys(k) if rule == "estimate-fp8" else k
        sums, mask = xattn_jax.xattn_estimate(q, keys, block_size=bs, stride=stride,
                                              threshold=levers["threshold"], causal=True,
                                              norm=norm)
    return apply_levers(mask, sums, levers)


def density_per_head(mask) -> jax.Array:
    """float32 `[Hq]`: the share of causally visible blocks a mask keeps."""
    allowed = causal_allowed(mask.shape[-1])
    kept = (mask & allowed).sum(axis=(0, 2, 3))
    return (kept / (allowed.sum() * mask.shape[0])).astype(jnp.float32)


def make_attention(kernel: tuple, cfg: llama.LlamaConfig):
    """The prefill attention of a setting's kernel: `(q, k, v, levers) -> (out,
    density)`, density float32 `[Hq]`."""
    if kernel[0] == "dense":
        def dense(q, k, v, levers):
            del levers
            return llama.dense_attention(q, k, v, scale=cfg.scale), jnp.ones(q.shape[1])
        return dense
    bs = kernel[2]

    def attention(q, k, v, levers):
        mask = select(q, k, levers, kernel, cfg.scale)
        out = xattn_jax.block_sparse_attention(q, k, v, mask, block_size=bs, causal=True,
                                               scale=cfg.scale)
        return out, density_per_head(mask)

    return attention


# --- metrics ---------------------------------------------------------------------------

@jax.jit
def _scores(dense_logits, logits, targets):
    """Per position: dense's and the setting's NLL of the target, KL(dense || setting),
    and whether the top-1 tokens agree. logits float32 `[P, V]`, targets int `[P]`."""
    ld = jax.nn.log_softmax(dense_logits, axis=-1)
    ls = jax.nn.log_softmax(logits, axis=-1)
    nll_d = -jnp.take_along_axis(ld, targets[:, None], axis=-1)[:, 0]
    nll_s = -jnp.take_along_axis(ls, targets[:, None], axis=-1)[:, 0]
    kl = jnp.sum(jnp.exp(ld) * (ld - ls), axis=-1)
    agree = jnp.argmax(ld, axis=-1) == jnp.argmax(ls, axis=-1)
    return nll_d, nll_s, kl, agree


def text_metrics(dense_logits, logits, tokens) -> dict:
    """Scores over the second half: positions n/2 .. n-2 predicting tokens n/2+1 .. n-1."""
    n = tokens.shape[0]
    start = n // 2
    nll_d, nll_s, kl, agree = (np.asarray(x) for x in _scores(
        dense_logits[start:n - 1], logits[start:n - 1], tokens[start + 1:]))
    ppl_d, ppl_s = float(np.exp(nll_d.mean())), float(np.exp(nll_s.mean()))
    return {"ppl": ppl_s, "ppl_change_pct": 100 * (ppl_s / ppl_d - 1),
            "top1": float(agree.mean()), "kl_mean": float(kl.mean()),
            "kl_p99": float(np.percentile(kl, 99))}


# --- running ---------------------------------------------------------------------------

class Model:
    """The real model's weights, config and tokenizer, and one compiled prefill per
    setting's attention."""

    def __init__(self, dtype):
        from transformers import AutoTokenizer

        path = smollm2.gguf_path()
        self.tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        self.cfg, self.params = llama.read_gguf(path, dtype)
        self._attention = {}

    def attention(self, setting: Setting):
        if setting.kernel not in self._attention:
            self._attention[setting.kernel] = make_attention(setting.kernel, self.cfg)
        return self._attention[setting.kernel]

    def prefill(self, tokens, setting: Setting):
        """float32 logits `[L, vocab]` and the density `[layers, Hq]` of one sequence."""
        logits, density, _ = llama.prefill(self.params, jnp.asarray(tokens)[None],
                                           setting.layer_data(self.cfg), cfg=self.cfg,
                                           attention=self.attention(setting))
        return logits[0], np.asarray(density)

    def generate(self, tokens, setting: Setting, steps: int) -> list[int]:
        return llama.generate(self.params, jnp.asarray(tokens)[None], steps, cfg=self.cfg,
                              attention=self.attention(setting),
                              layer_data=setting.layer_data(self.cfg))[0].tolist()


def layer_qkv(model: Model, tokens) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Every layer's q, k, v in the dense forward over tokens: `[layers, 1, H, L, D]`."""
    def attention(q, k, v, layer):
        del layer
        return llama.dense_attention(q, k, v, scale=model.cfg.scale), (q, k, v)

    _, qkv, _ = llama.prefill(model.params, jnp.asarray(tokens)[None], cfg=model.cfg,
                              attention=attention)
    return qkv


def calibrated(model: Model, tokens, text: str, target: float, base: Setting) -> Setting:
    """`base` with the per-head table for a mean density of `target`, calibrated on tokens
    (of `text`) at base's rule, block size, stride, norm and widening: `xattn_jax.calibrate`
    for the estimates, and for the oracle the same allocation over the exact block mass's
    curves (`xattn_jax.calibrate.head_curves` with block_scores)."""
    q, k, v = layer_qkv(model, tokens)
    options = dict(scale=model.cfg.scale, block_size=base.block_size, stride=base.stride,
                   norm=base.norm, min_blocks=base.min_blocks, dense_last=base.dense_last)
    if base.rule == "oracle":
        curves = [head_curves(
            *qkv, block_scores=exact_block_mass(qkv[0], qkv[1], base.block_size,
                                                model.cfg.scale), **options)
            for qkv in zip(q, k, v)]
        density, error = (np.stack(c) for c in zip(*curves))
        table = allocate(density, error, target_density=target)
    else:
        estimate = "sampled-rows" if base.rule == "sampled-rows" else "antidiagonal"
        table = xattn_jax.calibrate(zip(q, k, v), target_density=target, estimate=estimate,
                                    **options)
    log(f"calibrated {base.rule} on {text} for density {target}: thresholds "
        f"{dict(zip(*np.unique(table, return_counts=True)))}")
    return dataclasses.replace(base, name=f"calibrated {base.rule} {target} on {text}",
                               threshold=tuple(map(tuple, table.tolist())))


def one_at_a_time(model: Model, tokens, base: Setting, dense_logits) -> dict:
    """Where `base`'s loss comes from: its rule in one layer at a time (the others dense),
    then in one head at a time. Returns {"layers": [metrics per layer], "heads":
    [[metrics per head] per layer]} (text_metrics without ppl)."""
    cfg = model.cfg
    out = {"layers": [], "heads": []}

    def only(cells) -> Setting:
        table = np.full((cfg.layers, cfg.heads), 2.0, np.float32)
        for layer, head in cells:
            table[layer, head] = base.threshold
        return dataclasses.replace(base, threshold=tuple(map(tuple, table)))

    for layer in range(cfg.layers):
        logits, _ = model.prefill(tokens, only([(layer, h) for h in range(cfg.heads)]))
        out["layers"].append(text_metrics(dense_logits, logits, tokens))
    for layer in range(cfg.layers):
        row = []
        for head in range(cfg.heads):
            logits, _ = model.prefill(tokens, only([(layer, head)]))
            row.append(text_metrics(dense_logits, logits, tokens))
        out["heads"].append(row)
        log(f"{base.name}: layer {layer} one head at a time done")
    return out


def head_errors(model: Model, tokens, thresholds, stride: int, block_size: int) -> dict:
    """Per layer and head, on the dense model's own activations (nothing propagates):
    the estimate's and the oracle's density and relative output error
    ||o - o_dense|| / ||o_dense|| (over the second half's rows) at each threshold, and the
    share of the true mass in the forced blocks (sink and diagonal).
    Returns numpy arrays `[layers, thresholds, Hq]` and `[layers, Hq]`."""
    cfg = model.cfg
    t_all = jnp.asarray(thresholds, jnp.float32)

    def attention(q, k, v, levers):
        del levers
        dense = llama.dense_attention(q, k, v, scale=cfg.scale).astype(jnp.float32)
        half = q.shape[2] // 2
        def head_norm(x):  # [B, Hq, L, D] -> [Hq], over the second half's rows
            return jnp.sqrt(jnp.sum(jnp.square(x[:, :, half:]), axis=(0, 2, 3)))

        norm = head_norm(dense)
        mass = exact_block_mass(q, k, block_size, cfg.scale)
        sums, _ = xattn_jax.xattn_estimate(q, k, block_size=block_size, stride=stride,
                                           causal=True)
        qb = mass.shape[-1]
        forced = (jnp.arange(qb)[None, :] == 0) | jnp.eye(qb, dtype=bool)
        forced_share = (jnp.where(forced, mass, 0).sum(axis=(0, 2, 3))
                        / mass.sum(axis=(0, 2, 3)))

        def at(t):
            rows = {}
            for rule, scores in (("estimate", sums), ("oracle", mass)):
                mask = xattn_jax.select_blocks(scores, jnp.full((q.shape[1],), t), causal=True)
                o = xattn_jax.block_sparse_attention(q, k, v, mask, block_size=block_size,
                                                     causal=True, scale=cfg.scale)
                err = head_norm(o.astype(jnp.float32) - dense) / norm
                rows[rule] = (density_per_head(mask), err)
            return rows

        per_t = jax.lax.map(at, t_all)
        return dense.astype(q.dtype), {"forced_share": forced_share, **{
            f"{rule}_{what}": per_t[rule][i] for rule in ("estimate", "oracle")
            for i, what in enumerate(("density", "error"))}}

    _, aux, _ = llama.prefill(model.params, jnp.asarray(tokens)[None], None, cfg=cfg,
                              attention=attention)
    return {name: np.asarray(x) for name, x in aux.items()}


FP8_AGREEMENT = dict(threshold=0.9, block_size=128, stride=8)  # --fp8-agreement's estimate


def fp8_agreement(model: Model, tokens) -> np.ndarray:
    """float `[2, layers]`: per layer, the share of the causally allowed (query block, key
    block) pairs on which the causal estimate (FP8_AGREEMENT) selects alike: [0] on the
    keys in fp8 against the bf16 keys (the dense model's activations rounded to bf16),
    [1] the control, on the bf16 keys against the float32 keys they were rounded from."""
    options = dict(FP8_AGREEMENT, causal=True)

    def agreement(mask, other):
        allowed = causal_allowed(mask.shape[-1])
        return ((mask == other) & allowed).sum() / (allowed.sum() * mask[..., 0, 0].size)

    def attention(q, k, v, layer):
        del layer
        q16, k16 = q.astype(jnp.bfloat16), k.astype(jnp.bfloat16)
        _, mask = xattn_jax.xattn_estimate(q16, k16, **options)
        _, mask8 = xattn_jax.xattn_estimate(q16, fp8.quantize_keys(k16), **options)
        _, mask32 = xattn_jax.xattn_estimate(q16.astype(jnp.float32), k, **options)
        same = jnp.stack([agreement(mask, mask8), agreement(mask32, mask)])
        return llama.dense_attention(q, k, v, scale=model.cfg.scale), same

    _, same, _ = llama.prefill(model.params, jnp.asarray(tokens)[None], None, cfg=model.cfg,
                               attention=attention)
    return np.asarray(same).T


def fp8_markdown(same: np.ndarray) -> str:
    settings = ", ".join(f"{name} {value}" for name, value in FP8_AGREEMENT.items())
    fp8_keys, bf16_keys = same
    lines = ["", f"Estimate on fp8 keys against bf16 keys ({settings}): mask agreement per "
             f"layer, lowest {fp8_keys.min():.5f}, mean {fp8_keys.mean():.5f}. The control, "
             f"bf16 keys against the float32 keys they were rounded from: lowest "
             f"{bf16_keys.min():.5f}, mean {bf16_keys.mean():.5f}.", "",
             "| layer | fp8 against bf16 keys | bf16 against float32 keys |", "|---|---|---|"]
    lines += [f"| {i} | {x:.5f} | {y:.5f} |" for i, (x, y) in enumerate(same.T)]
    return "\n".join(lines) + "\n"


def answer_logprob(logits, prompt_len: int, answer: list[int]) -> float:
    """The teacher-forced log-probability of `answer` after the prompt."""
    steps = jax.nn.log_softmax(logits[prompt_len - 1: prompt_len - 1 + len(answer)], axis=-1)
    return float(sum(steps[i, a] for i, a in enumerate(answer)))


def passkey_grid(model: Model, settings, haystack, length: int) -> dict:
    """{setting name: [{depth, logprob, greedy}]} over PASSKEY_DEPTHS."""
    out = {s.name: [] for s in settings}
    for depth, key in zip(PASSKEY_DEPTHS, PASSKEY_KEYS):
        prompt, answer = texts.passkey_prompt(model.tokenizer, haystack, depth, key, length)
        for s in settings:
            logits, _ = model.prefill(prompt + answer, s)
            written = model.generate(prompt, s, len(answer))
            out[s.name].append({"depth": depth,
                                "logprob": answer_logprob(logits, len(prompt), answer),
                                "greedy": written == answer})
        log(f"passkey depth {depth:.0%} done")
    return out


def run(model: Model, settings, tokens, passkey_length: int | None, text: str) -> list[dict]:
    tokens = np.asarray(tokens)
    dense_logits, _ = model.prefill(tokens, Setting("dense", "dense"))
    records = []
    for s in settings:
        t0 = time.perf_counter()
        logits, density = model.prefill(tokens, s)
        rec = {"setting": s.name, "rule": s.rule, "text": text, "length": len(tokens),
               "threshold": s.threshold, "stride": s.stride, "block_size": s.block_size,
               "min_blocks": s.min_blocks, "dense_last": s.dense_last,
               "density": float(density.mean()),
               "density_per_layer": density.mean(axis=1).round(4).tolist(),
               **text_metrics(dense_logits, logits, tokens)}
        records.append(rec)
        log(f"{s.name}: density {rec['density']:.3f} top-1 {rec['top1']:.3f} "
            f"KL {rec['kl_mean']:.4f} ppl {rec['ppl_change_pct']:+.2f}% "
            f"({time.perf_counter() - t0:.1f} s)")
    if passkey_length:
        haystack = texts.text_tokens(model.tokenizer, text, passkey_length)
        grid_ = passkey_grid(model, settings, haystack, passkey_length)
        for rec in records:
            rec["passkey"] = grid_[rec["setting"]]
    return records


def header(records: list[dict], command: str) -> str:
    """The record's heading: the command, and what and where it ran."""
    r = records[0]
    return (f"`{command}`\n\n{r['text']}, {r['length']} tokens, {r['dtype']}, {r['gpu']}, "
            f"{r['date']}, commit {r['commit']}; {r['versions']}")


def markdown(records: list[dict], header: str) -> str:
    lines = [header, "",
             "| setting | density | top-1 | ppl change | KL mean | KL p99 | passkey kept |",
             "|---|---|---|---|---|---|---|"]
    dense = next((r for r in records if r["rule"] == "dense"), None)
    for r in records:
        kept = ""
        if "passkey" in r and dense is not None:
            ok = [p["logprob"] >= d["logprob"] - KEPT_NATS
                  for p, d in zip(r["passkey"], dense["passkey"])]
            kept = f"{sum(ok)}/{len(ok)}"
        lines.append(f"| {r['setting']} | {r['density']:.3f} | {r['top1']:.4f} | "
                     f"{r['ppl_change_pct']:+.2f}% | {r['kl_mean']:.4f} | {r['kl_p99']:.3f} | "
                     f"{kept} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--text", default="python-docs", choices=sorted(texts.TEXTS))
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--passkey", action="store_true")
    parser.add_argument("--passkey-length", type=int, default=7168)
    parser.add_argument("--settings", help="comma-separated names from SETTINGS")
    parser.add_argument("--calibrate-on", choices=sorted(texts.TEXTS),
                        help="add per-head tables calibrated on this text's dense forward")
    parser.add_argument("--calibrate-rules", default="estimate",
                        help="comma-separated rules to calibrate: estimate, sampled-rows, "
                             "oracle")
    parser.add_argument("--targets", default="0.3,0.35",
                        help="comma-separated mean densities to calibrate for")
    parser.add_argument("--smoke", action="store_true", help="CPU-sized: 512 tokens")
    parser.add_argument("--fp8-agreement", action="store_true",
                        help="also report the fp8 keys' mask agreement per layer")
    parser.add_argument("--json", help="merge the records into this JSON record (by "
                        "setting, text and gpu: bench.common.merge_json)")
    parser.add_argument("--md", help="write the markdown table here")
    args = parser.parse_args(argv)
    reason = smollm2.missing()
    if reason:
        raise SystemExit(reason)
    settings = SMOKE if args.smoke else SETTINGS
    if args.settings:
        names = args.settings.split(",")
        settings = [s for s in settings if s.name in names]
    length = 512 if args.smoke else args.length
    dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    model = Model(dtype)
    tokens = texts.text_tokens(model.tokenizer, args.text, length)
    if args.calibrate_on:
        sample = texts.text_tokens(model.tokenizer, args.calibrate_on, length)
        base = SMOKE[1] if args.smoke else DEFAULTS
        settings = settings + [
            calibrated(model, sample, args.calibrate_on, float(t),
                       dataclasses.replace(base, rule=rule))
            for rule in args.calibrate_rules.split(",") for t in args.targets.split(",")]
    records = run(model, settings, tokens, (256 if args.smoke else args.passkey_length)
                  if args.passkey else None, args.text)
    meta = {"benchmark": MODEL_QUALITY, "gpu": gpu_name(), "date": today(),
            "versions": versions(), "dtype": jnp.dtype(dtype).name, "commit": commit()}
    for r in records:
        r.update(meta)
    command = " ".join(["python -m bench.model_quality", *(sys.argv[1:] if argv is None
                                                           else argv)])
    table = markdown(records, header(records, command))
    if args.fp8_agreement:
        table += fp8_markdown(fp8_agreement(model, tokens))
    write_outputs(records, table, args.json, args.md, key=QUALITY_KEY)


if __name__ == "__main__":
    main()
