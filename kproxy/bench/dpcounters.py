"""What ``--service-counters`` costs the data path, per mode (``kproxy bench datapath --counters-cost``): new
connections per second (and every other metric) through a ClusterIP whose client's node counts, against one whose
client's node does not, measured in the same interleaved rounds.

Decisions:

- **Two nodes, one counting, the roles swapped once.** kproxy runs on node-1 and node-2; the counter flag is per
  process, so per node. The ClusterIP target (pod-1-1 -> pod-2-1, translated on node-1) gets a twin the other way
  round (``dpconfig.REV``: pod-2-3 -> its own service's ClusterIP -> pod-1-3, translated on node-2), each with its
  own client and server pod like every target (``dpconfig.ROLES``). In the first half node-2 runs with
  ``--service-counters`` and node-1 without: the reverse target is the counted path, the ClusterIP the uncounted one,
  one operation each in turn in the same rounds, so the machine's drift hits both alike. Then both nodes are
  restarted with the roles swapped and the rounds run again. The first half is the mode's run (its ClusterIP figures
  are the default, uncounted data path, as without the option); the second is kept beside it.
- **Why swap, not a restart between rounds.** Restarting the loaded nodes' kproxy with and without counters between
  rounds would put the two sides of the ratio seconds to minutes apart (a full sync at 10,000 services takes minutes
  here), on a machine whose speed drifts by more than the 3 % budget over such times, and would cost a full sync per
  round. Interleaved in the same rounds the two sides are microseconds apart. What that leaves is a difference between
  the two paths (other nodes, other pods, another service's place in the rules: iptables walks KUBE-SERVICES in
  order), which could pass for the counters' cost; the swap cancels it and measures it. Per metric, with ``h1`` and
  ``h2`` each half's median of the per-round ratios counted / uncounted (1.0: as fast; smaller: slower), and ``a``
  the reverse path's speed against the ClusterIP path's without counters: ``h1 = c * a``, ``h2 = c / a``, so the
  counters' cost is ``c = sqrt(h1 * h2)`` and the node asymmetry ``a = sqrt(h1 / h2)``, the twin-like check (1.0
  within the noise when the paths are alike), reported beside it. One restart per mode and size, not one per round.
- **The counting node really counts.** Before each half's rounds the other node's ``/metrics`` must serve no counters
  (``Scrape.offered`` None) and the counting node's must; after them the counted service's TCP port must have grown
  by at least the connections that were answered and at most the connections sent to it (warm-up and failed ones,
  rr's one per phase, and the readiness probes since kproxy started, in case the first read was an older one), read
  as any Prometheus reads it (``kproxy.counters.parse``), polled (bounded) because a slow mode serves a scrape from
  its last read. Anything else fails the half (``DatapathError``): a cost measured against a node that does not
  count would be no cost at all.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kproxy.bench.dpconfig import (
    CLUSTER_IPS,
    COUNTERS_BUDGET,
    TARGET_NAMESPACE,
    DatapathError,
    DatapathRun,
)
from kproxy.bench.dpstats import paired_ratios, ratio_spread
from kproxy.counters import Measure, Scrape, service_key

if TYPE_CHECKING:
    from kproxy.bench.dplab import DatapathLab

#: the counting node of the first half (the mode's run) and of the second (the roles swapped)
HALVES = ("node-2", "node-1")
COUNTED_TIMEOUT = 60.0  # seconds: a read of the counters newer than the traffic (iptables reads in the background)
BUDGET_METRIC = "conn_rate"


@dataclass
class CounterWatch:
    """One half's counting node, its counted target and service port, and what had been read and sent before."""

    node: str
    target: str
    key: str
    before: float
    made: dict[str, int]


def counted_target(dl: DatapathLab, node: str) -> str:
    """The ClusterIP target whose client pod runs on ``node`` (that node's kproxy translates, and counts, it)."""
    found = [t for t in CLUSTER_IPS if t in dl.all_targets and dl.client_of(t).node == node]
    if len(found) != 1:
        raise DatapathError(f"no single ClusterIP target starts on {node}: {found}")
    return found[0]


def key_of(target: str) -> str:
    """The counters' key of a ClusterIP target's TCP port (the one the connection and rr phases use)."""
    return service_key(TARGET_NAMESPACE, CLUSTER_IPS[target][0], "tcp", "TCP", "IPv4")


def connections(scrape: Scrape, key: str) -> float:
    sample = scrape.services.get(key)
    return float((sample.total if sample else {}).get(Measure.CONNECTIONS.value) or 0.0)


def watch(dl: DatapathLab, node: str) -> CounterWatch:
    """Before a half's rounds: the other loaded node serves no counters, ``node`` does; its count now."""
    for other in (n for n in HALVES if n != node):  # the loaded nodes
        if dl.read_counters(other).offered is not None:
            raise DatapathError(f"{other} serves service counters, but its kproxy should run without them")
    scrape = dl.read_counters(node)
    if scrape.offered is None or Measure.CONNECTIONS not in scrape.offered:
        raise DatapathError(f"{node}'s kproxy runs with --service-counters, but its /metrics counts no connections")
    target = counted_target(dl, node)
    key = key_of(target)
    return CounterWatch(node, target, key, connections(scrape, key), dict(dl.made.get(target, {})))


def verify(dl: DatapathLab, w: CounterWatch) -> dict[str, Any]:
    """After a half's rounds: the counted service grew by the connections made (see the module docstring); the
    check's figures, or DatapathError."""
    now = dl.made.get(w.target, {})
    made = {k: now.get(k, 0) - w.made.get(k, 0) for k in ("crr_ok", "crr_sent", "rr_sent")}
    low = made["crr_ok"]
    high = made["crr_sent"] + made["rr_sent"] + now.get("probes", 0)
    deadline = time.monotonic() + COUNTED_TIMEOUT
    while True:
        counted = connections(dl.read_counters(w.node), w.key) - w.before
        if counted >= low or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    check = {
        "node": w.node,
        "target": w.target,
        "service": w.key,
        "counted": round(counted),
        "answered": low,
        "sent": made["crr_sent"] + made["rr_sent"],
        "probes_since_start": now.get("probes", 0),
    }
    if not low <= counted <= high:
        raise DatapathError(
            f"{w.node}'s counters show {counted:g} new connections to {w.key} where {low} were answered and at most"
            f" {high} sent: the counting node does not count what it translates ({check})"
        )
    return check


def half_ratios(run: DatapathRun, counted: str, uncounted: str) -> tuple[dict[str, float], dict[str, list[float]]]:
    """One half's counted / uncounted per metric (median of the per-round ratios) and their interquartile range."""
    ratios = paired_ratios(run.rounds, [uncounted, counted], uncounted).get(counted, {})
    spread = ratio_spread(run.rounds, [uncounted, counted], uncounted).get(counted, {})
    return ratios, spread


def cost_entry(dl: DatapathLab, first: DatapathRun, second: DatapathRun) -> dict[str, Any]:
    """``DatapathRun.counters_cost`` from the two halves (each run's ``counters_cost`` holds its ``check``)."""
    halves: list[dict[str, Any]] = []
    per_half: list[dict[str, float]] = []
    for run, node in zip((first, second), HALVES, strict=True):
        counted = counted_target(dl, node)
        uncounted = next(t for t in CLUSTER_IPS if t != counted)
        ratios, spread = half_ratios(run, counted, uncounted) if not run.error else ({}, {})
        per_half.append(ratios)
        halves.append(
            {
                "counting_node": node,
                "counted": counted,
                "uncounted": uncounted,
                "ratio": {m: round(v, 4) for m, v in ratios.items()},
                "spread": spread,
                "rounds": len(run.rounds),
                "check": run.counters_cost.get("check"),
                "error": run.error,
            }
        )
    entry: dict[str, Any] = {
        "budget": {BUDGET_METRIC: COUNTERS_BUDGET},
        "halves": halves,
        "second_run": second.to_json(),
    }
    h1, h2 = per_half
    if second.error or not h1 or not h2:
        entry["error"] = f"the swapped half: {second.error or 'no figures'}"
        return entry
    # the asymmetry as the reverse path's speed against the ClusterIP path's, whichever half counted which
    rev_first = halves[0]["counted"] != "clusterip"
    entry["ratio"] = {m: round(math.sqrt(h1[m] * h2[m]), 4) for m in h1 if m in h2}
    entry["node_asymmetry"] = {
        m: round(math.sqrt(h1[m] / h2[m] if rev_first else h2[m] / h1[m]), 4) for m in h1 if m in h2
    }
    cost = entry["ratio"].get(BUDGET_METRIC)
    entry["within_budget"] = None if cost is None else cost >= COUNTERS_BUDGET
    return entry
