"""Plots KL(dense || setting) and top-1 agreement against density from
`bench.model_quality --json` records: the estimate's and the oracle's threshold sweeps as
lines, `xattention`'s defaults and calibrated tables as points. Where the records also
hold `bench.quality_time`'s rows (model_quality.json holds both), its plot of quality
against time goes below, in the same image.

    python -m bench.plot_model_quality RESULTS.json [MORE.json ...] OUT.png
"""

from __future__ import annotations

import sys

from bench import plot_quality_time
from bench.common import MODEL_QUALITY, QUALITY_TIME, rows_of
from bench.plotting import records_and_output


def series_of(records: list[dict]) -> dict[str, list[dict]]:
    """Records grouped into what is drawn: one sweep per (rule, stride, text), each other
    setting (defaults, calibrated tables) alone; the dense row is left out."""
    series: dict[str, list[dict]] = {}
    for r in records:
        if r["rule"] == "dense":
            continue
        swept = r["setting"].split()[0] in ("estimate", "sampled-rows", "oracle") and not (
            r.get("min_blocks") or r.get("dense_last"))
        name = f"{r['rule']} stride {r['stride']}" if r["rule"] == "estimate" else r["rule"]
        key = f"{name if swept else r['setting']}, {r['text']}"
        series.setdefault(key, []).append(r)
    return series


RULE_COLORS = {"estimate": "tab:blue", "estimate-fp8": "tab:purple",
               "sampled-rows": "tab:green", "oracle": "tab:red"}


def series_style(rows: list[dict], texts: list[str]) -> dict:
    """One colour per rule; threshold sweeps as lines of dots, defaults as squares,
    calibrated tables as stars; the first text's marks filled, the others' hollow."""
    first = rows[0]
    color = RULE_COLORS.get(first["rule"], "tab:gray")
    if first["setting"].startswith("calibrated"):
        style = dict(marker="*", markersize=12, linestyle="none")
    elif "defaults" in first["setting"]:
        style = dict(marker="s", markersize=9, linestyle="none")
    else:  # a threshold sweep
        style = dict(marker="o", linestyle="-" if first["text"] == texts[0] else "--")
    if first["text"] != texts[0]:
        style["markerfacecolor"] = "none"
    return dict(style, color=color)


def draw(fig, records: list[dict]) -> None:
    """KL and top-1 against density, one series per `series_of`, on `fig` (a figure or a
    subfigure)."""
    kl_ax, top_ax = fig.subplots(1, 2)
    texts = list(dict.fromkeys(r["text"] for r in records))
    for name, rows in sorted(series_of(records).items()):
        rows = sorted(rows, key=lambda r: r["density"])
        style = series_style(rows, texts)
        for ax, metric in ((kl_ax, "kl_mean"), (top_ax, "top1")):
            ax.plot([r["density"] for r in rows], [r[metric] for r in rows], label=name,
                    **style)
    kl_ax.set_yscale("log")
    kl_ax.set_ylabel("KL(dense || setting), mean per position")
    top_ax.set_ylabel("top-1 agreement with dense")
    first = records[0]
    for ax in (kl_ax, top_ax):
        ax.set_xlabel("density (share of causally visible blocks computed)")
        ax.grid(True, which="both", alpha=0.3)
    top_ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5))
    fig.suptitle(f"SmolLM2-135M-Instruct, {first['length']} tokens, {first['gpu']}, "
                 f"{first['date']}")


def figure(records: list[dict]):
    """Quality against density (`draw`) of the records' model_quality rows; where they
    hold quality_time rows too, quality against time below (`plot_quality_time.figure`).
    Raises ValueError where they hold no sparse setting."""
    import matplotlib.pyplot as plt

    quality, timed = rows_of(records, MODEL_QUALITY), rows_of(records, QUALITY_TIME)
    if not series_of(quality):
        raise ValueError("records: no sparse setting of bench.model_quality")
    if not timed:
        fig = plt.figure(figsize=(13, 4.8), layout="tight")
        draw(fig, quality)
        return fig
    width, height = plot_quality_time.figure_size(timed)
    fig = plt.figure(figsize=(max(13, width), 4.8 + height), layout="constrained")
    top, bottom = fig.subfigures(2, 1, height_ratios=(4.8, height))
    draw(top, quality)
    plot_quality_time.figure(plot_quality_time.one_gpu(timed, None), bottom)
    return fig


def main(argv=None) -> None:
    records, source, out = records_and_output(
        argv, "python -m bench.plot_model_quality RESULTS.json [MORE.json ...] OUT.png")
    try:
        fig = figure(records)
    except ValueError as e:
        sys.exit(f"{source}: {e}")
    fig.savefig(out, dpi=120)


if __name__ == "__main__":
    main()
