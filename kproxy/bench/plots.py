"""PNG plots of a ``kproxy compare`` run (matplotlib, headless Agg backend), from its ``results.json`` document.

- ``sync.png``: full and partial sync time against service count (log-log), one line per mode, upstream's nftables
  layout (the reference) dashed in black beside them;
- ``datapath.png``: data-path ratio against the limit (pod IP on nodes without proxy rules) per metric, against
  service count: solid = ClusterIP, dotted = pod IP on the loaded nodes; 1.0 = as fast as without a proxy, the grey
  line at 0.9 is the nftables target, the black dash-dotted line (when measured) the conntrack + NAT floor
  (``limit_nat`` against the limit: where a NAT-based proxy with no cost of its own would be);
- ``datapath_conn.png``: new connections per second in absolute terms (limit, NAT floor, pod IP, ClusterIP) per
  mode, so a proxy's cost that grows with services (iptables' KUBE-SERVICES walk) is visible as a slope;
- ``memory.png``: peak resident memory of the sync benchmark's process, and kproxy's resident memory in the lab.

``python -m kproxy.bench.plots results.json OUTDIR`` draws them again.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import sys
from pathlib import Path
from typing import Any

from kproxy.bench.results import as_results
from kproxy.proxier import MODE_NAMES

DATAPATH_PANELS = (
    ("conn_rate", "new connections/s"),
    ("conn_p99_us", "connection time p99"),
    ("rr_p50_us", "request/response p50"),
    ("rr_p99_us", "request/response p99"),
    ("udp_p99_us", "UDP request/response p99"),
    ("tcp_gbps", "bulk TCP throughput"),
)
Y_CAP = 2.0  # ratios above this are drawn at the top edge with their value written beside
# one colour per mode, in the mode table's order (a mode added to the table gets the next one)
COLORS = dict(
    zip(MODE_NAMES, ("tab:purple", "tab:orange", "tab:blue", "tab:green", "tab:red", "tab:brown"), strict=False)
)


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    logging.getLogger("matplotlib").setLevel(logging.WARNING)  # its font-cache notice is not a benchmark figure
    import matplotlib.pyplot as plt

    return plt


def _color(mode: str) -> str:
    return COLORS.get(mode, "tab:gray")


def plot_sync(results: dict[str, Any], path: Path) -> bool:
    rows = results.get("sync") or []
    refs = [r for r in results.get("reference") or [] if r.get("full_s")]
    if not rows:
        return False
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, key, ref_key, title in (
        (axes[0], "full_sync_s", "full_s", "full sync (empty -> N services)"),
        (axes[1], "partial_sync_s", "partial_s", "partial sync (one endpoint changes)"),
    ):
        for mode in dict.fromkeys(r["mode"] for r in rows):
            pts = sorted((r["services"], r[key]) for r in rows if r["mode"] == mode and r.get(key))
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=f"kproxy {mode}", color=_color(mode))
        rpts = sorted((r["services"], r[ref_key]) for r in refs if r.get(ref_key))
        if rpts:
            ax.plot(*zip(*rpts, strict=True), marker="s", ls="--", color="black", label="upstream nftables layout")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(f"services (x {results.get('endpoints', '?')} endpoints)")
        ax.set_ylabel("seconds (log)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("kproxy bench sync: time to program the kernel (lower is better)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _dp_runs(results: dict[str, Any]) -> list[dict[str, Any]]:
    dp = results.get("datapath") or {}
    return list(dp.get("runs") or [])


def _floor_points(runs: list[dict[str, Any]], metric: str) -> list[tuple[int, float]]:
    """The NAT floor (limit_nat against the limit) per size, the median over the modes measured at that size."""
    by_size: dict[int, list[float]] = {}
    for r in runs:
        v = (r.get("ratios") or {}).get("limit_nat", {}).get(metric)
        if v is not None:
            by_size.setdefault(r["services"], []).append(v)
    return sorted((n, statistics.median(v)) for n, v in by_size.items())


def plot_datapath(results: dict[str, Any], path: Path) -> bool:
    runs = [r for r in _dp_runs(results) if r.get("ratios") and r["mode"] != "none"]
    if not runs:
        return False
    plt = _plt()
    fig, axes = plt.subplots(2, 3, figsize=(13, 7), sharex=True)
    modes = list(dict.fromkeys(r["mode"] for r in runs))
    for ax, (metric, title) in zip(axes.flat, DATAPATH_PANELS, strict=True):
        series = []
        for mode in modes:
            for target, style, marker, label in (("clusterip", "-", "o", "ClusterIP"), ("podip", ":", "s", "pod IP")):
                pts = sorted(
                    (r["services"], r["ratios"][target][metric])
                    for r in runs
                    if r["mode"] == mode and metric in r["ratios"].get(target, {})
                )
                if pts:
                    series.append((mode, style, marker, label, pts))
        values = [v for *_, pts in series for _, v in pts]
        top = min(max(1.2, max(values, default=1.0) * 1.08), Y_CAP)
        for mode, style, marker, label, pts in series:
            xs = [x for x, _ in pts]
            ys = [min(y, top) for _, y in pts]
            ax.plot(
                xs,
                ys,
                ls=style,
                marker=marker,
                color=_color(mode),
                label=f"{mode} {label}",
                mfc="white" if marker == "s" else None,
            )
            for x, y in pts:
                if y > top:  # off the scale (noise on a shared machine): say so rather than stretch the axis
                    ax.annotate(f"{y:.1f}", (x, top), textcoords="offset points", xytext=(4, -10), fontsize=7)
        floor = _floor_points(runs, metric)
        if floor:
            ax.plot(
                [x for x, _ in floor],
                [min(y, top) for _, y in floor],
                ls="-.",
                color="black",
                lw=1.2,
                label="conntrack+NAT floor (no proxy rule)",
            )
        ax.axhline(1.0, color="black", lw=0.8)
        ax.axhline(0.9, color="gray", lw=0.8, ls="--")
        ax.set_xscale("log")
        # from 0 when something fell far (a mode at a third of the limit), else zoomed on the band around 1.0 where
        # 5 % is visible
        bottom = max(0.0, min(0.8, math.floor((min(values, default=1.0) - 0.05) * 10) / 10))
        ax.set_ylim(bottom, top)
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("services programmed")
    for ax in axes[:, 0]:
        ax.set_ylabel("fraction of the limit (1.0 = no proxy)")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    ncol = max(1, min(len(labels), 5))
    fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=8)
    fig.suptitle(
        "kproxy bench datapath: against the pod IP on nodes without proxy rules (higher is better; dashed 0.9;"
        " note the y axis)"
    )
    legend_rows = -(-len(labels) // ncol)
    fig.tight_layout(rect=(0, 0.03 + 0.03 * legend_rows, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_datapath_conn(results: dict[str, Any], path: Path) -> bool:
    runs = [r for r in _dp_runs(results) if r.get("medians") and r["mode"] != "none"]
    if not runs:
        return False
    plt = _plt()
    modes = list(dict.fromkeys(r["mode"] for r in runs))
    ncols = len(modes) if len(modes) <= 3 else 2  # four modes in one row are too small to read in a README
    nrows = -(-len(modes) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.5 * ncols, 4.2 * nrows), squeeze=False)
    for ax in axes.flat[len(modes) :]:
        ax.set_visible(False)
    for ax, mode in zip(axes.flat, modes, strict=False):
        for target, style, label in (
            ("limit", "--", "limit (no proxy rules)"),
            ("limit_nat", "-.", "limit + conntrack/NAT (floor)"),
            ("podip", ":", "pod IP, loaded nodes"),
            ("clusterip", "-", "ClusterIP"),
        ):
            pts = sorted(
                (r["services"], r["medians"][target]["conn_rate"])
                for r in runs
                if r["mode"] == mode and "conn_rate" in r["medians"].get(target, {})
            )
            if pts:
                color = "black" if target == "limit" else "gray" if target == "limit_nat" else _color(mode)
                ax.plot(*zip(*pts, strict=True), ls=style, marker="o", color=color, label=label)
        ax.set_xscale("log")
        ax.set_ylim(bottom=0)
        ax.set_title(f"{mode}", fontsize=10)
        ax.set_xlabel("services programmed")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    for row in axes:
        row[0].set_ylabel("new TCP connections / s (median)")
    fig.suptitle(
        "new connections per second (connect, one request/response, RST), same run\nabsolute figures move with"
        " the shared machine's load between sizes; the ratios (datapath.png) are the comparison",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_memory(results: dict[str, Any], path: Path) -> bool:
    rows = results.get("sync") or []
    runs = [r for r in _dp_runs(results) if r.get("kproxy_rss_mb")]
    if not rows and not runs:
        return False
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode in dict.fromkeys(r["mode"] for r in rows):
        pts = sorted((r["services"], r["rss_mb"]) for r in rows if r["mode"] == mode and r.get("rss_mb"))
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="o", color=_color(mode), label=f"{mode}: bench sync peak RSS")
    for mode in dict.fromkeys(r["mode"] for r in runs):
        pts = sorted((r["services"], r["kproxy_rss_mb"].get("node-1", 0.0)) for r in runs if r["mode"] == mode)
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="^", ls=":", color=_color(mode), label=f"{mode}: kproxy RSS in lab")
    ax.set_xscale("log")
    ax.set_ylim(bottom=0)
    ax.set_xlabel(f"services (x {results.get('endpoints', '?')} endpoints)")
    ax.set_ylabel("MB")
    ax.set_title("memory (lower is better)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


PLOTS = (
    ("sync.png", plot_sync),
    ("datapath.png", plot_datapath),
    ("datapath_conn.png", plot_datapath_conn),
    ("memory.png", plot_memory),
)


def write_all(results: dict[str, Any], out: Path) -> list[str]:
    """Draw every plot the results have data for into ``out``; the file names written."""
    written = []
    for name, fn in PLOTS:
        if fn(results, out / name):
            written.append(name)
    return written


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m kproxy.bench.plots RESULTS.json OUTDIR", file=sys.stderr)
        return 2
    results = as_results(json.loads(Path(args[0]).read_text()))
    out = Path(args[1])
    out.mkdir(parents=True, exist_ok=True)
    print("\n".join(write_all(results, out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
