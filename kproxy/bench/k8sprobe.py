"""The data-path probe on a real cluster: the Job of ``deploy/datapath`` runs ``python -m kproxy.bench.k8sprobe``.

It reads the Service's ClusterIP and a ready endpoint's address from the API (the Service and its EndpointSlices;
in-cluster service account, or ``--kubeconfig``), then runs rounds of the lab benchmark's traffic phases
(kproxy.bench.dpclient: new TCP connections per second with RST close, request/response on one connection, UDP
request/response) against the ClusterIP and the pod IP directly, alternating which goes first, and prints one JSON
document: the medians per target and the ClusterIP / pod IP ratios (1.0 = a ClusterIP costs nothing over the pod
IP). On a real cluster there is no node without proxy rules to serve as the limit, so the pod IP on the same nodes
is the reference here; compare backends by redeploying kproxy with another overlay and running the probe again
(deploy/datapath/README.md).

Bounded: ``--rounds`` x 3 phases x ``--seconds`` per target, each operation with a timeout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

from kproxy.bench import dpclient
from kproxy.bench.dpstats import flatten, ratio
from kproxy.bench.results import METRICS

MAX_ROUNDS = 50


def discover(namespace: str, service: str, kubeconfig: str | None) -> dict[str, Any]:
    """ClusterIP and ports of the Service, and one ready endpoint behind it (from its EndpointSlices, as a proxy
    sees it: address, node, and the target port of each service port)."""
    from kubernetes import client, config

    if kubeconfig:
        config.load_kube_config(kubeconfig)
    else:
        config.load_incluster_config()
    core = client.CoreV1Api()
    discovery = client.DiscoveryV1Api()
    svc: Any = core.read_namespaced_service(service, namespace, _request_timeout=30)
    tcp = next((p for p in svc.spec.ports if p.protocol == "TCP"), None)
    udp = next((p for p in svc.spec.ports if p.protocol == "UDP"), None)
    if tcp is None:
        raise SystemExit(f"k8sprobe: {namespace}/{service} has no TCP port")
    slices: Any = discovery.list_namespaced_endpoint_slice(
        namespace, label_selector=f"kubernetes.io/service-name={service}", _request_timeout=30
    ).items
    for sl in slices:
        if sl.address_type != "IPv4":
            continue
        target = {(p.protocol, p.name or ""): p.port for p in sl.ports or []}
        for ep in sl.endpoints or []:
            if ep.conditions and ep.conditions.ready and ep.addresses:
                return {
                    "cluster_ip": svc.spec.cluster_ip,
                    "tcp_port": tcp.port,
                    "udp_port": udp.port if udp else tcp.port,
                    "pod": ep.target_ref.name if ep.target_ref else "",
                    "pod_ip": ep.addresses[0],
                    "pod_node": ep.node_name or "",
                    "tcp_target": target.get(("TCP", tcp.name or ""), tcp.port),
                    "udp_target": target.get(("UDP", udp.name or ""), tcp.port) if udp else tcp.port,
                }
    raise SystemExit(f"k8sprobe: no ready IPv4 endpoint behind {namespace}/{service}")


def one_round(host: str, tcp_port: int, udp_port: int, seconds: float) -> dict[str, float]:
    doc: dict[str, Any] = {}
    for name, fn in dpclient.PHASES.items():
        port = udp_port if name == "udp" else tcp_port
        doc[name] = fn(host, port, seconds, 1_000_000, 1.0, 0.1)
    return flatten(doc, None)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kproxy.bench.k8sprobe", description=__doc__.splitlines()[0])
    p.add_argument("--namespace", required=True)
    p.add_argument("--service", required=True)
    p.add_argument("--kubeconfig", default=None, help="default: the in-cluster service account")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seconds", type=float, default=2.0)
    args = p.parse_args(argv)
    rounds = min(max(args.rounds, 1), MAX_ROUNDS)
    seconds = min(max(args.seconds, 0.1), dpclient.MAX_SECONDS)
    where = discover(args.namespace, args.service, args.kubeconfig)
    targets = {
        "clusterip": (where["cluster_ip"], where["tcp_port"], where["udp_port"]),
        "podip": (where["pod_ip"], where["tcp_target"], where["udp_target"]),
    }
    samples: dict[str, list[dict[str, float]]] = {t: [] for t in targets}
    started = time.time()
    for r in range(rounds):
        order = list(targets) if r % 2 == 0 else list(reversed(targets))
        for t in order:
            samples[t].append(one_round(*targets[t], seconds))
    medians = {
        t: {m: statistics.median(s[m] for s in rows if m in s) for m, *_ in METRICS if any(m in s for s in rows)}
        for t, rows in samples.items()
    }
    ratios = {
        m: q for m, v in medians["clusterip"].items() if (q := ratio(m, v, medians["podip"].get(m, 0.0))) is not None
    }
    print(
        json.dumps(
            {
                "client_node": os.environ.get("NODE_NAME", ""),
                "server": where,
                "rounds": rounds,
                "seconds": seconds,
                "started": started,
                "medians": medians,
                "clusterip_over_podip": ratios,
                "samples": samples,
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
