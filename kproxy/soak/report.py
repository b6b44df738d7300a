"""The soak's figures: percentiles, the JSON report's shape and the table printed at the end."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in 0..100) of ``values``; None when empty. With few samples p99 is the max."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def fault_summary(convergence: Mapping[str, Sequence[float]], unconverged: Mapping[str, int]) -> dict[str, Any]:
    """kind -> {injected, converged, unconverged, p50_s, p99_s, max_s} from each injection's convergence time."""
    out: dict[str, Any] = {}
    for kind in sorted(set(convergence) | set(unconverged)):
        times = list(convergence.get(kind, ()))
        bad = int(unconverged.get(kind, 0))
        p50, p99 = percentile(times, 50), percentile(times, 99)
        out[kind] = {
            "injected": len(times) + bad,
            "converged": len(times),
            "unconverged": bad,
            "p50_s": None if p50 is None else round(p50, 3),
            "p99_s": None if p99 is None else round(p99, 3),
            "max_s": round(max(times), 3) if times else None,
        }
    return out


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.2f}"
    return str(v)


def _held(held: Mapping[str, Any]) -> str:
    if held.get("alive"):
        return "open"
    if held.get("required") is False:
        return "closed (not required: this mode relays connections itself, survives_restart is False)"
    return "BROKEN"


def table(report: Mapping[str, Any]) -> str:
    """The human summary: the headline figures, then one row per fault kind."""
    conns = report.get("new_connections", {})
    held = report.get("held_connection", {})
    pk, kv = report.get("packets", {}), report.get("kernel_view", {})
    lines = [
        f"kproxy soak --mode {report.get('mode')}: {report.get('churn_s')} s of churn at {report.get('rate')}/s "
        f"on {report.get('nodes')} nodes, {report.get('duration_s')} s in all "
        f"({'PASS' if report.get('ok') else 'FAIL'})",
        f"  changes applied        {report.get('changes', {}).get('applied')}"
        f" ({report.get('changes', {}).get('api_refused', 0)} refused by the API, "
        f"{report.get('changes', {}).get('retries', 0)} retried)",
        f"  lost changes           {report.get('lost_changes')}",
        f"  drift at checkpoints   {report.get('drift_checkpoints')} (the most at one checkpoint; "
        f"final {report.get('drift_final')})",
        f"  checkpoints            {len(report.get('checkpoints', []))}, {report.get('cycles')} whole cycle(s) of "
        f"the faults",
        f"  packets (vs the model) {pk.get('sent')} sent to {pk.get('targets')} addresses of "
        f"{pk.get('services_probed')} services (sampled from {pk.get('services_changed')} changed; at the end "
        f"from all) and "
        f"{pk.get('removed_probed')} removed: {pk.get('lost')} lost, {pk.get('wrong')} wrong",
        f"  kernel view (vs model) {kv.get('checked')} service ports checked: {kv.get('missing')} missing, "
        f"{kv.get('extra')} extra" + (" (the mode has no kernel view)" if kv.get("unsupported") else ""),
        f"  new connections        {conns.get('total')} made, {conns.get('failed')} failed "
        f"({conns.get('failed_in_kproxy_restarts')} during kproxy restarts, {conns.get('failed_outside')} outside)",
        f"  held connection        {_held(held)}: {held.get('exchanges')} exchanges"
        + (f", error {held.get('error')}" if held.get("error") else ""),
        "",
        f"  {'fault':<14}{'injected':>9}{'conv.':>7}{'p50 s':>8}{'p99 s':>8}{'max s':>8}  not converged",
    ]
    for kind, row in (report.get("faults") or {}).items():
        lines.append(
            f"  {kind:<14}{row['injected']:>9}{row['converged']:>7}{_fmt(row['p50_s']):>8}{_fmt(row['p99_s']):>8}"
            f"{_fmt(row['max_s']):>8}  {row['unconverged']}"
        )
    for kind, why in (report.get("faults_not_injected") or {}).items():
        lines.append(f"  {kind:<14} not injected: {why}")
    if report.get("problems"):
        lines.append("")
        lines.append("  problems:")
        lines.extend(f"    - {p}" for p in report["problems"][:30])
    return "\n".join(lines)
