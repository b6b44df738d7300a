"""``kproxy bench datapath``: what a backend's rules cost the traffic that crosses them, in the lab
(docs/PERFORMANCE.md).

From a pod to a ClusterIP whose only endpoint is a pod on the other node, with N services programmed on both nodes,
and the same traffic to that pod's IP directly, against **the limit**: the same traffic between two pods on two
nodes that have no proxy rules at all, measured in the same run. The lab has four nodes (eight with the diagnostic
limits; prefix ``kpd-``, two pods each, IPv4): kproxy runs on node-1 and node-2 only; node-3 and node-4 never get a
rule, so pod-3-1 -> pod-4-1 is the limit at every size. (The pod IP on the loaded node is not the limit: a proxy's
rules also tax traffic that never touches a service, e.g. iptables' KUBE-SERVICES walk on every new connection, on
both nodes.)

Targets, measured in many short rounds whose order is shuffled, every target with a client pod and a server pod of
its own (``ROLES``: each echo server takes one operation per turn of the interleaving; a server shared by two targets
answers each later than a server of one, which once put the pod IP 4-10 % "above" the limit):

* ``limit``: pod-3-1 -> pod-4-1's IP (no proxy rules anywhere on the path);
* ``limit_twin``: pod-3-2 -> pod-4-2's IP, the limit's path between two other pods: the lab's self-test in every
  run (twin / limit must be 1.0 within a couple of per cent; ``DatapathConfig.twin``);
* ``podip``: pod-1-2 -> pod-2-2's IP across the loaded nodes;
* ``clusterip``: pod-1-1 -> the target service's ClusterIP, DNATed (or translated at connect()) to pod-2-1; in mode
  ``none`` pod-2-1's IP directly, so the calibration runs a real run's targets, pods and schedule;
* with ``DatapathConfig.counters_cost`` (``--counters-cost``), ``clusterip_rev``: pod-2-3 -> a second service's
  ClusterIP -> pod-1-3, the ClusterIP path the other way round, and each proxied mode runs twice: node-2 counting
  (``--service-counters``) and node-1 not, then swapped; counters on / off per metric comes from the two ClusterIP
  targets of the same rounds, the swap cancels (and measures) any difference between the two paths, and each half
  checks the counting node's ``/metrics`` grew by the connections made (kproxy.bench.dpcounters says why this way
  and not a restart between rounds). The first half is the mode's run: its ClusterIP target stays uncounted;
* diagnostic limits (``DatapathConfig.conntrack_limits``, on by default here, ``kproxy compare --conntrack-limits``):
  ``limit_ct``, the limit's path with conntrack turned on in nodes 5 and 6 by a one-rule table, and ``limit_nat``,
  nodes 7 and 8 with nat base chains and a DNAT rule that never matches (conntrack + the nat hooks + a null binding
  per connection: what every NAT-based proxy pays before any rule of its own). Why they exist: on this kernel
  conntrack's hooks register per network namespace only when a rule needs them (a ct expression, a NAT rule; a nat
  chain alone does not), so the plain limit tracks nothing, and a NAT proxy cannot reach it; the pod IP and the
  ClusterIP are also reported against ``limit_nat`` (``DatapathRun.ratios_vs``). The conntrack entries in each
  path's nodes after every round are recorded: 0 on the limit's nodes shows it.

One client (``dpclient --serve``) runs every target in turn, one operation each; it makes no socket itself. Each
target's sockets come from a factory process (``dpclient --factory``) in the target's client pod and in its client
node's cgroup, because a socket belongs to the cgroup of the process that made it and a bpf proxy's socket programs
(connect4, sendmsg4) run for the socket's cgroup: the limits' sockets come from nodes that never run a proxy and pass
no program; the pod IP's and the ClusterIP's come from node-1 and pass all of bpf's.

Metrics, per target and round (kproxy.bench.dpclient against the pods' echo servers; iperf3 for throughput): new TCP
connections per second (connect, one request/response, close with RST) with the p50/p99 of a whole connection (a
failed operation's time counts in its target's rate; a round in which some target failed more than
``MAX_ERROR_FRACTION`` of a phase's operations is left out whole); request/response p50/p99 on one established TCP
connection; UDP request/response p50/p99; bulk TCP throughput (``iperf3 -c``, Gbit/s). Each figure is the median
over the rounds; each ratio is against the limit, oriented so that 1.0 means "as fast as without a proxy" and
smaller is slower (rates: target / limit; latencies: limit / target), taken within each round and then the median
over rounds (:func:`paired_ratios`), with the interquartile range of the per-round ratios beside it
(:func:`ratio_spread`: the noise of a shared machine).

Pinning (2 cores): every client (dpclient, its factories, iperf3 -c) runs under ``taskset -c 0``; the servers (the
targets' echo servers, re-pinned with ``taskset -a -p -c 1``, and ``iperf3 -s``) on CPU 1. The kproxy processes and
the lab's API stand-in are not pinned: they are idle while traffic runs (their sync is finished and checked first).

Services: size N means N services programmed in total: the target plus N - 1 synthetic ones (kproxy.bench.synthetic:
namespace ``bench``, ClusterIPs from 198.19.0.0/16, E endpoints each on node-1/node-2, every tenth UDP), written to
the lab's API stand-in over its HTTP API before kproxy starts, so each size costs one full sync per node. Sizes run in
ascending order; each mode is started on both loaded nodes, waited for (``/healthz`` 200, then the ClusterIP answers
over TCP and UDP), measured, stopped, and its rules removed (``kproxy cleanup --mode MODE`` in both nodes, then any
table left, e.g. iptables-nft's empty built-in ones, whose forward chain would tax the next mode's every packet, and
the conntrack entries). kproxy's CPU time over a quiet interval before the traffic (``idle_cpu_s``: synced, no
change, no traffic; an idle proxy must cost almost nothing) and while the traffic runs are recorded.

Mode ``none`` starts no proxy: every target against ``limit`` then shows what the lab itself contributes (1.0 within
the noise), with the same targets and schedule as a real run.
"""

import json
import random
import signal
import statistics
import threading
from collections.abc import Callable, Sequence

from kproxy.bench import dpcounters, synthetic
from kproxy.bench.dpconfig import (
    CONNTRACK_LIMITS,
    NONE_MODE,
    REV,
    TWIN,
    DatapathConfig,
    DatapathError,
    DatapathResult,
    DatapathRun,
    targets_for,
)
from kproxy.bench.dplab import DatapathLab, Progress
from kproxy.bench.dpstats import medians, paired_ratios, ratio_spread
from kproxy.bench.dptable import format_table
from kproxy.bench.results import METRICS
from kproxy.lab.plan import LabError


def parse_sizes(text: str) -> list[int]:
    """``"1,1000,10000"`` -> [1, 1000, 10000] (sorted, unique); ValueError for anything else."""
    sizes = sorted({int(x) for x in text.split(",") if x.strip()})
    if not sizes or sizes[0] < 1 or sizes[-1] > synthetic.MAX_SERVICES:
        raise ValueError(f"service counts must be 1..{synthetic.MAX_SERVICES}: {text!r}")
    return sizes


def round_order(targets: Sequence[str], r: int) -> list[str]:
    """The targets' order in round ``r``: a shuffle seeded by the round, the same in every run. An interleaved
    operation runs a little faster after one from the same pod (warm caches), so a fixed cyclic order (a rotation
    keeps each target's predecessor) would favour one target for the whole run; shuffled, each has every
    predecessor in turn."""
    order = list(targets)
    random.Random(r).shuffle(order)
    return order


def measure_run(dl: DatapathLab, mode: str, services: int, targets: Sequence[str]) -> DatapathRun:
    """Rounds over ``targets`` (rotating their order) with whatever is programmed now; medians and ratios."""
    run = DatapathRun(mode=mode, services=services)
    per_target: dict[str, list[dict[str, float]]] = {t: [] for t in targets}
    ct: dict[str, dict[str, list[float]]] = {}
    cpu0 = dl.kproxy_cpu()
    for r in range(dl.config.rounds):
        order = round_order(targets, r)
        dl.progress(f"{mode} @ {services}: round {r + 1}/{dl.config.rounds}, {', '.join(order)} interleaved")
        this_round, errors, failure = dl.judged_round(order)
        for t in order:
            run.errors[t] = run.errors.get(t, 0) + errors[t]
        if failure:  # left out whole, every target's figures of it, so the rounds stay paired
            run.failed_rounds.append(f"round {r + 1}: {failure}")
            dl.progress(f"{mode} @ {services}: round {r + 1} failed: {failure}", len(order))
            continue
        for t in order:
            for side, node in zip(("client_node", "server_node"), dl.path_nodes(t), strict=True):
                n = dl.conntrack_count(node.ns)
                if n is not None:
                    ct.setdefault(t, {}).setdefault(side, []).append(n)
            per_target[t].append(this_round[t])
        dl.progress("", len(order))
        run.rounds.append(this_round)
    cpu1 = dl.kproxy_cpu()
    run.kproxy_cpu_s = {k: round(cpu1[k] - cpu0[k], 2) for k in cpu1 if k in cpu0}
    if len(run.failed_rounds) * 2 > dl.config.rounds:
        raise DatapathError(f"{len(run.failed_rounds)} of {dl.config.rounds} rounds failed: {run.failed_rounds}")
    run.medians = {t: medians(v) for t, v in per_target.items()}
    run.ratios = paired_ratios(run.rounds, targets)
    run.ratio_spread = ratio_spread(run.rounds, targets)
    run.conntrack_entries = {t: {side: statistics.median(v) for side, v in d.items()} for t, d in ct.items()}
    for base in CONNTRACK_LIMITS:
        if base in targets:
            both = [t for t in ("podip", "clusterip") if t in targets]
            run.ratios_vs[base] = paired_ratios(run.rounds, [base, *both], base)
    return run


def proxied_run(dl: DatapathLab, mode: str, n: int, counting: str = "", idle: bool = True) -> DatapathRun:
    """``mode`` started on both loaded nodes (``--service-counters`` on ``counting``, whose counters are checked
    around the rounds: kproxy.bench.dpcounters), measured and removed again; a failure is the run's ``error``."""
    targets = targets_for(mode, dl.config)
    with_counters = f" (--service-counters on {counting})" if counting else ""
    dl.progress(f"{mode} @ {n}: starting kproxy on node-1 and node-2{with_counters}")
    try:
        ready = dl.start_mode(mode, (counting,) if counting else ())
    except (DatapathError, LabError) as exc:
        # one mode failing at one size is a finding for the report, not the end of everyone's figures
        dl.progress(f"{mode} @ {n}: FAILED: {exc}", dl.config.rounds * len(targets))
        dl.stop_mode(mode)
        return DatapathRun(mode=mode, services=n, error=str(exc)[:2000])
    try:
        rss, peak = dl.kproxy_memory()
        idle_cpu: dict[str, float] = {}
        if idle:
            dl.progress(f"{mode} @ {n}: kproxy's idle CPU over {dl.config.idle_seconds:g} s")
            idle_cpu = dl.idle_cpu(dl.config.idle_seconds)
        try:
            watch = dpcounters.watch(dl, counting) if counting else None
            run = measure_run(dl, mode, n, targets)
            if watch is not None:
                run.counters_cost = {"check": dpcounters.verify(dl, watch)}
        except DatapathError as exc:  # a measurement that failed: this run's finding, not everyone's end
            run = DatapathRun(mode=mode, services=n, error=f"measuring: {str(exc)[:2000]}")
        run.idle_cpu_s, run.idle_seconds = idle_cpu, dl.config.idle_seconds if idle else 0.0
        run.ready_s = ready
        run.kproxy_rss_mb, run.kproxy_peak_rss_mb = rss, peak
        run.sync_metrics = dl.sync_metrics()
    finally:
        cleanup_problem = dl.stop_mode(mode)
    if cleanup_problem:
        run.note = cleanup_problem
    return run


def run_in_lab(
    dl: DatapathLab, modes: Sequence[str], n: int, on_run: Callable[[DatapathRun], None] | None = None
) -> list[DatapathRun]:
    """Every mode at size ``n`` in a running DatapathLab (mode ``none``: no proxy at all). With the counters' cost,
    each proxied mode runs twice, the counting node swapped (kproxy.bench.dpcounters); the first is the mode's run."""
    dl.ensure_services(n)
    runs = []
    cost = dl.config.counters_cost
    for mode in modes:
        if mode == NONE_MODE:
            run = measure_run(dl, mode, n, targets_for(mode, dl.config))
        else:
            run = proxied_run(dl, mode, n, dpcounters.HALVES[0] if cost else "")
            if cost and not run.error:
                second = proxied_run(dl, mode, n, dpcounters.HALVES[1], idle=False)
                run.counters_cost = dpcounters.cost_entry(dl, run, second)
        runs.append(run)
        if on_run is not None:
            on_run(run)
    return runs


def run_datapath(
    modes: Sequence[str],
    sizes: Sequence[int],
    config: DatapathConfig | None = None,
    progress: Progress | None = None,
    on_run: Callable[[DatapathRun], None] | None = None,
) -> DatapathResult:
    """Every mode at every size (ascending) in one lab, taken down afterwards. Modes must be available here."""
    config = config or DatapathConfig()
    result = DatapathResult(config=config.describe())
    if on_run is None and progress is not None:
        # each run's whole figures as one line on the progress stream as soon as it is measured, so a run that
        # ends early (a crash, a kill) still leaves what it measured
        report = progress

        def on_run(run: DatapathRun) -> None:
            report("measured: " + json.dumps(run.to_json(), separators=(",", ":")))

    with DatapathLab(config, progress) as dl:
        for n in sorted(set(sizes)):
            result.runs += run_in_lab(dl, modes, n, on_run)
    return result


def stop_on_sigterm() -> None:
    """Make SIGTERM (``timeout``, a CI runner, ``kill``) unwind like Ctrl-C, so the lab goes down with the run
    instead of being left behind with its processes (the main thread only, where Python runs signal handlers)."""

    def _raise(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise)


def check_modes(modes: Sequence[str]) -> list[str]:
    """Problems with the requested modes (unknown, not installed, not available here): empty when all can run."""
    from kproxy.proxier import availability

    problems = []
    for mode in modes:
        if mode == NONE_MODE:
            continue
        avail = availability(mode)
        if not avail:
            problems.append(f"mode {mode}: {avail.reason}")
    return problems


# the benchmark's interface: its own functions and the types and names its callers use with them
__all__ = [
    "CONNTRACK_LIMITS",
    "METRICS",
    "NONE_MODE",
    "REV",
    "TWIN",
    "DatapathConfig",
    "DatapathError",
    "DatapathLab",
    "DatapathResult",
    "DatapathRun",
    "LabError",
    "check_modes",
    "format_table",
    "measure_run",
    "parse_sizes",
    "proxied_run",
    "round_order",
    "run_datapath",
    "run_in_lab",
    "stop_on_sigterm",
    "targets_for",
]
