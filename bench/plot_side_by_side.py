"""Plots each case's time over its floor for the original, the Triton and the Mosaic GPU
kernels, from `bench.estimate --json` / `bench.chunked --json` records (one file holding
both, as bench/results/estimate.json does, or several files, read in order).

    python -m bench.plot_side_by_side RESULTS.json [MORE.json ...] OUT.png
    python -m bench.plot_side_by_side bench/results/estimate.json \
        bench/results/side_by_side.png

One group of bars a case (in the records' order), one bar an implementation (a record's
`impl` up to its first " (", so that labelled records of several calls group together);
each bar's height is ms / floor_ms on a log axis, its label the time in ms. The dotted
line is the floor (1.0); where a record holds `same_run_floor_ms`, a tick on its bar marks
the floor at the matmul rate measured in the same run.
"""

from __future__ import annotations

from bench.plotting import records_and_output

IMPL_ORDER = ("original", "xattn-jax-triton", "xattn-jax-mosaic", "xattn-jax")


def _impl(record: dict, gpu: str) -> str:
    """The bar's implementation: the record's, with its GPU where that is not `gpu`."""
    name = record["impl"].split(" (", 1)[0]
    return name if record["gpu"] == gpu else f"{name}, {record['gpu']}"


def side_by_side_figure(records: list[dict]):
    """The figure of `records` (dicts with case, impl, ms, floor_ms, gpu, date and,
    optionally, same_run_floor_ms): one bar container per implementation, in IMPL_ORDER
    (others after, by name), the GPU of most records in the title and any other GPU in
    its bars' names. A ValueError where two records share a case and an implementation."""
    import matplotlib.pyplot as plt

    gpus = [r["gpu"] for r in records]
    gpu = max(dict.fromkeys(gpus), key=gpus.count)
    cases = list(dict.fromkeys(r["case"] for r in records))
    found = {_impl(r, gpu) for r in records}
    impls = [i for i in IMPL_ORDER if i in found] + sorted(found - set(IMPL_ORDER))
    by_key = {}
    for r in records:
        if by_key.setdefault((r["case"], _impl(r, gpu)), r) is not r:
            raise ValueError(f"records: two of case {r['case']!r} and implementation "
                             f"{_impl(r, gpu)!r}; a case takes one bar an implementation")
    width = 0.8 / len(impls)
    highest = max(r["ms"] / r["floor_ms"] for r in records)
    fig, ax = plt.subplots(figsize=(max(7.0, 1.1 * len(cases)), 4.8))
    for n, impl in enumerate(impls):
        xs, rows = zip(*[(c + (n - (len(impls) - 1) / 2) * width, by_key[case, impl])
                         for c, case in enumerate(cases) if (case, impl) in by_key])
        bars = ax.bar(xs, [r["ms"] / r["floor_ms"] for r in rows], width, label=impl)
        ax.bar_label(bars, [f"{r['ms']:.3g}" for r in rows], fontsize=6, rotation=90,
                     padding=2)
        same_run = [(x, r["same_run_floor_ms"] / r["floor_ms"]) for x, r in zip(xs, rows)
                    if r.get("same_run_floor_ms")]
        if same_run:
            ax.scatter(*zip(*same_run), marker="_", s=120, color="black", zorder=3)
    ax.axhline(1.0, color="grey", linestyle=":", linewidth=1)
    ax.set_yscale("log")
    ax.set_ylim(top=highest * 1.8)  # room for the tallest bar's label
    ax.set_xticks(range(len(cases)), cases, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("time / floor (bar labels: ms)")
    dates = ", ".join(sorted({r["date"] for r in records}))
    ax.set_title(f"XAttention estimate, {gpu}, {dates} "
                 "(black tick: the same run's matmul floor)", fontsize=9)
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def main(argv=None) -> None:
    records, _, out = records_and_output(
        argv, "python -m bench.plot_side_by_side RESULTS.json [MORE.json ...] OUT.png")
    side_by_side_figure(records).savefig(out, dpi=130)


if __name__ == "__main__":
    main()
