"""The data path's text table (``kproxy bench datapath --format table``): per run, each metric's medians per target
and the ratios to the limit with their interquartile range, then the ratios against the diagnostic limits.
"""

from __future__ import annotations

from typing import Any

from kproxy.bench.dpconfig import CONNTRACK_LIMITS, REV, TARGETS, TWIN, DatapathResult
from kproxy.bench.results import METRICS


def _fmt(metric: str, v: float | None) -> str:
    if v is None:
        return "-"
    if metric == "tcp_gbps":
        return f"{v:.2f}"
    return f"{v:,.0f}"


def _columns(rows: list[list[str]]) -> list[str]:
    """Rows as aligned text: the first column left, the others right."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(x.ljust(w) if i == 0 else x.rjust(w) for i, (x, w) in enumerate(zip(r, widths, strict=True)))
        for r in rows
    ]


ALL_TARGETS = (*TARGETS, TWIN, *CONNTRACK_LIMITS, REV)


def _ratio_cell(ratios: dict[str, float], spread: dict[str, list[float]], metric: str) -> str:
    v = ratios.get(metric)
    if v is None:
        return "-"
    q = spread.get(metric)
    return f"{v:.2f} [{q[0]:.2f}-{q[1]:.2f}]" if q else f"{v:.2f}"


def counters_cost_lines(cost: dict[str, Any]) -> list[str]:
    """The counters' cost block of a run (``DatapathRun.counters_cost``, kproxy.bench.dpcounters): counters on / off
    per metric (the geometric mean of the two halves), the node asymmetry, each half, and each half's counter check."""
    if not cost:
        return []
    halves = cost.get("halves") or []
    lines = [
        "counters on / off (--service-counters), both halves' geometric mean; asymmetry: the two paths alike = 1.0:"
    ]
    if cost.get("error"):
        lines.append(f"counters' cost NOT MEASURED: {cost['error']}")
    else:
        heads = [f"{h['counting_node']} counting" for h in halves]
        rows = [["metric", "on/off", "asymmetry", *heads]]
        for metric, _, _, unit in METRICS:
            cells = [_ratio_cell(h.get("ratio") or {}, h.get("spread") or {}, metric) for h in halves]
            on_off, asym = (cost.get("ratio") or {}).get(metric), (cost.get("node_asymmetry") or {}).get(metric)
            rows.append(
                [
                    f"{metric} ({unit})",
                    "-" if on_off is None else f"{on_off:.3f}",
                    "-" if asym is None else f"{asym:.3f}",
                ]
                + cells
            )
        lines += _columns(rows)
        for metric, bound in (cost.get("budget") or {}).items():
            v = (cost.get("ratio") or {}).get(metric)
            verdict = "-" if v is None else ("within" if v >= bound else "OVER")
            lines.append(f"budget: {metric} on/off >= {bound:.2f}: {verdict}")
    for h in halves:
        c = h.get("check")
        if c:
            lines.append(
                f"counted on {c['node']}: {c['counted']:,} new connections to {c['service']} ({c['answered']:,}"
                f" answered, {c['sent']:,} sent)"
            )
    return lines


def format_table(result: DatapathResult) -> str:
    """One block per run: each metric's medians per target and the ratios to the limit (with the interquartile range
    of the per-round ratios in brackets: the noise), then the ratios against the diagnostic limits."""
    lines = []
    c = result.config
    lines.append(
        f"medians of {c['rounds']} rounds ({c['seconds']} s per phase, iperf3 {c['iperf_seconds']} s);"
        f" pinning: {c['pinning']}; limit: {c['limit']}; ratio 1.0 = as fast as the limit, [q1-q3] of the"
        " per-round ratios beside each"
    )
    if c.get("twin"):
        lines.append(f"limit_twin: {c['twin']}")
    for name, text in (c.get("conntrack_limits_detail") or {}).items():
        lines.append(f"{name}: {text}")
    for run in result.runs:
        lines.append("")
        head = f"mode {run.mode}, {run.services} services"
        if run.ready_s:
            head += f" (ready {run.ready_s:.1f} s after start"
            if run.kproxy_rss_mb:
                head += ", kproxy RSS " + ", ".join(f"{k} {v:.0f} MB" for k, v in sorted(run.kproxy_rss_mb.items()))
            if run.idle_cpu_s:
                head += f", kproxy CPU idle over {run.idle_seconds:g} s " + ", ".join(
                    f"{k} {v:.2f} s" for k, v in sorted(run.idle_cpu_s.items())
                )
            if run.kproxy_cpu_s:
                head += ", kproxy CPU while measuring " + ", ".join(
                    f"{k} {v:.1f} s" for k, v in sorted(run.kproxy_cpu_s.items())
                )
            head += ")"
        lines.append(head)
        if run.error:
            lines.append(f"NOT MEASURED: {run.error}")
            continue
        targets = [t for t in ALL_TARGETS if t in run.medians]
        cols = ["metric", *targets, *(f"{t}/limit" for t in targets if t != "limit")]
        rows = []
        for metric, _, _, unit in METRICS:
            row = [f"{metric} ({unit})"]
            row += [_fmt(metric, run.medians[t].get(metric)) for t in targets]
            row += [
                _ratio_cell(run.ratios.get(t, {}), run.ratio_spread.get(t, {}), metric) for t in targets if t != "limit"
            ]
            rows.append(row)
        lines += _columns([cols, *rows])
        for base, per_target in run.ratios_vs.items():
            against = [t for t in ("podip", "clusterip") if t in per_target]
            if not against:
                continue
            lines.append(f"against {base}:")
            rows = [["metric", *(f"{t}/{base}" for t in against)]]
            for metric, _, _, unit in METRICS:
                rows.append(
                    [
                        f"{metric} ({unit})",
                        *(
                            "-" if per_target[t].get(metric) is None else f"{per_target[t][metric]:.2f}"
                            for t in against
                        ),
                    ]
                )
            lines += _columns(rows)
        lines += counters_cost_lines(run.counters_cost)
        if run.conntrack_entries:
            lines.append(
                "conntrack entries after a round (client node, server node): "
                + "; ".join(
                    f"{t} {d.get('client_node', 0):.0f}, {d.get('server_node', 0):.0f}"
                    for t, d in run.conntrack_entries.items()
                )
            )
        if any(run.errors.values()):
            lines.append("errors: " + ", ".join(f"{t} {n}" for t, n in sorted(run.errors.items()) if n))
        for why in run.failed_rounds:
            lines.append(f"left out: {why}")
    return "\n".join(lines)
