"""Plots each retrieval task's accuracy and log-prob change against dense, over density,
from `bench.retrieval --json` records: threshold sweeps as lines, `xattention`'s
defaults and calibrated tables as points (`bench.plot_model_quality`'s series and style).

    python -m bench.plot_retrieval RESULTS.json OUT.png
"""

from __future__ import annotations

import sys

from bench.common import RETRIEVAL, rows_of
from bench.plot_model_quality import series_of, series_style
from bench.plotting import records_and_output

METRICS = (("accuracy_change_points", "accuracy change against dense, points"),
           ("logprob_change", "answer log-prob change against dense, nats"))


def main(argv=None) -> None:
    records, source, out = records_and_output(
        argv, "python -m bench.plot_retrieval RESULTS.json OUT.png")
    records = rows_of(records, RETRIEVAL)
    import matplotlib.pyplot as plt

    tasks = list(dict.fromkeys(r["task"] for r in records))
    if not series_of(records):
        sys.exit(f"{source} holds no sparse settings")
    fig, axes = plt.subplots(len(METRICS), len(tasks), figsize=(5 * len(tasks), 8),
                             squeeze=False)
    texts = list(dict.fromkeys(r["text"] for r in records))
    for column, task in enumerate(tasks):
        rows_of_task = [r for r in records if r["task"] == task]
        for row, (metric, label) in enumerate(METRICS):
            ax = axes[row, column]
            for name, rows in sorted(series_of(rows_of_task).items()):
                rows = sorted(rows, key=lambda r: r["density"])
                ax.plot([r["density"] for r in rows], [r[metric] for r in rows], label=name,
                        **series_style(rows, texts))
            ax.axhline(0, color="black", linewidth=0.8)  # dense
            ax.set_ylabel(label)
            ax.set_xlabel("density (share of causally visible blocks computed)")
            ax.grid(True, alpha=0.3)
        axes[0, column].set_title(f"{task}, {rows_of_task[0]['items']} items")
    axes[0, -1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5))
    first = records[0]
    fig.suptitle(f"Retrieval, SmolLM2-135M-Instruct, {first['length']} tokens of "
                 f"{first['text']}, {first['gpu']}, {first['date']}")
    fig.tight_layout()
    fig.savefig(out, dpi=120)


if __name__ == "__main__":
    main()
