"""Plots time against block size from `bench.estimate --json` records, ours and the original's.

    python -m bench.plot_sweep RESULTS.json [MORE.json ...] OUT.png
    python -m bench.plot_sweep bench/results/estimate.json sweep.png
"""

from __future__ import annotations

import re
import sys

from bench.plotting import records_and_output

_CASE = re.compile(r"noncausal-(\d+k)-b(\d+)$")


def main(argv=None) -> None:
    records, source, out = records_and_output(
        argv, "python -m bench.plot_sweep RESULTS.json [MORE.json ...] OUT.png")
    import matplotlib.pyplot as plt

    series: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for r in records:
        match = _CASE.match(r["case"])
        if match:
            series.setdefault((r["impl"], match[1]), []).append((int(match[2]), r["ms"]))
    if not series:
        sys.exit(f"{source} has no noncausal-<length>-b<block> records")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    lengths = sorted({length for _, length in series}, key=lambda n: int(n[:-1]))
    colors = dict(zip(lengths, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    for (impl, length), points in sorted(series.items()):  # color: length; line: impl
        points.sort()
        ax.plot([p[0] for p in points], [p[1] for p in points], color=colors[length],
                marker="o" if impl.startswith("xattn-jax") else "s",
                linestyle="-" if impl.startswith("xattn-jax") else "--", label=f"{impl}, {length}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("block size (tokens)")
    ax.set_ylabel("estimate time (ms)")
    ax.set_title(f"Non-causal estimate vs block size, {records[0]['gpu']}, bf16, "
                 f"Hq=32, D=128, S=8")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


if __name__ == "__main__":
    main()
