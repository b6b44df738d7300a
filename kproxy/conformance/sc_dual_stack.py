"""Conformance scenario dual-stack: IPv6-only and dual-stack services reached on both families, while an IPv4
guard service's traffic and kernel rules stay untouched.

The spec is docs/BEHAVIOUR.md's scenario table; ``kproxy.conformance.scenarios`` fixes the order.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from kproxy.conformance.checks import answer_is, split_counters, view_changes
from kproxy.conformance.context import Context
from kproxy.conformance.registry import scenario
from kproxy.conformance.steps import SYNC_WAIT, FailedResult, cip, kernel_view, two_nodes, wait_reach
from kproxy.conformance.values import NotApplicable, Probe


@scenario(
    "dual-stack",
    "IPv6-only and dual-stack services",
    needs={"ipv6"},
    timeout_s=90,
    parts={"client-ip", "kernel-counters", "kernel-rules"},
)
def dual_stack(ctx: Context) -> None:
    if not ctx.has_ipv6:
        raise NotApplicable("the lab has no IPv6 addresses")
    n1, n2 = two_nodes(ctx)
    client = ctx.pods_on(n1)[0]
    guard_ep = [ctx.pods_on(n2)[2]]
    guard = ctx.service("guard")
    ctx.apply(guard, ctx.slice_for(guard, guard_ep))
    gip = cip(guard)
    wait_reach(ctx, client, gip, 80, only=guard_ep)
    # traffic through the guard first, so its counters are not zero: a rewrite would then show as counters falling
    ctx.reach(client, gip, 80, count=10, only=guard_ep)
    results: list[Any] = []
    stop = threading.Event()

    def guard_loop() -> None:
        while not stop.is_set() and ctx.remaining() > 3:
            try:
                results.extend(ctx.probe(client, gip, 80, count=1, timeout=1.0).results)
            except Exception as exc:
                results.append(FailedResult(str(exc)))
            time.sleep(0.2)

    guard_key = f"{ctx.namespace}/guard:tcp/TCP"
    kernel_before = _guard_kernel_before(ctx, (n1, n2), guard_key)
    t = threading.Thread(target=guard_loop, daemon=True)
    t.start()
    try:
        _ipv6_objects_come_and_go(ctx, n1, n2, client)
    finally:
        stop.set()
        t.join(timeout=5)
    _judge_guard_kernel(ctx, (n1, n2), guard_key, kernel_before)
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


def _guard_kernel_before(ctx: Context, nodes: tuple[Any, Any], guard_key: str) -> dict[str, list[str]]:
    """The guard's kernel lines on each node whose mode has a kernel view, before the IPv6 objects come; the first
    node's must carry some non-zero counter, or a rewrite with the same content could not be seen (a view without
    counters makes that part not applicable)."""
    n1 = nodes[0]
    kernel_before: dict[str, list[str]] = {}
    for n in nodes:
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
    return kernel_before


def _ipv6_objects_come_and_go(ctx: Context, n1: Any, n2: Any, client: Any) -> None:
    """An IPv6-only service (the remote endpoint sees the client's IPv6 address) and a dual-stack one are reached on
    each family; the IPv6-only one is deleted again, and the dual-stack one's IPv4 half still answers."""
    eps6 = [ctx.pods_on(n1)[1], ctx.pods_on(n2)[0]]
    v6 = ctx.service("v6only", families=("IPv6",))
    ctx.apply(v6, ctx.slice_for(v6, eps6, family="IPv6"))
    ip6 = cip(v6, "IPv6")
    wait_reach(ctx, client, ip6, 80, only=eps6)
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
        wait_reach(ctx, client, cip(ds, fam), 80, only=eps_ds)
        ctx.reach(client, cip(ds, fam), 80, count=12, only=eps_ds, all_of=eps_ds)
    ctx.delete_service("v6only")
    ctx.eventually(lambda: ctx.blocked(client, ip6, 80, timeout=1.0), timeout=SYNC_WAIT, what="after deleting v6only")
    ctx.reach(client, cip(ds, "IPv4"), 80, count=4, only=eps_ds)


def _judge_guard_kernel(
    ctx: Context, nodes: tuple[Any, Any], guard_key: str, kernel_before: dict[str, list[str]]
) -> None:
    """The guard's IPv4 kernel lines on each node are as before, counters only rising."""
    n1, n2 = nodes
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
