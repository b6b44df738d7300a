"""Conformance scenarios, the basic paths: ClusterIP over TCP and UDP, several ports, NodePort, localhost NodePort,
externalIP, load balancer source ranges, rejection without endpoints, session affinity, the client's source address
and hairpin.

The spec is docs/BEHAVIOUR.md's scenario table; ``kproxy.conformance.scenarios`` fixes the order.
"""

from __future__ import annotations

from typing import Any

from kproxy.conformance.checks import judge_outside_reject
from kproxy.conformance.context import Context
from kproxy.conformance.registry import scenario
from kproxy.conformance.steps import SYNC_WAIT, barrier, cip, started_and_synced, stdout_of, two_nodes, wait_reach
from kproxy.conformance.values import Probe, ScenarioFailure, hostport


@scenario("clusterip-tcp", "pod -> ClusterIP:port over TCP, 3 endpoints on 2 nodes")
def clusterip_tcp(ctx: Context) -> None:
    n1, n2 = two_nodes(ctx)
    client = ctx.pods_on(n1)[0]
    eps = [ctx.pods_on(n1)[1], ctx.pods_on(n2)[0], ctx.pods_on(n2)[1]]
    svc = ctx.service("web")
    ctx.apply(svc, ctx.slice_for(svc, eps))
    ip = cip(svc)
    wait_reach(ctx, client, ip, 80, only=eps)
    pr = ctx.reach(client, ip, 80, count=60, only=eps, all_of=eps)
    ctx.note(pr.summary())


@scenario("clusterip-udp", "the same over UDP")
def clusterip_udp(ctx: Context) -> None:
    n1, n2 = two_nodes(ctx)
    client = ctx.pods_on(n1)[0]
    eps = [ctx.pods_on(n1)[1], ctx.pods_on(n2)[0], ctx.pods_on(n2)[1]]
    svc = ctx.service("dns", [ctx.port(53, 8080, name="udp", protocol="UDP")])
    ctx.apply(svc, ctx.slice_for(svc, eps))
    ip = cip(svc)
    wait_reach(ctx, client, ip, 53, "udp", only=eps)
    pr = ctx.reach(client, ip, 53, "udp", count=60, only=eps, all_of=eps)
    ctx.note(pr.summary())


@scenario("multiport", "two ports with named targetPorts to different container ports")
def multiport(ctx: Context) -> None:
    n1, n2 = two_nodes(ctx)
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
    ip = cip(svc)
    for port, container in ((80, 8081), (81, 9000)):
        wait_reach(ctx, client, ip, port, only=eps)
        pr = ctx.probe(client, ip, port, count=8, timeout=1.0, payload="info")
        ports = {getattr(r, "local_port", None) for r in pr.ok}
        ctx.expect(
            not pr.failed and ports == {container},
            f"service port {port} did not reach container port {container}",
            sent=pr.sent + " with payload 'info'",
            got=pr.summary() + f"; container ports seen: {sorted(map(str, ports))}",
            expected=f"every answer from port {container}",
        )


@scenario("same-port-two-protocols", "TCP and UDP on one port number (and one NodePort)")
def same_port_two_protocols(ctx: Context) -> None:
    n1, n2 = two_nodes(ctx)
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
    ip = cip(svc)
    checks = [(client, ip, 80, 80), (ctx.external_ns, n1.ip4, np_, np_udp)]
    for src, host, tcp_port, udp_port in checks:
        for kind, container in (("tcp", 8080), ("udp", 8081)):
            port = tcp_port if kind == "tcp" else udp_port
            wait_reach(ctx, src, host, port, kind, only=eps)
            pr = ctx.probe(src, host, port, kind, count=4, payload="info")
            seen = {(getattr(r, "local_port", None), (r.reply.split() + [""] * 5)[4]) for r in pr.ok}
            ctx.expect(
                not pr.failed and seen == {(container, f"proto={kind}")},
                f"{kind.upper()} to {hostport(host, port)} did not reach the {kind.upper()} listener on {container}",
                sent=pr.sent + " with payload 'info'",
                got=pr.summary() + f"; listeners seen: {sorted(map(str, seen))}",
                expected=f"every answer from {kind} port {container}",
            )


@scenario("nodeport", "external client, pod and node itself -> node IP:nodePort")
def nodeport(ctx: Context) -> None:
    n1, n2 = two_nodes(ctx)
    client = ctx.pods_on(n1)[0]
    eps = [ctx.pods_on(n1)[1], ctx.pods_on(n2)[1]]
    svc = ctx.service("np", type="NodePort")
    ctx.apply(svc, ctx.slice_for(svc, eps))
    np_ = svc["spec"]["ports"][0]["nodePort"]
    for node in (n1, n2):
        wait_reach(ctx, ctx.external_ns, node.ip4, np_, only=eps)
        ctx.reach(ctx.external_ns, node.ip4, np_, count=6, only=eps)
        ctx.reach(client, node.ip4, np_, count=3, only=eps)
        ctx.reach(node, node.ip4, np_, count=3, only=eps)
    ctx.note(f"nodePort {np_}: external client, pod and node itself reached both nodes")


LOCALHOST = "127.0.0.1"


@scenario(
    "localhost-nodeport",
    "the node itself -> 127.0.0.1:nodePort (TCP, UDP); off with --iptables-localhost-nodeports=false or a "
    "--nodeport-addresses without loopback",
    timeout_s=180,
)
def localhost_nodeport(ctx: Context) -> None:
    n1, n2 = two_nodes(ctx)
    eps = [ctx.pods_on(n1)[1], ctx.pods_on(n2)[1]]
    svc = ctx.service(
        "lnp",
        [ctx.port(80, 8080, name="tcp", protocol="TCP"), ctx.port(53, 8080, name="udp", protocol="UDP")],
        type="NodePort",
    )
    ctx.apply(svc, ctx.slice_for(svc, eps))
    np_tcp, np_udp = (p["nodePort"] for p in svc["spec"]["ports"])
    # upstream's default (localhostNodePorts true, no --nodeport-addresses): the node's own processes reach it
    wait_reach(ctx, n1, LOCALHOST, np_tcp, only=eps, what=f"{LOCALHOST}:{np_tcp} from {n1.name} itself")
    ctx.reach(n1, LOCALHOST, np_tcp, count=6, only=eps)
    wait_reach(ctx, n1, LOCALHOST, np_udp, "udp", only=eps)
    ctx.reach(n1, LOCALHOST, np_udp, "udp", count=4, only=eps)
    try:
        for extra in (["--iptables-localhost-nodeports=false"], ["--nodeport-addresses", f"{n1.ip4}/32"]):
            _restart_with(ctx, n1, extra)
            wait_reach(ctx, n1, n1.ip4, np_tcp, only=eps, what=f"{n1.ip4}:{np_tcp} after a restart with {extra}")
            ctx.blocked(n1, LOCALHOST, np_tcp, how="refused", count=2)
    finally:
        _restart_with(ctx, n1, [])
    wait_reach(ctx, n1, LOCALHOST, np_tcp, only=eps, what="localhost NodePort back with the default flags")
    ctx.note(
        f"{LOCALHOST}:{np_tcp}/TCP and :{np_udp}/UDP answered on {n1.name} itself; refused with "
        "--iptables-localhost-nodeports=false and with --nodeport-addresses of the node's address alone"
    )


def _restart_with(ctx: Context, node: Any, extra: list[str]) -> None:
    """kproxy on ``node`` stopped and started again with the suite's arguments plus ``extra``; waits for its sync."""
    ctx.lab.stop_kproxy(node)
    ctx.lab.start_kproxy(node, ctx.mode, [*ctx.kproxy_argv, *extra])
    started_and_synced(ctx, node, None, f"restarted with {' '.join(extra) or 'its usual flags'}")


@scenario("externalip", "external client -> externalIP:port")
def externalip(ctx: Context) -> None:
    n1, n2 = two_nodes(ctx)
    eps = [ctx.pods_on(n1)[1], ctx.pods_on(n2)[1]]
    ext = ctx.addresses.external_ip()
    svc = ctx.service("ext", externalIPs=[ext])
    ctx.apply(svc, ctx.slice_for(svc, eps))
    wait_reach(ctx, ctx.external_ns, ext, 80, only=eps)
    ctx.reach(ctx.external_ns, ext, 80, count=10, only=eps)


@scenario("loadbalancer", "LB ingress IP with loadBalancerSourceRanges allowing / denying")
def loadbalancer(ctx: Context) -> None:
    n1, n2 = two_nodes(ctx)
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
    wait_reach(ctx, ctx.external_ns, allowed_ip, 80, only=eps)
    ctx.reach(ctx.external_ns, allowed_ip, 80, count=6, only=eps)
    ctx.blocked(ctx.external_ns, denied_ip, 80, count=2, timeout=1.0)
    # The denial must come from the source ranges, not from the LB IP being unprogrammed: open it up.
    denied["spec"]["loadBalancerSourceRanges"] = [client_cidr]
    ctx.apply(denied)
    ctx.set_lb_ingress("lb-denied", [denied_ip])
    wait_reach(ctx, ctx.external_ns, denied_ip, 80, only=eps, what="after allowing the client's range")


@scenario("no-endpoints-reject", "no endpoints: TCP refused fast, UDP port-unreachable")
def no_endpoints_reject(ctx: Context) -> None:
    n1, _ = two_nodes(ctx)
    client = ctx.pods_on(n1)[0]
    udp_client = ctx.pods_on(n1)[1]
    svc = ctx.service("empty", [ctx.port(80, 8080, name="tcp"), ctx.port(80, 8080, name="udp", protocol="UDP")])
    ctx.apply(svc, ctx.slice_for(svc, []))  # the controller writes an empty slice for a service with no pods
    ip = cip(svc)
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


def _icmp_counters(ctx: Context, node: Any) -> dict[str, int]:
    """The node's ICMP SNMP counters (nstat: absolute, without touching nstat's history file)."""
    res = ctx.exec(node, ["nstat", "-asz"], timeout=10)
    out: dict[str, int] = {}
    for line in stdout_of(res).splitlines():
        words = line.split()
        if len(words) >= 2 and words[0].startswith("Icmp") and words[1].isdigit():
            out[words[0]] = int(words[1])
    return out


@scenario(
    "session-affinity",
    "ClientIP affinity on (kept while another endpoint goes), off, and with a short timeout",
    timeout_s=90,
)
def session_affinity(ctx: Context) -> None:
    n1, n2 = two_nodes(ctx)
    client = ctx.pods_on(n1)[0]
    eps = [ctx.pods_on(n1)[1], ctx.pods_on(n2)[0], ctx.pods_on(n2)[1]]
    svc = ctx.service(
        "sticky", sessionAffinity="ClientIP", sessionAffinityConfig={"clientIP": {"timeoutSeconds": 10800}}
    )
    ctx.apply(svc, ctx.slice_for(svc, eps))
    ip = cip(svc)
    wait_reach(ctx, client, ip, 80, only=eps)

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
    barrier(ctx, n1)  # node-1 has synced the removal
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


@scenario("source-ip", "pod -> ClusterIP -> pod on another node sees the client pod's IP")
def source_ip(ctx: Context) -> None:
    n1, n2 = two_nodes(ctx)
    client = ctx.pods_on(n1)[0]
    ep = ctx.pods_on(n2)[0]
    svc = ctx.service("srcip")
    ctx.apply(svc, ctx.slice_for(svc, [ep]))
    ip = cip(svc)
    wait_reach(ctx, client, ip, 80, only=[ep])
    for kind in ("tcp", "udp"):
        if kind == "udp":
            svc2 = ctx.service("srcip-udp", [ctx.port(80, 8080, name="udp", protocol="UDP")])
            ctx.apply(svc2, ctx.slice_for(svc2, [ep]))
            ip = cip(svc2)
            wait_reach(ctx, client, ip, 80, "udp", only=[ep])
        pr = ctx.reach(client, ip, 80, kind, count=5, only=[ep])
        ctx.expect(
            pr.seen_ips == {client.ip4},
            f"{kind.upper()}: the backend did not see the client pod's address",
            sent=pr.sent,
            got=pr.summary() + f"; source addresses seen: {sorted(pr.seen_ips)}",
            expected=f"{ep.name} sees {client.ip4} (no masquerade for pod -> ClusterIP -> remote pod)",
        )


@scenario("hairpin", "pod -> its own service, itself the only endpoint")
def hairpin(ctx: Context) -> None:
    n1, _ = two_nodes(ctx)
    pod = ctx.pods_on(n1)[1]
    svc = ctx.service("self")
    ctx.apply(svc, ctx.slice_for(svc, [pod]))
    ip = cip(svc)
    wait_reach(ctx, pod, ip, 80, only=[pod])
    pr = ctx.reach(pod, ip, 80, count=5, only=[pod])
    ctx.note(f"{pod.name} reached itself through {ip}:80, seen as {sorted(pr.seen_ips)}")
