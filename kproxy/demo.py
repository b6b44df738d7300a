"""``kproxy demo`` (what ``make demo`` runs): kproxy doing its job on the embedded lab, in about a minute.

It brings up a 2-node lab with one kproxy per node in the chosen mode, publishes a Service ``demo/web`` (a
ClusterIP with a NodePort) backed by all six pods, and shows real traffic: a pod's connections spread over the
endpoints on both nodes, an external client reaching the NodePort of either node, and ``kproxy show`` on node 1
telling how the service is programmed there. The lab is removed at the end unless ``--keep-lab``.
Like ``kproxy conformance`` it checks the mode before building anything (exit 2) and refuses to take down a lab
that is running under its prefix (exit 2) unless ``--replace-lab``; ``--lab-prefix`` gives it a lab of its own.
What a killed run left is removed silently. A lab or traffic failure is a short error and exit 1, no traceback.
It reuses the conformance suite's object builders and probes, so the demo and the proof speak the same language.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from typing import Any

from kproxy.conformance.context import Addresses, Context, ScenarioFailure
from kproxy.lab.cli import live_lab_problem, mode_problem
from kproxy.lab.cluster import Lab, LabError, check_prefix
from kproxy.proxier import DEFAULT_MODE


def _spread(results: Any) -> str:
    counts = collections.Counter(r.pod for r in results if r.ok)
    failed = sum(1 for r in results if not r.ok)
    text = "  ".join(f"{pod}:{n}" for pod, n in sorted(counts.items()))
    return text + (f"  (failed: {failed})" if failed else "")


def _error(exc: BaseException) -> None:
    # the first line says what went wrong; what follows (a log's tail) is detail, indented under it
    head, *rest = (str(exc).strip() or type(exc).__name__).splitlines()
    print(f"kproxy demo: {head}", file=sys.stderr)
    for line in rest:
        print(f"    {line}", file=sys.stderr)


def run_demo(mode: str, keep_lab: bool = False, *, replace_lab: bool = False, prefix: str | None = None) -> int:
    problem = mode_problem(mode)
    if problem:
        print(f"kproxy demo: {problem}", file=sys.stderr)
        return 2
    try:
        check_prefix(prefix or Lab.PREFIX)
        live = None if replace_lab else Lab.live(prefix=prefix)
    except LabError as exc:  # an invalid prefix
        _error(exc)
        return 2
    if live is not None:
        alternatives = (
            "pass --replace-lab to replace it, --lab-prefix PREFIX for a lab of the demo's own, or run "
            "`kproxy lab down` first"
        )
        print(f"kproxy demo: {live_lab_problem(live, alternatives)}", file=sys.stderr)
        return 2
    try:
        return _demo(mode, keep_lab, prefix)
    except (LabError, ScenarioFailure) as exc:
        _error(exc)
        return 1


def _demo(mode: str, keep_lab: bool, prefix: str | None) -> int:
    started = time.monotonic()
    print(f"== bringing up a 2-node lab with kproxy --mode {mode} on each node")
    lab: Lab | None = None
    try:
        lab = Lab.up(nodes=2, pods_per_node=3, mode=mode, prefix=prefix)
        lab.wait_all()
        print(
            f"   lab ready in {time.monotonic() - started:.1f}s: nodes "
            + ", ".join(f"{n.name} ({n.ip4})" for n in lab.nodes)
            + "; pods "
            + ", ".join(p.name for p in lab.pods)
        )
        ctx = Context(lab, mode, "demo", Addresses(), timeout_s=120)
        ctx.namespace = "demo"
        svc = ctx.service(
            "web", [ctx.port(80, 8080, name="http"), ctx.port(80, 8080, name="dns", protocol="UDP")], type="NodePort"
        )
        ctx.apply(svc, ctx.slice_for(svc, lab.pods))
        vip = svc["spec"]["clusterIP"]
        node_port = svc["spec"]["ports"][0]["nodePort"]
        print(f"== Service {ctx.namespace}/web: ClusterIP {vip}:80, NodePort {node_port}, 6 endpoints on 2 nodes")
        client = lab.pods[0]
        ctx.eventually(lambda: ctx.probe(client, vip, 80).ok, timeout=30, what="the service answers")
        pr = ctx.probe(client, vip, 80, count=30)
        print(f"   {client.name} -> {vip}:80, 30 new connections: {_spread(pr.results)}")
        others = sorted({r.seen_ip for r in pr.results if r.ok and r.pod != client.name})
        hairpin = sorted({r.seen_ip for r in pr.results if r.ok and r.pod == client.name})
        print(
            f"   other pods saw the client as {', '.join(others)} (its own IP: no SNAT)"
            + (f"; {client.name} reaching itself saw {', '.join(hairpin)} (hairpin is masqueraded)" if hairpin else "")
        )
        pr = ctx.probe(client, vip, 80, "udp", count=12)
        print(f"   {client.name} -> {vip}:80/UDP, 12 datagrams from new sockets: {_spread(pr.results)}")
        for node in lab.nodes:
            pr = ctx.probe(lab.external_ns, node.ip4, node_port, count=12)
            print(f"   external client -> {node.name} {node.ip4}:{node_port}, 12 connections: {_spread(pr.results)}")
        print(f"== kproxy show --service {ctx.namespace}/web:http  (inside {lab.nodes[0].name})")
        out = lab.exec(lab.nodes[0].ns, [*Lab.kproxy_command(), "show", "--service", f"{ctx.namespace}/web:http"])
        sys.stdout.write(out.stdout.decode(errors="replace"))
        if out.returncode != 0:
            sys.stdout.write(out.stderr.decode(errors="replace"))
            return 1
        node1 = lab.nodes[0]
        print(
            f"== kproxy show --trace {lab.external_ip4} {node1.ip4}:{node_port}/tcp --to-node  (the packet explainer)"
        )
        out = lab.exec(
            node1.ns,
            [*Lab.kproxy_command(), "show", "--trace", lab.external_ip4, f"{node1.ip4}:{node_port}/tcp", "--to-node"],
        )
        sys.stdout.write(out.stdout.decode(errors="replace") or out.stderr.decode(errors="replace"))
        print(
            f"== done in {time.monotonic() - started:.1f}s. Next: `kproxy conformance --mode {mode}` runs every "
            "scenario of BEHAVIOUR.md on a lab like this one."
        )
        return 0
    finally:
        if keep_lab and lab is not None:
            opt = "" if lab.prefix == Lab.PREFIX else f" --prefix {lab.prefix}"
            print(f"   lab kept: `kproxy lab{opt} status`, `kproxy lab{opt} down`")
        else:
            Lab.down(prefix=prefix)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("demo", help="kproxy on a 2-node lab: traffic and `kproxy show` (what `make demo` runs)")
    p.add_argument("--mode", default=DEFAULT_MODE)
    p.add_argument("--keep-lab", action="store_true", help="leave the lab running afterwards")
    p.add_argument(
        "--replace-lab",
        action="store_true",
        help="take down a lab already running under the prefix and bring up a fresh one (without this, a running "
        "lab is left alone and the demo refuses to start)",
    )
    p.add_argument(
        "--lab-prefix", default=None, help="namespace prefix of the demo's lab (default: the lab's own, kpl-)"
    )
    p.set_defaults(
        func=lambda args: run_demo(args.mode, args.keep_lab, replace_lab=args.replace_lab, prefix=args.lab_prefix)
    )
