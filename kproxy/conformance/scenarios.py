"""The conformance scenarios: the one ordered list ``SCENARIOS`` of what every backend must do, on real packets.

``kproxy.conformance.runner`` runs them in this order on one lab per backend; docs/BEHAVIOUR.md's table is the
spec, id for id, in the same order (tests/unit/test_docs.py keeps them equal). Each
scenario is a plain function of a ``Context``: set up Services and EndpointSlices, send probes, state what must
hold. Adding a scenario is one function and one ``Scenario`` line; adding a backend needs nothing here: its
impossible scenarios are its own ``not_applicable(options)``, and what the kernel holds is read through its own
hooks (``remnants``: what of the mode is left; ``kernel_view``: each service port's kernel lines), handed a probe
into the node (``Context.kernel_probe``). Nothing here names a mode.

Conventions the scenarios share (the lab's default shape: 2 nodes x 3 pods): ``node-1``'s first pod is the
usual client; service port 80 maps to the echo servers' 8080; "the service is programmed" is always waited
for with ``ctx.eventually`` (kproxy syncs at most once a second), and a negative expectation (must time out,
must not be reachable) is only checked after a *barrier*: a fresh service created afterwards answers on the
nodes concerned, which proves those nodes have synced past the objects under test.
"""

from __future__ import annotations

import collections
import json
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from kproxy.conformance.context import (
    API_TIMEOUT,
    HEALTHZ_PORT,
    METRICS_PORT,
    Context,
    NotApplicable,
    NotApplicableHere,
    Probe,
    ScenarioFailure,
    answer_pod,
    body_of,
    header,
    hostport,
)


@dataclass(frozen=True)
class Scenario:
    """One row of docs/BEHAVIOUR.md's table. ``needs``: lab features (``"ipv6"``) without which it is not applicable;
    ``parts``: the parts (an assertion, a half) a mode may declare not applicable (``not_applicable_parts``)."""

    id: str
    title: str
    run: Callable[[Context], None]
    needs: frozenset[str] = field(default_factory=frozenset)
    timeout_s: float = 60.0
    parts: frozenset[str] = field(default_factory=frozenset)


# --------------------------------------------------------------------------------------------------------------
# Shared steps
# --------------------------------------------------------------------------------------------------------------

SYNC_WAIT = 15.0  # how long a change may take to show up before a scenario gives up waiting
#: how long a (re)started kproxy may take to answer /healthz 200, which it does once every family has synced once: its
#: start (the bpf mode compiles its programs with bcc: 5-10 s alone on a busy 2-core machine), lists and first sync
START_WAIT = 45.0


def _two_nodes(ctx: Context) -> tuple[Any, Any]:
    nodes = ctx.nodes
    if len(nodes) < 2:
        raise NotApplicable(f"needs a lab of at least 2 nodes, this one has {len(nodes)}")
    if any(len(ctx.pods_on(n)) < 3 for n in nodes[:2]):
        raise NotApplicable("needs at least 3 pods per node")
    return nodes[0], nodes[1]


def _cip(svc: dict[str, Any], family: str = "IPv4") -> str:
    for ip in svc["spec"].get("clusterIPs") or [svc["spec"]["clusterIP"]]:
        if (":" in ip) == (family == "IPv6"):
            return str(ip)
    raise KeyError(f"service {svc['metadata']['name']} has no {family} ClusterIP")


def _wait_reach(
    ctx: Context, src: Any, host: str, port: int, kind: str = "tcp", only: Sequence[Any] | None = None, what: str = ""
) -> Probe:
    return ctx.eventually(
        lambda: ctx.reach(src, host, port, kind, count=1, timeout=0.5, only=only),
        timeout=SYNC_WAIT,
        interval=0.2,
        what=what or f"waiting for {hostport(host, port)}/{kind} to be programmed",
    )


_barrier_seq = [0]


def _barrier(ctx: Context, *nodes: Any) -> list[str]:
    """Create a fresh service and wait until a pod on each of ``nodes`` reaches it: from then on those nodes'
    kproxies have synced every object written before (they sync whole states, in API order). Returns the names
    of the barrier services, in ``nodes`` order."""
    _barrier_seq[0] += 1
    name = f"barrier-{_barrier_seq[0]}"
    made = []
    for node in nodes:
        pods = ctx.pods_on(node)
        svc = ctx.service(f"{name}-{node.name}")
        ctx.apply(svc, ctx.slice_for(svc, [pods[2]]))
        _wait_reach(ctx, pods[0], _cip(svc), 80, only=[pods[2]], what=f"barrier: {node.name} syncing")
        made.append(svc["metadata"]["name"])
    return made


def _url(host: str, port: int, path: str = "/") -> str:
    return f"http://{hostport(host, port)}{path}"


# --------------------------------------------------------------------------------------------------------------
# Scenarios
# --------------------------------------------------------------------------------------------------------------


def clusterip_tcp(ctx: Context) -> None:
    n1, n2 = _two_nodes(ctx)
    client = ctx.pods_on(n1)[0]
    eps = [ctx.pods_on(n1)[1], ctx.pods_on(n2)[0], ctx.pods_on(n2)[1]]
    svc = ctx.service("web")
    ctx.apply(svc, ctx.slice_for(svc, eps))
    ip = _cip(svc)
    _wait_reach(ctx, client, ip, 80, only=eps)
    pr = ctx.reach(client, ip, 80, count=60, only=eps, all_of=eps)
    ctx.note(pr.summary())


def clusterip_udp(ctx: Context) -> None:
    n1, n2 = _two_nodes(ctx)
    client = ctx.pods_on(n1)[0]
    eps = [ctx.pods_on(n1)[1], ctx.pods_on(n2)[0], ctx.pods_on(n2)[1]]
    svc = ctx.service("dns", [ctx.port(53, 8080, name="udp", protocol="UDP")])
    ctx.apply(svc, ctx.slice_for(svc, eps))
    ip = _cip(svc)
    _wait_reach(ctx, client, ip, 53, "udp", only=eps)
    pr = ctx.reach(client, ip, 53, "udp", count=60, only=eps, all_of=eps)
    ctx.note(pr.summary())


def multiport(ctx: Context) -> None:
    n1, n2 = _two_nodes(ctx)
    client = ctx.pods_on(n1)[0]
    eps = [ctx.pods_on(n1)[1], ctx.pods_on(n2)[0]]
    # Named targetPorts: the service says "http"/"admin"; the slice (as the endpoint-slice controller would,
    # from the pods' container ports) resolves them to 8081 and 9000.
    svc = ctx.service("multi", [ctx.port(80, "http", name="web"), ctx.port(81, "admin", name="admin")])
    slice_ = ctx.slice_for(
        svc,
        eps,
        ports=[{"name": "web", "port": 8081, "protocol": "TCP"}, {"name": "admin", "port": 9000, "protocol": "TCP"}],
    )
    ctx.apply(svc, slice_)
    ip = _cip(svc)
    for port, container in ((80, 8081), (81, 9000)):
        _wait_reach(ctx, client, ip, port, only=eps)
        pr = ctx.probe(client, ip, port, count=8, timeout=1.0, payload="info")
        ports = {getattr(r, "local_port", None) for r in pr.ok}
        ctx.expect(
            not pr.failed and ports == {container},
            f"service port {port} did not reach container port {container}",
            sent=pr.sent + " with payload 'info'",
            got=pr.summary() + f"; container ports seen: {sorted(map(str, ports))}",
            expected=f"every answer from port {container}",
        )


def same_port_two_protocols(ctx: Context) -> None:
    n1, n2 = _two_nodes(ctx)
    client = ctx.pods_on(n1)[0]
    eps = [ctx.pods_on(n2)[0]]
    np_ = ctx.addresses.node_port()

    # One port number, two protocols, different listeners; also the same NodePort for both (upstream e2e
    # "update service type to NodePort listening on same port number but different protocols").
    def build(np_udp: int) -> dict[str, Any]:
        return ctx.service(
            "both",
            [
                ctx.port(80, 8080, name="tcp", protocol="TCP", node_port=np_),
                ctx.port(80, 8081, name="udp", protocol="UDP", node_port=np_udp),
            ],
            type="NodePort",
            cluster_ip=cluster_ip,
        )

    cluster_ip = ctx.addresses.cluster_ip()
    svc = build(np_)
    np_udp = np_
    try:
        ctx.apply(svc)
    except ScenarioFailure as exc:
        if "already allocated" not in str(exc):
            raise
        # Kubernetes lets one service use a NodePort number for TCP and UDP; an API that refuses it is noted.
        np_udp = ctx.addresses.node_port()
        svc = build(np_udp)
        ctx.apply(svc)
        ctx.note(f"the API refused nodePort {np_} for both TCP and UDP ({exc.got}); UDP used {np_udp}")
    ctx.apply(ctx.slice_for(svc, eps))
    ip = _cip(svc)
    checks = [(client, ip, 80, 80), (ctx.external_ns, n1.ip4, np_, np_udp)]
    for src, host, tcp_port, udp_port in checks:
        for kind, container in (("tcp", 8080), ("udp", 8081)):
            port = tcp_port if kind == "tcp" else udp_port
            _wait_reach(ctx, src, host, port, kind, only=eps)
            pr = ctx.probe(src, host, port, kind, count=4, payload="info")
            seen = {(getattr(r, "local_port", None), (r.reply.split() + [""] * 5)[4]) for r in pr.ok}
            ctx.expect(
                not pr.failed and seen == {(container, f"proto={kind}")},
                f"{kind.upper()} to {hostport(host, port)} did not reach the {kind.upper()} listener on {container}",
                sent=pr.sent + " with payload 'info'",
                got=pr.summary() + f"; listeners seen: {sorted(map(str, seen))}",
                expected=f"every answer from {kind} port {container}",
            )


def nodeport(ctx: Context) -> None:
    n1, n2 = _two_nodes(ctx)
    client = ctx.pods_on(n1)[0]
    eps = [ctx.pods_on(n1)[1], ctx.pods_on(n2)[1]]
    svc = ctx.service("np", type="NodePort")
    ctx.apply(svc, ctx.slice_for(svc, eps))
    np_ = svc["spec"]["ports"][0]["nodePort"]
    for node in (n1, n2):
        _wait_reach(ctx, ctx.external_ns, node.ip4, np_, only=eps)
        ctx.reach(ctx.external_ns, node.ip4, np_, count=6, only=eps)
        ctx.reach(client, node.ip4, np_, count=3, only=eps)
        ctx.reach(node, node.ip4, np_, count=3, only=eps)
    ctx.note(f"nodePort {np_}: external client, pod and node itself reached both nodes")


def externalip(ctx: Context) -> None:
    n1, n2 = _two_nodes(ctx)
    eps = [ctx.pods_on(n1)[1], ctx.pods_on(n2)[1]]
    ext = ctx.addresses.external_ip()
    svc = ctx.service("ext", externalIPs=[ext])
    ctx.apply(svc, ctx.slice_for(svc, eps))
    _wait_reach(ctx, ctx.external_ns, ext, 80, only=eps)
    ctx.reach(ctx.external_ns, ext, 80, count=10, only=eps)


def loadbalancer(ctx: Context) -> None:
    n1, n2 = _two_nodes(ctx)
    eps = [ctx.pods_on(n1)[1], ctx.pods_on(n2)[1]]
    client_cidr = f"{ctx.external_ip4}/32"
    denied_ip, allowed_ip = ctx.addresses.lb_ip(), ctx.addresses.lb_ip()
    denied = ctx.service("lb-denied", type="LoadBalancer", loadBalancerSourceRanges=["198.18.99.0/24"])
    ctx.apply(denied, ctx.slice_for(denied, eps))
    ctx.set_lb_ingress("lb-denied", [denied_ip])
    # Written after the denied one: once the allowed one works through node-1, node-1 has synced both.
    allowed = ctx.service("lb-allowed", type="LoadBalancer", loadBalancerSourceRanges=[client_cidr])
    ctx.apply(allowed, ctx.slice_for(allowed, eps))
    ctx.set_lb_ingress("lb-allowed", [allowed_ip])
    _wait_reach(ctx, ctx.external_ns, allowed_ip, 80, only=eps)
    ctx.reach(ctx.external_ns, allowed_ip, 80, count=6, only=eps)
    ctx.blocked(ctx.external_ns, denied_ip, 80, count=2, timeout=1.0)
    # The denial must come from the source ranges, not from the LB IP being unprogrammed: open it up.
    denied["spec"]["loadBalancerSourceRanges"] = [client_cidr]
    ctx.apply(denied)
    ctx.set_lb_ingress("lb-denied", [denied_ip])
    _wait_reach(ctx, ctx.external_ns, denied_ip, 80, only=eps, what="after allowing the client's range")


def no_endpoints_reject(ctx: Context) -> None:
    n1, _ = _two_nodes(ctx)
    client = ctx.pods_on(n1)[0]
    udp_client = ctx.pods_on(n1)[1]
    svc = ctx.service("empty", [ctx.port(80, 8080, name="tcp"), ctx.port(80, 8080, name="udp", protocol="UDP")])
    ctx.apply(svc, ctx.slice_for(svc, []))  # the controller writes an empty slice for a service with no pods
    ip = _cip(svc)
    # The kernel rate-limits ICMP errors per destination host (net.ipv4.icmp_ratelimit: a burst of 6, then one a
    # second), and a REJECT answers with ICMP: so each kind of probe comes from its own client, a few probes each.
    pr = ctx.eventually(
        lambda: ctx.blocked(client, ip, 80, "tcp", how="refused", within=1.0, timeout=2.0),
        timeout=SYNC_WAIT,
        what="TCP to a service with no endpoints",
    )
    ctx.blocked(client, ip, 80, "tcp", how="refused", within=1.0, count=3, timeout=2.0)
    ctx.blocked(udp_client, ip, 80, "udp", how="port-unreachable", count=3, timeout=2.0)
    # From outside (through node-1): the client's view is not enough, since the node's ICMP errors to it can be
    # rate-limited per host (a burst of 6, then one a second; ICMP redirects share the limiter). So node-1's own
    # counters say what it did: every SYN is answered by an ICMP error it sent (IcmpOutDestUnreachs) or one the
    # limiter suppressed (IcmpOutRateLimitHost), and at least one was really sent. A DROP moves neither.
    before = _icmp_counters(ctx, n1)
    ext = ctx.probe(ctx.external_ns, ip, 80, count=2, timeout=2.0)
    after = _icmp_counters(ctx, n1)
    sent_icmp = after.get("IcmpOutDestUnreachs", 0) - before.get("IcmpOutDestUnreachs", 0)
    limited = after.get("IcmpOutRateLimitHost", 0) - before.get("IcmpOutRateLimitHost", 0)
    judge_outside_reject(ctx, ext, sent_icmp, limited, n1.name)
    secs = max(float(r.seconds) for r in pr.results)
    ctx.note(
        f"TCP refused in {secs * 1000:.0f} ms; UDP port-unreachable; from outside the cluster {n1.name} sent "
        f"{sent_icmp} ICMP destination-unreachable ({limited} more rate-limited) for {len(ext.results)} SYNs"
    )


def judge_outside_reject(ctx: Context, ext: Probe, sent_icmp: int, limited: int, node: str) -> None:
    """The external client's probes to a service with no endpoints: none answered, each one rejected by the node
    (its IcmpOutDestUnreachs plus IcmpOutRateLimitHost rose by at least the number of probes), at least one ICMP
    error really sent, and every probe that came back failed as a refusal or (rate-limited) a timeout."""
    n = len(ext.results)
    odd = sorted(e for e in ext.errors if e not in ("refused", "unreachable", "timeout"))
    ctx.expect(
        n > 0 and not ext.ok and not odd and sent_icmp >= 1 and sent_icmp + limited >= n,
        "TCP from outside the cluster to a service with no endpoints was not rejected by the node",
        sent=ext.sent,
        got=ext.summary() + f"; {node} IcmpOutDestUnreachs +{sent_icmp}, IcmpOutRateLimitHost +{limited}",
        expected=f"no answer; {node} sending an ICMP error for each of the {n} SYNs (IcmpOutDestUnreachs >= 1, "
        "with the rate-limited ones counted in IcmpOutRateLimitHost)",
    )


def _icmp_counters(ctx: Context, node: Any) -> dict[str, int]:
    """The node's ICMP SNMP counters (nstat: absolute, without touching nstat's history file)."""
    res = ctx.exec(node, ["nstat", "-asz"], timeout=10)
    out: dict[str, int] = {}
    for line in _stdout(res).splitlines():
        words = line.split()
        if len(words) >= 2 and words[0].startswith("Icmp") and words[1].isdigit():
            out[words[0]] = int(words[1])
    return out


def session_affinity(ctx: Context) -> None:
    n1, n2 = _two_nodes(ctx)
    client = ctx.pods_on(n1)[0]
    eps = [ctx.pods_on(n1)[1], ctx.pods_on(n2)[0], ctx.pods_on(n2)[1]]
    svc = ctx.service(
        "sticky", sessionAffinity="ClientIP", sessionAffinityConfig={"clientIP": {"timeoutSeconds": 10800}}
    )
    ctx.apply(svc, ctx.slice_for(svc, eps))
    ip = _cip(svc)
    _wait_reach(ctx, client, ip, 80, only=eps)

    def sticky() -> Probe:
        pr = ctx.reach(client, ip, 80, count=15, only=eps)
        ctx.expect(
            len(pr.pods) == 1,
            "ClientIP affinity: not 15 identical answers in a row",
            sent=pr.sent,
            got=pr.summary(),
            expected="one pod answering all 15",
        )
        return pr

    def spread() -> Probe:
        pr = ctx.reach(client, ip, 80, count=15, only=eps)
        ctx.expect(
            len(pr.pods) >= 2,
            "affinity switched off, yet one pod answered all 15",
            sent=pr.sent,
            got=pr.summary(),
            expected="several backends",
        )
        return pr

    # Affinity is per endpoint (upstream's): a client stays with its endpoint while another endpoint goes.
    kept = next(p for p in eps if p.name in sticky().pods)
    gone = next(p for p in eps if p is not kept)
    ctx.apply(ctx.slice_for(svc, [p for p in eps if p is not gone]))
    _barrier(ctx, n1)  # node-1 has synced the removal
    pr = ctx.reach(client, ip, 80, count=15, only=eps)
    ctx.expect(
        pr.pods == {kept.name},
        f"ClientIP affinity to {kept.name} lost when another endpoint ({gone.name}) was removed",
        sent=pr.sent,
        got=pr.summary(),
        expected=f"{kept.name} answering all 15, as before the removal",
    )
    ctx.apply(ctx.slice_for(svc, eps))
    svc["spec"]["sessionAffinity"] = "None"
    svc["spec"].pop("sessionAffinityConfig")
    ctx.apply(svc)
    ctx.eventually(spread, timeout=SYNC_WAIT, what="after switching affinity off")
    timeout_s = 2
    svc["spec"]["sessionAffinity"] = "ClientIP"
    svc["spec"]["sessionAffinityConfig"] = {"clientIP": {"timeoutSeconds": timeout_s}}
    ctx.apply(svc)
    first = ctx.eventually(sticky, timeout=SYNC_WAIT, what=f"after switching affinity on (timeout {timeout_s} s)")
    chosen = next(iter(first.pods))
    history = [chosen]
    # After the timeout, the next connection is balanced afresh: with 3 endpoints a different one is chosen with
    # probability 2/3 each time, so 8 tries miss with probability (1/3)^8 (1.5e-4).
    for _ in range(8):
        ctx.sleep(timeout_s + 1.2)
        pr = ctx.reach(client, ip, 80, count=1, only=eps)
        now = next(iter(pr.pods))
        history.append(now)
        if now != history[-2]:
            ctx.note(
                f"affinity held 15/15, and 15/15 to {kept.name} once {gone.name} was removed; off: spread; after a "
                f"{timeout_s} s timeout re-chosen ({' -> '.join(history)})"
            )
            return
    ctx.fail(
        f"after each {timeout_s} s affinity timeout the same pod answered again",
        sent=f"{len(history) - 1} connections from {client.name} to {ip}:80, {timeout_s + 1.2:.1f} s apart",
        got=" -> ".join(history),
        expected="a different backend chosen at least once (probability of this by chance: 1.5e-4)",
    )


def source_ip(ctx: Context) -> None:
    n1, n2 = _two_nodes(ctx)
    client = ctx.pods_on(n1)[0]
    ep = ctx.pods_on(n2)[0]
    svc = ctx.service("srcip")
    ctx.apply(svc, ctx.slice_for(svc, [ep]))
    ip = _cip(svc)
    _wait_reach(ctx, client, ip, 80, only=[ep])
    for kind in ("tcp", "udp"):
        if kind == "udp":
            svc2 = ctx.service("srcip-udp", [ctx.port(80, 8080, name="udp", protocol="UDP")])
            ctx.apply(svc2, ctx.slice_for(svc2, [ep]))
            ip = _cip(svc2)
            _wait_reach(ctx, client, ip, 80, "udp", only=[ep])
        pr = ctx.reach(client, ip, 80, kind, count=5, only=[ep])
        ctx.expect(
            pr.seen_ips == {client.ip4},
            f"{kind.upper()}: the backend did not see the client pod's address",
            sent=pr.sent,
            got=pr.summary() + f"; source addresses seen: {sorted(pr.seen_ips)}",
            expected=f"{ep.name} sees {client.ip4} (no masquerade for pod -> ClusterIP -> remote pod)",
        )


def hairpin(ctx: Context) -> None:
    n1, _ = _two_nodes(ctx)
    pod = ctx.pods_on(n1)[1]
    svc = ctx.service("self")
    ctx.apply(svc, ctx.slice_for(svc, [pod]))
    ip = _cip(svc)
    _wait_reach(ctx, pod, ip, 80, only=[pod])
    pr = ctx.reach(pod, ip, 80, count=5, only=[pod])
    ctx.note(f"{pod.name} reached itself through {ip}:80, seen as {sorted(pr.seen_ips)}")


def _health(ctx: Context, node: Any, hc_port: int, svc_name: str, local: int) -> None:
    r = ctx.http(ctx.external_ns, _url(node.ip4, hc_port))
    want_status = 200 if local > 0 else 503
    want_body = {
        "service": {"namespace": ctx.namespace, "name": svc_name},
        "localEndpoints": local,
        "serviceProxyHealthy": True,
    }
    body = body_of(r)
    try:
        got_body = json.loads(body)
    except ValueError:
        got_body = None
    weight = header(r, "X-Load-Balancing-Endpoint-Weight")
    ctx.expect(
        getattr(r, "status", None) == want_status and got_body == want_body and weight == str(local),
        f"healthCheckNodePort on {node.name} answered wrongly",
        sent=f"GET {_url(node.ip4, hc_port)} from the external client",
        got=f"{getattr(r, 'status', None)} X-Load-Balancing-Endpoint-Weight={weight} {body.strip()[:300]}"
        + (f" ({getattr(r, 'error', '')})" if getattr(r, "error", "") else ""),
        expected=f"{want_status} X-Load-Balancing-Endpoint-Weight={local} {json.dumps(want_body)}",
    )


def _client_ip_kept(ctx: Context, pr: Probe, want: str, what: str) -> None:
    """The endpoint saw only ``want`` as the source address: the client IP was preserved. A mode that declares the
    ``client-ip`` part not applicable (its endpoint sees the node, by its mechanism) leaves this assertion out."""
    if ctx.skips("client-ip"):
        return
    ctx.expect(
        pr.seen_ips == {want},
        f"{what}: client IP not preserved",
        sent=pr.sent,
        got=f"source addresses seen: {sorted(pr.seen_ips)}",
        expected=f"only {want}",
    )


def etp_local(ctx: Context) -> None:
    n1, n2 = _two_nodes(ctx)
    local1 = [ctx.pods_on(n1)[1], ctx.pods_on(n1)[2]]
    hc = ctx.addresses.node_port()
    lb_ip = ctx.addresses.lb_ip()
    # healthCheckNodePort exists only for type LoadBalancer with externalTrafficPolicy Local (as upstream's ESIPP)
    svc = ctx.service("local", type="LoadBalancer", externalTrafficPolicy="Local", healthCheckNodePort=hc)
    np_ = svc["spec"]["ports"][0]["nodePort"]
    ctx.apply(svc, ctx.slice_for(svc, local1))
    ctx.set_lb_ingress("local", [lb_ip])
    ext = ctx.external_ns
    _wait_reach(ctx, ext, n1.ip4, np_, only=local1)
    _barrier(ctx, n1, n2)
    pr = ctx.reach(ext, n1.ip4, np_, count=10, only=local1)
    _client_ip_kept(ctx, pr, ctx.external_ip4, "externalTrafficPolicy=Local")
    ctx.blocked(ext, n2.ip4, np_, how="timeout", count=2, timeout=1.5)
    # The LB IP is routed to node-1, which has local endpoints: reached, client IP preserved.
    pr = ctx.reach(ext, lb_ip, 80, count=6, only=local1)
    _client_ip_kept(ctx, pr, ctx.external_ip4, "LB IP with externalTrafficPolicy=Local")
    ctx.eventually(lambda: _health(ctx, n1, hc, "local", 2), timeout=SYNC_WAIT, what="health check node port")
    ctx.eventually(lambda: _health(ctx, n2, hc, "local", 0), timeout=SYNC_WAIT, what="health check node port")
    # Endpoints on both nodes now: each node must still send external traffic only to its own.
    local2 = [ctx.pods_on(n2)[1]]
    ctx.apply(ctx.slice_for(svc, local1 + local2))
    _wait_reach(ctx, ext, n2.ip4, np_, only=local2, what="after adding an endpoint on node-2")
    pr = ctx.reach(ext, n2.ip4, np_, count=8, only=local2)
    _client_ip_kept(ctx, pr, ctx.external_ip4, "externalTrafficPolicy=Local on node-2")
    ctx.reach(ext, n1.ip4, np_, count=10, only=local1)
    ctx.eventually(lambda: _health(ctx, n2, hc, "local", 1), timeout=SYNC_WAIT, what="health check node port")
    ctx.note("node without local endpoints dropped (timeout); health 200/503 with upstream's JSON")


def itp_local(ctx: Context) -> None:
    n1, n2 = _two_nodes(ctx)
    a, b = ctx.pods_on(n1)[0], ctx.pods_on(n2)[0]
    ep1 = ctx.pods_on(n1)[1]
    svc = ctx.service("itp", internalTrafficPolicy="Local")
    ctx.apply(svc, ctx.slice_for(svc, [ep1]))
    ip = _cip(svc)
    _wait_reach(ctx, a, ip, 80, only=[ep1])
    _barrier(ctx, n2)
    ctx.reach(a, ip, 80, count=8, only=[ep1])
    ctx.blocked(b, ip, 80, how="timeout", count=3, timeout=1.0)
    _internal_verdict(ctx, n2, f"{ctx.namespace}/itp:tcp", "drop")
    ep2 = ctx.pods_on(n2)[1]
    ctx.apply(ctx.slice_for(svc, [ep1, ep2]))
    _wait_reach(ctx, b, ip, 80, only=[ep2], what="after adding an endpoint on node-2")
    ctx.reach(b, ip, 80, count=8, only=[ep2])
    ctx.reach(a, ip, 80, count=8, only=[ep1])


def _internal_verdict(ctx: Context, node: Any, key: str, want: str) -> None:
    """The node's /rules says traffic from inside the cluster to ``key`` gets verdict ``want`` (every backend's
    description of a service port carries the cache's ``internal`` verdict, per family where it has families)."""
    services = (ctx.rules(node, service=key).get("backend") or {}).get("services") or {}
    verdicts = []
    for entry in services.values():
        for info in entry.values() if isinstance(entry, dict) and "internal" not in entry else [entry]:
            if isinstance(info, dict) and "internal" in info:
                verdicts.append(info["internal"])
    ctx.expect(
        verdicts and all(v == want for v in verdicts),
        f"/rules on {node.name} does not show internal verdict {want!r} for {key}",
        sent=f"GET http://127.0.0.1:{METRICS_PORT}/rules?service={key} in {node.ns}",
        got=f"internal verdicts {verdicts}; backend.services: {json.dumps(services)[:300]}",
        expected=f"the service described, internal verdict {want!r}",
    )


def terminating_fallback(ctx: Context) -> None:
    n1, n2 = _two_nodes(ctx)
    client = ctx.pods_on(n1)[0]
    eps = [ctx.pods_on(n1)[1], ctx.pods_on(n2)[1]]
    svc = ctx.service("term")
    ctx.apply(svc, ctx.slice_for(svc, eps, ready=False, serving=True, terminating=True))
    ip = _cip(svc)
    _wait_reach(ctx, client, ip, 80, only=eps, what="all endpoints terminating but serving")
    ctx.reach(client, ip, 80, count=10, only=eps)
    ctx.apply(ctx.slice_for(svc, eps, ready=False, serving=False, terminating=True))
    ctx.eventually(
        lambda: ctx.blocked(client, ip, 80, how="refused", within=1.0, timeout=2.0),
        timeout=SYNC_WAIT,
        what="all endpoints terminating and no longer serving",
    )


def lifecycle(ctx: Context) -> None:
    n1, n2 = _two_nodes(ctx)
    client = ctx.pods_on(n1)[0]
    eps_a, eps_b = [ctx.pods_on(n2)[0]], [ctx.pods_on(n2)[1]]
    a, b = ctx.service("alpha"), ctx.service("beta")
    ctx.apply(a, ctx.slice_for(a, eps_a), b, ctx.slice_for(b, eps_b))
    ip_a, ip_b = _cip(a), _cip(b)
    _wait_reach(ctx, client, ip_a, 80, only=eps_a)
    _wait_reach(ctx, client, ip_b, 80, only=eps_b)
    ctx.delete_service("alpha")
    ctx.eventually(lambda: ctx.blocked(client, ip_a, 80, timeout=1.0), timeout=SYNC_WAIT, what="after deleting alpha")
    ctx.reach(client, ip_b, 80, count=5, only=eps_b)
    ctx.apply(a, ctx.slice_for(a, eps_a))
    _wait_reach(ctx, client, ip_a, 80, only=eps_a, what="after recreating alpha")
    ctx.reach(client, ip_a, 80, count=5, only=eps_a)
    ctx.reach(client, ip_b, 80, count=5, only=eps_b)


def _full_syncs(ctx: Context, node: Any) -> float:
    parsed = _parsed_metrics(ctx, node)
    return histogram(parsed, "kubeproxy_sync_full_proxy_rules_duration_seconds", ip_family="IPv4")[1]


def _refusal(ctx: Context, node: Any, key: str) -> str:
    """What ``/rules`` on ``node`` says the core refused of ``key`` (``ns/name:port/PROTO``), or ""."""
    doc = ctx.rules(node)
    entry = (((doc.get("backend") or {}).get("services") or {}).get(key) or {}).get("IPv4") or {}
    return str(entry.get("refused") or "")


def address_collision(ctx: Context) -> None:
    """One tenant lists another service's ClusterIP among its externalIPs (the claimant's name sorts first, as a
    Service in namespace ``aaa`` would against ``kube-system/kube-dns``): the owner's endpoints answer throughout,
    through a partial sync, a full sync, a restart of kproxy and the claimant's deletion; the claim is reported."""
    n1, n2 = _two_nodes(ctx)
    client = ctx.pods_on(n1)[0]
    owner_eps, claim_eps = [ctx.pods_on(n2)[0]], [ctx.pods_on(n2)[1]]
    owner = ctx.service("zz-owner")
    ctx.apply(owner, ctx.slice_for(owner, owner_eps))
    vip = _cip(owner)
    _wait_reach(ctx, client, vip, 80, only=owner_eps)
    claimant = ctx.service("aa-claimant", externalIPs=[vip])
    ctx.apply(claimant, ctx.slice_for(claimant, claim_eps))
    own_vip = _cip(claimant)
    _wait_reach(ctx, client, own_vip, 80, only=claim_eps, what="the claimant's own ClusterIP")

    def owner_answers() -> None:
        ctx.reach(client, vip, 80, count=10, only=owner_eps)
        ctx.reach(client, own_vip, 80, count=3, only=claim_eps)

    # "throughout": a client keeps connecting to the owner's address while everything below happens
    with _Prober(ctx, client, vip, "claimed", interval=0.2) as prober:
        why = _collide(ctx, n1, client, vip, own_vip, owner_eps, claim_eps, owner_answers, prober.phase)
    # a mode whose data path is kproxy itself declares that new connections fail while no process runs; no other may
    judge_collision(prober.probes, {p.name for p in owner_eps}, ctx.skips("while-down"))
    ctx.note(f"{vip}:80 stayed with its owner through {len(prober.probes)} connections; the claimant was told: {why}")


class _Prober:
    """A client connecting to ``ip:80`` once per ``interval`` in a thread of its own while a scenario changes things;
    each result is kept with the phase (``phase[0]``, set by the scenario) it was sent in."""

    def __init__(self, ctx: Context, client: Any, ip: str, first_phase: str, interval: float) -> None:
        self.ctx, self.client, self.ip, self.interval = ctx, client, ip, interval
        self.phase = [first_phase]
        self.probes: list[tuple[str, Probe]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set() and self.ctx.remaining() > 5:
            try:
                self.probes.append((self.phase[0], self.ctx.probe(self.client, self.ip, 80, count=1, timeout=1.0)))
            except Exception as exc:  # recorded, judged by the scenario
                self.probes.append((self.phase[0], Probe(self.client.name, "tcp", self.ip, 80, [_Err(str(exc))])))
            time.sleep(self.interval)

    def __enter__(self) -> _Prober:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def judge_collision(probes: Sequence[tuple[str, Probe]], owners: set[str], gap_ok: bool) -> None:
    """Every connection to the owner's address reached the owner; none failed, but while kproxy restarted in a mode
    whose data path is kproxy itself (``gap_ok``)."""
    stolen = [(ph, pr.summary()) for ph, pr in probes if pr.pods - owners]
    failed = [(ph, pr.summary()) for ph, pr in probes if pr.failed and not (gap_ok and ph == "restarting")]
    if stolen or failed:
        raise ScenarioFailure(
            "connections to the owner's ClusterIP went elsewhere or failed",
            sent=f"{len(probes)} connections, one at a time",
            got="; ".join(f"{ph}: {s}" for ph, s in (stolen + failed)[:6]),
            expected="every one answered by " + ", ".join(sorted(owners)),
        )


def _collide(
    ctx: Context,
    n1: Any,
    client: Any,
    vip: str,
    own_vip: str,
    owner_eps: Sequence[Any],
    claim_eps: Sequence[Any],
    owner_answers: Callable[[], None],
    phase: list[str],
) -> str:
    """The steps of ``address_collision`` while its client keeps connecting; returns what /rules says of the claim."""
    owner_answers()
    # a full sync (a node label change makes the cache owe one): the holder keeps the address
    before = _full_syncs(ctx, n1)
    patch = {"metadata": {"labels": {"kproxy.io/conformance-full-sync": str(int(time.time() * 1000))}}}
    ctx.core.patch_node(n1.name, patch, _content_type="application/merge-patch+json", _request_timeout=API_TIMEOUT)
    ctx.eventually(
        lambda: ctx.expect(_full_syncs(ctx, n1) > before, f"a full sync on {n1.name} after a node label change"),
        timeout=SYNC_WAIT,
        what="a full sync",
    )
    owner_answers()
    # a restart: the new process adopts what the kernel holds, and adoption says who holds the address
    phase[0] = "restarting"
    ctx.lab.stop_kproxy(n1)
    _start_kproxy(ctx, n1, ctx.mode)
    ctx.eventually(lambda: _synced_since_start(ctx, n1), timeout=START_WAIT, what="restarted kproxy's first sync")
    phase[0] = "restarted"
    owner_answers()
    key = f"{ctx.namespace}/aa-claimant:tcp/TCP"

    def reported() -> str:
        found = _refusal(ctx, n1, key)
        ctx.expect(found, f"{key} is not reported refused on {n1.name}", sent=f"GET /rules on {n1.name}")
        return found

    why = ctx.eventually(reported, timeout=SYNC_WAIT, what="the claim reported")
    ctx.expect(
        "address-conflict" in why and "zz-owner" in why,
        "the refused claim is reported in /rules",
        sent=f"GET /rules?service={key} on {n1.name}",
        got=why,
        expected="refused: address-conflict ... held by the owner",
    )
    # deleting the refused claimant never touches the owner's entries
    phase[0] = "deleted"
    ctx.delete_service("aa-claimant")
    ctx.eventually(
        lambda: ctx.blocked(client, own_vip, 80, timeout=1.0), timeout=SYNC_WAIT, what="after deleting the claimant"
    )
    ctx.reach(client, vip, 80, count=10, only=owner_eps)
    return why


CONVERGE_SETTLE_S = 0.5  # how long past the limit _converge keeps watching for the old state to come back


def _converge(
    ctx: Context,
    src: Any,
    ip: str,
    ok: Callable[[Probe], bool],
    what: str,
    stale: Callable[[Any], bool] | None = None,
    limit: float = 2.0,
    batch: int = 6,
) -> tuple[float, float]:
    """Probe in batches of ``batch`` from a write until the change has taken effect and stayed so past ``limit``.

    The old state was last seen at ``lo``: the send time of the last probe ``stale`` flags (an answer only the old
    state gives, or none), and, until the first batch that is ``ok``, the start of every batch that is not (so a
    datapath only half way to the new state counts as old). Probing goes on after the first ok batch until a batch
    has started CONVERGE_SETTLE_S after ``limit``, so an old answer that comes back late (a flapping or half-removed
    rule) is seen.
    Fails when ``lo`` exceeds ``limit`` (a batch that straddled the change does not count against it) or when no
    batch was ok within SYNC_WAIT; returns (lo, hi), ``hi`` the start of the first ok batch."""
    t0 = ctx.now()
    last: Probe | None = None
    first_good: tuple[float, Probe] | None = None
    lo = 0.0
    last_old: Probe | None = None
    while ctx.now() - t0 < SYNC_WAIT:
        start = ctx.now() - t0
        pr = ctx.probe(src, ip, 80, count=batch, timeout=0.5)
        good = ok(pr)
        if stale is not None:
            offset = start  # a probe's send time: its batch's start plus the time the probes before it took
            for r in pr.results:
                if stale(r):
                    lo, last_old = max(lo, offset), pr
                offset += float(getattr(r, "seconds", 0.0) or 0.0)
        if not good and (first_good is None or stale is None):
            lo, last_old = max(lo, start), pr
        if good and first_good is None:
            first_good = (start, pr)
        last = pr
        if first_good is not None and start > limit + CONVERGE_SETTLE_S:
            break
    if first_good is None:
        ctx.fail(
            f"{what}: never converged within {SYNC_WAIT:.0f} s",
            sent=(last.sent + " per batch, from the write on") if last else "",
            got=f"last batch: {last.summary()}" if last else "no batch sent",
            expected=f"converged within {limit:.1f} s",
        )
        raise AssertionError("unreachable")
    hi, good_pr = first_good
    ctx.expect(
        lo <= limit,
        f"{what}: the old state was still seen {lo:.2f} s after the write (first good batch at {hi:.2f} s)",
        sent=good_pr.sent + " per batch, from the write until a batch after the limit",
        got=f"last batch showing the old state: {last_old.summary() if last_old else '-'}; first good: "
        f"{good_pr.summary()}",
        expected=f"converged within {limit:.1f} s and stayed so",
    )
    return lo, hi


UP_BATCH = 30  # probes per batch while converging on five endpoints (each must answer)


def endpoint_churn(ctx: Context) -> None:
    n1, n2 = _two_nodes(ctx)
    client = ctx.pods_on(n1)[0]
    others = [p for p in ctx.pods if p.name != client.name]
    three, one, five = others[1:4], [others[3]], others[:5]
    svc = ctx.service("churn")
    ctx.apply(svc, ctx.slice_for(svc, three))
    ip = _cip(svc)
    _wait_reach(ctx, client, ip, 80, only=three)
    ctx.reach(client, ip, 80, count=30, only=three, all_of=three)
    names1 = {p.name for p in one}
    ctx.apply(ctx.slice_for(svc, one))
    t_down = _converge(
        ctx,
        client,
        ip,
        lambda pr: not pr.failed and pr.pods == names1,
        "3 -> 1 endpoints",
        # an answer from a removed endpoint (or none) is the old state; one from the remaining one proves nothing
        stale=lambda r: not getattr(r, "ok", False) or answer_pod(r) not in names1,
    )
    ctx.reach(client, ip, 80, count=10, only=one)
    names5 = {p.name for p in five}
    ctx.apply(ctx.slice_for(svc, five))
    # Converged means the whole new set answers: one new endpoint answering proves only that a sync began. A batch
    # of 30 misses one of 5 uniformly chosen endpoints with probability 5 * 0.8^30 = 0.6%, which only delays the
    # first good batch (a miss before the change took effect is what "lo" measures, and it is still bounded).
    t_up = _converge(
        ctx,
        client,
        ip,
        lambda pr: not pr.failed and pr.pods == names5,
        "1 -> 5 endpoints",
        # after the first batch where all five answered, a failure or a stranger is the old (or a broken) state
        stale=lambda r: not getattr(r, "ok", False) or answer_pod(r) not in names5,
        batch=UP_BATCH,
    )
    ctx.reach(client, ip, 80, count=60, only=five, all_of=five)
    ctx.note(
        f"3->1 converged between {t_down[0]:.2f} and {t_down[1]:.2f} s, 1->5 between {t_up[0]:.2f} and "
        f"{t_up[1]:.2f} s after the write"
    )


def port_update(ctx: Context) -> None:
    n1, n2 = _two_nodes(ctx)
    client = ctx.pods_on(n1)[0]
    eps = [ctx.pods_on(n2)[0]]
    svc = ctx.service("moving")
    ctx.apply(svc, ctx.slice_for(svc, eps))
    ip = _cip(svc)
    _wait_reach(ctx, client, ip, 80, only=eps)
    svc["spec"]["ports"][0]["port"] = 81
    ctx.apply(svc)

    def moved() -> None:
        ctx.reach(client, ip, 81, count=1, timeout=0.5, only=eps)
        ctx.blocked(client, ip, 80, count=1, timeout=1.0)

    ctx.eventually(moved, timeout=SYNC_WAIT, what="after changing port 80 to 81")
    ctx.reach(client, ip, 81, count=5, only=eps)


def kernel_view(ctx: Context, node: Any, family: str) -> dict[str, list[str]] | None:
    """The mode's ``kernel_view`` hook on ``node``: service port -> the kernel's lines for it, read from the kernel
    now (never kproxy's own account). None when the mode has no such view; a hook that fails fails the scenario."""
    from kproxy.model import IPFamily
    from kproxy.proxier import backend_class

    hook = getattr(backend_class(ctx.mode), "kernel_view", None)
    if hook is None:
        return None
    try:
        view = hook(ctx.kernel_probe(node), IPFamily(family))
    except Exception as exc:  # BackendError: a tool failed
        raise ScenarioFailure(
            f"could not read the {family} kernel view of mode {ctx.mode} on {node.name}",
            sent=f"{ctx.mode}.kernel_view({family}) through a probe into {node.ns}",
            got=f"{type(exc).__name__}: {exc}",
            expected="service port -> kernel lines",
        ) from None
    return None if view is None else {str(k): [str(x) for x in v] for k, v in view.items()}


def _view_keys(view: dict[str, list[str]], namespace: str, name: str) -> list[str]:
    return [k for k in view if k.startswith((f"{namespace}/{name}:", f"{namespace}/{name}/"))]


def _mentions(lines: Sequence[str], namespace: str, name: str) -> list[str]:
    pattern = re.compile(re.escape(f"{namespace}/{name}") + r"(?![-a-z0-9.])")
    return [ln for ln in lines if pattern.search(ln)]


_COUNTER = re.compile(r"\[(\d+):(\d+)\]|packets (\d+) bytes (\d+)")


def split_counters(line: str) -> tuple[str, tuple[int, ...]]:
    """A kernel line without its counters (iptables-save -c's ``[packets:bytes]``, nft's ``packets N bytes M``),
    and the packet counts it carried."""
    packets: list[int] = []

    def cut(m: re.Match[str]) -> str:
        packets.append(int(m.group(1) or m.group(3)))
        return "[counters]"

    return _COUNTER.sub(cut, line), tuple(packets)


def view_changes(before: Sequence[str], after: Sequence[str]) -> list[str]:
    """How one service port's kernel lines changed, other than by counters rising: lines that went or came, and
    lines whose counters fell (a rewrite resets them). [] when untouched."""
    b = sorted(split_counters(ln) for ln in before)
    a = sorted(split_counters(ln) for ln in after)
    gone = collections.Counter(shape for shape, _ in b) - collections.Counter(shape for shape, _ in a)
    came = collections.Counter(shape for shape, _ in a) - collections.Counter(shape for shape, _ in b)
    if gone or came:
        return [f"gone: {x}" for x in gone] + [f"new: {x}" for x in came]
    return [
        f"counters fell {list(cb)} -> {list(ca)} (rewritten): {shape}"
        for (shape, cb), (_, ca) in zip(b, a, strict=True)
        if any(x < y for x, y in zip(ca, cb, strict=False))
    ]


def ignored_services(ctx: Context) -> None:
    n1, n2 = _two_nodes(ctx)
    client = ctx.pods_on(n1)[0]
    eps = [ctx.pods_on(n2)[0]]
    other = ctx.service("other-proxy", labels={"service.kubernetes.io/service-proxy-name": "someone-else"})
    marked = ctx.service("marked-headless", labels={"service.kubernetes.io/headless": ""})
    headless = ctx.service("headless", cluster_ip=None)
    extname = ctx.service("extname", type="ExternalName", externalName="backend.example.invalid")
    # one that is served first and labelled afterwards: what it had in the kernel must go too
    late = ctx.service("late-label")
    ctx.apply(late, ctx.slice_for(late, eps))
    _wait_reach(ctx, client, _cip(late), 80, only=eps)
    late["metadata"]["labels"] = {"service.kubernetes.io/service-proxy-name": "someone-else"}
    ctx.apply(
        other,
        ctx.slice_for(other, eps),
        marked,
        ctx.slice_for(marked, eps),
        headless,
        ctx.slice_for(headless, eps),
        extname,
        late,
    )
    (present,) = _barrier(ctx, n1)
    for svc in (other, marked, late):
        ctx.blocked(client, _cip(svc), 80, count=1, timeout=1.0)
    view = kernel_view(ctx, n1, "IPv4")
    if view is None:
        ctx.part_not_applicable("kernel-rules", f"mode {ctx.mode} has no kernel view to show that no rules exist")
    else:
        sent = f"{ctx.mode}.kernel_view(IPv4) through a probe into {n1.ns}"
        lines = [ln for v in view.values() for ln in v]
        # The absence checks below mean something only if the same view shows a service that is programmed (a
        # view that reads nothing, or keys in another format, would make them pass vacuously).
        ctx.expect(
            _view_keys(view, ctx.namespace, present) and _mentions(lines, ctx.namespace, present),
            f"the kernel view does not show the programmed service {present}, so it cannot show the ignored ones' "
            "absence",
            sent=sent,
            got=f"{len(view)} service ports: {', '.join(sorted(view)[:10])}",
            expected=f"a key {ctx.namespace}/{present}:tcp/TCP and lines naming it",
        )
        for name in ("other-proxy", "marked-headless", "headless", "extname", "late-label"):
            keys, found = _view_keys(view, ctx.namespace, name), _mentions(lines, ctx.namespace, name)
            ctx.expect(
                not keys and not found,
                f"the ignored service {name} has rules in the kernel",
                sent=sent,
                got=f"keys {keys}; lines: " + " | ".join(found[:4]),
                expected=f"no key for {ctx.namespace}/{name} and no kernel line naming it",
            )
    for svc in (other, marked):
        svc["metadata"]["labels"] = {}
        ctx.apply(svc)
    for svc in (other, marked):
        _wait_reach(ctx, client, _cip(svc), 80, only=eps, what=f"after removing the label of {svc['metadata']['name']}")
    ctx.note(
        "labelled services (also one labelled after it was served) unreachable and without kernel rules until "
        "unlabelled; headless and ExternalName have none"
    )


UDP_FOLLOW_S = 2.0


def _udp_follow(ctx: Context, client: Any, ip: str, src_port: int, target: Any, label: str) -> str:
    """Send from the fixed port, one datagram at a time, until ``target`` answers. The change took effect between
    the last datagram that did not reach it and the first that did; fail when one sent later than UDP_FOLLOW_S
    after the change still did not (the earlier bound, so a lost datagram's timeout is not counted against it)."""
    t0 = ctx.now()
    seen: list[str] = []
    last_miss = 0.0
    sent = f"UDP datagrams from {client.name}:{src_port} to {ip}:80, one at a time (0.3 s timeout)"
    while True:
        sent_at = ctx.now() - t0
        pr = ctx.probe(client, ip, 80, "udp", count=1, timeout=0.3, src_port=src_port)
        seen.append(f"+{sent_at:.2f} s: " + (",".join(sorted(pr.pods)) if pr.ok else pr.summary()))
        if pr.pods == {target.name}:
            break
        last_miss = sent_at
        if sent_at > SYNC_WAIT:
            ctx.fail(
                f"{label}: UDP from a fixed source port never reached {target.name}",
                sent=sent,
                got=" | ".join(seen[-5:]),
                expected=f"answers from {target.name} within {UDP_FOLLOW_S:.0f} s",
            )
    ctx.expect(
        last_miss <= UDP_FOLLOW_S,
        f"{label}: UDP from a fixed source port still missed {target.name} {last_miss:.2f} s after the change "
        f"(first reached at {sent_at:.2f} s)",
        sent=sent,
        got=" | ".join(seen[-5:]),
        expected=f"answers from {target.name} within {UDP_FOLLOW_S:.0f} s (stale conntrack entries deleted)",
    )
    return f"{label}: between {last_miss:.2f} and {sent_at:.2f} s"


def _udp_conntrack_entries(ctx: Context, node: Any, dst: str, sport: int) -> list[str]:
    """The node's UDP conntrack entries to ``dst`` from source port ``sport`` (``conntrack -L``)."""
    argv = ["conntrack", "-L", "-p", "udp", "-d", dst, "--sport", str(sport)]
    res = ctx.exec(node, argv, timeout=10)
    if _rc(res) != 0:
        ctx.fail(
            f"conntrack -L failed on {node.name}",
            sent=" ".join(argv) + f" in {node.ns}",
            got=f"exit {_rc(res)}: {_stdout(getattr(res, 'stderr', ''))[:200]}",
            expected="exit 0",
        )
    return [ln.strip() for ln in _stdout(res).splitlines() if ln.startswith("udp")]


def udp_conntrack(ctx: Context) -> None:
    n1, n2 = _two_nodes(ctx)
    client = ctx.pods_on(n1)[0]
    old, new = ctx.pods_on(n2)[0], ctx.pods_on(n2)[1]
    src_port = 40000 + random.randrange(1000)
    svc = ctx.service("udp", [ctx.port(80, 8080, name="udp", protocol="UDP")])
    ctx.apply(svc, ctx.slice_for(svc, [old]))
    ip = _cip(svc)

    def from_(pod: Any, timeout: float) -> Probe:
        pr = ctx.probe(client, ip, 80, "udp", count=1, timeout=timeout, src_port=src_port)
        ctx.expect(
            pr.pods == {pod.name},
            f"UDP from fixed port {src_port} not answered by {pod.name}",
            sent=pr.sent + f" from source port {src_port}",
            got=pr.summary(),
            expected=f"answer from {pod.name}",
        )
        return pr

    ctx.eventually(lambda: from_(old, 0.3), timeout=SYNC_WAIT, what="initial backend")
    for _ in range(3):
        from_(old, 1.0)  # the conntrack entry to the old backend is alive and in use (steady state: no hurry)
    figures = []
    ctx.apply(ctx.slice_for(svc, [new]))
    figures.append(_udp_follow(ctx, client, ip, src_port, new, "backend replaced"))
    figures.append(_udp_stale_entry(ctx, n1, client, new, src_port + 1000))
    figures.append(_udp_socket_follow(ctx, client, old, new))
    ctx.note("; ".join(figures))


def _udp_stale_entry(ctx: Context, n1: Any, client: Any, new: Any, late_port: int) -> str:
    """A service that goes from nothing to an endpoint, with a stale entry in the way: before the Service exists, a
    datagram from the fixed port to its (future) ClusterIP leaves node-1 by its default route un-NATed, and
    conntrack confirms that entry (its original destination is that ClusterIP); the client's retries keep it alive.
    Only deleting it lets the next datagram be DNATed to the new endpoint. (A service with no endpoints would not
    do: its REJECT comes before conntrack confirms anything.) A mode that translates without conntrack declares the
    ``stale-entry`` part not applicable: the new service must still be reached from the same port at once."""
    late = ctx.service("udp-late", [ctx.port(80, 8080, name="udp", protocol="UDP")])
    ip2 = _cip(late)
    pre = ctx.probe(client, ip2, 80, "udp", count=2, timeout=0.3, src_port=late_port)
    ctx.expect(not pre.ok, "a ClusterIP with no Service behind it answered", sent=pre.sent, got=pre.summary())
    if ctx.skips("stale-entry"):
        ctx.apply(late, ctx.slice_for(late, [new]))
        return _udp_follow(ctx, client, ip2, late_port, new, "service appeared (stale-entry part declared away)")
    stale = _udp_conntrack_entries(ctx, n1, ip2, late_port)
    ctx.expect(
        stale,
        f"no conntrack entry for the datagrams to {ip2}:80 before the service existed, so nothing stale to test",
        sent=pre.sent + f" from source port {late_port}; then conntrack -L -p udp -d {ip2} in {n1.ns}",
        got="no entry",
        expected="one un-NATed UDP entry",
    )
    ctx.apply(late, ctx.slice_for(late, [new]))
    follow = _udp_follow(ctx, client, ip2, late_port, new, "service appeared over a stale entry")
    return follow + f" (stale entry before: {stale[0][:160]})"


UDP_SOCKET_INTERVAL = 0.1
# One connected UDP socket, a datagram every UDP_SOCKET_INTERVAL s until the stop file appears: each line is the
# send time (time.monotonic, the same clock as the runner's) and the answering pod, or "!<error>". On an error other
# than a timeout the socket is replaced, as an application does once its socket is ended ("+reconnect").
UDP_SOCKET_SCRIPT = r"""
import errno, os, socket, sys, time
host, port, seconds, interval = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[6])
out, stop = sys.argv[4], sys.argv[5]
fam = socket.AF_INET6 if ":" in host else socket.AF_INET
end = time.monotonic() + seconds
sock = None
with open(out, "a", buffering=1) as f:
    while time.monotonic() < end and not os.path.exists(stop):
        t = time.monotonic()
        try:
            if sock is None:
                sock = socket.socket(fam, socket.SOCK_DGRAM)
                sock.settimeout(0.3)
                sock.connect((host, port))
            sock.send(b"hello\n")
            word = (sock.recv(65535).decode(errors="replace").split() or ["!empty"])[0]
        except socket.timeout:
            word = "!timeout"
        except OSError as e:
            word = "!" + errno.errorcode.get(e.errno or 0, type(e).__name__) + "+reconnect"
            if sock is not None:
                sock.close()
            sock = None
        f.write(f"{t:.4f} {word}\n")
        time.sleep(interval)
"""


def _socket_log(path: Path) -> list[tuple[float, str]]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    out = []
    for line in text.splitlines():
        t, _, word = line.partition(" ")
        if word:
            out.append((float(t), word))
    return out


def _udp_socket_follow(ctx: Context, client: Any, old: Any, new: Any) -> str:
    """One long-lived connected UDP socket in the client pod (its node's cgroup, like every probe), answered by
    ``old``, then the service's endpoint replaced by ``new``: within UDP_FOLLOW_S its datagrams reach ``new`` (a
    socket the mode ends may be replaced by the client, as an application does on the error; counted)."""
    import shutil
    import tempfile

    svc = ctx.service("udp-held", [ctx.port(80, 8080, name="udp", protocol="UDP")])
    ctx.apply(svc, ctx.slice_for(svc, [old]))
    ip = _cip(svc)
    _wait_reach(ctx, client, ip, 80, "udp", only=[old])
    work = Path(tempfile.mkdtemp(prefix="kproxy-conformance-udp-"))
    out, stop = work / "log", work / "stop"
    seconds = max(10.0, min(3 * SYNC_WAIT, ctx.remaining() - 10))
    argv = [sys.executable, "-I", "-c", UDP_SOCKET_SCRIPT, ip, "80", f"{seconds:.1f}", str(out), str(stop)]
    argv.append(str(UDP_SOCKET_INTERVAL))
    done: list[Any] = []
    runner = threading.Thread(target=lambda: done.append(_run_quietly(ctx, client, argv, seconds + 15)), daemon=True)
    runner.start()
    t_change = 0.0
    try:

        def answered_by(pod: str, after: float, times: int) -> None:
            words = [w for t, w in _socket_log(out) if t >= after]
            ctx.expect(
                words[-times:] == [pod] * times,
                f"the long-lived UDP socket has not been answered by {pod} {times} times in a row yet",
                got=" ".join(words[-6:]) or "nothing yet",
            )

        ctx.eventually(lambda: answered_by(old.name, 0.0, 2), timeout=SYNC_WAIT, what="long-lived UDP socket")
        t_change = ctx.now()
        ctx.apply(ctx.slice_for(svc, [new]))
        try:
            ctx.eventually(lambda: answered_by(new.name, t_change, 3), timeout=SYNC_WAIT, interval=0.2)
        except ScenarioFailure:
            pass  # judged below, on the whole record
    finally:
        stop.touch()
        runner.join(timeout=30)
        log = _socket_log(out)
        shutil.rmtree(work, ignore_errors=True)
    return judge_udp_socket(ctx, log, t_change, old.name, new.name, f"{client.name} -> {ip}:80", done)


def _run_quietly(ctx: Context, where: Any, argv: list[str], timeout: float) -> str:
    """Run ``argv`` in ``where``'s namespace; "" when it ended well, else what went wrong (judged by the caller)."""
    try:
        res = ctx.exec(where, argv, timeout=timeout)
    except Exception as exc:  # recorded: the judge reports it with the socket's record
        return f"{type(exc).__name__}: {exc}"
    return "" if _rc(res) == 0 else f"exit {_rc(res)}: {_stdout(getattr(res, 'stderr', ''))[-300:]}"


def judge_udp_socket(
    ctx: Context, log: Sequence[tuple[float, str]], t_change: float, old: str, new: str, what: str, done: Sequence[str]
) -> str:
    """The long-lived socket's verdict: answered by ``old`` before the change; every datagram sent later than
    UDP_FOLLOW_S after it answered by ``new``, and some were. Returns the figure for the note."""
    sent = f"one connected UDP socket {what}, a datagram every {UDP_SOCKET_INTERVAL} s (0.3 s timeout)"
    before = [w for t, w in log if t < t_change]
    after = [(t - t_change, w) for t, w in log if t >= t_change]
    shown = " ".join(f"+{t:.2f}:{w}" for t, w in after[:12])
    problem = next((d for d in done if d), "")
    ctx.expect(
        before and set(before) - {"!timeout"} == {old},
        f"the long-lived UDP socket was not answered by {old} alone before the change",
        sent=sent,
        got=" ".join(before[-8:]) or "no datagram before the change" + (f" ({problem})" if problem else ""),
        expected=f"answers from {old}",
    )
    late = [(t, w) for t, w in after if t > UDP_FOLLOW_S and w != new]
    reached = [t for t, w in after if w == new]
    ctx.expect(
        reached and not late,
        f"the long-lived UDP socket did not follow the endpoint change to {new} within {UDP_FOLLOW_S:.0f} s"
        + (f": at +{late[0][0]:.2f} s still {late[0][1]}" if late else ""),
        sent=sent + ", the service's endpoint replaced at +0.00",
        got=shown
        + (f" ... ({len(after)} datagrams)" if len(after) > 12 else "")
        + (f" [{problem}]" if problem else ""),
        expected=f"every datagram sent from +{UDP_FOLLOW_S:.0f} s on answered by {new}",
    )
    reconnects = sum(1 for _, w in after if w.endswith("+reconnect"))
    return f"long-lived socket: first answer from {new} at +{reached[0]:.2f} s" + (
        f" after {reconnects} reconnect(s) on a socket error" if reconnects else ", the same socket throughout"
    )


def _kproxy_bin() -> str:
    exe = Path(sys.executable).with_name("kproxy")
    return str(exe) if exe.exists() else "kproxy"


HOLD_INTERVAL = 0.5


def _synced_since_start(ctx: Context, node: Any) -> int:
    """The restarted kproxy's sync count from its /rules (a new process starts at 0): >= 1 once it has synced."""
    doc = ctx.rules(node)
    syncs = int((doc.get("sync") or {}).get("syncs") or 0)
    ctx.expect(
        syncs >= 1,
        f"the restarted kproxy on {node.name} has not synced yet",
        sent=f"GET http://127.0.0.1:{METRICS_PORT}/rules in {node.ns}",
        got=f"sync: {json.dumps(doc.get('sync'))[:200]}, ready: {doc.get('ready')}",
        expected="sync.syncs >= 1",
    )
    return syncs


def restart(ctx: Context) -> None:
    n1, n2 = _two_nodes(ctx)
    client = ctx.pods_on(n1)[0]
    ep = ctx.pods_on(n2)[0]
    svc = ctx.service("survivor")
    ctx.apply(svc, ctx.slice_for(svc, [ep]))
    ip = _cip(svc)
    _wait_reach(ctx, client, ip, 80, only=[ep])
    # The held connection runs until stopped: it must span the kill, the restart and the restarted kproxy's first
    # sync (which rewrites every rule), whenever that comes; it is bounded by the scenario's own budget. A mode
    # whose connections are its own process's sockets declares it (and new connections while it is down) instead.
    holding, judge_down = not ctx.skips("held-connection"), not ctx.skips("while-down")
    t_hold = ctx.now()
    held = ctx.lab.hold(client.ns, ip, 80, max(10.0, ctx.remaining() - 10), HOLD_INTERVAL) if holding else None
    hold_results: Any = []
    t_synced = t_after_end = 0.0
    prober = _Prober(ctx, client, ip, "before", interval=0.15)
    phase = prober.phase
    try:
        with prober:
            time.sleep(1.0)
            phase[0] = "killed"
            ctx.lab.stop_kproxy(n1, signal.SIGKILL)
            time.sleep(1.5)
            phase[0] = "restarting"
            _start_kproxy(ctx, n1, ctx.mode)
            # /healthz is 503 until the restarted kproxy's first sync of every family
            ctx.eventually(lambda: _healthz_ok(ctx, n1), timeout=START_WAIT, what="restarted kproxy healthy")
            ctx.eventually(
                lambda: _synced_since_start(ctx, n1), timeout=SYNC_WAIT, what="restarted kproxy's first sync"
            )
            t_synced = ctx.now()
            phase[0] = "after"
            time.sleep(2.0)
            t_after_end = ctx.now()
    finally:
        if held is not None:
            hold_results = ctx.lab.finish_hold(held, stop=True, timeout=30)
    probes = prober.probes
    hold_list = list(hold_results) if isinstance(hold_results, (list, tuple)) else [hold_results]
    by_phase = judge_restart(
        ctx, client.name, ip, n1.name, hold_list, probes, t_hold, t_synced, t_after_end, holding, judge_down
    )
    ctx.note(
        ("held connection: " + Probe(client.name, "tcp", ip, 80, hold_list).summary() + "; " if holding else "")
        + f"first sync after restart {t_synced - t_hold:.1f} s after the kill began; new connections: "
        + ", ".join(f"{ph} {len(rs)}" for ph, rs in by_phase.items())
    )


def judge_restart(
    ctx: Context,
    client: str,
    ip: str,
    node: str,
    hold_list: Sequence[Any],
    probes: Sequence[tuple[str, Probe]],
    t_hold: float,
    t_synced: float,
    t_after_end: float,
    holding: bool = True,
    judge_down: bool = True,
) -> dict[str, list[Any]]:
    """The restart scenario's verdict on what it recorded (split out so the judge's own tests feed it scripted
    results): every exchange of the held connection answered, and its last one started after the restarted
    kproxy's first sync; every new connection answered, in each phase, and the phases "killed" and "after" saw
    some. Without ``holding`` (the mode declares the held connection not applicable) there is no hold to judge;
    without ``judge_down`` (it declares new connections while it is down not applicable) only the phases before
    the kill and after the restarted kproxy's first sync are. Returns the new connections' results per phase."""
    by_phase: dict[str, list[Any]] = {}
    for ph, pr in probes:
        by_phase.setdefault(ph, []).extend(pr.results)
    if holding:
        _judge_restart_hold(ctx, client, ip, node, hold_list, t_hold, t_synced)
    judged = {ph: rs for ph, rs in by_phase.items() if judge_down or ph in ("before", "after")}
    bad = {ph: [r for r in rs if not getattr(r, "ok", False)] for ph, rs in judged.items()}
    got = "; ".join(f"{ph}: {Probe(client, 'tcp', ip, 80, rs).summary()}" for ph, rs in by_phase.items())
    sent = f"new TCP connections {client} -> {ip}:80 every ~0.2 s"
    ctx.expect(
        not any(bad.values()),
        "new connections failed around the restart: " + ", ".join(ph for ph, rs in bad.items() if rs),
        sent=sent,
        got=got,
        expected="all answered, "
        + (
            "before, while killed, while restarting and after"
            if judge_down
            else "before the kill and after the restart"
        ),
    )
    windows = [("after", f"in the {t_after_end - t_synced:.1f} s after the restarted kproxy's first sync")]
    if judge_down:
        windows.insert(0, ("killed", "in the 1.5 s while kproxy was dead"))
    for ph, window in windows:
        ctx.expect(
            by_phase.get(ph),
            f"no new connection was made {window}, so that window was not tested",
            sent=sent,
            got=got or "no probes at all",
            expected=f"connections answered {window}",
        )
    return by_phase


def _judge_restart_hold(
    ctx: Context, client: str, ip: str, node: str, hold_list: Sequence[Any], t_hold: float, t_synced: float
) -> None:
    """The held connection's part of the restart verdict (see ``judge_restart``)."""
    hold_bad = [r for r in hold_list if not getattr(r, "ok", False)]
    hold_sent = (
        f"one TCP connection {client} -> {ip}:80, an exchange every {HOLD_INTERVAL} s from before kproxy on "
        f"{node} was killed (SIGKILL) until 2 s after the restarted one's first sync"
    )
    ctx.expect(
        hold_list and not hold_bad,
        "the established TCP connection broke across the restart",
        sent=hold_sent,
        got=Probe(client, "tcp", ip, 80, list(hold_list)).summary(),
        expected="every exchange answered",
    )
    # When the last exchange started, at the earliest: each one takes its own time plus the interval (sleeps only
    # overshoot, and the hold started after t_hold), so this is a lower bound.
    last_start = t_hold + sum(float(getattr(r, "seconds", 0.0) or 0.0) + HOLD_INTERVAL for r in hold_list[:-1])
    ctx.expect(
        last_start >= t_synced,
        "the held connection had no exchange after the restarted kproxy's first sync",
        sent=hold_sent,
        got=f"{len(hold_list)} exchanges, the last started at the earliest {last_start - t_hold:.1f} s after the "
        f"hold began; the first sync was seen {t_synced - t_hold:.1f} s after it",
        expected="exchanges answered after the first sync",
    )


@dataclass
class _Err:
    error: str
    ok: bool = False
    reply: str = ""
    seconds: float = 0.0


def _start_kproxy(ctx: Context, node: Any, mode: str) -> None:
    if ctx.kproxy_argv:
        ctx.lab.start_kproxy(node, mode, list(ctx.kproxy_argv))
    else:
        ctx.lab.start_kproxy(node, mode)


def _healthz_ok(ctx: Context, node: Any) -> None:
    url = _url(node.ip4, HEALTHZ_PORT, "/healthz")
    r = ctx.http(ctx.external_ns, url)
    ctx.expect(
        getattr(r, "status", None) == 200,
        f"/healthz on {node.name} not 200",
        sent=f"GET {url} from the external client",
        got=f"{getattr(r, 'status', None)} {getattr(r, 'error', '')} {body_of(r)[:200]}",
        expected="200",
    )


def _stdout(res: Any) -> str:
    out = getattr(res, "stdout", res)
    return out.decode(errors="replace") if isinstance(out, bytes) else str(out or "")


def _rc(res: Any) -> int:
    return int(getattr(res, "returncode", 0) or 0)


def _remnants(ctx: Context, mode: str, node: Any) -> list[str]:
    """What ``mode`` left in ``node``'s kernel, by the mode's own ``remnants`` hook reading the kernel through a
    probe into the node. A hook that could not look fails the scenario: "nothing left" must mean "looked"."""
    from kproxy.proxier import backend_class

    hook = getattr(backend_class(mode), "remnants", None)
    if hook is None:
        raise ScenarioFailure(f"mode {mode} has no remnants hook, so what it left in the kernel cannot be checked")
    try:
        return list(hook(ctx.kernel_probe(node, mode)))
    except ScenarioFailure:
        raise
    except Exception as exc:  # BackendError: a tool failed; NotImplementedError: the hook is missing
        raise ScenarioFailure(
            f"could not read what mode {mode} left in {node.name}'s kernel",
            sent=f"{mode}.remnants() through a probe into {node.ns}",
            got=f"{type(exc).__name__}: {exc}",
            expected="a list of leftovers (empty when clean)",
        ) from None


def _started_and_synced(ctx: Context, node: Any, mode: str | None, what: str) -> None:
    """Start kproxy in ``mode`` on ``node`` (None: it was started already) and wait for its first sync. Reaching a
    ClusterIP from the node's pods proves nothing here: with no rules on this node a pod's SYN leaves by the
    default route and the lab's router hands it to node-1, whose rules answer it."""
    if mode is not None:
        _start_kproxy(ctx, node, mode)
    ctx.eventually(lambda: _healthz_ok(ctx, node), timeout=START_WAIT, what=f"kproxy {what}: healthy")
    ctx.eventually(lambda: _synced_since_start(ctx, node), timeout=SYNC_WAIT, what=f"kproxy {what}: first sync")


def cleanup(ctx: Context) -> None:
    from kproxy.proxier import availability, installed_backends

    n1, n2 = _two_nodes(ctx)
    node = n2
    client = ctx.pods_on(n2)[0]
    eps = [ctx.pods_on(n2)[1], ctx.pods_on(n1)[1]]
    svc = ctx.service("clean")
    # an eTP=Local NodePort with an endpoint on the node: the mode's local-policy objects (iptables' KUBE-SVL-,
    # KUBE-EXT-) exist too, so cleanup must remove them as well
    local = ctx.service("clean-local", type="NodePort", externalTrafficPolicy="Local")
    ctx.apply(svc, ctx.slice_for(svc, eps), local, ctx.slice_for(local, [ctx.pods_on(n2)[2]]))
    ip = _cip(svc)
    _wait_reach(ctx, client, ip, 80, only=eps)
    np_local = local["spec"]["ports"][0]["nodePort"]
    _wait_reach(ctx, ctx.external_ns, node.ip4, np_local, only=[ctx.pods_on(n2)[2]])
    before = _remnants(ctx, ctx.mode, node)
    ctx.expect(
        before,
        f"the {ctx.mode} remnant check finds nothing while kproxy {ctx.mode} runs, so its 'nothing left' means nothing",
        sent=f"{ctx.mode}.remnants() in {node.ns} with two services programmed",
        got="[]",
        expected="the running mode's objects",
    )
    ctx.lab.stop_kproxy(node, signal.SIGTERM)
    command = getattr(ctx.lab, "kproxy_command", None)
    argv = [*(command() if command else [_kproxy_bin()]), "cleanup", "--mode", ctx.mode]
    res = ctx.exec(node, argv, timeout=60)
    ctx.expect(
        _rc(res) == 0,
        "kproxy cleanup failed",
        sent=" ".join(argv) + f" in {node.ns}",
        got=f"exit {_rc(res)}: {_stdout(getattr(res, 'stderr', ''))[:300]}",
        expected="exit 0",
    )
    left = _remnants(ctx, ctx.mode, node)
    ctx.expect(
        not left,
        f"{len(left)} things of mode {ctx.mode} remain after kproxy cleanup",
        sent=" ".join(argv) + f" in {node.ns}",
        got="; ".join(left[:8]),
        expected="nothing of the mode left",
    )
    # Nothing programmed: the NodePort is closed on this node (refused). (Not the ClusterIP: with no rules on this
    # node a pod's SYN to it leaves by the default route, and the lab's router hands it to node-1, which has rules.)
    ctx.blocked(ctx.external_ns, node.ip4, np_local, how="refused", count=2, timeout=1.0)
    _started_and_synced(ctx, node, ctx.mode, "restarted after cleanup")
    _wait_reach(ctx, client, ip, 80, only=eps, what=f"kproxy {ctx.mode} restarted after cleanup")
    ctx.reach(client, ip, 80, count=6, only=eps)
    ctx.note(f"kproxy cleanup left nothing of {ctx.mode} (checked {len(before)} objects before)")
    others = [m for m in installed_backends() if m != ctx.mode and availability(m)]
    if not others:
        # nothing exercised it: its own not-applicable row, never part of this pass
        ctx.part_not_applicable_here(
            "another-mode", f"no mode besides {ctx.mode} is installed and available here to start over it"
        )
        return
    tried = []
    try:
        for other in others:
            ctx.lab.stop_kproxy(node, signal.SIGTERM)
            # kproxy removes other modes' leftovers before its first sync, so one that has synced has done it
            # (whether the other mode then proxies correctly is that mode's own conformance run)
            _started_and_synced(ctx, node, other, f"started in mode {other}")
            left = _remnants(ctx, ctx.mode, node)
            ctx.expect(
                not left,
                f"{len(left)} things of mode {ctx.mode} remain after starting mode {other}",
                sent=f"kproxy --mode {ctx.mode} stopped (SIGTERM) and kproxy --mode {other} started in {node.ns}, "
                f"healthy; then the {ctx.mode} remnant check there",
                got="; ".join(left[:8]),
                expected="nothing of the old mode left",
            )
            tried.append(other)
    finally:
        ctx.lab.stop_kproxy(node, signal.SIGTERM)
        _start_kproxy(ctx, node, ctx.mode)
    _started_and_synced(ctx, node, None, "back after the other modes")
    _wait_reach(ctx, client, ip, 80, only=eps, what=f"kproxy {ctx.mode} back after the other modes")
    # ... and the mode it came back in removed what the others left
    for other in tried:
        left = _remnants(ctx, other, node)
        ctx.expect(
            not left,
            f"{len(left)} things of mode {other} remain after switching back to mode {ctx.mode}",
            sent=f"kproxy --mode {other} stopped (SIGTERM) and kproxy --mode {ctx.mode} started in {node.ns}, "
            f"serving {ip}:80 again; then the {other} remnant check there",
            got="; ".join(left[:8]),
            expected=f"nothing of mode {other} left",
        )
    ctx.note(
        f"starting {', '.join(tried)} removed everything of {ctx.mode}, and switching back removed everything of "
        + ", ".join(tried)
    )


REQUIRED_METRICS = (
    "kubeproxy_sync_proxy_rules_duration_seconds",
    "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
    "kubeproxy_network_programming_duration_seconds",
    "kubeproxy_sync_proxy_rules_service_changes_total",
    "kubeproxy_sync_proxy_rules_endpoint_changes_total",
    "kubeproxy_sync_proxy_rules_service_changes_pending",
    "kubeproxy_sync_proxy_rules_endpoint_changes_pending",
    "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
    "kubeproxy_sync_full_proxy_rules_duration_seconds",
    "kubeproxy_sync_partial_proxy_rules_duration_seconds",
    "kubeproxy_proxy_healthz_total",
)


def samples(text: str) -> list[Sample]:
    """Every sample of a Prometheus text exposition, parsed by prometheus_client's own parser (a malformed
    exposition raises ValueError, which the callers turn into a failure saying so)."""
    return [sm for fam in text_string_to_metric_families(text) for sm in fam.samples]


def sample_value(parsed: Sequence[Sample], name: str, **labels: str) -> float | None:
    """The value of the first sample called ``name`` whose labels include ``labels``, or None."""
    for sm in parsed:
        if sm.name == name and all(sm.labels.get(k) == v for k, v in labels.items()):
            return float(sm.value)
    return None


def histogram(parsed: Sequence[Sample], name: str, **labels: str) -> tuple[float, float, dict[float, float]]:
    """(sum, count, {le: cumulative count}) of one histogram series (0s when it has not been observed yet)."""
    buckets = {
        float(sm.labels["le"]): float(sm.value)
        for sm in parsed
        if sm.name == name + "_bucket" and "le" in sm.labels and all(sm.labels.get(k) == v for k, v in labels.items())
    }
    return (
        sample_value(parsed, name + "_sum", **labels) or 0.0,
        sample_value(parsed, name + "_count", **labels) or 0.0,
        buckets,
    )


def _parsed_metrics(ctx: Context, node: Any) -> list[Sample]:
    text = ctx.metrics_text(node)
    try:
        return samples(text)
    except ValueError as exc:
        ctx.fail(
            f"/metrics on {node.name} is not a valid Prometheus exposition: {exc}",
            sent=f"GET http://127.0.0.1:{METRICS_PORT}/metrics in {node.ns}",
            got=text[:300],
            expected="text format 0.0.4",
        )
        raise  # unreachable; fail raises


CONFIGZ_GROUP = "kubeproxy.config.k8s.io"  # upstream's configz registers the KubeProxyConfiguration under it


def configz_problems(body: str, mode: str, node: str) -> list[str]:
    """What is wrong with a /configz body against upstream's: one key, the API group, holding the effective
    KubeProxyConfiguration, whose ``mode`` is the running mode and ``hostnameOverride`` the node's name."""
    try:
        doc = json.loads(body)
    except ValueError:
        return ["not JSON"]
    if not isinstance(doc, dict) or set(doc) != {CONFIGZ_GROUP}:
        return [f"not a JSON object with the one key {CONFIGZ_GROUP!r}"]
    cfg = doc[CONFIGZ_GROUP]
    if not isinstance(cfg, dict):
        return [f"{CONFIGZ_GROUP} is not an object"]
    problems = []
    if cfg.get("mode") != mode:
        problems.append(f"mode {cfg.get('mode')!r}, not {mode!r}")
    if cfg.get("hostnameOverride") != node:
        problems.append(f"hostnameOverride {cfg.get('hostnameOverride')!r}, not {node!r}")
    return problems


_GO_TIME = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)$")


def health_body_problems(doc: Any, path: str) -> list[str]:
    """What is wrong with a /healthz or /livez body against upstream's ProxyHealth JSON: ``lastUpdated`` and
    ``currentTime`` (Go time), ``nodeEligible`` on /healthz only; newer upstream releases add ``healthy`` (bool)
    and ``status`` (per IP family ``{"lastUpdated", "healthy"}``), which are allowed; anything else is not."""
    if not isinstance(doc, dict):
        return ["not a JSON object"]
    problems = []
    required = {"lastUpdated", "currentTime"} | ({"nodeEligible"} if path == "/healthz" else set())
    allowed = required | {"healthy", "status"}
    if missing := required - set(doc):
        problems.append("missing " + ", ".join(sorted(missing)))
    if extra := set(doc) - allowed:
        problems.append("unknown keys " + ", ".join(sorted(extra)))
    if path == "/livez" and "nodeEligible" in doc:
        problems.append("nodeEligible on /livez")
    for key in ("lastUpdated", "currentTime"):
        if key in doc and not _GO_TIME.match(str(doc[key])):
            problems.append(f"{key} {doc[key]!r} is not an RFC 3339 time")
    if path == "/healthz" and doc.get("nodeEligible") is not True:
        problems.append("nodeEligible is not true")
    if "healthy" in doc and not isinstance(doc["healthy"], bool):
        problems.append("healthy is not a boolean")
    status = doc.get("status", {})
    if not isinstance(status, dict) or any(
        fam not in ("IPv4", "IPv6") or not isinstance(v, dict) or set(v) - {"lastUpdated", "healthy"}
        for fam, v in status.items()
    ):
        problems.append("status is not {IPv4|IPv6: {lastUpdated, healthy}}")
    return problems


def _node_eligibility(ctx: Context, node: Any) -> None:
    """Upstream: a Node tainted ToBeDeletedByClusterAutoscaler makes /healthz 503 with nodeEligible false, while
    /livez stays 200; removing the taint makes it 200 again."""
    original = (
        ctx.api_client.sanitize_for_serialization(
            ctx.core.read_node(node.name, _request_timeout=API_TIMEOUT).spec.taints
        )
        or []
    )
    taint = {"key": "ToBeDeletedByClusterAutoscaler", "value": str(int(time.time())), "effect": "NoSchedule"}
    healthz, livez = _url(node.ip4, HEALTHZ_PORT, "/healthz"), _url(node.ip4, HEALTHZ_PORT, "/livez")

    def answers(url: str, status: int, eligible: bool | None) -> None:
        r = ctx.http(ctx.external_ns, url)
        try:
            doc = json.loads(body_of(r))
        except ValueError:
            doc = {}
        ctx.expect(
            getattr(r, "status", None) == status and (eligible is None or doc.get("nodeEligible") is eligible),
            f"{url} on {node.name} with the node {'tainted' if eligible is False else 'untainted'}",
            sent=f"GET {url}",
            got=f"{getattr(r, 'status', None)} {body_of(r).strip()[:200]}",
            expected=f"{status}" + ("" if eligible is None else f" with nodeEligible {str(eligible).lower()}"),
        )

    patch = {"spec": {"taints": [*original, taint]}}
    ctx.core.patch_node(node.name, patch, _content_type="application/merge-patch+json", _request_timeout=API_TIMEOUT)
    try:
        ctx.eventually(lambda: answers(healthz, 503, False), timeout=SYNC_WAIT, what="node tainted for deletion")
        answers(livez, 200, None)
    finally:
        ctx.core.patch_node(
            node.name,
            {"spec": {"taints": original or None}},
            _content_type="application/merge-patch+json",
            _request_timeout=API_TIMEOUT,
        )
    ctx.eventually(lambda: answers(healthz, 200, True), timeout=SYNC_WAIT, what="taint removed")


def servers(ctx: Context) -> None:
    n1, n2 = _two_nodes(ctx)

    def health_bodies() -> None:
        for path in ("/healthz", "/livez"):
            url = _url(n1.ip4, HEALTHZ_PORT, path)
            r = ctx.http(ctx.external_ns, url)
            body = body_of(r)
            try:
                doc = json.loads(body)
            except ValueError:
                doc = None
            ctype = header(r, "Content-Type") or ""
            problems = health_body_problems(doc, path)
            if getattr(r, "status", None) != 200:
                problems.append(f"status {getattr(r, 'status', None)}")
            if not ctype.startswith("application/json"):
                problems.append(f"Content-Type {ctype!r}")
            if header(r, "X-Content-Type-Options") != "nosniff":
                problems.append("no X-Content-Type-Options: nosniff")
            ctx.expect(
                not problems,
                f"{path} is not upstream's: " + "; ".join(problems),
                sent=f"GET {url} from the external client",
                got=f"{getattr(r, 'status', None)} Content-Type={ctype!r} X-Content-Type-Options="
                f"{header(r, 'X-Content-Type-Options')!r} {body.strip()[:300]}",
                expected="200 application/json, nosniff, upstream's ProxyHealth JSON",
            )

    def plain_endpoints() -> None:
        r = ctx.http(n1, f"http://127.0.0.1:{METRICS_PORT}/proxyMode")
        ctx.expect(
            getattr(r, "status", None) == 200 and body_of(r).strip() == ctx.mode,
            "/proxyMode is wrong",
            sent=f"GET http://127.0.0.1:{METRICS_PORT}/proxyMode in {n1.ns}",
            got=f"{getattr(r, 'status', None)} {body_of(r)[:100]!r}",
            expected=f"200 {ctx.mode!r}",
        )
        r = ctx.http(n1, f"http://127.0.0.1:{METRICS_PORT}/configz")
        ctx.expect(
            getattr(r, "status", None) == 200 and configz_problems(body_of(r), ctx.mode, n1.name) == [],
            "/configz is not upstream's: " + "; ".join(configz_problems(body_of(r), ctx.mode, n1.name)),
            sent=f"GET http://127.0.0.1:{METRICS_PORT}/configz in {n1.ns}",
            got=f"{getattr(r, 'status', None)} {body_of(r)[:300]!r}",
            expected=f'200 {{"{CONFIGZ_GROUP}": {{... "mode": "{ctx.mode}", "hostnameOverride": "{n1.name}" ...}}}}',
        )

    def metrics() -> None:
        # A change (service + slice) must move the change counters and the last-sync timestamp, and leave every
        # upstream series in place (labelled series appear once observed, as in upstream's Go client).
        svc_total = "kubeproxy_sync_proxy_rules_service_changes_total"
        ep_total = "kubeproxy_sync_proxy_rules_endpoint_changes_total"
        last_ts = "kubeproxy_sync_proxy_rules_last_timestamp_seconds"
        before = _parsed_metrics(ctx, n1)
        svc_before = sample_value(before, svc_total) or 0.0
        ep_before = sample_value(before, ep_total) or 0.0
        ts_before = sample_value(before, last_ts, ip_family="IPv4") or 0.0
        svc = ctx.service("observed")
        ctx.apply(svc, ctx.slice_for(svc, [ctx.pods_on(n2)[0]]))
        _wait_reach(ctx, ctx.pods_on(n1)[0], _cip(svc), 80)

        def counted() -> None:
            after = _parsed_metrics(ctx, n1)
            problems, got = [], []
            for name, old, new in (
                (svc_total, svc_before, sample_value(after, svc_total) or 0.0),
                (ep_total, ep_before, sample_value(after, ep_total) or 0.0),
                (last_ts + '{ip_family="IPv4"}', ts_before, sample_value(after, last_ts, ip_family="IPv4") or 0.0),
            ):
                got.append(f"{name} {old} -> {new}")
                if not new > old:
                    problems.append(f"{name} did not increase")
            names = {sm.name for sm in after}
            missing = [
                m for m in REQUIRED_METRICS if not names & {m, m + "_total", m + "_bucket", m + "_sum", m + "_count"}
            ]
            if missing:
                problems.append("missing: " + ", ".join(missing))
            if not histogram(after, "kubeproxy_sync_proxy_rules_duration_seconds", ip_family="IPv4")[2]:
                problems.append('kubeproxy_sync_proxy_rules_duration_seconds has no ip_family="IPv4" series')
            ctx.expect(
                not problems,
                "/metrics after creating a Service and its EndpointSlice: " + "; ".join(problems),
                sent=f"GET http://127.0.0.1:{METRICS_PORT}/metrics in {n1.ns}, before and after",
                got="; ".join(got),
                expected="the change counters and the last-sync time increase; all of " + ", ".join(REQUIRED_METRICS),
            )

        ctx.eventually(counted, timeout=5, what="metrics after a change")

    # Independent checks: each runs, and the failure lists every one that failed.
    failures = []
    for check in (health_bodies, lambda: _node_eligibility(ctx, n2), plain_endpoints, metrics):
        try:
            check()
        except ScenarioFailure as exc:
            failures.append(str(exc))
    if failures:
        raise ScenarioFailure(" || ".join(failures))
    ctx.note("/healthz (also 503 for a node tainted for deletion), /livez, /proxyMode, /configz, /metrics as upstream")


def dual_stack(ctx: Context) -> None:
    if not ctx.has_ipv6:
        raise NotApplicable("the lab has no IPv6 addresses")
    n1, n2 = _two_nodes(ctx)
    client = ctx.pods_on(n1)[0]
    guard_ep = [ctx.pods_on(n2)[2]]
    guard = ctx.service("guard")
    ctx.apply(guard, ctx.slice_for(guard, guard_ep))
    gip = _cip(guard)
    _wait_reach(ctx, client, gip, 80, only=guard_ep)
    # traffic through the guard first, so its counters are not zero: a rewrite would then show as counters falling
    ctx.reach(client, gip, 80, count=10, only=guard_ep)
    results: list[Any] = []
    stop = threading.Event()

    def guard_loop() -> None:
        while not stop.is_set() and ctx.remaining() > 3:
            try:
                results.extend(ctx.probe(client, gip, 80, count=1, timeout=1.0).results)
            except Exception as exc:
                results.append(_Err(str(exc)))
            time.sleep(0.2)

    guard_key = f"{ctx.namespace}/guard:tcp/TCP"
    kernel_before: dict[str, list[str]] = {}
    for n in (n1, n2):
        lines = _guard_lines(ctx, n, guard_key)
        if lines is not None:
            kernel_before[n.name] = lines
    if kernel_before:
        counted = [c for ln in kernel_before[n1.name] for c in split_counters(ln)[1]]
        ctx.expect(
            not counted or any(counted),
            f"the guard's counters on {n1.name} are all zero after 11 connections, so a rewrite would not show",
            sent=f"{ctx.mode}.kernel_view(IPv4) on {n1.name}",
            got=" | ".join(kernel_before[n1.name][:6]),
            expected="some counter above zero",
        )
        if not counted:
            ctx.part_not_applicable(
                "kernel-counters",
                f"mode {ctx.mode}'s kernel view carries no counters, so a rewrite of the guard's rules with the same "
                "content cannot be seen (lines that come or go still are)",
            )
    t = threading.Thread(target=guard_loop, daemon=True)
    t.start()
    try:
        eps6 = [ctx.pods_on(n1)[1], ctx.pods_on(n2)[0]]
        v6 = ctx.service("v6only", families=("IPv6",))
        ctx.apply(v6, ctx.slice_for(v6, eps6, family="IPv6"))
        ip6 = _cip(v6, "IPv6")
        _wait_reach(ctx, client, ip6, 80, only=eps6)
        pr = ctx.reach(client, ip6, 80, count=20, only=eps6, all_of=eps6)
        remote = {r.seen_ip for r in pr.ok if answer_is(r, ctx.pods_on(n2)[0].name)}
        ctx.expect(
            ctx.skips("client-ip") or remote == {client.ip6},
            "IPv6: the remote backend did not see the client pod's IPv6 address",
            sent=pr.sent,
            got=f"seen: {sorted(map(str, remote))}",
            expected=client.ip6,
        )
        eps_ds = [ctx.pods_on(n1)[2], ctx.pods_on(n2)[1]]
        ds = ctx.service("dual", families=("IPv4", "IPv6"))
        ctx.apply(ds, ctx.slice_for(ds, eps_ds, family="IPv4"), ctx.slice_for(ds, eps_ds, family="IPv6"))
        for fam in ("IPv4", "IPv6"):
            _wait_reach(ctx, client, _cip(ds, fam), 80, only=eps_ds)
            ctx.reach(client, _cip(ds, fam), 80, count=12, only=eps_ds, all_of=eps_ds)
        ctx.delete_service("v6only")
        ctx.eventually(
            lambda: ctx.blocked(client, ip6, 80, timeout=1.0), timeout=SYNC_WAIT, what="after deleting v6only"
        )
        ctx.reach(client, _cip(ds, "IPv4"), 80, count=4, only=eps_ds)
    finally:
        stop.set()
        t.join(timeout=5)
    for name, before in kernel_before.items():
        node = n1 if name == n1.name else n2
        after = _guard_lines(ctx, node, guard_key) or []
        changes = view_changes(before, after)
        ctx.expect(
            not changes,
            f"the kernel's IPv4 rules of {guard_key} on {name} changed while only IPv6 objects (and another "
            "service's IPv4 half) came and went",
            sent=f"{ctx.mode}.kernel_view(IPv4) on {name} before and after, guard traffic every 0.2 s throughout",
            got="; ".join(changes[:6]),
            expected="the same lines, counters only rising",
        )
    bad = [r for r in results if not getattr(r, "ok", False)]
    ctx.expect(
        results and not bad,
        "IPv4 traffic was disturbed while IPv6 objects came and went",
        sent=f"TCP {client.name} -> {gip}:80 every 0.2 s throughout",
        got=Probe(client.name, "tcp", gip, 80, results).summary(),
        expected="every probe answered",
    )
    ctx.note(
        f"IPv6-only and dual-stack reached on both families; {len(results)} IPv4 guard probes all answered"
        + (f"; the guard's kernel rules untouched on {', '.join(kernel_before)}" if kernel_before else "")
    )


def _guard_lines(ctx: Context, node: Any, key: str) -> list[str] | None:
    """The guard's IPv4 lines in ``node``'s kernel (None, reported as a not-applicable part, when the mode has no
    kernel view); the view must hold the guard, or the comparison would pass vacuously."""
    view = kernel_view(ctx, node, "IPv4")
    if view is None:
        if not any(p == "kernel-rules" for p, _ in ctx.parts):
            ctx.part_not_applicable("kernel-rules", f"mode {ctx.mode} has no kernel view to compare")
        return None
    ctx.expect(
        view.get(key),
        f"the kernel view on {node.name} has no lines for {key}",
        sent=f"{ctx.mode}.kernel_view(IPv4) through a probe into {node.ns}",
        got=f"{len(view)} service ports: {', '.join(sorted(view)[:10])}",
        expected=f"lines for {key}",
    )
    return view[key]


def answer_is(result: Any, pod: str) -> bool:
    return bool(getattr(result, "ok", False)) and (getattr(result, "reply", "") or "").split()[:1] == [pod]


SCALE_SERVICES = 1000
SCALE_ENDPOINTS = 3
SCALE_SAMPLE = 50
SCALE_CONVERGE_S = 30.0
SYNC_METRIC = "kubeproxy_sync_proxy_rules_duration_seconds"
# The syncs on node-1 while the 1,000 services x 3 endpoints arrive are judged against the mode's *floor*: the
# kernel's own time to take the whole 1,000 x 3 state at once by the most direct means (``kproxy bench sync``'s
# ``floor_s``, measured in the same run, in a namespace of the bench's own). Each sync programs a slice of that
# state, so their mean must not exceed SCALE_MEAN_FLOOR_FACTOR x floor and none may exceed SCALE_MAX_FLOOR_FACTOR
# x floor, read off the histogram's buckets (edges 1 ms x 2^n) as "every sync <= the first edge at or above the
# bound". Both bounds have a minimum (SCALE_MAX_MIN_S, SCALE_MEAN_MIN_S): a mode whose floor is a few ms (bpf's map
# writes) still pays the lab's per-sync Python work and an occasional collection or GIL wait on shared cores,
# which says nothing about the backend. The runs these values were chosen from: docs/PERFORMANCE.md.
# A mode whose floor cannot be measured (``floor_s`` null) is held to the absolute SCALE_*_DEFAULT_S, and says so.
#
# Those time bounds leave room for the shared cores (2.5-10x), so a backend that rewrote its whole table on every
# sync would still pass them: at 1,000 services a whole nftables table is ~0.1 s and bpf's maps ~0.005 s, inside
# the noise of a loaded lab. What such a backend changes beyond doubt is how much each sync writes, and that count
# does not depend on the machine's load:
# - the services written in the window (kproxy_sync_services_written_total: the ledger's per-service deltas of
#   every successful sync) must not exceed SCALE_WRITES_PER_SERVICE x the services written to the API. Each service
#   is written at most twice by an incremental proxy (its Service, then its EndpointSlice, when they land in two
#   syncs); a proxy that rewrites everything writes the table as it stands at every sync: ~syncs x N / 2 (17-550
#   syncs here, so 8,500-275,000 against a bound of 3,000);
# - at most SCALE_FULL_SYNCS_MAX full syncs (kubeproxy_sync_full_proxy_rules_duration_seconds' count): a backend
#   that asks for a full sync after every sync (need_full) writes little through the ledger, but reads and renders
#   the whole state each time. One is allowed: a failed sync's recovery is a full sync, and not this scenario's
#   question.
# The total time the node spent syncing is reported beside the bench's full sync of the final state (``total / full``
# in the figures), as an order of magnitude; the sharp time check of one change is the bench's partial_sync_s /
# full_sync_s (kproxy.bench.sync.PARTIAL_RATIO_MAX at 10,000 services).
SCALE_WRITES_PER_SERVICE = 3
SCALE_FULL_SYNCS_MAX = 1
WRITTEN_METRIC = "kproxy_sync_services_written_total"
FULL_SYNC_METRIC = "kubeproxy_sync_full_proxy_rules_duration_seconds"
SCALE_MEAN_FLOOR_FACTOR = 1.0
SCALE_MAX_FLOOR_FACTOR = 8.0
SCALE_MAX_MIN_S = 0.25
SCALE_MEAN_MIN_S = 0.016
SCALE_MEAN_DEFAULT_S = 0.5
SCALE_MAX_DEFAULT_S = 4.0


def measure_floor(ctx: Context) -> tuple[float | None, float | None]:
    """``floor_s`` and ``full_sync_s`` of ``kproxy bench sync --mode MODE`` at SCALE_SERVICES x SCALE_ENDPOINTS (a
    few seconds; the bench makes and removes its own namespace). None for a figure the mode does not have; a bench
    that fails fails the scenario (its bound would otherwise be guessed)."""
    command = getattr(ctx.lab, "kproxy_command", None)
    argv = [*(command() if command else [_kproxy_bin()]), "bench", "sync", "--mode", ctx.mode]
    argv += ["--services", str(SCALE_SERVICES), "--endpoints", str(SCALE_ENDPOINTS), "--repeat", "1"]
    argv += ["--format", "json"]
    ctx.check_deadline("measuring the floor")
    doc: Any = None
    try:
        res = subprocess.run(argv, capture_output=True, text=True, timeout=min(120.0, ctx.remaining()), check=False)
        err = f"exit {res.returncode}: {res.stderr.strip()[-300:]}"
        doc = json.loads(res.stdout) if res.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, ValueError) as exc:
        err = f"{type(exc).__name__}: {exc}"
    if not isinstance(doc, dict):
        ctx.fail(
            f"could not measure the {ctx.mode} floor the sync bounds are relative to",
            sent=" ".join(argv),
            got=err,
            expected="exit 0 and the bench's JSON",
        )
        raise AssertionError("unreachable")
    floor, full = doc.get("floor_s"), doc.get("full_sync_s")
    return (
        float(floor) if isinstance(floor, (int, float)) and floor > 0 else None,
        float(full) if isinstance(full, (int, float)) and full > 0 else None,
    )


def judge_syncs(
    ctx: Context,
    before: Sequence[Sample],
    after: Sequence[Sample],
    floor: float | None,
    *,
    node: str = "node-1",
    sent: str = "",
    services: int = SCALE_SERVICES,
    full_s: float | None = None,
) -> str:
    """The verdict on node-1's IPv4 syncs between two reads of /metrics (parsed) while ``services`` services were
    written: at least one sync, the mean within the mean bound, every sync within the max bound (see
    SCALE_MEAN_FLOOR_FACTOR), at most SCALE_WRITES_PER_SERVICE x ``services`` services written and at most
    SCALE_FULL_SYNCS_MAX full syncs (see SCALE_WRITES_PER_SERVICE). ``full_s``: the bench's full sync of the final
    state, for the figures. Returns the figures."""
    b_sum, b_count, b_buckets = histogram(before, SYNC_METRIC, ip_family="IPv4")
    a_sum, a_count, a_buckets = histogram(after, SYNC_METRIC, ip_family="IPv4")
    syncs = a_count - b_count
    mean = (a_sum - b_sum) / syncs if syncs else 0.0
    written = _grown(ctx, before, after, WRITTEN_METRIC)
    fulls = (
        histogram(after, FULL_SYNC_METRIC, ip_family="IPv4")[1]
        - histogram(before, FULL_SYNC_METRIC, ip_family="IPv4")[1]
    )
    if floor is not None:
        mean_bound = max(SCALE_MEAN_FLOOR_FACTOR * floor, SCALE_MEAN_MIN_S)
        max_target = max(SCALE_MAX_FLOOR_FACTOR * floor, SCALE_MAX_MIN_S)
        basis = f"floor {floor:.3f} s (kproxy bench sync, {SCALE_SERVICES} x {SCALE_ENDPOINTS})"
    else:
        mean_bound, max_target = SCALE_MEAN_DEFAULT_S, SCALE_MAX_DEFAULT_S
        basis = f"no floor measurable for {ctx.mode}: default bounds"
    edges = sorted(a_buckets)
    grown = {le: a_buckets[le] - b_buckets.get(le, 0.0) for le in edges}
    # the longest sync lies in (lower, longest]: the first bucket holding every sync, and the one before
    longest = next((le for le in edges if grown[le] >= syncs), float("inf"))
    lower = max((le for le in edges if le < longest), default=0.0)
    max_bound = next((le for le in edges if le >= max_target), float("inf"))
    total = a_sum - b_sum
    figures = (
        f"{syncs:.0f} IPv4 syncs on {node}, mean {mean:.3f} s, longest in ({lower:g}, {longest:g}] s, "
        f"{written:.0f} services written ({written / max(services, 1):.2f} per service), {fulls:.0f} full, "
        f"{total:.2f} s in all"
        + (f" ({total / full_s:.1f} x the bench's full sync, {full_s:.3f} s)" if full_s else "")
        + f" ({SYNC_METRIC}_bucket/_sum/_count, {WRITTEN_METRIC}, {FULL_SYNC_METRIC}_count before and after); {basis}"
    )
    writes_bound = SCALE_WRITES_PER_SERVICE * services
    expected = (
        f"at least one sync, mean <= {mean_bound:.3f} s, every sync <= {max_bound:g} s (the bucket edge at or above "
        f"{max_target:.3f} s), at most {writes_bound} services written for {services} services, at most "
        f"{SCALE_FULL_SYNCS_MAX} full sync"
    )
    ctx.expect(syncs >= 1, "no sync was observed", sent=sent, got=figures, expected=expected)
    ctx.expect(
        written <= writes_bound,
        f"the syncs wrote {written:.0f} services for {services} written to the API: the table is rewritten, not "
        "changed",
        sent=sent,
        got=figures,
        expected=expected,
    )
    ctx.expect(
        fulls <= SCALE_FULL_SYNCS_MAX,
        f"{fulls:.0f} full syncs while services were written",
        sent=sent,
        got=figures,
        expected=expected,
    )
    ctx.expect(
        mean <= mean_bound,
        f"the mean sync took {mean:.3f} s, over {mean_bound:.3f} s",
        sent=sent,
        got=figures,
        expected=expected,
    )
    ctx.expect(
        longest <= max_bound,
        f"a sync took longer than {max_bound:g} s",
        sent=sent,
        got=figures,
        expected=expected,
    )
    return figures


def _grown(ctx: Context, before: Sequence[Sample], after: Sequence[Sample], name: str) -> float:
    """How much the IPv4 counter ``name`` grew between the two reads; a counter missing from either fails."""
    b, a = sample_value(before, name, ip_family="IPv4"), sample_value(after, name, ip_family="IPv4")
    if a is None or b is None:
        ctx.fail(f"{name} is missing from /metrics", got=f"before {b}, after {a}", expected="an IPv4 series")
        raise AssertionError("unreachable")
    return a - b


def scale_smoke(ctx: Context) -> None:
    n1, _ = _two_nodes(ctx)
    client = ctx.pods_on(n1)[0]
    others = [p for p in ctx.pods if p.name != client.name]
    seed = random.randrange(1 << 30)
    rnd = random.Random(seed)
    metrics_url = f"http://127.0.0.1:{METRICS_PORT}/metrics in {n1.ns}"
    floor, full_s = measure_floor(ctx)
    before = _parsed_metrics(ctx, n1)
    plan = []
    for i in range(SCALE_SERVICES):
        svc = ctx.service(f"s{i:04d}")
        plan.append((svc, rnd.sample(others, SCALE_ENDPOINTS)))
    objs = [o for svc, eps in plan for o in (svc, ctx.slice_for(svc, eps))]
    try:
        t0 = ctx.now()
        with ThreadPoolExecutor(max_workers=8) as pool:
            list(pool.map(lambda o: ctx.apply(o), objs))
        t_written = ctx.now()
        sample = rnd.sample(plan, SCALE_SAMPLE)
        reached: dict[str, float] = {}

        def reach_one(item: tuple[dict[str, Any], list[Any]]) -> None:
            svc, eps = item
            ctx.eventually(
                lambda: ctx.reach(client, _cip(svc), 80, count=1, timeout=0.5, only=eps),
                timeout=SCALE_CONVERGE_S,
                interval=0.5,
                what=f"sample service {svc['metadata']['name']} ({_cip(svc)}:80, written "
                f"{ctx.now() - t_written:.1f} s before giving up)",
            )
            reached[svc["metadata"]["name"]] = ctx.now() - t_written

        with ThreadPoolExecutor(max_workers=4) as pool:
            list(pool.map(reach_one, sample))
        slowest = max(reached, key=reached.__getitem__)
        ctx.expect(
            reached[slowest] <= SCALE_CONVERGE_S,
            f"the sample became reachable only {reached[slowest]:.1f} s after the last write (slowest: {slowest})",
            sent=f"{SCALE_SAMPLE} TCP probes from {client.name}, one per sampled service (seed {seed})",
            got=f"slowest {slowest} reachable after {reached[slowest]:.1f} s",
            expected=f"all reachable within {SCALE_CONVERGE_S:.0f} s",
        )
        # The sample answering does not mean node-1 has synced every write (the sync carrying the last ones may
        # still run): a service written after all of them answering does, and its sync is then observed too.
        _barrier(ctx, n1)
        after = _parsed_metrics(ctx, n1)
    finally:
        # Deleted here, in parallel: the runner empties a namespace one object at a time, which for 2,000 objects
        # could push the test past pytest's timeout.
        with ThreadPoolExecutor(max_workers=8) as pool:
            list(pool.map(lambda item: ctx.delete("Service", item[0]["metadata"]["name"]), plan))
            list(pool.map(lambda item: ctx.delete("EndpointSlice", item[0]["metadata"]["name"] + "-v4"), plan))
    figures = judge_syncs(
        ctx,
        before,
        after,
        floor,
        node=n1.name,
        full_s=full_s,
        sent=f"{SCALE_SERVICES} Services + EndpointSlices ({SCALE_ENDPOINTS} endpoints each), then a barrier "
        f"service; GET {metrics_url} before and after",
    )
    ctx.note(
        f"{SCALE_SERVICES} services x {SCALE_ENDPOINTS} endpoints written in {t_written - t0:.1f} s; sample of "
        f"{SCALE_SAMPLE} (seed {seed}) all reachable {reached[slowest]:.1f} s after the last write (slowest "
        f"{slowest}); {figures}"
    )


# --------------------------------------------------------------------------------------------------------------
# The table: BEHAVIOUR.md's order.
# --------------------------------------------------------------------------------------------------------------


SWITCH_STEADY_S = 2.0  # seconds of traffic after each switch's first sync


def mode_switch(ctx: Context) -> None:
    """``kproxy run --mode B`` replaces a running ``--mode A`` on a node, under traffic, for every other available
    mode B whose established connections outlive the process (and back to A): held TCP connections through a
    ClusterIP (pod on the node) and a NodePort (external client to the node) stay open, no new connection fails
    (kproxy removes A's leftovers only once B's rules are in: there is no start-up gap to forgive), and nothing of A
    remains once B has synced. A mode A whose connections are its own process's sockets declares the held
    connections, and new connections from A's stop until B's first sync, not applicable; the rest is judged."""
    from kproxy.proxier import available_backends

    others = [m for m, cls in available_backends().items() if m != ctx.mode and cls.survives_restart]
    if not others:
        raise NotApplicableHere(f"no mode besides {ctx.mode} (whose connections outlive the process) is available here")
    n1, n2 = _two_nodes(ctx)
    node = n2
    client = ctx.pods_on(n2)[0]
    eps = [ctx.pods_on(n1)[0]]  # on the other node: the node's rules carry both connections
    svc = ctx.service("switch", type="NodePort")
    ctx.apply(svc, ctx.slice_for(svc, eps))
    ip = _cip(svc)
    np_ = svc["spec"]["ports"][0]["nodePort"]
    _wait_reach(ctx, client, ip, 80, only=eps)
    _wait_reach(ctx, ctx.external_ns, node.ip4, np_, only=eps)
    switches = [m for other in others for m in (other, ctx.mode)]  # A -> B -> A for every B
    budget = max(20.0, ctx.remaining() - 15)
    holds = {}
    if not ctx.skips("held-connections"):
        holds = {
            "ClusterIP": ctx.lab.hold(client.ns, ip, 80, budget, HOLD_INTERVAL),
            "NodePort": ctx.lab.hold(ctx.external_ns, node.ip4, np_, budget, HOLD_INTERVAL),
        }
    targets = {"ClusterIP": (client, ip, 80), "NodePort": (ctx.external_ns, node.ip4, np_)}
    probes: list[tuple[str, str, Probe]] = []
    phase = [f"{ctx.mode} running"]
    stop = threading.Event()

    def keep_probing() -> None:
        while not stop.is_set() and ctx.remaining() > 5:
            for what, (src, host, port) in targets.items():
                try:
                    probes.append((phase[0], what, ctx.probe(src, host, port, count=1, timeout=1.0)))
                except Exception as exc:  # recorded, judged below
                    probes.append((phase[0], what, Probe(str(src), "tcp", host, port, [_Err(str(exc))])))
            time.sleep(0.2)

    prober = threading.Thread(target=keep_probing, daemon=True)
    prober.start()
    results: dict[str, list[Any]] = {}
    try:
        time.sleep(1.0)
        previous = ctx.mode
        for mode in switches:
            phase[0] = f"{previous} -> {mode}: starting"
            ctx.lab.stop_kproxy(node, signal.SIGTERM)
            _started_and_synced(ctx, node, mode, f"started in mode {mode} over {previous}")
            phase[0] = f"{previous} -> {mode}: {mode} running"
            left = _remnants(ctx, previous, node)
            ctx.expect(
                not left,
                f"{len(left)} things of mode {previous} remain after mode {mode} started and synced",
                sent=f"kproxy --mode {previous} stopped (SIGTERM), --mode {mode} started in {node.ns} and synced",
                got="; ".join(left[:8]),
                expected=f"nothing of {previous} left",
            )
            time.sleep(SWITCH_STEADY_S)
            previous = mode
    finally:
        stop.set()
        prober.join(timeout=5)
        for what, proc in holds.items():
            results[what] = list(ctx.lab.finish_hold(proc, stop=True, timeout=30))
        if not ctx.lab.kproxy_running(node):  # a failure half-way: leave the node in the session's mode
            _start_kproxy(ctx, node, ctx.mode)
    for what, held in results.items():
        src, host, port = targets[what]
        ctx.expect(
            held and all(getattr(r, "ok", False) for r in held),
            f"the established {what} connection broke across the mode switches",
            sent=f"one TCP connection {src} -> {hostport(host, port)}, an exchange every {HOLD_INTERVAL} s, through "
            f"the switches {ctx.mode} -> " + " -> ".join(switches) + f" on {node.name}",
            got=Probe(str(src), "tcp", host, port, held).summary(),
            expected="every exchange answered",
        )
    down = ctx.skips("while-down")  # from A's stop until B's first sync nothing of A's answers: not judged
    judged = [
        (ph, what, p)
        for ph, what, p in probes
        if not (down and ph.startswith(f"{ctx.mode} -> ") and ph.endswith(": starting"))
    ]
    failed = [(ph, what, p) for ph, what, p in judged if not all(getattr(r, "ok", False) for r in p.results)]
    if ctx.skips("hand-over-reset"):  # declared: at most one reset per target as the mode takes over
        taking_over = f"-> {ctx.mode}: {ctx.mode} running"
        first: set[tuple[str, str]] = set()
        kept = []
        for ph, what, p in failed:
            refused = all("refused" in str(getattr(r, "error", "") or r) for r in p.results if not r.ok)
            if ph.endswith(taking_over) and refused and (ph, what) not in first:
                first.add((ph, what))
                continue
            kept.append((ph, what, p))
        failed = kept
    ctx.expect(
        judged and not failed,
        f"{len(failed)} of {len(judged)} new connections judged failed during the mode switches",
        sent="new TCP connections to the ClusterIP (from the node's pod) and the NodePort (from outside) every ~0.2 s",
        got="; ".join(f"{ph} {what}: {p.summary()}" for ph, what, p in failed[:6]),
        expected="all answered, in every phase",
    )
    ctx.note(
        f"{len(switches)} switches ({ctx.mode} -> "
        + " -> ".join(switches)
        + "): "
        + (
            f"held ClusterIP and NodePort connections {', '.join(str(len(v)) for v in results.values())} exchanges "
            "each all answered; "
            if holds
            else ""
        )
        + f"{len(judged)} new connections answered"
        + (f" ({len(probes) - len(judged)} made while {ctx.mode} was down not judged)" if down else "")
    )


SCENARIOS: tuple[Scenario, ...] = (
    Scenario("clusterip-tcp", "pod -> ClusterIP:port over TCP, 3 endpoints on 2 nodes", clusterip_tcp),
    Scenario("clusterip-udp", "the same over UDP", clusterip_udp),
    Scenario("multiport", "two ports with named targetPorts to different container ports", multiport),
    Scenario("same-port-two-protocols", "TCP and UDP on one port number (and one NodePort)", same_port_two_protocols),
    Scenario("nodeport", "external client, pod and node itself -> node IP:nodePort", nodeport),
    Scenario("externalip", "external client -> externalIP:port", externalip),
    Scenario("loadbalancer", "LB ingress IP with loadBalancerSourceRanges allowing / denying", loadbalancer),
    Scenario("no-endpoints-reject", "no endpoints: TCP refused fast, UDP port-unreachable", no_endpoints_reject),
    Scenario(
        "session-affinity",
        "ClientIP affinity on (kept while another endpoint goes), off, and with a short timeout",
        session_affinity,
        timeout_s=90,
    ),
    Scenario("source-ip", "pod -> ClusterIP -> pod on another node sees the client pod's IP", source_ip),
    Scenario("hairpin", "pod -> its own service, itself the only endpoint", hairpin),
    Scenario(
        "etp-local",
        "externalTrafficPolicy=Local: NodePorts, LB IP, health check node port",
        etp_local,
        timeout_s=90,
        parts=frozenset({"client-ip"}),
    ),
    Scenario("itp-local", "internalTrafficPolicy=Local", itp_local),
    Scenario("terminating-fallback", "all endpoints terminating: serving, then not serving", terminating_fallback),
    Scenario("lifecycle", "create, delete, recreate a service; others untouched", lifecycle),
    Scenario(
        "address-collision",
        "an externalIP claiming another service's ClusterIP: the owner keeps it through full syncs and restarts",
        address_collision,
        timeout_s=120,
        parts=frozenset({"while-down"}),
    ),
    Scenario("endpoint-churn", "3 -> 1 -> 5 endpoints, each within 2 s", endpoint_churn),
    Scenario("port-update", "change a service's port in place", port_update),
    Scenario(
        "ignored-services",
        "service-proxy-name and headless labels, headless, ExternalName",
        ignored_services,
        parts=frozenset({"kernel-rules"}),
    ),
    Scenario(
        "udp-conntrack",
        "UDP from a fixed source port, and one long-lived connected UDP socket, follow a replaced backend within 2 s",
        udp_conntrack,
        timeout_s=90,
        parts=frozenset({"stale-entry"}),
    ),
    Scenario(
        "restart",
        "kproxy killed and restarted during traffic",
        restart,
        timeout_s=90,
        parts=frozenset({"held-connection", "while-down"}),
    ),
    Scenario("cleanup", "kproxy cleanup, and starting another mode", cleanup, timeout_s=150),
    Scenario(
        "mode-switch",
        "another mode replaces the running one under traffic, and back",
        mode_switch,
        timeout_s=200,
        parts=frozenset({"held-connections", "while-down", "hand-over-reset"}),
    ),
    Scenario("servers", "/healthz, /livez, /metrics, /proxyMode, /configz", servers),
    Scenario(
        "dual-stack",
        "IPv6-only and dual-stack services",
        dual_stack,
        needs=frozenset({"ipv6"}),
        timeout_s=90,
        parts=frozenset({"client-ip", "kernel-counters", "kernel-rules"}),
    ),
    Scenario(
        "scale-smoke", "1,000 services x 3 endpoints; a random sample of 50 reachable", scale_smoke, timeout_s=280
    ),
)

SCENARIO_IDS: tuple[str, ...] = tuple(s.id for s in SCENARIOS)
BY_ID: dict[str, Scenario] = {s.id: s for s in SCENARIOS}
assert len(BY_ID) == len(SCENARIOS), "scenario ids must be unique"
