"""Quality against the whole call's device time, from `bench.quality_time` records alone:
a markdown record and a plot (CPU, nothing timed).

    python -m bench.plot_quality_time RECORDS.json --md OUT.md --png OUT.png [--gpu NAME]

One curve per (estimate, threshold rule) at every scale: each setting's top-1 agreement
and KL (the real model's, at 8K) against its whole XAttention call's median time
(estimate and attention, part "xattention"), and cuDNN's dense attention as a line. Where
the records hold several implementations of one estimate (`estimate_impl`), each is a
curve of its own.

Ahead at equal time (`equal_time`): a curve's quality at a time T is read off its points
sorted by time, interpolated linearly in T (top-1 linearly, KL linearly in log KL), and
only between its fastest and its slowest point. At every whole-call time some curve was
measured at, the curves defined there are compared: the one with the highest top-1 is
ahead on top-1, the one with the lowest KL ahead on KL.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys

from bench.common import QUALITY_TIME, rows_of

PARTS = ("estimate", "attention", "xattention")  # a setting's timed rows at a scale
ESTIMATE_COLORS = {"antidiagonal": "tab:blue", "sampled-rows": "tab:green"}
RULE_STYLES = {"uniform": dict(marker="o", linestyle="--"),
               "calibrated": dict(marker="*", markersize=11, linestyle="-")}


# --- records to points -----------------------------------------------------------------

def one_gpu(records: list[dict], gpu: str | None) -> list[dict]:
    """The records of `gpu`; without it, of the only GPU they hold. Raises ValueError
    naming `gpu` where that GPU has none, or where several GPUs leave the choice open."""
    gpus = sorted({r["gpu"] for r in records})
    if gpu is None:
        if len(gpus) != 1:
            raise ValueError(f"gpu: the records hold {gpus}; name one")
        gpu = gpus[0]
    chosen = [r for r in records if r["gpu"] == gpu]
    if not chosen:
        raise ValueError(f"gpu: no record of {gpu!r} (the records hold {gpus})")
    return chosen


def points(records: list[dict]) -> tuple[dict, dict]:
    """({scale: [one dict per setting and estimate implementation: its fields and
    `ms` per part]}, {scale: the dense row}), scales in the records' order. Raises
    ValueError for a scale without its dense row, a setting without one of PARTS, or a
    part recorded twice."""
    settings: dict = {}
    dense: dict = {}
    for r in records:
        if r["part"] == "dense":
            if r["scale"] in dense:
                raise ValueError(f"records: {r['scale']}'s dense row recorded twice")
            dense[r["scale"]] = r
            continue
        point = settings.setdefault(r["scale"], {}).setdefault(
            (r["setting"], r["estimate_impl"]), {"ms": {}})
        if r["part"] in point["ms"]:
            raise ValueError(f"records: {r['case']} ({r['estimate_impl']}) recorded twice")
        point["ms"][r["part"]] = r["ms"]
        point.update({key: value for key, value in r.items() if key not in ("ms", "case")})
    for name, by_setting in settings.items():
        if name not in dense:
            raise ValueError(f"records: {name} has no dense row")
        for (setting, impl), point in by_setting.items():
            missing = [part for part in PARTS if part not in point["ms"]]
            if missing:
                raise ValueError(f"records: {name} {setting} ({impl}) lacks {missing}")
    return {name: list(by_setting.values()) for name, by_setting in settings.items()}, dense


def curve_name(point: dict, several_impls: set[str]) -> str:
    """"estimate, rule", with the estimate's implementation where it has several."""
    impl = f" ({point['estimate_impl']})" if point["estimate"] in several_impls else ""
    return f"{point['estimate']}{impl}, {point['threshold_rule']}"


def curves(scale_points: list[dict], several_impls: set[str]) -> dict[str, list[dict]]:
    """{curve name: its points sorted by whole-call time}, names sorted."""
    out: dict[str, list[dict]] = {}
    for p in scale_points:
        out.setdefault(curve_name(p, several_impls), []).append(p)
    return {name: sorted(out[name], key=lambda p: p["ms"]["xattention"])
            for name in sorted(out)}


def impls_of_estimates(records: list[dict]) -> set[str]:
    """The estimates the records time in several implementations."""
    seen: dict[str, set] = {}
    for r in records:
        if r["part"] != "dense":
            seen.setdefault(r["estimate"], set()).add(r["estimate_impl"])
    return {estimate for estimate, impls in seen.items() if len(impls) > 1}


# --- ahead at equal time ---------------------------------------------------------------

def quality_at(curve: list[dict], ms: float, metric: str) -> float | None:
    """The curve's `metric` ("top1" or "kl_mean") at whole-call time `ms`: linear between
    its neighbouring points (KL in log KL), None outside its time span."""
    times = [p["ms"]["xattention"] for p in curve]
    if not times[0] <= ms <= times[-1]:
        return None
    as_line = math.log if metric == "kl_mean" else float
    back = math.exp if metric == "kl_mean" else float
    for (t0, p0), (t1, p1) in zip(zip(times, curve), zip(times[1:], curve[1:])):
        if t0 <= ms <= t1 and t1 > t0:
            y0, y1 = as_line(p0[metric]), as_line(p1[metric])
            return back(y0 + (y1 - y0) * (ms - t0) / (t1 - t0))
    return float(next(p[metric] for t, p in zip(times, curve) if t == ms))


def equal_time(named: dict[str, list[dict]]) -> list[dict]:
    """At every whole-call time of a point of `named`'s curves (ascending) where two or
    more curves are defined: {"ms", "quality": {curve: (top1, kl) or None}, "top1": the
    curve ahead on top-1, "kl": the curve ahead on KL}."""
    times = sorted({p["ms"]["xattention"] for curve in named.values() for p in curve})
    rows = []
    for ms in times:
        quality = {name: None if quality_at(c, ms, "top1") is None else
                   (quality_at(c, ms, "top1"), quality_at(c, ms, "kl_mean"))
                   for name, c in named.items()}
        defined = {name: q for name, q in quality.items() if q is not None}
        if len(defined) < 2:
            continue
        rows.append({"ms": ms, "quality": quality,
                     "top1": max(defined, key=lambda name: defined[name][0]),
                     "kl": min(defined, key=lambda name: defined[name][1])})
    return rows


def ahead_summary(rows: list[dict], metric: str) -> str:
    """Which curve is ahead on `metric` over which times: "A (1.2-3.4 ms), B (5.6 ms)"."""
    runs: list[list] = []
    for r in rows:
        if runs and runs[-1][0] == r[metric]:
            runs[-1][2] = r["ms"]
        else:
            runs.append([r[metric], r["ms"], r["ms"]])
    return ", ".join(f"{name} ({lo:.3g} ms)" if lo == hi else f"{name} ({lo:.3g}-{hi:.3g} ms)"
                     for name, lo, hi in runs)


# --- markdown and plot -----------------------------------------------------------------

def _distinct(records: list[dict], key: str) -> str:
    """The values of `key` among the rows holding it, "; "-joined."""
    return "; ".join(sorted({str(r[key]) for r in records if key in r}))


def setting_table(named: dict[str, list[dict]], dense: dict) -> list[str]:
    lines = ["| curve | setting | density: model / timed mask | top-1 | KL | ppl change | "
             "estimate ms | attention ms | whole call ms | whole / dense |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, curve in named.items():
        for p in curve:
            ms = p["ms"]
            lines.append(
                f"| {name} | {p['setting']} | {p['model_density']:.3f} / {p['density']:.3f} | "
                f"{p['top1']:.4f} | {p['kl_mean']:.4f} | {p['ppl_change_pct']:+.2f}% | "
                f"{ms['estimate']:.3f} | {ms['attention']:.3f} | {ms['xattention']:.3f} | "
                f"{ms['xattention'] / dense['ms']:.3f} |")
    lines.append(f"| dense ({dense['impl']}) | | 1 | 1 | 0 | | | | {dense['ms']:.3f} | 1 |")
    return lines


def equal_time_table(named: dict[str, list[dict]]) -> list[str]:
    rows = equal_time(named)
    if not rows:
        return ["No time at which two curves are both defined."]
    names = list(named)
    lines = ["| whole call ms | " + " | ".join(f"{n}: top-1 / KL" for n in names)
             + " | ahead: top-1 | ahead: KL |", "|---" * (len(names) + 3) + "|"]
    for r in rows:
        cells = ["" if r["quality"][n] is None else
                 f"{r['quality'][n][0]:.4f} / {r['quality'][n][1]:.4f}" for n in names]
        lines.append(f"| {r['ms']:.3f} | " + " | ".join(cells)
                     + f" | {r['top1']} | {r['kl']} |")
    return lines + ["", f"Ahead on top-1: {ahead_summary(rows, 'top1')}.",
                    f"Ahead on KL: {ahead_summary(rows, 'kl')}."]


def markdown(records: list[dict], png_name: str, command: str) -> str:
    """The record: what was run where, the plot, then per scale the settings' table and
    the equal-time comparison."""
    by_scale, dense = points(records)
    several = impls_of_estimates(records)
    quality = sorted({r["quality_source"] for r in records if r["part"] != "dense"})
    tflops = _distinct(records, "matmul_tflops")
    lines = ["# Quality per unit of time", "",
             "Each setting's top-1 agreement and KL against dense on the real model "
             "(SmolLM2-135M-Instruct, from `bench.model_quality`'s records) against "
             "the whole XAttention call's median device time (its estimate, then "
             "`block_sparse_attention` on a mask of the setting's measured density, "
             "selected by the setting's own estimate on structured synthetic data), bf16, "
             "causal, at each scale below with the same densities (`bench.quality_time`). "
             "Ahead at equal time: interpolated along each curve in time (top-1 linearly, "
             "KL in log KL), compared at each measured time where two or more curves "
             "reach (`bench.plot_quality_time`).", "",
             f"Timed: `{_distinct(records, 'command')}`; GPU {_distinct(records, 'gpu')}; "
             f"{_distinct(records, 'date')}; commit {_distinct(records, 'commit')}; "
             f"{_distinct(records, 'versions')}"
             f"{f'; same-run matmul {tflops} TFLOP/s' if tflops else ''}.", "",
             f"Quality: {'; '.join(quality)}.", "", f"Table and plot: `{command}`.", "",
             f"![top-1 and KL against the whole call's time]({png_name})"]
    for name, scale_points in by_scale.items():
        named = curves(scale_points, several)
        d = dense[name]
        lines += ["", f"## {name}: {d['model']}'s attention, {d['length']} tokens", "",
                  *setting_table(named, d), "", "At equal time:", "",
                  *equal_time_table(named)]
    return "\n".join(lines) + "\n"


def figure_size(records: list[dict]) -> tuple[float, float]:
    """The plot's (width, height) in inches: a column per scale."""
    return 5.2 * len(points(records)[0]), 8


def figure(records: list[dict], fig=None):
    """Top-1 (upper row) and KL (lower row, log) against the whole call's time, one column
    per scale; the dense call as a grey line, the settings named defaults squared. Drawn
    on `fig` (a figure or subfigure) where given."""
    import matplotlib.pyplot as plt

    by_scale, dense = points(records)
    several = impls_of_estimates(records)
    fig = fig or plt.figure(figsize=figure_size(records), layout="tight")
    axes = fig.subplots(2, len(by_scale), squeeze=False)
    for col, (name, scale_points) in enumerate(by_scale.items()):
        top_ax, kl_ax = axes[0, col], axes[1, col]
        for curve, pts in curves(scale_points, several).items():
            style = dict(RULE_STYLES[pts[0]["threshold_rule"]],
                         color=ESTIMATE_COLORS.get(pts[0]["estimate"], "tab:gray"))
            ms = [p["ms"]["xattention"] for p in pts]
            top_ax.plot(ms, [p["top1"] for p in pts], label=curve, **style)
            kl_ax.plot(ms, [p["kl_mean"] for p in pts], label=curve, **style)
            named_defaults = [p for p in pts if "defaults" in p["setting"]]
            for ax, metric in ((top_ax, "top1"), (kl_ax, "kl_mean")):
                ax.plot([p["ms"]["xattention"] for p in named_defaults],
                        [p[metric] for p in named_defaults], linestyle="none", marker="s",
                        markersize=12, markerfacecolor="none", color="black")
        d = dense[name]
        for ax in (top_ax, kl_ax):
            ax.axvline(d["ms"], color="gray", linestyle=":", label=f"dense ({d['impl']})")
            ax.set_xlabel("whole XAttention call, ms (median)")
            ax.grid(True, which="both", alpha=0.3)
        top_ax.set_title(f"{d['model']}'s attention, {d['length']} tokens")
        kl_ax.set_yscale("log")
    axes[0, 0].set_ylabel("top-1 agreement with dense")
    axes[1, 0].set_ylabel("KL(dense || setting), mean per position")
    axes[0, -1].legend(fontsize=8, loc="lower right")
    fig.suptitle(f"Quality (SmolLM2-135M-Instruct, {_distinct(records, 'quality_length')} "
                 f"tokens of real text) against time, {_distinct(records, 'gpu')}, "
                 f"{_distinct(records, 'date')}; squares: the settings named defaults")
    return fig


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("records", nargs="+", help="bench.quality_time's JSON records")
    parser.add_argument("--md", required=True, help="the markdown record's path")
    parser.add_argument("--png", required=True, help="the plot's path")
    parser.add_argument("--gpu", help="the GPU whose rows to show (default: the only one)")
    args = parser.parse_args(argv)
    records = []
    for path in args.records:
        records += json.loads(pathlib.Path(path).read_text())
    records = one_gpu(rows_of(records, QUALITY_TIME), args.gpu)
    command = " ".join(["python -m bench.plot_quality_time",
                        *(sys.argv[1:] if argv is None else argv)])
    import matplotlib

    matplotlib.use("Agg")
    figure(records).savefig(args.png, dpi=110)
    pathlib.Path(args.md).write_text(markdown(records, pathlib.Path(args.png).name, command))


if __name__ == "__main__":
    main()
