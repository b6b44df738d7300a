"""Conformance scenario servers: /healthz and /livez (with a node tainted for deletion), /proxyMode, /configz and
/metrics, each as upstream serves them.

The spec is docs/BEHAVIOUR.md's scenario table; ``kproxy.conformance.scenarios`` fixes the order.
"""

from __future__ import annotations

import json
import time
from typing import Any

from kproxy.conformance.checks import (
    CONFIGZ_GROUP,
    REQUIRED_METRICS,
    configz_problems,
    health_body_problems,
    histogram,
    sample_value,
)
from kproxy.conformance.context import Context
from kproxy.conformance.registry import scenario
from kproxy.conformance.steps import SYNC_WAIT, cip, http_url, parsed_metrics, two_nodes, wait_reach
from kproxy.conformance.values import API_TIMEOUT, HEALTHZ_PORT, METRICS_PORT, ScenarioFailure, body_of, header


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
    healthz, livez = http_url(node.ip4, HEALTHZ_PORT, "/healthz"), http_url(node.ip4, HEALTHZ_PORT, "/livez")

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


@scenario("servers", "/healthz, /livez, /metrics, /proxyMode, /configz")
def servers(ctx: Context) -> None:
    n1, n2 = two_nodes(ctx)
    # Independent checks: each runs, and the failure lists every one that failed.
    failures = []
    for check in (
        lambda: _health_bodies(ctx, n1),
        lambda: _node_eligibility(ctx, n2),
        lambda: _plain_endpoints(ctx, n1),
        lambda: _metrics_follow_a_change(ctx, n1, n2),
    ):
        try:
            check()
        except ScenarioFailure as exc:
            failures.append(str(exc))
    if failures:
        raise ScenarioFailure(" || ".join(failures))
    ctx.note("/healthz (also 503 for a node tainted for deletion), /livez, /proxyMode, /configz, /metrics as upstream")


def _health_bodies(ctx: Context, n1: Any) -> None:
    """/healthz and /livez from outside: 200, application/json, nosniff and upstream's ProxyHealth JSON."""
    for path in ("/healthz", "/livez"):
        url = http_url(n1.ip4, HEALTHZ_PORT, path)
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


def _plain_endpoints(ctx: Context, n1: Any) -> None:
    """/proxyMode names the running mode; /configz is upstream's, for this mode and node."""
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


SERVICE_CHANGES = "kubeproxy_sync_proxy_rules_service_changes_total"
ENDPOINT_CHANGES = "kubeproxy_sync_proxy_rules_endpoint_changes_total"
LAST_SYNC = "kubeproxy_sync_proxy_rules_last_timestamp_seconds"


def _metrics_follow_a_change(ctx: Context, n1: Any, n2: Any) -> None:
    """A change (service + slice) must move the change counters and the last-sync timestamp, and leave every
    upstream series in place (labelled series appear once observed, as in upstream's Go client)."""
    before = parsed_metrics(ctx, n1)
    svc_before = sample_value(before, SERVICE_CHANGES) or 0.0
    ep_before = sample_value(before, ENDPOINT_CHANGES) or 0.0
    ts_before = sample_value(before, LAST_SYNC, ip_family="IPv4") or 0.0
    svc = ctx.service("observed")
    ctx.apply(svc, ctx.slice_for(svc, [ctx.pods_on(n2)[0]]))
    wait_reach(ctx, ctx.pods_on(n1)[0], cip(svc), 80)

    def counted() -> None:
        after = parsed_metrics(ctx, n1)
        problems, got = [], []
        for name, old, new in (
            (SERVICE_CHANGES, svc_before, sample_value(after, SERVICE_CHANGES) or 0.0),
            (ENDPOINT_CHANGES, ep_before, sample_value(after, ENDPOINT_CHANGES) or 0.0),
            (LAST_SYNC + '{ip_family="IPv4"}', ts_before, sample_value(after, LAST_SYNC, ip_family="IPv4") or 0.0),
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
