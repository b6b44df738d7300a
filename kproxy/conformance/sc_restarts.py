"""Conformance scenarios around kproxy's process: killed and restarted under traffic, ``kproxy cleanup`` (and
another mode started over the running one), and a switch to every other mode under traffic and back.

The spec is docs/BEHAVIOUR.md's scenario table; ``kproxy.conformance.scenarios`` fixes the order.
"""

from __future__ import annotations

import signal
import time
from typing import Any

from kproxy.conformance.checks import HOLD_INTERVAL, judge_restart
from kproxy.conformance.context import Context
from kproxy.conformance.registry import scenario
from kproxy.conformance.steps import (
    START_WAIT,
    SYNC_WAIT,
    Prober,
    cip,
    healthz_ok,
    kproxy_bin,
    rc_of,
    remnants,
    start_kproxy,
    started_and_synced,
    stdout_of,
    synced_since_start,
    two_nodes,
    wait_reach,
)
from kproxy.conformance.values import NotApplicableHere, Probe, hostport


@scenario(
    "restart", "kproxy killed and restarted during traffic", timeout_s=90, parts={"held-connection", "while-down"}
)
def restart(ctx: Context) -> None:
    n1, n2 = two_nodes(ctx)
    client = ctx.pods_on(n1)[0]
    ep = ctx.pods_on(n2)[0]
    svc = ctx.service("survivor")
    ctx.apply(svc, ctx.slice_for(svc, [ep]))
    ip = cip(svc)
    wait_reach(ctx, client, ip, 80, only=[ep])
    # The held connection runs until stopped: it must span the kill, the restart and the restarted kproxy's first
    # sync (which rewrites every rule), whenever that comes; it is bounded by the scenario's own budget. A mode
    # whose connections are its own process's sockets declares it (and new connections while it is down) instead.
    holding, judge_down = not ctx.skips("held-connection"), not ctx.skips("while-down")
    t_hold = ctx.now()
    held = ctx.lab.hold(client.ns, ip, 80, max(10.0, ctx.remaining() - 10), HOLD_INTERVAL) if holding else None
    hold_results: Any = []
    t_synced = t_after_end = 0.0
    prober = Prober.to(ctx, client, ip, "before", interval=0.15)
    phase = prober.phase
    try:
        with prober:
            time.sleep(1.0)
            phase[0] = "killed"
            ctx.lab.stop_kproxy(n1, signal.SIGKILL)
            time.sleep(1.5)
            phase[0] = "restarting"
            start_kproxy(ctx, n1, ctx.mode)
            # /healthz is 503 until the restarted kproxy's first sync of every family
            ctx.eventually(lambda: healthz_ok(ctx, n1), timeout=START_WAIT, what="restarted kproxy healthy")
            ctx.eventually(lambda: synced_since_start(ctx, n1), timeout=SYNC_WAIT, what="restarted kproxy's first sync")
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


@scenario("cleanup", "kproxy cleanup, and starting another mode", timeout_s=150)
def cleanup(ctx: Context) -> None:
    from kproxy.proxier import availability, installed_backends

    n1, n2 = two_nodes(ctx)
    node = n2
    client = ctx.pods_on(n2)[0]
    eps = [ctx.pods_on(n2)[1], ctx.pods_on(n1)[1]]
    svc = ctx.service("clean")
    # an eTP=Local NodePort with an endpoint on the node: the mode's local-policy objects (iptables' KUBE-SVL-,
    # KUBE-EXT-) exist too, so cleanup must remove them as well
    local = ctx.service("clean-local", type="NodePort", externalTrafficPolicy="Local")
    ctx.apply(svc, ctx.slice_for(svc, eps), local, ctx.slice_for(local, [ctx.pods_on(n2)[2]]))
    ip = cip(svc)
    wait_reach(ctx, client, ip, 80, only=eps)
    np_local = local["spec"]["ports"][0]["nodePort"]
    wait_reach(ctx, ctx.external_ns, node.ip4, np_local, only=[ctx.pods_on(n2)[2]])
    before = remnants(ctx, ctx.mode, node)
    ctx.expect(
        before,
        f"the {ctx.mode} remnant check finds nothing while kproxy {ctx.mode} runs, so its 'nothing left' means nothing",
        sent=f"{ctx.mode}.remnants() in {node.ns} with two services programmed",
        got="[]",
        expected="the running mode's objects",
    )
    _cleanup_leaves_nothing(ctx, node)
    # Nothing programmed: the NodePort is closed on this node (refused). (Not the ClusterIP: with no rules on this
    # node a pod's SYN to it leaves by the default route, and the lab's router hands it to node-1, which has rules.)
    ctx.blocked(ctx.external_ns, node.ip4, np_local, how="refused", count=2, timeout=1.0)
    started_and_synced(ctx, node, ctx.mode, "restarted after cleanup")
    wait_reach(ctx, client, ip, 80, only=eps, what=f"kproxy {ctx.mode} restarted after cleanup")
    ctx.reach(client, ip, 80, count=6, only=eps)
    ctx.note(f"kproxy cleanup left nothing of {ctx.mode} (checked {len(before)} objects before)")
    others = [m for m in installed_backends() if m != ctx.mode and availability(m)]
    if not others:
        # nothing exercised it: its own not-applicable row, never part of this pass
        ctx.part_not_applicable_here(
            "another-mode", f"no mode besides {ctx.mode} is installed and available here to start over it"
        )
        return
    tried = _other_modes_over(ctx, node, others)
    started_and_synced(ctx, node, None, "back after the other modes")
    wait_reach(ctx, client, ip, 80, only=eps, what=f"kproxy {ctx.mode} back after the other modes")
    # ... and the mode it came back in removed what the others left
    for other in tried:
        left = remnants(ctx, other, node)
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


def _cleanup_leaves_nothing(ctx: Context, node: Any) -> None:
    """kproxy stopped (SIGTERM) on ``node``, then ``kproxy cleanup --mode MODE`` there: exit 0 and nothing of the
    mode left in the kernel."""
    ctx.lab.stop_kproxy(node, signal.SIGTERM)
    command = getattr(ctx.lab, "kproxy_command", None)
    argv = [*(command() if command else [kproxy_bin()]), "cleanup", "--mode", ctx.mode]
    res = ctx.exec(node, argv, timeout=60)
    ctx.expect(
        rc_of(res) == 0,
        "kproxy cleanup failed",
        sent=" ".join(argv) + f" in {node.ns}",
        got=f"exit {rc_of(res)}: {stdout_of(getattr(res, 'stderr', ''))[:300]}",
        expected="exit 0",
    )
    left = remnants(ctx, ctx.mode, node)
    ctx.expect(
        not left,
        f"{len(left)} things of mode {ctx.mode} remain after kproxy cleanup",
        sent=" ".join(argv) + f" in {node.ns}",
        got="; ".join(left[:8]),
        expected="nothing of the mode left",
    )


def _other_modes_over(ctx: Context, node: Any, others: list[str]) -> list[str]:
    """Each of ``others`` started over the session's mode on ``node`` leaves nothing of it; the node is left running
    the session's mode again (not yet synced). Returns the modes tried."""
    tried = []
    try:
        for other in others:
            ctx.lab.stop_kproxy(node, signal.SIGTERM)
            # kproxy removes other modes' leftovers before its first sync, so one that has synced has done it
            # (whether the other mode then proxies correctly is that mode's own conformance run)
            started_and_synced(ctx, node, other, f"started in mode {other}")
            left = remnants(ctx, ctx.mode, node)
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
        start_kproxy(ctx, node, ctx.mode)
    return tried


SWITCH_STEADY_S = 2.0  # seconds of traffic after each switch's first sync


@scenario(
    "mode-switch",
    "another mode replaces the running one under traffic, and back",
    timeout_s=200,
    parts={"held-connections", "while-down"},
)
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
    n1, n2 = two_nodes(ctx)
    node = n2
    client = ctx.pods_on(n2)[0]
    eps = [ctx.pods_on(n1)[0]]  # on the other node: the node's rules carry both connections
    svc = ctx.service("switch", type="NodePort")
    ctx.apply(svc, ctx.slice_for(svc, eps))
    ip = cip(svc)
    np_ = svc["spec"]["ports"][0]["nodePort"]
    wait_reach(ctx, client, ip, 80, only=eps)
    wait_reach(ctx, ctx.external_ns, node.ip4, np_, only=eps)
    switches = [m for other in others for m in (other, ctx.mode)]  # A -> B -> A for every B
    budget = max(20.0, ctx.remaining() - 15)
    holds = {}
    if not ctx.skips("held-connections"):
        holds = {
            "ClusterIP": ctx.lab.hold(client.ns, ip, 80, budget, HOLD_INTERVAL),
            "NodePort": ctx.lab.hold(ctx.external_ns, node.ip4, np_, budget, HOLD_INTERVAL),
        }
    targets = {"ClusterIP": (client, ip, 80), "NodePort": (ctx.external_ns, node.ip4, np_)}
    prober = Prober(ctx, targets, f"{ctx.mode} running", interval=0.2)
    results: dict[str, list[Any]] = {}
    try:
        with prober:
            time.sleep(1.0)
            _switch_through(ctx, node, switches, prober.phase)
    finally:
        for what, proc in holds.items():
            results[what] = list(ctx.lab.finish_hold(proc, stop=True, timeout=30))
        if not ctx.lab.kproxy_running(node):  # a failure half-way: leave the node in the session's mode
            start_kproxy(ctx, node, ctx.mode)
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
    judged = _judge_new_connections(ctx, prober.records)
    down = ctx.skips("while-down")
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
        + (f" ({len(prober.records) - len(judged)} made while {ctx.mode} was down not judged)" if down else "")
    )


def _switch_through(ctx: Context, node: Any, switches: list[str], phase: list[str]) -> None:
    """Stop kproxy on ``node`` and start it in each of ``switches`` in turn; once each has synced, nothing of the
    mode it replaced may remain. ``phase[0]`` says where the switching is, for the prober."""
    previous = ctx.mode
    for mode in switches:
        phase[0] = f"{previous} -> {mode}: starting"
        ctx.lab.stop_kproxy(node, signal.SIGTERM)
        started_and_synced(ctx, node, mode, f"started in mode {mode} over {previous}")
        phase[0] = f"{previous} -> {mode}: {mode} running"
        left = remnants(ctx, previous, node)
        ctx.expect(
            not left,
            f"{len(left)} things of mode {previous} remain after mode {mode} started and synced",
            sent=f"kproxy --mode {previous} stopped (SIGTERM), --mode {mode} started in {node.ns} and synced",
            got="; ".join(left[:8]),
            expected=f"nothing of {previous} left",
        )
        time.sleep(SWITCH_STEADY_S)
        previous = mode


def _judge_new_connections(ctx: Context, probes: list[tuple[str, str, str, Probe]]) -> list[tuple[str, str, Probe]]:
    """Every new connection made during the switches answered, but those the mode declares away: started or ended
    from its stop until the next mode's first sync (``while-down``: its connections end with its process). Returns
    the connections judged."""
    down = ctx.skips("while-down")  # from A's stop until B's first sync nothing of A's answers: not judged

    def stopped(ph: str) -> bool:  # the mode's process was stopped: a probe in flight then ends with it
        return ph.startswith(f"{ctx.mode} -> ") and ph.endswith(": starting")

    judged = [(ph, what, p) for ph, end, what, p in probes if not (down and (stopped(ph) or stopped(end)))]
    failed = [(ph, what, p) for ph, what, p in judged if not all(getattr(r, "ok", False) for r in p.results)]
    ctx.expect(
        judged and not failed,
        f"{len(failed)} of {len(judged)} new connections judged failed during the mode switches",
        sent="new TCP connections to the ClusterIP (from the node's pod) and the NodePort (from outside) every ~0.2 s",
        got="; ".join(f"{ph} {what}: {p.summary()}" for ph, what, p in failed[:6]),
        expected="all answered, in every phase",
    )
    return judged
