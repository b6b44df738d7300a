"""Conformance scenarios, the traffic policies: externalTrafficPolicy=Local (with its health check node port),
internalTrafficPolicy=Local, and endpoints that are all terminating.

The spec is docs/BEHAVIOUR.md's scenario table; ``kproxy.conformance.scenarios`` fixes the order.
"""

from __future__ import annotations

import json
from typing import Any

from kproxy.conformance.context import Context
from kproxy.conformance.registry import scenario
from kproxy.conformance.steps import SYNC_WAIT, barrier, cip, http_url, two_nodes, wait_reach
from kproxy.conformance.values import METRICS_PORT, Probe, body_of, header


def _health(ctx: Context, node: Any, hc_port: int, svc_name: str, local: int) -> None:
    r = ctx.http(ctx.external_ns, http_url(node.ip4, hc_port))
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
        sent=f"GET {http_url(node.ip4, hc_port)} from the external client",
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


@scenario(
    "etp-local",
    "externalTrafficPolicy=Local: NodePorts, LB IP, health check node port",
    timeout_s=90,
    parts={"client-ip"},
)
def etp_local(ctx: Context) -> None:
    n1, n2 = two_nodes(ctx)
    local1 = [ctx.pods_on(n1)[1], ctx.pods_on(n1)[2]]
    hc = ctx.addresses.node_port()
    lb_ip = ctx.addresses.lb_ip()
    # healthCheckNodePort exists only for type LoadBalancer with externalTrafficPolicy Local (as upstream's ESIPP)
    svc = ctx.service("local", type="LoadBalancer", externalTrafficPolicy="Local", healthCheckNodePort=hc)
    np_ = svc["spec"]["ports"][0]["nodePort"]
    ctx.apply(svc, ctx.slice_for(svc, local1))
    ctx.set_lb_ingress("local", [lb_ip])
    ext = ctx.external_ns
    wait_reach(ctx, ext, n1.ip4, np_, only=local1)
    barrier(ctx, n1, n2)
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
    wait_reach(ctx, ext, n2.ip4, np_, only=local2, what="after adding an endpoint on node-2")
    pr = ctx.reach(ext, n2.ip4, np_, count=8, only=local2)
    _client_ip_kept(ctx, pr, ctx.external_ip4, "externalTrafficPolicy=Local on node-2")
    ctx.reach(ext, n1.ip4, np_, count=10, only=local1)
    ctx.eventually(lambda: _health(ctx, n2, hc, "local", 1), timeout=SYNC_WAIT, what="health check node port")
    ctx.note("node without local endpoints dropped (timeout); health 200/503 with upstream's JSON")


@scenario("itp-local", "internalTrafficPolicy=Local")
def itp_local(ctx: Context) -> None:
    n1, n2 = two_nodes(ctx)
    a, b = ctx.pods_on(n1)[0], ctx.pods_on(n2)[0]
    ep1 = ctx.pods_on(n1)[1]
    svc = ctx.service("itp", internalTrafficPolicy="Local")
    ctx.apply(svc, ctx.slice_for(svc, [ep1]))
    ip = cip(svc)
    wait_reach(ctx, a, ip, 80, only=[ep1])
    barrier(ctx, n2)
    ctx.reach(a, ip, 80, count=8, only=[ep1])
    ctx.blocked(b, ip, 80, how="timeout", count=3, timeout=1.0)
    _internal_verdict(ctx, n2, f"{ctx.namespace}/itp:tcp", "drop")
    ep2 = ctx.pods_on(n2)[1]
    ctx.apply(ctx.slice_for(svc, [ep1, ep2]))
    wait_reach(ctx, b, ip, 80, only=[ep2], what="after adding an endpoint on node-2")
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


@scenario("terminating-fallback", "all endpoints terminating: serving, then not serving")
def terminating_fallback(ctx: Context) -> None:
    n1, n2 = two_nodes(ctx)
    client = ctx.pods_on(n1)[0]
    eps = [ctx.pods_on(n1)[1], ctx.pods_on(n2)[1]]
    svc = ctx.service("term")
    ctx.apply(svc, ctx.slice_for(svc, eps, ready=False, serving=True, terminating=True))
    ip = cip(svc)
    wait_reach(ctx, client, ip, 80, only=eps, what="all endpoints terminating but serving")
    ctx.reach(client, ip, 80, count=10, only=eps)
    ctx.apply(ctx.slice_for(svc, eps, ready=False, serving=False, terminating=True))
    ctx.eventually(
        lambda: ctx.blocked(client, ip, 80, how="refused", within=1.0, timeout=2.0),
        timeout=SYNC_WAIT,
        what="all endpoints terminating and no longer serving",
    )
