"""``kproxy top``: the busiest services on this node, from its own ``/metrics`` (``--service-counters``).

It reads what any Prometheus would (``kproxy_service_*_total`` and ``kproxy_endpoint_*_total``, parsed with
prometheus-client's text parser), so it shows the same figures in every mode and needs nothing but the metrics
address: new connections per second, bytes per second where the mode counts bytes ("n/a" where it does not, from
``kproxy_service_counters_offered``), and per endpoint its share of the service's connections against the even split,
with the chi-square test of ``kproxy.fairness``. Rates come from two scrapes ``--interval`` apart; ``--once`` prints
one answer (``--format json`` for scripts; ``--interval 0``: totals only). The live view redraws in place with ANSI
escapes, so the command needs no terminal library beyond the runtime dependencies the image already carries.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
from typing import Any

from kproxy.config import ConfigError, parse_hostport
from kproxy.counters import Measure, Scrape, parse
from kproxy.counters import ServiceSample as ServiceSample
from kproxy.counters import service_key as service_key
from kproxy.fairness import fairness

SORTS = ("connections", "bytes", "name")
_CLEAR = "\x1b[H\x1b[2J"  # cursor home, clear screen: the live view redraws in place


def _rate(now: float | None, before: float | None, seconds: float | None) -> float | None:
    """Per second between two counter readings; a counter that went down was reset (the service was re-created)."""
    if now is None or before is None or not seconds:
        return None
    return (now - before if now >= before else now) / seconds


def figures(cur: Scrape, prev: Scrape | None = None) -> list[dict[str, Any]]:
    """One row per service port and family: totals, rates (with ``prev``), and per endpoint its share of the
    connections (of the rate when there is one, else of the totals) against the even split, with the fairness test
    over the same counts."""
    seconds = cur.at - prev.at if prev is not None else None
    rows = []
    for key, sample in cur.services.items():
        before = prev.services.get(key) if prev is not None else None
        row: dict[str, Any] = {"service": key, **{m: sample.total.get(m) for m in ("connections", "packets", "bytes")}}
        for m in ("connections", "bytes"):
            row[f"{m}PerSecond"] = _rate(sample.total.get(m), before.total.get(m) if before else None, seconds)
        endpoints = []
        for ep, values in sample.endpoints.items():
            was = before.endpoints.get(ep, {}) if before else {}
            endpoints.append(
                {
                    "endpoint": ep,
                    "connections": values.get("connections"),
                    "bytes": values.get("bytes"),
                    "connectionsPerSecond": _rate(values.get("connections"), was.get("connections"), seconds),
                    "bytesPerSecond": _rate(values.get("bytes"), was.get("bytes"), seconds),
                }
            )
        basis = _shares(endpoints, "connectionsPerSecond" if seconds else "connections")
        row["endpoints"] = endpoints
        spread = fairness(basis) if endpoints else None
        row["fairness"] = spread.as_dict() if spread is not None else None
        rows.append(row)
    return rows


def _shares(endpoints: list[dict[str, Any]], basis: str) -> list[float]:
    """Each endpoint's share of ``basis`` against the even split; the values of ``basis``."""
    values = [float(e.get(basis) or 0.0) for e in endpoints]
    total = sum(values)
    even = 1.0 / len(endpoints) if endpoints else 0.0
    for e, v in zip(endpoints, values, strict=True):
        e["share"] = v / total if total else None
        e["evenShare"] = even
        e["shareVsEven"] = (v / total) / even if total else None
    return values


def sort_rows(rows: list[dict[str, Any]], by: str) -> list[dict[str, Any]]:
    """Busiest first (by connection or byte rate, else by totals), or by name."""
    if by == "name":
        return sorted(rows, key=lambda r: r["service"])

    def busy(r: dict[str, Any]) -> tuple[float, float, str]:
        rate, total = r.get(f"{by}PerSecond"), r.get(by)
        return (-(rate or 0.0), -(total or 0.0), r["service"])

    return sorted(rows, key=busy)


def _num(value: float | None, offered: bool, scale: str = "") -> str:
    if not offered:
        return "n/a"
    if value is None:
        return "-"
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= size:
            return f"{value / size:.1f}{unit}{scale}"
    return f"{value:.1f}{scale}" if value != int(value) else f"{int(value)}{scale}"


def render(rows: list[dict[str, Any]], offered: frozenset[Measure], limit: int, title: str = "") -> str:
    """The table: one line per service (busiest first), one indented line per endpoint with its share."""
    has_bytes = Measure.BYTES in offered
    lines = [title] if title else []
    lines.append(f"{'SERVICE':<48} {'CONN':>8} {'CONN/S':>8} {'BYTES':>8} {'BYTES/S':>8}  FAIRNESS (p, max/min)")
    for row in rows[:limit]:
        f = row.get("fairness")
        spread = "-" if not f else f"p={f['pValue']:.3g} {_num(f['maxMinRatio'], True) if f['maxMinRatio'] else 'inf'}"
        lines.append(
            f"{row['service']:<48} {_num(row['connections'], True):>8} {_num(row['connectionsPerSecond'], True):>8} "
            f"{_num(row['bytes'], has_bytes):>8} {_num(row['bytesPerSecond'], has_bytes):>8}  {spread}"
        )
        for e in row["endpoints"]:
            share = (
                "-" if e["share"] is None else f"{e['share']:.1%} (even {e['evenShare']:.1%}, x{e['shareVsEven']:.2f})"
            )
            lines.append(
                f"  {e['endpoint']:<46} {_num(e['connections'], True):>8} {_num(e['connectionsPerSecond'], True):>8} "
                f"{_num(e['bytes'], has_bytes):>8} {_num(e['bytesPerSecond'], has_bytes):>8}  {share}"
            )
    if len(rows) > limit:
        lines.append(f"... {len(rows) - limit} more service ports (--limit)")
    return "\n".join(lines)


def metrics_url(address: str) -> str:
    host, port = parse_hostport(address, "--metrics-address")
    host = host if host not in ("", "0.0.0.0", "::") else "127.0.0.1"
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/metrics"


def scrape(url: str, timeout: float) -> Scrape:
    with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 - a loopback URL built from a flag
        text = resp.read().decode()
    return parse(text, time.monotonic())


def answer(cur: Scrape, prev: Scrape | None, sort: str) -> dict[str, Any]:
    """``--format json``: what the table shows, every service."""
    return {
        "offered": sorted(m.value for m in cur.offered or ()),
        "intervalSeconds": None if prev is None else cur.at - prev.at,
        "services": sort_rows(figures(cur, prev), sort),
    }


def for_service(address: str, service: str, timeout: float = 10.0) -> dict[str, Any] | None:
    """``kproxy show --service``'s counters: the figures of the service ports ``service`` names (totals: one
    scrape), or None when that kproxy does not count. Errors as ``scrape``'s."""
    from kproxy.queries import ServiceFilter  # the same ns/name[:port][/PROTO] matching as /rules?service=

    wanted = ServiceFilter.parse(service)
    cur = scrape(metrics_url(address), timeout)
    if cur.offered is None:
        return None
    data = answer(cur, None, "name")
    data["services"] = [r for r in data["services"] if wanted.matches(r["service"].rsplit(" ", 1)[0])]
    return data


def cmd_top(args: argparse.Namespace) -> int:
    try:
        url = metrics_url(args.metrics_address)
    except ConfigError as exc:
        print(f"kproxy top: {exc}", file=sys.stderr)
        return 2
    try:
        return _run(args, url)
    except (OSError, urllib.error.URLError, ValueError) as exc:
        print(f"kproxy top: cannot read {url}: {exc} (is `kproxy run` running on this node?)", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0


def _run(args: argparse.Namespace, url: str) -> int:
    prev = scrape(url, args.timeout)
    if prev.offered is None:
        print("kproxy top: this kproxy does not count traffic (start it with --service-counters)", file=sys.stderr)
        return 1
    if args.once:
        cur = prev
        if args.interval > 0:
            time.sleep(args.interval)  # the rate's window: the command's own pace, not a test's wait
            cur = scrape(url, args.timeout)
        data = answer(cur, prev if cur is not prev else None, args.sort)
        if args.format == "json":
            print(json.dumps(data, indent=2))
        else:
            print(render(data["services"], cur.offered or frozenset(), args.limit))
        return 0
    while True:
        time.sleep(max(args.interval, 0.5))
        cur = scrape(url, args.timeout)
        rows = sort_rows(figures(cur, prev), args.sort)
        title = f"kproxy top  {url}  every {args.interval:g}s  sorted by {args.sort}  (ctrl-c quits)"
        sys.stdout.write(_CLEAR + render(rows, cur.offered or frozenset(), args.limit, title) + "\n")
        sys.stdout.flush()
        prev = cur


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("top", help="the busiest services on this node, live (needs kproxy run --service-counters)")
    p.add_argument("--metrics-address", "--metrics-bind-address", dest="metrics_address", default="127.0.0.1:10249")
    p.add_argument("--sort", choices=SORTS, default="connections", help="busiest by connections or bytes, or by name")
    p.add_argument("--limit", type=int, default=20, help="service ports shown (default 20)")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between scrapes (0 with --once: totals only)")
    p.add_argument("--once", action="store_true", help="print one answer and exit")
    p.add_argument("--format", choices=("table", "json"), default="table", help="with --once: json for scripts")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for /metrics")
    p.set_defaults(func=cmd_top)
