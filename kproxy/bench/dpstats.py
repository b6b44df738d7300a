"""The data path's statistics: a figure as a fraction of the limit's (oriented so 1.0 is "as fast as without a
proxy"), medians over rounds, ratios paired within each round and their interquartile spread (the noise of a shared
machine). Pure, apart from reading an iperf3 document.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from typing import Any

from kproxy.bench.dpconfig import MAX_ERROR_FRACTION, DatapathError
from kproxy.bench.results import HIGHER_IS_BETTER, METRICS


def ratio(metric: str, target: float, limit: float) -> float | None:
    """Fraction of the limit's performance (1.0 = as fast as without proxy rules; smaller is slower)."""
    if target <= 0 or limit <= 0:
        return None
    return target / limit if HIGHER_IS_BETTER[metric] else limit / target


def flatten(client: dict[str, Any], iperf: dict[str, Any] | None) -> dict[str, float]:
    """One round's dpclient JSON (and iperf3's figure) as metric -> value."""
    out: dict[str, float] = {}
    for metric, source, _, _ in METRICS:
        phase, key = source.split(".")
        if phase == "iperf":
            if iperf is not None:
                out[metric] = float(iperf[key])
            continue
        part = client.get(phase)
        if isinstance(part, dict) and part.get("ops"):
            out[metric] = float(part[key])
    return out


def medians(rounds: Iterable[dict[str, float]]) -> dict[str, float]:
    values: dict[str, list[float]] = {}
    for r in rounds:
        for k, v in r.items():
            values.setdefault(k, []).append(v)
    return {k: statistics.median(v) for k, v in values.items()}


def per_round_ratios(
    rounds: Sequence[dict[str, dict[str, float]]], targets: Sequence[str], base: str = "limit"
) -> dict[str, dict[str, list[float]]]:
    """Each target's ratio to ``base`` per metric, one per round (target and base measured seconds apart)."""
    out: dict[str, dict[str, list[float]]] = {}
    for t in targets:
        if t == base:
            continue
        per_metric: dict[str, list[float]] = {}
        for r in rounds:
            limit, this = r.get(base, {}), r.get(t, {})
            for m, v in this.items():
                q = ratio(m, v, limit.get(m, 0.0))
                if q is not None:
                    per_metric.setdefault(m, []).append(q)
        out[t] = per_metric
    return out


def paired_ratios(
    rounds: Sequence[dict[str, dict[str, float]]], targets: Sequence[str], base: str = "limit"
) -> dict[str, dict[str, float]]:
    """Each target's ratio to the limit (or ``base``) per metric: the median over rounds of the ratio *within* each
    round (the target and the limit measured seconds apart), which drift between rounds on a shared machine cannot
    skew the way it skews a ratio of two medians."""
    return {
        t: {m: statistics.median(v) for m, v in per_metric.items()}
        for t, per_metric in per_round_ratios(rounds, targets, base).items()
    }


def quartiles(values: Sequence[float]) -> list[float]:
    """[first quartile, third quartile] (the spread the report shows beside a median); one value: [v, v]."""
    if len(values) < 2:
        return [values[0], values[0]] if values else []
    q = statistics.quantiles(values, n=4, method="inclusive")
    return [q[0], q[2]]


def ratio_spread(
    rounds: Sequence[dict[str, dict[str, float]]], targets: Sequence[str], base: str = "limit"
) -> dict[str, dict[str, list[float]]]:
    """The interquartile range of each target's per-round ratios to ``base``: how noisy the median beside it is."""
    return {
        t: {m: [round(x, 4) for x in quartiles(v)] for m, v in per_metric.items()}
        for t, per_metric in per_round_ratios(rounds, targets, base).items()
    }


def iperf_gbps(doc: dict[str, Any]) -> float:
    """Receiver-side throughput of an ``iperf3 -J`` run, in Gbit/s."""
    try:
        return float(doc["end"]["sum_received"]["bits_per_second"]) / 1e9
    except (KeyError, TypeError, ValueError):
        raise DatapathError(f"iperf3 gave no throughput: {str(doc.get('error') or doc)[:300]}") from None


def round_failure(client: dict[str, dict[str, dict[str, Any]]], limit: float = MAX_ERROR_FRACTION) -> str:
    """Why a round's figures cannot stand ("" if they can): some target failed more than ``limit`` of one phase's
    operations (a path that loses connections or datagrams is broken, not slow; its rate would hide it)."""
    bad = []
    for t, phases in client.items():
        for phase, fig in phases.items():
            ops, errs = int(fig.get("ops", 0)), int(fig.get("errors", 0))
            if errs and errs > limit * (ops + errs):
                bad.append(f"{t} {phase}: {errs} of {ops + errs} operations failed")
    return "; ".join(bad)
