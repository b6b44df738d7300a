"""``report.md`` of a ``kproxy compare`` run, from its ``results.json`` document: the machine, kernel and versions,
one table per benchmark with the exact command behind each figure, the plots, and how to read them.

``python -m kproxy.bench.report results.json`` prints it again.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kproxy.bench.results import METRICS, UNITS, as_results

RATIO_COLUMNS = (
    ("conn_rate", "conn/s"),
    ("conn_p50_us", "conn p50"),
    ("conn_p99_us", "conn p99"),
    ("rr_p50_us", "RR p50"),
    ("rr_p99_us", "RR p99"),
    ("udp_p99_us", "UDP p99"),
    ("tcp_gbps", "Gbit/s"),
)


def _s(v: Any, digits: int = 3) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out


def _num(metric: str, v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.2f}" if metric == "tcp_gbps" else f"{v:,.0f}"


def sync_section(results: dict[str, Any]) -> list[str]:
    rows = results.get("sync") or []
    refs = {r["services"]: r for r in results.get("reference") or []}
    cache = {r["services"]: r for r in results.get("cache_alone") or []}
    if not rows and not refs:
        return []
    lines = ["## Sync benchmark (control plane)", ""]
    lines.append(
        "Medians of the runs; `full` is empty -> N services, `partial` one endpoint of one service changed,"
        " `floor` the kernel alone taking the same payload. The reference is upstream kube-proxy's nftables"
        " layout for the same state, timed with `nft -f` into a namespace of its own (a yardstick, never a mode);"
        " `ref / full` says how many times longer upstream's layout takes than kproxy's whole full sync."
    )
    lines.append("")
    table = []
    for r in rows:
        ref = refs.get(r["services"]) or {}
        ref_full = ref.get("full_s")
        table.append(
            [
                r["mode"],
                f"{r['services']:,} x {r['endpoints']}",
                _s(r["full_sync_s"]),
                _s(r.get("floor_s")),
                _s(r.get("ratio"), 2),
                _s(r["partial_sync_s"], 4),
                _s(r.get("partial_floor_s"), 4),
                f"{r['rss_mb']:.0f} MB" if r.get("rss_mb") else "-",
                _s(ref_full) if ref_full else "-",
                f"{ref_full / r['full_sync_s']:.1f}x" if ref_full and r["full_sync_s"] else "-",
                f"{r['runs']}",
            ]
        )
    head = ["mode", "services x E", "full s", "floor s", "full/floor", "partial s", "partial floor s", "peak RSS"]
    head += ["reference full s", "ref / full", "runs"]
    lines += _table(head, table)
    lines.append("")
    if refs:
        lines.append("Reference (upstream nftables layout) and the cache alone (`--mode fake`):")
        lines.append("")
        t2 = []
        for n in sorted(refs):
            ref = refs[n]
            c = cache.get(n) or {}
            if ref.get("full_s"):
                t2.append(
                    [
                        f"{n:,} x {ref.get('endpoints')}",
                        _s(ref["full_s"]),
                        _s(ref.get("partial_s"), 4),
                        _s(ref.get("partial_cleanup_s"), 4),
                        f"{ref.get('chains'):,}",
                        _s(ref.get("render_s")),
                        _s(c.get("full_sync_s"), 4),
                    ]
                )
            else:
                t2.append([f"{n:,} x {ref.get('endpoints')}", "not run: " + str(ref.get("note", "")), "", "", "", ""])
                t2[-1].append(_s(c.get("full_sync_s"), 4))
        head2 = ["services x E", "ref full (nft -f) s", "ref partial s", "ref stale-chain delete s", "chains"]
        head2 += ["ref render s", "cache alone full s"]
        lines += _table(head2, t2)
        lines.append("")
    lines.append("Commands:")
    lines.append("")
    for r in rows:
        lines.append(f"- `{r['command']}` (x{r['runs']})")
    for n in sorted(refs):
        lines.append(f"- `{refs[n]['command']}`")
    lines.append("")
    return lines


TARGET_NAMES = {"clusterip": "ClusterIP", "podip": "pod IP", "limit_twin": "twin (self-test)"}


def _spread_cell(v: float | None, q: list[float] | None) -> str:
    if v is None:
        return "-"
    return f"{v:.2f} ({q[0]:.2f}-{q[1]:.2f})" if q and len(q) == 2 else f"{v:.2f}"


FLOOR_COLUMNS = (
    ("conn_rate", "conn/s"),
    ("conn_p50_us", "conn p50"),
    ("conn_p99_us", "conn p99"),
    ("rr_p50_us", "RR p50"),
    ("rr_p99_us", "RR p99"),
    ("udp_p50_us", "UDP p50"),
    ("tcp_gbps", "Gbit/s"),
)


def floor_section(runs: list[dict[str, Any]]) -> list[str]:
    """The diagnostic limits (when measured): what conntrack and NAT alone cost the limit's path, each target against
    the NAT floor, and whether a mode's nodes track connections at all."""
    rows = [r for r in runs if (r.get("ratios") or {}).get("limit_nat")]
    if not rows:
        return []
    lines = ["### The conntrack floor", ""]
    lines.append(
        "Measured in the same rounds: `limit_ct` is the limit's path with conntrack turned on in its two nodes (a"
        " chain with `ct state established accept`), `limit_nat` the same with nat base chains and one DNAT rule that"
        " never matches (conntrack, the nat hooks and a null binding per connection: what every NAT-based proxy"
        " pays, before any rule of its own). Nodes without netfilter rules track nothing at all (conntrack's hooks"
        " register per network namespace, only when a rule needs them; `conntrack entries` below is 0 on the limit's"
        " nodes), so the plain limit is lower than any NAT-based proxy can reach. `X / NAT floor` is a target"
        " against `limit_nat`: 1.0 means the proxy's own rules cost nothing beyond the floor."
    )
    lines.append("")
    head = ["mode", "services", "ratio"] + [label for _, label in FLOOR_COLUMNS]
    table = []
    for r in rows:
        ratios, spread, vs = r.get("ratios") or {}, r.get("ratio_spread") or {}, r.get("ratios_vs") or {}
        n = f"{r['services']:,}"
        for t, label in (("limit_ct", "conntrack on / limit"), ("limit_nat", "NAT floor / limit")):
            if ratios.get(t):
                cells = [_spread_cell(ratios[t].get(m), (spread.get(t) or {}).get(m)) for m, _ in FLOOR_COLUMNS]
                table.append([r["mode"], n, label, *cells])
        for t, label in (("clusterip", "ClusterIP / NAT floor"), ("podip", "pod IP / NAT floor")):
            got = (vs.get("limit_nat") or {}).get(t)
            if got:
                table.append([r["mode"], n, label, *(_s(got.get(m), 2) for m, _ in FLOOR_COLUMNS)])
    lines += _table(head, table)
    lines.append("")
    ct_rows = []
    for r in rows:
        ce = r.get("conntrack_entries") or {}
        if ce:
            cells = []
            for t in ("limit", "limit_ct", "limit_nat", "podip", "clusterip"):
                d = ce.get(t)
                cells.append(f"{d.get('client_node', 0):,.0f} / {d.get('server_node', 0):,.0f}" if d else "-")
            ct_rows.append([r["mode"], f"{r['services']:,}", *cells])
    if ct_rows:
        lines.append(
            "Conntrack entries in the client's node / the server's node right after each round (median; connections"
            " closed with RST linger 10 s in conntrack): 0 means that node tracks no connection at all."
        )
        lines.append("")
        lines += _table(["mode", "services", "limit", "limit_ct", "limit_nat", "pod IP", "ClusterIP"], ct_rows)
        lines.append("")
    return lines


def datapath_section(results: dict[str, Any]) -> list[str]:
    dp = results.get("datapath") or {}
    runs = dp.get("runs") or []
    if not runs:
        return []
    c = dp.get("config", {})
    lines = ["## Data-path benchmark (the lab)", ""]
    lines.append(
        f"Medians of {c.get('rounds')} rounds, {c.get('seconds')} s per traffic phase, iperf3 {c.get('iperf_seconds')}"
        f" s. Limit: {c.get('limit')}. Pinning: {c.get('pinning')}. Client close: {c.get('client_close')}."
        " Ratios are fractions of the limit's performance: rates target / limit, latencies limit / target,"
        " so 1.0 = as fast as without any proxy and 0.5 = half as fast (or twice the latency); each is taken within a"
        " round (target and limit seconds apart) and the median over the rounds is shown."
    )
    lines.append("")
    lines += _ratio_table(runs)
    lines += floor_section(runs)
    lines += counters_cost_section(runs)
    lines += _absolute_table(runs)
    failed = [r for r in runs if r.get("error")]
    if failed:
        lines.append("Not measured:")
        lines.append("")
        lines += [f"- {r['mode']} at {r['services']:,} services: {r['error']}" for r in failed]
        lines.append("")
    lines += _kproxy_table(runs)
    lines.append("Commands (each mode's figures are what this command measures; compare ran them in one lab):")
    lines.append("")
    for mode, cmd in (dp.get("commands") or {}).items():
        lines.append(f"- {mode}: `{cmd}`")
    lines.append("")
    return lines


def _ratio_table(runs: list[dict[str, Any]]) -> list[str]:
    lines = ["### Ratios against the limit", ""]
    lines.append(
        "Each cell: the median of the per-round ratios, and in brackets their first and third quartiles (half the"
        " rounds fall inside): the noise of this shared machine, and how far apart two figures must be to differ."
        " The twin is the limit's path between two other pods, measured in the same rounds: the lab's self-test,"
        " 1.0 within a couple of per cent when the targets share the machine fairly. In mode none the ClusterIP row"
        " is its endpoint's pod IP (no proxy to translate it): the same targets and schedule as a real run."
    )
    lines.append("")
    head = ["mode", "services", "target", *(label for _, label in RATIO_COLUMNS)]
    table = []
    for r in runs:
        for target in ("clusterip", "podip", "limit_twin"):
            ratios = (r.get("ratios") or {}).get(target)
            if not ratios:
                continue
            spread = (r.get("ratio_spread") or {}).get(target) or {}
            name = TARGET_NAMES[target]
            cells = [_spread_cell(ratios.get(m), spread.get(m)) for m, _ in RATIO_COLUMNS]
            table.append([r["mode"], f"{r['services']:,}", name, *cells])
    lines += _table(head, table)
    lines.append("")
    return lines


def counters_cost_section(runs: list[dict[str, Any]]) -> list[str]:
    """Per run measured with ``--counters-cost`` (kproxy.bench.dpcounters): counters on / off per metric with the node
    asymmetry (1.0: the two ClusterIP paths alike) under it, the budget's verdict, and what the counting nodes
    counted."""
    table, checks = [], []
    for r in runs:
        cost = r.get("counters_cost") or {}
        if not cost:
            continue
        where = [r["mode"], f"{r['services']:,}"]
        if cost.get("error"):
            table.append([*where, "not measured", *("-" for _ in RATIO_COLUMNS), "-"])
        for name, key in (("on / off", "ratio"), ("asymmetry", "node_asymmetry")):
            if key in cost:
                verdict = (
                    {True: "within", False: "OVER", None: "-"}[cost.get("within_budget")] if key == "ratio" else ""
                )
                table.append([*where, name, *(_s(cost[key].get(m), 3) for m, _ in RATIO_COLUMNS), verdict])
        checks += [
            f"- {r['mode']} at {r['services']:,}: {c['node']} counted {c['counted']:,} new connections to"
            f" `{c['service']}` ({c['answered']:,} answered, {c['sent']:,} sent)"
            for c in (h.get("check") for h in cost.get("halves") or [])
            if c
        ]
    if not table:
        return []
    lines = ["### What the service counters cost", ""]
    lines.append(
        "`--counters-cost`: the ClusterIP path from node-1 and its twin from node-2 in the same rounds, one node's"
        " kproxy with `--service-counters` and the other's without, then swapped. on / off: the geometric mean of the"
        " two halves' per-round ratios (1.0: counters cost nothing); asymmetry: how the two paths differ without"
        " counters (1.0: alike; the swap cancels it). Budget: conn/s on / off >= 0.97."
    )
    lines.append("")
    lines += _table(["mode", "services", "figure", *(label for _, label in RATIO_COLUMNS), "budget"], table)
    lines += ["", *checks, ""] if checks else [""]
    return lines


def _absolute_table(runs: list[dict[str, Any]]) -> list[str]:
    lines = ["### Absolute medians", ""]
    head = ["mode", "services", "target", *(f"{m} ({UNITS[m]})" for m, _, _, _ in METRICS)]
    table = []
    for r in runs:
        for target in ("limit", "limit_twin", "limit_ct", "limit_nat", "podip", "clusterip", "clusterip_rev"):
            med = (r.get("medians") or {}).get(target)
            if med:
                table.append(
                    [r["mode"], f"{r['services']:,}", target, *(_num(m, med.get(m)) for m, _, _, _ in METRICS)]
                )
    lines += _table(head, table)
    lines.append("")
    return lines


def _kproxy_table(runs: list[dict[str, Any]]) -> list[str]:
    """kproxy itself in each run: ready time, memory, idle and busy CPU, errors, rounds left out."""
    extra = []
    for r in runs:
        if r.get("ready_s"):
            rss = ", ".join(f"{k} {v:.0f} MB" for k, v in sorted((r.get("kproxy_rss_mb") or {}).items()))
            errs = ", ".join(f"{k} {v}" for k, v in sorted((r.get("errors") or {}).items()) if v) or "none"
            cpu = ", ".join(f"{k} {v:.1f} s" for k, v in sorted((r.get("kproxy_cpu_s") or {}).items())) or "-"
            idle = ", ".join(f"{k} {v:.2f} s" for k, v in sorted((r.get("idle_cpu_s") or {}).items()))
            idle = f"{idle} in {r.get('idle_seconds', 0):g} s" if idle else "-"
            left_out = str(len(r.get("failed_rounds") or []))
            extra.append([r["mode"], f"{r['services']:,}", f"{r['ready_s']:.1f}", rss, idle, cpu, errs, left_out])
    if not extra:
        return []
    lines = [
        "kproxy in the lab: seconds from start on both nodes to healthy and the ClusterIP answering,"
        " resident memory, CPU it used idle (synced, no traffic, no change: it must be almost nothing) and while"
        " the traffic ran (it should be idle: a busy proxy slows every target on this 2-core machine, the limit"
        " too), failed operations during the measurements, and rounds left out for them (over 1 % of a phase's"
        " operations failed for some target):",
        "",
    ]
    head = ["mode", "services", "ready s", "kproxy RSS", "kproxy idle CPU", "kproxy CPU while measuring"]
    lines += _table([*head, "errors", "failed rounds"], extra)
    lines.append("")
    return lines


def fairness_section(results: dict[str, Any]) -> list[str]:
    """Per mode, how evenly the fairness burst's new connections spread over the service's endpoints, from the
    mode's counters (kproxy.bench.spread): the chi-square test against the even split and the max/min share."""
    doc = results.get("fairness") or {}
    runs = doc.get("runs") or []
    if not runs:
        return []
    lines = ["## Fairness (new connections per endpoint, from the counters)", ""]
    lines.append(
        f"{doc.get('connections')} new TCP connections from one pod to a ClusterIP with {doc.get('endpoints')}"
        " endpoints, per mode, counted by the mode itself (`--service-counters`, read from `/metrics`). p: the"
        " chi-square test against the even split (near 0: not even); shares: the busiest and idlest endpoint's part"
        " of the connections (even: 1 / endpoints). `counted = answered`: the counters split the connections as the"
        " echo servers' answers did."
    )
    lines.append("")
    head = ["mode", "connections", "chi2 (dof)", "p", "max share", "min share", "max/min", "counted = answered"]
    table = []
    for run in runs:
        f = run.get("fairness")
        if run.get("error") or not f:
            why = run.get("error") or "nothing counted"
            table.append([run["mode"], str(run.get("connections", "-")), f"failed: {why[:200]}", *["-"] * 5])
            continue
        ratio = f.get("maxMinRatio")
        table.append(
            [
                run["mode"],
                str(f["total"]),
                f"{f['chi2']:.2f} ({f['dof']})",
                f"{f['pValue']:.3g}",
                f"{f['maxShare']:.1%}",
                f"{f['minShare']:.1%}",
                "inf" if ratio is None else f"{ratio:.2f}",
                "yes" if run.get("counted_equals_answered") else "no",
            ]
        )
    lines += _table(head, table)
    lines.append("")
    return lines


HOW_TO_READ = """## How to read this

- **Sync** (`sync.png`, left: full, right: partial; log-log): lower is better. A line parallel to the reference's
  but below it is a constant factor ahead; a flatter partial line means a change costs less as the table grows.
- **Data path** (`datapath.png`): each panel is one metric, as a fraction of the limit (the same traffic between two
  pods on two nodes that run no proxy, measured in the same run). Solid lines are traffic to the ClusterIP, dotted
  lines traffic to the server pod's IP on the nodes the proxy runs on: a proxy's rules tax that too. 1.0 means no
  cost; the dashed line at 0.9 is the nftables target. A line falling with the service count is a per-packet cost
  that grows with services (iptables walks KUBE-SERVICES for every new connection, on both nodes).
- **The conntrack floor**: the limit's nodes have no netfilter rule, and on this kernel conntrack's hooks register
  per network namespace only when a rule needs them, so the limit pays no connection tracking at all. Every
  NAT-based proxy (iptables, nftables: DNAT needs conntrack) pays it on every packet, on both nodes, plus the nat
  hooks on each new connection: the kernel's floor for a NAT proxy, measured in the same rounds as `limit_nat`
  (the limit's path with conntrack and a DNAT rule that never matches) and drawn dash-dotted. A NAT proxy at that
  line costs nothing of its own; only a proxy that translates without conntrack (bpf: at connect()) can reach 1.0.
- **Connections** (`datapath_conn.png`): the same connection rates in absolute terms, limit in black.
- **Memory** (`memory.png`): the sync benchmark's peak resident memory (cache + backend in one process) and kproxy's
  resident memory on node-1 of the lab.
- Noise: the machine is shared (2 cores, other benchmarks running). Each round measures every target interleaved,
  one operation each in turn, so load hits all alike; the brackets give the quartiles of the per-round ratios:
  about +-2-5 % for rates and p50 latencies, +-10-30 % for p99 (preemption of the client or server for
  milliseconds, not the proxy) and for bulk throughput (iperf3 runs one target at a time). Read p50 and rates for
  the proxy's cost, p99 for gross regressions only. `kproxy CPU while measuring` should be near 0: a proxy busy
  during the traffic slows every target, the limit too, and its ratios then say little.
"""


def render(results: dict[str, Any], plot_files: list[str]) -> str:
    m = results.get("machine") or {}
    title = "kproxy bench datapath" if str(results.get("command", "")).startswith("kproxy bench") else "kproxy compare"
    lines = [f"# {title}", ""]
    lines.append(f"`{results.get('command', 'kproxy compare')}` — {m.get('date_utc', '')}")
    if results.get("elapsed_s"):
        lines[-1] += f", took {results['elapsed_s'] / 60:.1f} min"
    lines.append("")
    lines.append("## Machine")
    lines.append("")
    facts = [
        ("CPU", f"{m.get('cpu')} ({m.get('cores')} cores), {m.get('memory_gib')} GiB"),
        ("OS / kernel", f"{m.get('os')} / {m.get('kernel')}"),
        ("kproxy", f"{m.get('kproxy')} at {m.get('commit')}, Python {m.get('python')}"),
        ("tools", f"{m.get('iptables')}; {m.get('nft')}; {m.get('iperf3')}"),
        ("modes", ", ".join(results.get("modes") or [])),
    ]
    for mode, why in (results.get("skipped_modes") or {}).items():
        facts.append((f"not compared: {mode}", why))
    lines += _table(["", ""], [[k, v] for k, v in facts])
    lines.append("")
    for note in results.get("notes") or []:
        lines.append(f"> {note}")
        lines.append("")
    lines += sync_section(results)
    lines += datapath_section(results)
    lines += fairness_section(results)
    if plot_files:
        lines.append("## Plots")
        lines.append("")
        for f in plot_files:
            lines.append(f"![{f}]({f})")
            lines.append("")
    lines.append(HOW_TO_READ)
    return "\n".join(lines)


def readme_section(
    results: dict[str, Any], folder: str, floor_doc: dict[str, Any] | None = None, floor_folder: str = ""
) -> str:
    """A compact summary for the project README: one row per mode and size, the plots under ``folder``; with
    ``floor_doc`` (a data-path run with the diagnostic limits, its files under ``floor_folder``) its table too."""
    m = results.get("machine") or {}
    sync = {(r["mode"], r["services"]): r for r in results.get("sync") or []}
    refs = {r["services"]: r for r in results.get("reference") or []}
    runs = {(r["mode"], r["services"]): r for r in (results.get("datapath") or {}).get("runs") or []}
    keys = sorted(set(sync) | {k for k in runs if k[0] != "none"}, key=lambda k: (k[1], k[0]))
    lines = [
        "## Comparing the backends (`kproxy compare`)",
        "",
        f"`{results.get('command')}` on this machine ({m.get('cpu')}, {m.get('cores')} cores, kernel"
        f" {m.get('kernel')}, {m.get('date_utc')}"
        + (f", took {results['elapsed_s'] / 60:.1f} min" if results.get("elapsed_s") else "")
        + "); the full report with every figure and the command behind it is"
        f" [{folder}/report.md]({folder}/report.md), the raw figures [{folder}/results.json]({folder}/results.json).",
        "",
    ]
    head = ["mode", "services", "full sync s", "partial sync s", "upstream nft layout full s"]
    head += ["ClusterIP conn/s", "pod IP conn/s", "ClusterIP conn p99", "ClusterIP RR p99"]
    floor = any((r.get("ratios_vs") or {}).get("limit_nat") for r in runs.values())
    if floor:
        head += ["ClusterIP conn/s vs NAT floor", "pod IP conn/s vs NAT floor"]
    head += ["kproxy RSS (lab)"]
    rows = []
    for mode, n in keys:
        s_ = sync.get((mode, n)) or {}
        d = runs.get((mode, n)) or {}
        ref = refs.get(n) or {}
        cr, pr = (d.get("ratios") or {}).get("clusterip", {}), (d.get("ratios") or {}).get("podip", {})
        rss = (d.get("kproxy_rss_mb") or {}).get("node-1")
        rows.append(
            [
                mode,
                f"{n:,}",
                _s(s_.get("full_sync_s")),
                _s(s_.get("partial_sync_s"), 4),
                _s(ref.get("full_s")) if ref.get("full_s") else "-",
                "not measured (see the report)" if d.get("error") else _s(cr.get("conn_rate"), 2),
                _s(pr.get("conn_rate"), 2),
                _s(cr.get("conn_p99_us"), 2),
                _s(cr.get("rr_p99_us"), 2),
                *(
                    [
                        _s(((d.get("ratios_vs") or {}).get("limit_nat") or {}).get(t, {}).get("conn_rate"), 2)
                        for t in ("clusterip", "podip")
                    ]
                    if floor
                    else []
                ),
                f"{rss:.0f} MB" if rss else "-",
            ]
        )
    lines += _table(head, rows)
    lines += [
        "",
        "Sync times are medians of the sync benchmark's runs (services x"
        f" {results.get('endpoints')} endpoints, in a throwaway namespace); data-path columns are fractions of the"
        " limit (the same traffic between pods on two nodes without any proxy rules, measured in the same run:"
        " 1.0 = no cost, higher is better, latencies inverted).",
        "",
    ]
    for f in ("sync.png", "datapath.png", "datapath_conn.png", "memory.png"):
        lines += [f"![{f}]({folder}/{f})", ""]
    if floor_doc is not None:
        lines += floor_summary(floor_doc, floor_folder or folder)
    lines.append(HOW_TO_READ.replace("## How to read this", "How to read them:").strip())
    return "\n".join(lines) + "\n"


def _loaded_tracks(run: dict[str, Any]) -> str:
    ce = (run.get("conntrack_entries") or {}).get("podip") or {}
    if not ce:
        return "-"
    return "yes" if ce.get("client_node", 0) > 0 or ce.get("server_node", 0) > 0 else "no"


def floor_summary(doc: dict[str, Any], folder: str) -> list[str]:
    """The README's data-path table from a ``kproxy bench datapath`` run with the diagnostic limits: each mode and
    size against the limit and against the NAT floor, and whether the loaded nodes track connections at all."""
    results = as_results(doc)
    dp = results.get("datapath") or {}
    runs = [r for r in dp.get("runs") or [] if (r.get("ratios") or {}).get("limit_nat")]
    if not runs:
        return []
    lines = [
        "### The data path at 1, 1,000 and 10,000 services, and the conntrack floor",
        "",
        f"`{results.get('command')}` ({(results.get('machine') or {}).get('date_utc', '')}; report"
        f" [{folder}/report.md]({folder}/report.md), figures [{folder}/results.json]({folder}/results.json), plots"
        f" [{folder}/datapath.png]({folder}/datapath.png)). Medians of {(dp.get('config') or {}).get('rounds')}"
        " interleaved rounds; in brackets the first and third quartiles of the per-round ratios (the noise).",
        "",
    ]
    head = ["mode", "services", "ClusterIP conn/s", "pod IP conn/s", "ClusterIP conn p50", "ClusterIP RR p99"]
    head += ["NAT floor conn/s", "ClusterIP / floor", "pod IP / floor", "loaded nodes track connections"]
    rows = []
    for r in runs:
        ratios, spread = r.get("ratios") or {}, r.get("ratio_spread") or {}
        vs = (r.get("ratios_vs") or {}).get("limit_nat") or {}

        def cell(t: str, m: str, ratios: dict[str, Any] = ratios, spread: dict[str, Any] = spread) -> str:
            return _spread_cell((ratios.get(t) or {}).get(m), (spread.get(t) or {}).get(m))

        rows.append(
            [
                r["mode"],
                f"{r['services']:,}",
                cell("clusterip", "conn_rate"),
                cell("podip", "conn_rate"),
                cell("clusterip", "conn_p50_us"),
                cell("clusterip", "rr_p99_us"),
                cell("limit_nat", "conn_rate"),
                _s((vs.get("clusterip") or {}).get("conn_rate"), 2),
                _s((vs.get("podip") or {}).get("conn_rate"), 2),
                _loaded_tracks(r),
            ]
        )
    lines += _table(head, rows)
    lines.append("")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m kproxy.bench.report",
        description="print report.md (or the README summary) of a kproxy compare results.json, or of a kproxy bench"
        " datapath --format json document",
    )
    p.add_argument("results")
    p.add_argument("--readme", metavar="FOLDER", help="print the README summary, with links into FOLDER")
    p.add_argument("--command", default="", help="the command behind a bench datapath document")
    p.add_argument("--floor", metavar="JSON", help="with --readme: a bench datapath run with the diagnostic limits")
    p.add_argument("--floor-folder", default="", metavar="FOLDER", help="where --floor's report and plots are")
    args = p.parse_args(argv)
    path = Path(args.results)
    results = as_results(json.loads(path.read_text()), args.command)
    if args.readme:
        floor = json.loads(Path(args.floor).read_text()) if args.floor else None
        print(readme_section(results, args.readme, floor, args.floor_folder))
        return 0
    files = [f for f in ("sync.png", "datapath.png", "datapath_conn.png", "memory.png") if (path.parent / f).exists()]
    print(render(results, files))
    return 0


if __name__ == "__main__":
    sys.exit(main())
