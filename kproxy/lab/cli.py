"""``kproxy lab up|down|status|exec``: the lab cluster from the command line (wired into kproxy.cli by the lead).

For people: bring a lab up to try kproxy by hand, look at it, run a command inside one of its namespaces, take it
down again (also after a run that was killed). The conformance runner uses kproxy.lab.cluster.Lab directly.
``python -m kproxy.lab.cli lab ...`` works too.

``lab up`` refuses to replace a live lab (someone's, see :meth:`Lab.live`) unless ``--replace``, and checks the
mode before building anything; :func:`mode_problem` and :func:`live_lab_problem` are shared with ``kproxy demo``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from kproxy.lab.cluster import Lab, LabError, check_prefix
from kproxy.proxier import DEFAULT_MODE, BackendError, backend_class, parse_option_assignments


def mode_problem(mode: str | None) -> str | None:
    """Why kproxy cannot run in ``mode`` here (unknown, not installed, not available on this host), or None.

    ``None`` (no kproxy) is always fine. Checked before a lab is built, so a bad mode costs nothing.
    """
    if mode is None:
        return None
    from kproxy.proxier import availability

    avail = availability(mode)
    return None if avail else f"mode {mode} cannot run here: {avail.reason}"


def live_lab_problem(lab: Lab, alternatives: str) -> str:
    """The refusal for a command that would take down the live ``lab``; ``alternatives`` says what to do instead."""
    mode = lab.mode or "no kproxy"
    return (
        f"a lab is already running under prefix {lab.prefix!r} ({len(lab.nodes)} nodes, {mode}, state in "
        f"{lab.state_dir}) and bringing up a fresh one would take it down: {alternatives}"
    )


def mode_text(mode: str | None) -> str:
    return "no kproxy (mode none)" if mode is None else f"kproxy --mode {mode}"


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``lab`` and its subcommands; each handler is the ``func`` default and returns an exit code."""
    lab = subparsers.add_parser("lab", help="a cluster made of network namespaces, for trying and testing kproxy")
    lab.add_argument(
        "--prefix", default=Lab.PREFIX, help="name prefix of the lab's namespaces (a second lab beside the default)"
    )
    sub = lab.add_subparsers(dest="lab_command", required=True, metavar="ACTION")

    up = sub.add_parser(
        "up",
        help="build a fresh lab (removing what a killed run left; a running lab only with --replace)",
    )
    up.add_argument("--nodes", type=int, default=2)
    up.add_argument("--pods-per-node", type=int, default=3)
    up.add_argument("--mode", default=DEFAULT_MODE, help="kproxy mode to start on every node, or 'none'")
    up.add_argument(
        "--backend-option",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an option of the mode's backend for every node's kproxy (repeatable), e.g. iptables_flavour=legacy",
    )
    up.add_argument("--no-ipv6", action="store_true", help="IPv4 only")
    up.add_argument(
        "--kproxy-arg", action="append", default=[], metavar="ARG", help="extra argument for every kproxy (repeatable)"
    )
    up.add_argument(
        "--replace",
        action="store_true",
        help="take down a lab already running under the prefix (and its API objects) and build a fresh one",
    )
    up.add_argument("--timeout", type=float, default=30.0, help="seconds for each kproxy to become healthy")
    up.set_defaults(func=cmd_up)

    down = sub.add_parser("down", help="remove the lab: processes, namespaces, cgroups, state and logs (idempotent)")
    down.add_argument("--keep-logs", action="store_true", help="keep the *.log files of the state folder")
    down.set_defaults(func=cmd_down)

    status = sub.add_parser("status", help="what runs where")
    status.add_argument("--format", choices=("table", "json"), default="table")
    status.set_defaults(func=cmd_status)

    ex = sub.add_parser("exec", help="run a command in a lab namespace (and its node's cgroup): lab exec NS -- CMD")
    ex.add_argument("ns", help="a lab namespace, e.g. kpl-n1 or kpl-n1-p2 (or a node/pod name: node-1, pod-1-2)")
    ex.add_argument("argv", nargs=argparse.REMAINDER, help="-- CMD ARGS...")
    ex.set_defaults(func=cmd_exec)


def cmd_up(args: argparse.Namespace) -> int:
    mode = None if args.mode.lower() == "none" else args.mode
    problem = mode_problem(mode)
    if problem:
        print(f"kproxy lab up: {problem}", file=sys.stderr)
        return 2
    try:
        options = parse_option_assignments(backend_class(mode), args.backend_option) if mode else {}
    except (ValueError, BackendError) as e:
        print(f"kproxy lab up: {e}", file=sys.stderr)
        return 2
    try:
        check_prefix(args.prefix)
        live = None if args.replace else Lab.live(prefix=args.prefix)
    except LabError as e:  # an invalid prefix
        print(f"kproxy lab up: {e}", file=sys.stderr)
        return 2
    if live is not None:
        opt = "" if live.prefix == Lab.PREFIX else f" --prefix {live.prefix}"
        alternatives = (
            f"`kproxy lab{opt} down` removes it, `kproxy lab{opt} up --replace` replaces it, or "
            "`kproxy lab --prefix PREFIX up` builds a second lab beside it"
        )
        print(f"kproxy lab up: {live_lab_problem(live, alternatives)}", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    try:
        lab = Lab.up(
            nodes=args.nodes,
            pods_per_node=args.pods_per_node,
            mode=mode,
            ipv6=not args.no_ipv6,
            kproxy_args=args.kproxy_arg,
            prefix=args.prefix,
            backend_options=options,
        )
    except LabError as e:  # Lab.up removes a half-built lab itself
        print(f"kproxy lab up: {e}", file=sys.stderr)
        return 1
    print(f"lab up in {time.monotonic() - t0:.2f}s: {len(lab.nodes)} nodes, {len(lab.pods)} pods, {mode_text(mode)}")
    print(f"API: {lab.api_url} (from this machine), {lab.lab_api_url} (from the nodes); state in {lab.state_dir}")
    print(f"kubectl --kubeconfig {lab.kubeconfig} --validate=false apply -f ...   (Services and EndpointSlices)")
    if mode is None:
        return 0
    # a person typing this wants to know at once when kproxy cannot start (a bad flag, a backend failing), and a
    # lab whose kproxy never came up is no lab to leave behind
    try:
        lab.wait_all(timeout=args.timeout)
    except LabError as e:
        print(f"kproxy lab up: {e}", file=sys.stderr)
        try:
            Lab.down(prefix=lab.prefix, keep_logs=True)
        except LabError as down_error:
            print(f"kproxy lab up: and taking the lab down failed: {down_error}", file=sys.stderr)
        else:
            print(f"kproxy lab up: lab taken down; its logs stay in {lab.state_dir}", file=sys.stderr)
        return 1
    print(f"kproxy healthy on every node after {time.monotonic() - t0:.2f}s")
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    try:
        Lab.down(prefix=args.prefix, keep_logs=args.keep_logs)
    except LabError as e:
        print(f"kproxy lab down: {e}", file=sys.stderr)
        return 1
    print(f"lab down in {time.monotonic() - t0:.2f}s")
    return 0


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def format_status(st: dict[str, Any]) -> str:
    lines = [
        f"mode {st['mode'] or 'none'}  ipv6 {st['ipv6']}  API {st['api_url']} / {st['lab_api_url']} "
        f"({'up' if st['api_running'] else 'DOWN'})  state {st['state_dir']}",
        f"external {st['external']['ns']} {st['external']['ip4']} {st['external']['ip6']}",
        "",
    ]
    rows = [["NODE", "NETNS", "IPv4", "IPv6", "POD CIDRS", "ZONE", "KPROXY"]]
    for n in st["nodes"]:
        kp = f"{n['kproxy_mode']} pid {n['kproxy_pid']}" if n["kproxy_pid"] else "-"
        cidrs = ",".join(c for c in (n["pod_cidr4"], n["pod_cidr6"]) if c)
        rows.append(
            [n["name"], n["ns"] + ("" if n["netns"] else " (MISSING)"), n["ip4"], n["ip6"], cidrs, n["zone"], kp]
        )
    lines += [_table(rows), ""]
    rows = [["POD", "NETNS", "NODE", "IPv4", "IPv6", "ECHO"]]
    for p in st["pods"]:
        echo = f"pid {p['echo_pid']}" if p["echo_pid"] else "DOWN"
        rows.append([p["name"], p["ns"] + ("" if p["netns"] else " (MISSING)"), p["node"], p["ip4"], p["ip6"], echo])
    lines.append(_table(rows))
    return "\n".join(lines)


def cmd_status(args: argparse.Namespace) -> int:
    try:
        st = Lab.attach(prefix=args.prefix).status()
    except LabError as e:
        print(f"kproxy lab status: {e}", file=sys.stderr)
        return 1
    print(json.dumps(st, indent=2) if args.format == "json" else format_status(st))
    return 0


def cmd_exec(args: argparse.Namespace) -> int:
    argv = list(args.argv)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        print("kproxy lab exec: give a command after --", file=sys.stderr)
        return 2
    try:
        lab = Lab.attach(prefix=args.prefix)
        ns = args.ns
        if not ns.startswith(lab.prefix):
            ns = lab.node(ns).ns if ns.startswith("node-") else lab.pod(ns).ns
        node = lab.node_of_ns(ns)
    except LabError as e:
        print(f"kproxy lab exec: {e}", file=sys.stderr)
        return 1
    from kproxy.lab import netns

    # interactive use: inherit the terminal instead of capturing like Lab.exec does
    full = netns.exec_argv(ns, argv)
    preexec = netns.cgroup_preexec(lab.cgroup_path(node) if node else None)
    if preexec is None:
        os.execvp(full[0], full)
    import subprocess

    return subprocess.call(full, preexec_fn=preexec)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kproxy.lab.cli")
    sub = parser.add_subparsers(dest="command", required=True)
    register(sub)
    args = parser.parse_args(argv)
    rc: int = args.func(args)
    return rc


if __name__ == "__main__":
    sys.exit(main())
