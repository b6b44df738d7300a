"""``kproxy bench apiscale``: N services x E endpoints through the API, kproxy listing them in pages on a lab.

What ``kproxy bench sync`` cannot show: the time from kproxy's first list to services answering on a node, with
the objects coming from the API the way they do in a cluster. The run:

1. a lab (``kproxy.lab.cluster``, one or two nodes, E echo pods in all, no kproxy yet) under ``--lab-prefix``;
2. N Services (``kproxy.bench.synthetic``'s ClusterIPs, TCP 80 -> 8080, every ``--ports-every``-th with two more
   ports) and one EndpointSlice each whose E endpoints are the lab's real pods, created in the stand-in through
   the official client's ApiClient on the stand-in's bulk path (POST /_bulk: one request per few thousand
   objects; one request per object would take longer than everything measured after it). kproxy itself gets them
   through the ordinary API: paginated lists (pages of 500), then watches;
3. on node 1 the sweep (``kproxy.bench.apiscale_probe``) starts connecting to a sample of the ClusterIPs, then
   kproxy starts on every node in ``--mode``; reported per node: the first and last list request (the stand-in's
   request log, by the node's address), when the cache had absorbed both lists (``absorbed_s``: the last sync
   queued), /healthz 200, and, on node 1, when every sampled service had answered a real connection
   (``all_answered_s``, from the first list request), with the sync phases from kproxy's metrics
   (``kubeproxy_sync_full_proxy_rules_duration_seconds``, ``kproxy_sync_phase_duration_seconds``);
4. the churn (``--churn-rate`` K per second for ``--churn-seconds`` T): every tenth of a second K/10 EndpointSlices
   each move one endpoint to another pod, stamped with ``endpoints.kubernetes.io/last-change-trigger-time`` as the
   EndpointSlice controller stamps them (bulk replace, through the official client); then the p50/p99 of
   ``kubeproxy_network_programming_duration_seconds`` over the churn, read once kproxy has observed every change
   (``caught_up_s`` after the last one; bounded by ``--timeout``), from the histogram's buckets (upstream's
   buckets: 0, 0.25, 0.5, 1, 2, ... s, so a quantile below 1 s is interpolated within a quarter-second bucket).

JSON (``--format json``) or a short table. The lab is taken down at the end, also on failure. Figures belong in
docs/PERFORMANCE.md with their command.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kproxy.bench import options as bench_options
from kproxy.bench import synthetic
from kproxy.bench.memory import process_mb
from kproxy.objects import ANNOTATION_TRIGGER_TIME

if TYPE_CHECKING:  # the lab loads when the command runs, not with every `kproxy` command line
    from kproxy.lab.cluster import Lab, LabPod

BULK_CHUNK = 4000  # objects per bulk request: a few MB of JSON
PROGRAMMING = "kubeproxy_network_programming_duration_seconds"


@dataclass(frozen=True)
class ScaleConfig:
    mode: str
    services: int = 10_000
    endpoints: int = 10
    nodes: int = 2
    sample: int = 200
    ports_every: int = 0
    churn_rate: int = 0
    churn_seconds: float = 10.0
    lab_prefix: str = "kpa-"
    timeout: float = 600.0
    #: the mode's options (``--backend-option``, typed as it declares them) for every node's kproxy, e.g.
    #: bpf_map_size: the default maps of the bpf mode do not hold 100,000 services x 10 endpoints
    backend_options: dict[str, Any] = field(default_factory=dict)

    def check(self) -> None:
        if not 1 <= self.services <= synthetic.MAX_SERVICES:
            raise ValueError(f"--services must be 1..{synthetic.MAX_SERVICES}")
        if not 1 <= self.endpoints <= 200 or not 1 <= self.nodes <= 2:
            raise ValueError("--endpoints must be 1..200 and --nodes 1 or 2")
        if self.sample < 1 or self.churn_rate < 0 or self.churn_seconds < 0 or self.ports_every < 0:
            raise ValueError("--sample must be at least 1; --churn-rate, --churn-seconds, --ports-every not negative")


@dataclass
class ScaleResult:
    config: dict[str, Any]
    service_ports: int
    load_s: float = 0.0
    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    sweep: dict[str, Any] = field(default_factory=dict)
    churn: dict[str, Any] = field(default_factory=dict)


# --- the objects --------------------------------------------------------------------------------------------------


def _endpoints(i: int, n: int, pods: Sequence[LabPod], variant: int = 0) -> list[dict[str, Any]]:
    """n of the lab's pods for service i, rotating through them; ``variant`` moves the last one to another pod."""
    picks = [pods[(i + j) % len(pods)] for j in range(n)]
    if variant and len(pods) > n:
        picks[-1] = pods[(i + n - 1 + 1 + variant % (len(pods) - n)) % len(pods)]
    return [
        {
            "addresses": [p.ip4],
            "conditions": {"ready": True, "serving": True, "terminating": False},
            "nodeName": p.node,
            "targetRef": {"kind": "Pod", "namespace": synthetic.NAMESPACE, "name": p.name},
        }
        for p in picks
    ]


def service(i: int, cfg: ScaleConfig) -> dict[str, Any]:
    svc = synthetic.service(i, udp_every=0, ports_every=cfg.ports_every)
    meta = svc["metadata"]
    svc["metadata"] = {"name": meta["name"], "namespace": meta["namespace"], "labels": meta["labels"]}
    svc.pop("status", None)
    return svc


def endpoint_slice(
    i: int, cfg: ScaleConfig, pods: Sequence[LabPod], variant: int = 0, trigger: float | None = None
) -> dict[str, Any]:
    eps = synthetic.endpoint_slice(i, 0, udp_every=0, ports_every=cfg.ports_every)
    meta = {k: eps["metadata"][k] for k in ("name", "namespace", "labels")}
    if trigger is not None:
        stamp = datetime.fromtimestamp(trigger, timezone.utc).isoformat(timespec="microseconds")
        meta["annotations"] = {ANNOTATION_TRIGGER_TIME: stamp.replace("+00:00", "Z")}
    eps["metadata"] = meta
    eps["endpoints"] = _endpoints(i, cfg.endpoints, pods, variant)
    return eps


def objects(cfg: ScaleConfig, pods: Sequence[LabPod]) -> Iterator[dict[str, Any]]:
    for i in range(1, cfg.services + 1):
        yield service(i, cfg)
        yield endpoint_slice(i, cfg, pods)


def _answer(resp: Any, what: str) -> Any:
    """The JSON of a raw ApiClient.call_api response (which does not raise for an error status)."""
    data = resp.read()
    if not 200 <= resp.status < 300:
        raise RuntimeError(f"{what}: HTTP {resp.status}: {data[:300]!r}")
    return json.loads(data)


def bulk(client: Any, url: str, items: list[dict[str, Any]], replace: bool = False) -> int:
    """One POST /_bulk through the official client's ApiClient; RuntimeError naming the first failure."""
    body: dict[str, Any] = {"items": items, **({"replace": True} if replace else {})}
    resp = client.call_api("POST", f"{url}/_bulk", header_params={"Content-Type": "application/json"}, body=body)
    answer = _answer(resp, "POST /_bulk")
    if answer.get("failures"):
        first = answer["failures"][0]
        raise RuntimeError(f"the stand-in refused {len(answer['failures'])}+ objects, first: {first.get('message')}")
    return int(answer.get("replaced" if replace else "created", 0))


def load(client: Any, url: str, cfg: ScaleConfig, pods: Sequence[LabPod]) -> float:
    t0 = time.monotonic()
    chunk: list[dict[str, Any]] = []
    for obj in objects(cfg, pods):
        chunk.append(obj)
        if len(chunk) >= BULK_CHUNK:
            bulk(client, url, chunk)
            chunk = []
    if chunk:
        bulk(client, url, chunk)
    return time.monotonic() - t0


# --- metrics ------------------------------------------------------------------------------------------------------


def scrape(lab: Lab, ns: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """A node's /metrics (kproxy binds it to the node's 127.0.0.1), parsed by prometheus_client: sample name ->
    [(labels, value)]."""
    from prometheus_client.parser import text_string_to_metric_families

    from kproxy.lab.cluster import LabError

    got = lab.probe_http(ns, "http://127.0.0.1:10249/metrics", timeout=10.0)
    if got.status != 200 or got.body is None:
        raise LabError(f"/metrics in {ns}: {got}")
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(got.body):
        for s in family.samples:
            out.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    return out


def buckets(metrics: Mapping[str, list[tuple[dict[str, str], float]]], name: str) -> dict[float, float]:
    """A histogram's cumulative bucket counts by upper bound, summed over its label sets."""
    out: dict[float, float] = {}
    for labels, value in metrics.get(f"{name}_bucket", []):
        le = float(labels["le"])
        out[le] = out.get(le, 0.0) + value
    return out


def quantile(q: float, cumulative: Mapping[float, float]) -> float | None:
    """Prometheus' histogram_quantile over cumulative bucket counts (linear within the bucket)."""
    bounds = sorted(cumulative)
    if not bounds or cumulative[bounds[-1]] <= 0:
        return None
    rank = q * cumulative[bounds[-1]]
    prev_bound, prev_count = 0.0, 0.0
    for bound in bounds:
        count = cumulative[bound]
        if count >= rank:
            if bound == float("inf"):
                return prev_bound
            inside = count - prev_count
            return prev_bound + (bound - prev_bound) * ((rank - prev_count) / inside if inside else 0.0)
        prev_bound, prev_count = bound, count
    return bounds[-1]


def _hist_sum(metrics: Mapping[str, list[tuple[dict[str, str], float]]], name: str, **match: str) -> dict[str, float]:
    total = sum(v for lb, v in metrics.get(f"{name}_sum", []) if all(lb.get(k) == w for k, w in match.items()))
    count = sum(v for lb, v in metrics.get(f"{name}_count", []) if all(lb.get(k) == w for k, w in match.items()))
    return {"count": count, "sum_s": round(total, 3)}


def sync_phases(metrics: Mapping[str, list[tuple[dict[str, str], float]]], family: str = "IPv4") -> dict[str, Any]:
    """The syncs and their phases as one family's histograms count them: kproxy observes each sync (and its
    phases) once per configured family, so a sum over families would count every sync twice. The scale lab is
    IPv4."""
    series = metrics.get("kproxy_sync_phase_duration_seconds_count", [])
    phases = {lb["phase"] for lb, _ in series if lb.get("ip_family") == family}
    return {
        "full_syncs": _hist_sum(metrics, "kubeproxy_sync_full_proxy_rules_duration_seconds", ip_family=family),
        "partial_syncs": _hist_sum(metrics, "kubeproxy_sync_partial_proxy_rules_duration_seconds", ip_family=family),
        "phases": {
            p: _hist_sum(metrics, "kproxy_sync_phase_duration_seconds", phase=p, ip_family=family)
            for p in sorted(phases)
        },
    }


def queued_at(
    metrics: Mapping[str, list[tuple[dict[str, str], float]]], start: float, family: str = "IPv4"
) -> float | None:
    """When kproxy last queued a sync (``kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds``), in seconds
    after ``start``. Read before the churn, it is when the cache had absorbed both lists: kproxy queues a sync for
    every change once the cache is ready, and nothing changes between that moment and the scrape."""
    name = "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds"
    got = [v for lb, v in metrics.get(name, []) if lb.get("ip_family") == family and v > 0]
    return round(max(got) - start, 3) if got else None


# --- the run ------------------------------------------------------------------------------------------------------


def requests_log(client: Any, url: str) -> list[dict[str, Any]]:
    resp = client.call_api("GET", f"{url}/_requests?limit=10000")
    return list(_answer(resp, "GET /_requests"))


def list_phase(log: Sequence[Mapping[str, Any]], client_ip: str, start: float) -> dict[str, Any]:
    """First and last list request of one node (seconds after kproxy's start), and how many pages."""
    lists = [
        r
        for r in log
        if r.get("client") == client_ip
        and r["method"] == "GET"
        and r["path"].endswith(("/services", "/endpointslices"))
        and r["query"].get("watch") not in ("true", "1")
        and r["time"] >= start
    ]
    if not lists:
        return {"pages": 0}
    first, last = min(r["time"] for r in lists), max(r["time"] for r in lists)
    return {"pages": len(lists), "first_list_s": round(first - start, 3), "last_page_s": round(last - start, 3)}


def start_sweep(lab: Lab, ns: str, targets: list[tuple[str, int]], seconds: float) -> subprocess.Popen[bytes]:
    from kproxy.lab import netns
    from kproxy.lab.state import stdlib_module_argv

    argv = [*stdlib_module_argv("kproxy.bench.apiscale_probe"), "--seconds", str(seconds)]
    env = dict(os.environ)
    root = str(Path(synthetic.__file__).parent.parent.parent)  # -S: the package is found through PYTHONPATH only
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.Popen(
        netns.exec_argv(ns, argv),
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=netns.cgroup_preexec(lab.cgroup_path(lab.nodes[0])),
    )
    assert proc.stdin is not None
    proc.stdin.write(json.dumps(targets).encode())
    proc.stdin.close()
    proc.stdin = None  # written whole: communicate() must not flush it again
    return proc


def finish_sweep(proc: subprocess.Popen[bytes], timeout: float) -> dict[str, Any]:
    from kproxy.lab.cluster import LabError

    out, err = proc.communicate(timeout=timeout)
    if proc.returncode != 0:
        raise LabError(f"the sweep failed ({proc.returncode}): {err.decode(errors='replace')[-2000:]}")
    return dict(json.loads(out))


def sample_targets(cfg: ScaleConfig) -> list[tuple[str, int]]:
    n = min(cfg.sample, cfg.services)
    picks = sorted({1 + k * cfg.services // n for k in range(n)})
    return [(synthetic.cluster_ip(i), 80) for i in picks]


def wait_healthy(lab: Lab, start: float, timeout: float) -> dict[str, float]:
    """Seconds after `start` at which each node's /healthz first answered 200."""
    out: dict[str, float] = {}
    deadline = time.monotonic() + timeout
    for node in lab.nodes:
        lab.wait_kproxy(node, max(1.0, deadline - time.monotonic()))
        out[node.name] = round(time.time() - start, 3)
    return out


def measure_startup(lab: Lab, client: Any, cfg: ScaleConfig, out: ScaleResult) -> None:
    targets = sample_targets(cfg)
    sweep = start_sweep(lab, lab.nodes[0].ns, targets, cfg.timeout)
    time.sleep(0.5)  # the sweep's interpreter starts (its first round fails: nothing is programmed yet)
    start = time.time()
    lab.start_all(cfg.mode)
    healthy = wait_healthy(lab, start, cfg.timeout)
    result = finish_sweep(sweep, cfg.timeout + 60)
    log = requests_log(client, lab.api_url)
    for node in lab.nodes:
        phase = list_phase(log, node.ip4, start)
        metrics = scrape(lab, node.ns)
        absorbed = {"absorbed_s": queued_at(metrics, start)}
        out.nodes[node.name] = {**phase, **absorbed, "healthz_s": healthy[node.name], **sync_phases(metrics)}
    answered = result["answered"]
    first_list = out.nodes[lab.nodes[0].name].get("first_list_s", 0.0)
    out.sweep = {
        "targets": len(targets),
        "answered": len(answered),
        "rounds": result["rounds"],
        "errors": result["errors"],
        "all_answered_s": round(max(answered.values()) - start, 3) if len(answered) == len(targets) else None,
    }
    if out.sweep["all_answered_s"] is not None:
        out.sweep["from_first_list_s"] = round(out.sweep["all_answered_s"] - first_list, 3)


def churn(lab: Lab, client: Any, cfg: ScaleConfig, out: ScaleResult) -> None:
    """K endpoint changes per second for T seconds, in batches every 0.1 s; the latency histogram's p50/p99."""
    pods = lab.pods
    before = {n.name: buckets(scrape(lab, n.ns), PROGRAMMING) for n in lab.nodes}
    per_tick = max(1, round(cfg.churn_rate / 10))
    ticks = max(1, round(cfg.churn_seconds * 10))
    t0 = time.monotonic()
    sent, late = 0, 0
    for tick in range(ticks):
        due = t0 + tick * 0.1
        now = time.monotonic()
        if now < due:
            time.sleep(due - now)
        else:
            late += 1
        stamp = time.time()
        batch = []
        for k in range(per_tick):
            i = 1 + ((tick * per_tick + k) * 7919) % cfg.services
            batch.append(endpoint_slice(i, cfg, pods, variant=tick + 1, trigger=stamp))
        sent += bulk(client, lab.api_url, batch, replace=True)
    elapsed = time.monotonic() - t0
    out.churn = {"changes": sent, "seconds": round(elapsed, 3), "rate": round(sent / elapsed, 1), "late_ticks": late}
    for node in lab.nodes:
        delta, caught_up = _programmed(lab, node.ns, before[node.name], sent, t0 + elapsed, cfg.timeout)
        out.churn[node.name] = {
            "observed": delta.get(float("inf"), 0.0),
            "caught_up_s": caught_up,
            "p50_s": quantile(0.5, delta),
            "p99_s": quantile(0.99, delta),
        }


def _programmed(
    lab: Lab, ns: str, before: Mapping[float, float], sent: int, churn_end: float, timeout: float
) -> tuple[dict[float, float], float | None]:
    """The latency histogram's growth since `before` once every change is observed (or `timeout` ran out), and
    when that was, in seconds after the churn's last change (None: it never caught up)."""
    deadline = time.monotonic() + timeout
    while True:
        after = buckets(scrape(lab, ns), PROGRAMMING)
        delta = {le: after[le] - before.get(le, 0.0) for le in after}
        if delta.get(float("inf"), 0.0) >= sent:
            return delta, round(time.monotonic() - churn_end, 3)
        if time.monotonic() >= deadline:
            return delta, None
        time.sleep(1.0)


def memory(lab: Lab, out: ScaleResult) -> None:
    """Each node's kproxy after the run: resident MiB now and at its peak (``VmHWM``: every phase, the first list
    and the churn included)."""
    for node in lab.nodes:
        pid = lab.kproxy_pid(node)
        got = process_mb(pid) if pid is not None else None
        if got is not None:
            out.nodes.setdefault(node.name, {}).update(rss_mb=round(got[0], 1), peak_rss_mb=round(got[1], 1))


def run(cfg: ScaleConfig) -> ScaleResult:
    from kproxy.lab.cluster import Lab

    cfg.check()
    ports = synthetic.service_ports(cfg.services, ports_every=cfg.ports_every)
    out = ScaleResult(config=asdict(cfg), service_ports=ports)
    per_node = -(-(cfg.endpoints + 2) // cfg.nodes)  # two pods more than E, so the churn can move an endpoint
    lab = Lab.up(
        nodes=cfg.nodes,
        pods_per_node=per_node,
        mode=None,
        ipv6=False,
        prefix=cfg.lab_prefix,
        timeout=120,
        backend_options=cfg.backend_options,  # Lab.kproxy_argv turns them into the mode's flags on every node
    )
    try:
        client = lab.api_client()
        try:
            out.load_s = round(load(client, lab.api_url, cfg, lab.pods), 3)
            measure_startup(lab, client, cfg, out)
            if cfg.churn_rate > 0 and cfg.churn_seconds > 0:
                churn(lab, client, cfg, out)
            memory(lab, out)
        finally:
            client.close()
    finally:
        lab.stop_all()
        Lab.down(prefix=cfg.lab_prefix)
    return out


def table(r: ScaleResult) -> str:
    c = r.config
    rows = [
        ("mode / nodes", f"{c['mode']} / {c['nodes']}"),
        ("services (service ports) x endpoints", f"{c['services']} ({r.service_ports}) x {c['endpoints']}"),
        ("bulk load", f"{r.load_s} s"),
    ]
    if c.get("backend_options"):
        rows.append(("backend options", ", ".join(f"{k}={v}" for k, v in sorted(c["backend_options"].items()))))
    for name, n in r.nodes.items():
        full = n.get("full_syncs", {})
        pages = f"{n.get('pages')}, {n.get('first_list_s')} .. {n.get('last_page_s')} s"
        rows.append((f"{name}: list pages, first .. last", pages))
        rows.append((f"{name}: both lists absorbed (sync queued)", f"{n.get('absorbed_s')} s"))
        rows.append((f"{name}: full syncs (count, total)", f"{full.get('count')}, {full.get('sum_s')} s"))
        rows.append((f"{name}: /healthz 200", f"{n.get('healthz_s')} s"))
        if "peak_rss_mb" in n:
            rows.append((f"{name}: kproxy resident at the end / peak", f"{n['rss_mb']} / {n['peak_rss_mb']} MiB"))
    s = r.sweep
    rows.append(("sampled services answering", f"{s.get('answered')}/{s.get('targets')}"))
    answered = f"{s.get('all_answered_s')} / {s.get('from_first_list_s')} s"
    rows.append(("all answered, from kproxy's start / first list", answered))
    if r.churn:
        ch = r.churn
        rows.append(("churn", f"{ch['changes']} changes in {ch['seconds']} s ({ch['rate']}/s)"))
        for name in r.nodes:
            if name in ch:
                got = f"{ch[name]['p50_s']} / {ch[name]['p99_s']} s ({ch[name]['observed']:.0f} observed)"
                rows.append((f"{name}: programming p50 / p99", got))
                rows.append((f"{name}: caught up after the churn", f"{ch[name]['caught_up_s']} s"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mode", required=True, help="the backend kproxy runs with on the lab's nodes")
    p.add_argument("--services", type=int, default=10_000, metavar="N")
    p.add_argument("--endpoints", type=int, default=10, metavar="E", help="endpoints per service: the lab's pods")
    p.add_argument("--nodes", type=int, default=2, choices=(1, 2))
    p.add_argument("--sample", type=int, default=200, help="services probed with real connections from node 1")
    p.add_argument("--ports-every", type=int, default=0, metavar="K", help="every K-th service has 3 ports")
    p.add_argument("--churn-rate", type=int, default=0, metavar="K", help="endpoint changes per second (0: none)")
    p.add_argument("--churn-seconds", type=float, default=10.0, metavar="T")
    bench_options.add_argument(p)
    p.add_argument("--lab-prefix", default="kpa-")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds the start-up may take")
    p.add_argument("--format", choices=("json", "table"), default="table")


def cmd_apiscale(args: argparse.Namespace) -> int:
    # SIGTERM (a time limit around the run) must still take the lab down: run the finally blocks
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    from kproxy.proxier import BackendError

    try:  # before the lab: an option the mode does not declare (or a mode that cannot load) is a usage error
        options = bench_options.parse_for_modes([args.mode], args.backend_option)[args.mode]
    except (ValueError, BackendError) as exc:
        print(f"kproxy bench apiscale: {exc}", file=sys.stderr)
        return 2
    cfg = ScaleConfig(
        mode=args.mode,
        services=args.services,
        endpoints=args.endpoints,
        nodes=args.nodes,
        sample=args.sample,
        ports_every=args.ports_every,
        churn_rate=args.churn_rate,
        churn_seconds=args.churn_seconds,
        lab_prefix=args.lab_prefix,
        timeout=args.timeout,
        backend_options=options,
    )
    from kproxy.lab.cluster import LabError

    try:
        result = run(cfg)
    except (ValueError, LabError, RuntimeError) as exc:
        print(f"kproxy bench apiscale: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ValueError) else 1
    print(json.dumps(asdict(result), indent=2) if args.format == "json" else table(result))
    return 0 if result.sweep.get("all_answered_s") is not None else 1


def register(bench_subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``apiscale`` to ``kproxy bench``'s sub-commands."""
    p = bench_subparsers.add_parser(
        "apiscale", help="N services x E endpoints through the API stand-in: time to answering, and a churn"
    )
    add_arguments(p)
    p.set_defaults(func=cmd_apiscale)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kproxy bench apiscale", description=__doc__.splitlines()[0])
    add_arguments(p)
    return cmd_apiscale(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
