"""Retrieval that no single passkey decides, on the real model: `python -m bench.retrieval`.

The tasks of `bench.retrieval_tasks` (several keys with distractors, variable tracking,
the most frequent word), `--items` seeded items each, every prompt and its answer
`--length` tokens of a `--text` window (`bench.texts`) in the model's chat template. The
model and the settings are `bench.model_quality`'s: SmolLM2-135M-Instruct in the JAX
forward of `bench.llama`, `SETTINGS` by name (`--settings`; dense always runs first) and
with `--calibrate-on TEXT` its per-head tables calibrated on the first `--length` tokens
of the other text. Per setting and task, from one teacher-forced forward per item over
prompt + answer:
- accuracy: the share of items solved (`retrieval_tasks.solved`: at every scored answer
  token, the number, name or word the facts give, the most likely token spells the
  answer from there), and its change against dense in points;
- log-prob: the scored answer tokens' summed log-probability, mean over items, and the
  mean change against dense of the same items;
- density: the share of the causally visible blocks computed, mean over items, layers
  and heads.

    python -m bench.retrieval --text licenses --calibrate-on python-docs \\
        --json RECORDS.json --md RECORD.md
    python -m bench.plot_retrieval RECORDS.json PLOT.png
    python -m bench.retrieval --smoke        # CPU-sized: 512 tokens, 2 items, block 64
    python -m bench.retrieval --settings dense --items 3 --device cpu   # dense's check
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

from bench import model_quality, retrieval_tasks, smollm2, texts
from bench.common import RETRIEVAL, commit, log, today, versions, write_outputs

TARGET_POINTS = 2.0  # the defaults' accuracy should stay within this of dense's
ITEMS = 50  # per task by default: one item is 2 points, TARGET_POINTS
# what identifies a record's row (bench.common.merge_json); "gpu" is the device's name
RETRIEVAL_KEY = ("benchmark", "setting", "task", "text", "gpu")
DENSE = model_quality.Setting("dense", "dense")
CALIBRATE_RULES = ("estimate", "sampled-rows", "oracle")  # model_quality.calibrated's


@functools.partial(jax.jit, static_argnames=("answer_len",))
def answer_scores(logits, answer, scored, *, answer_len: int):
    """Per answer token: the most likely token and the log-probability of the answer's
    token where it stands, and their summed log-probability over the scored tokens.
    logits float32 `[L, vocab]` of prompt + answer, the answer last; answer int
    `[answer_len]`; scored bool `[answer_len]`."""
    n = logits.shape[0]
    steps = jax.nn.log_softmax(logits[n - 1 - answer_len:n - 1], axis=-1)
    logprobs = jnp.take_along_axis(steps, answer[:, None], axis=-1)[:, 0]
    return jnp.argmax(steps, axis=-1), jnp.sum(jnp.where(scored, logprobs, 0.0))


def score_items(model: model_quality.Model, setting: model_quality.Setting, items,
                label: str) -> list[dict]:
    """One teacher-forced forward per item: [{seed, solved, logprob, density}]."""
    out, last_log = [], time.perf_counter()
    for i, item in enumerate(items):
        logits, density = model.prefill(item.prompt + item.answer, setting)
        predicted, logprob = answer_scores(logits, jnp.asarray(item.answer),
                                           jnp.asarray(item.scored),
                                           answer_len=len(item.answer))
        out.append({"seed": list(item.seed),
                    "solved": retrieval_tasks.solved(model.tokenizer, item,
                                                     np.asarray(predicted)),
                    "logprob": float(logprob), "density": float(density.mean())})
        if time.perf_counter() - last_log > 20:
            log(f"{label}: item {i + 1}/{len(items)}")
            last_log = time.perf_counter()
    return out


def summary(rows: list[dict], dense_rows: list[dict]) -> dict:
    """A (setting, task)'s figures from its items' rows and dense's on the same items."""
    solved = np.mean([r["solved"] for r in rows])
    logprobs = np.asarray([r["logprob"] for r in rows])
    dense_logprobs = np.asarray([r["logprob"] for r in dense_rows])
    return {"accuracy": float(solved),
            "accuracy_change_points": 100 * float(solved - np.mean(
                [r["solved"] for r in dense_rows])),
            "logprob": float(logprobs.mean()),
            "logprob_change": float((logprobs - dense_logprobs).mean()),
            "density": float(np.mean([r["density"] for r in rows]))}


def run(model: model_quality.Model, settings, task_items: dict) -> list[dict]:
    """Records, one per (setting, task), dense's first."""
    dense = {}
    records = []
    order = [DENSE] + [s for s in settings if s.rule != "dense"]
    for done, s in enumerate(order, 1):
        t0 = time.perf_counter()
        for task, items in task_items.items():
            rows = score_items(model, s, items, f"{s.name}, {task}")
            dense.setdefault(task, rows)
            rec = {"setting": s.name, "rule": s.rule, "task": task, "items": len(items),
                   "threshold": s.threshold, "stride": s.stride, "block_size": s.block_size,
                   "min_blocks": s.min_blocks, "dense_last": s.dense_last,
                   **summary(rows, dense[task]), "per_item": rows}
            records.append(rec)
            log(f"{s.name}, {task}: accuracy {rec['accuracy']:.3f} "
                f"({rec['accuracy_change_points']:+.1f} points), log-prob "
                f"{rec['logprob']:.3f} ({rec['logprob_change']:+.3f}), density "
                f"{rec['density']:.3f}")
        took, left = time.perf_counter() - t0, len(order) - done
        log(f"{s.name} done, setting {done}/{len(order)} ({took:.1f} s with its compile; "
            f"the {left} left at this pace: {took * left:.0f} s)")
    return records


def markdown(records: list[dict], command: str) -> str:
    """The run's header, the accuracy and log-prob table, and the target's verdict."""
    r = records[0]
    tasks = list(dict.fromkeys(x["task"] for x in records))
    lines = [f"`{command}`", "",
             f"{r['text']}, {r['length']} tokens per prompt and answer, items per task: "
             f"{r['items']}, {r['form']} prompts, {r['dtype']}, {r['gpu']}, "
             f"{r['date']}, commit {r['commit']}; {r['versions']}", "",
             "Accuracy: items solved (every scored answer token the most likely, or a "
             "shorter spelling of it: `bench.retrieval_tasks.solved`), change against "
             "dense in points. Log-prob: "
             "the scored answer tokens' summed log-probability, mean over items, change "
             "against dense on the same items.", "",
             "| setting | density | " + " | ".join(f"{t} accuracy | {t} log-prob"
                                                  for t in tasks) + " |",
             "|---|---|" + "---|---|" * len(tasks)]
    by_setting: dict[str, dict] = {}
    for x in records:
        by_setting.setdefault(x["setting"], {})[x["task"]] = x
    for name, row in by_setting.items():
        density = np.mean([x["density"] for x in row.values()])
        cells = [f"{100 * x['accuracy']:.1f}% ({x['accuracy_change_points']:+.1f}) | "
                 f"{x['logprob']:.3f} ({x['logprob_change']:+.3f})"
                 for x in (row[t] for t in tasks)]
        lines.append(f"| {name} | {density:.3f} | " + " | ".join(cells) + " |")
    defaults = by_setting.get(model_quality.DEFAULTS.name)
    if defaults:
        worst = min(defaults.values(), key=lambda x: x["accuracy_change_points"])
        verdict = ("yes" if worst["accuracy_change_points"] >= -TARGET_POINTS else "no")
        lines += ["", f"The defaults within {TARGET_POINTS:g} points of dense's accuracy "
                      f"on every task: {verdict} (lowest: {worst['task']}, "
                      f"{worst['accuracy_change_points']:+.1f} points)."]
    return "\n".join(lines) + "\n"


def device_of(name: str):
    """The JAX device the run uses: "auto" (JAX's default: a GPU where there is one),
    "cpu" or "gpu"."""
    if name == "auto":
        return jax.devices()[0]
    try:
        return jax.devices(name)[0]
    except RuntimeError as e:
        raise SystemExit(f"--device {name}: {e}") from e


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--text", default="licenses", choices=sorted(texts.TEXTS))
    parser.add_argument("--length", type=int, default=7168,
                        help="tokens of each prompt and its answer together")
    parser.add_argument("--items", type=int,
                        help=f"items per task (default {ITEMS}: one item is 2 points; "
                             f"smoke: 2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tasks", default=",".join(retrieval_tasks.TASKS),
                        help="comma-separated names from bench.retrieval_tasks.TASKS")
    parser.add_argument("--form", default="chat", choices=retrieval_tasks.FORMATS)
    parser.add_argument("--settings", help="comma-separated names from "
                                           "bench.model_quality.SETTINGS")
    parser.add_argument("--calibrate-on", choices=sorted(texts.TEXTS),
                        help="add per-head tables calibrated on this text's dense forward")
    parser.add_argument("--calibrate-rules", default=",".join(CALIBRATE_RULES),
                        help="comma-separated rules to calibrate, of CALIBRATE_RULES")
    parser.add_argument("--targets", default="0.3,0.35",
                        help="comma-separated mean densities to calibrate for")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "gpu"))
    parser.add_argument("--smoke", action="store_true",
                        help="CPU-sized: 512 tokens, 2 items, model_quality.SMOKE")
    parser.add_argument("--json", help="write the records here")
    parser.add_argument("--md", help="write the markdown table here")
    args = parser.parse_args(argv)
    tasks = args.tasks.split(",")
    unknown = sorted(set(tasks) - set(retrieval_tasks.TASKS))
    if unknown:
        parser.error(f"--tasks: unknown {unknown}; known: {list(retrieval_tasks.TASKS)}")
    items = args.items if args.items is not None else (2 if args.smoke else ITEMS)
    if items < 1:
        parser.error(f"--items must be at least 1, got {args.items}")
    settings = model_quality.SMOKE if args.smoke else model_quality.SETTINGS
    if args.settings:
        names = args.settings.split(",")
        missing = sorted(set(names) - {s.name for s in settings})
        if missing:
            parser.error(f"--settings: unknown {missing}")
        settings = [s for s in settings if s.name in names]
    rules = args.calibrate_rules.split(",")
    if not set(rules) <= set(CALIBRATE_RULES):
        parser.error(f"--calibrate-rules: {rules}, known: {list(CALIBRATE_RULES)}")
    try:
        targets = [float(t) for t in args.targets.split(",")]
    except ValueError:
        parser.error(f"--targets: comma-separated densities, got {args.targets!r}")
    reason = smollm2.missing()
    if reason:
        raise SystemExit(reason)
    length = 512 if args.smoke else args.length
    device = device_of(args.device)
    dtype = jnp.bfloat16 if device.platform == "gpu" else jnp.float32
    command = " ".join(["python -m bench.retrieval",
                        *(sys.argv[1:] if argv is None else argv)])
    # what ran and where, taken before the run (the checkout may change during it)
    stamp = {"benchmark": RETRIEVAL, "text": args.text, "length": length, "form": args.form,
             "seed": args.seed, "gpu": device.device_kind, "dtype": jnp.dtype(dtype).name,
             "date": today(), "versions": versions(), "commit": commit(), "command": command}
    with jax.default_device(device):
        model = model_quality.Model(dtype)
        if args.calibrate_on:
            sample = texts.text_tokens(model.tokenizer, args.calibrate_on, length)
            base = model_quality.SMOKE[1] if args.smoke else model_quality.DEFAULTS
            settings = settings + [
                model_quality.calibrated(model, sample, args.calibrate_on, t,
                                         dataclasses.replace(base, rule=rule))
                for rule in rules for t in targets]
        haystack = retrieval_tasks.Haystack(
            model.tokenizer, model.tokenizer(texts.TEXTS[args.text]())["input_ids"])
        task_items = {t: retrieval_tasks.items(model.tokenizer, haystack, t, length, items,
                                               args.seed, args.form) for t in tasks}
        log(f"{items} items per task, {length} tokens, {len(settings)} settings on "
            f"{device.device_kind}")
        records = run(model, settings, task_items)
    for r in records:
        r.update(stamp)
    write_outputs(records, markdown(records, command), args.json, args.md, RETRIEVAL_KEY)


if __name__ == "__main__":
    main()
