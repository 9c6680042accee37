"""Plots KL(dense || setting) and top-1 agreement against density from
`bench.model_quality --json` records: the estimate's and the oracle's threshold sweeps as
lines, `xattention`'s defaults and calibrated tables as points.

    python -m bench.plot_model_quality RESULTS.json [MORE.json ...] OUT.png
"""

from __future__ import annotations

import sys

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


def main(argv=None) -> None:
    records, source, out = records_and_output(
        argv, "python -m bench.plot_model_quality RESULTS.json [MORE.json ...] OUT.png")
    import matplotlib.pyplot as plt

    series = series_of(records)
    if not series:
        sys.exit(f"{source} holds no sparse settings")
    fig, (kl_ax, top_ax) = plt.subplots(1, 2, figsize=(13, 4.8))
    texts = list(dict.fromkeys(r["text"] for r in records))
    for name, rows in sorted(series.items()):
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
    fig.tight_layout()
    fig.savefig(out, dpi=120)


if __name__ == "__main__":
    main()
