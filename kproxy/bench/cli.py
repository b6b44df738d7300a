"""``kproxy bench sync`` and ``kproxy bench datapath``: the benchmarks' command line (wired into kproxy.cli).

``python -m kproxy bench ...`` and ``python -m kproxy.bench ...`` both work. Figures go to stdout (JSON or a
table), diagnostics to stderr; exit code 0 on success, 1 when the run failed, 2 for a usage problem.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

from kproxy.bench import options as bench_options
from kproxy.bench.reference_nft import DEFAULT_MAX_ENDPOINTS, REFERENCES
from kproxy.bench.synthetic import UDP_EVERY
from kproxy.proxier import MODE_NAMES, BackendError, backend_class, parse_option_assignments


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``bench`` with its sub-commands; each handler is the ``func`` default and returns an exit code."""
    bench = subparsers.add_parser("bench", help="control-plane and data-path benchmarks (PERFORMANCE.md)")
    sub = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")

    s = sub.add_parser(
        "sync",
        help="time full and partial syncs of N services x E endpoints in a throwaway network namespace",
    )
    s.add_argument("--mode", required=True, choices=(*MODE_NAMES, "fake"), help="backend; fake times the cache alone")
    s.add_argument("--services", type=int, default=1000, metavar="N")
    s.add_argument("--endpoints", type=int, default=10, metavar="E", help="endpoints per service (<= 1000)")
    s.add_argument("--repeat", type=int, default=5, metavar="R", help="partial syncs to take the median of")
    s.add_argument("--format", choices=("json", "table"), default="table")
    s.add_argument(
        "--state",
        choices=("default", "mixed"),
        default="default",
        help="the synthetic state: default (ClusterIPs, as every published figure) or mixed (NodePorts, externalIPs,"
        " load-balancer IPs, eTP=Local, services without endpoints)",
    )
    s.add_argument(
        "--ports-every",
        type=int,
        default=0,
        metavar="N",
        help="default state: every Nth service has three ports (http, https, metrics); 0 (default): one port each",
    )
    s.add_argument(
        "--udp-every",
        type=int,
        default=UDP_EVERY,
        metavar="N",
        help="default state: every Nth service is UDP (default %(default)s; 1: all of them, 0: none)",
    )
    bench_options.add_argument(s)
    s.add_argument(
        "--service-counters",
        action="store_true",
        help="with per-service traffic counters on (kproxy run's --service-counters)",
    )
    s.add_argument(
        "--reference",
        choices=REFERENCES,
        default=None,
        help="also time upstream kube-proxy's nftables layout for the same state, in a namespace of its own (a"
        " yardstick, never a mode)",
    )
    s.add_argument(
        "--reference-max-endpoints",
        type=int,
        default=DEFAULT_MAX_ENDPOINTS,
        metavar="N",
        help="run the reference only up to services x endpoints = N (default %(default)s: upstream's layout took 68 s"
        " in nft -f at 10,000 x 10 here)",
    )
    s.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)  # already in the bench namespace
    s.set_defaults(func=cmd_sync)

    d = sub.add_parser(
        "datapath",
        help="connections/s, latency, UDP and throughput through a ClusterIP in the lab, against the pod IP on nodes"
        " without proxy rules (measured in the same run)",
    )
    d.add_argument(
        "--mode",
        action="append",
        required=True,
        help="a backend, or 'none' (no proxy: the lab's own baseline); repeat or comma-separate for several",
    )
    d.add_argument("--services", default="1,1000", metavar="N[,N...]", help="service counts (default %(default)s)")
    d.add_argument("--endpoints", type=int, default=10, metavar="E", help="endpoints of each synthetic service")
    d.add_argument("--rounds", type=int, default=10, help="rounds per size; figures are their medians")
    d.add_argument("--seconds", type=float, default=0.5, help="measured seconds of each traffic phase")
    d.add_argument("--iperf-seconds", type=float, default=1.0, help="seconds of each iperf3 run")
    d.add_argument(
        "--conntrack-limits",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also measure the diagnostic limits every round: the limit's path with conntrack on, and with conntrack"
        " and nat on (the floor of a NAT-based proxy); 6 targets a round instead of 4 (default: on)",
    )
    d.add_argument(
        "--counters-cost",
        action="store_true",
        help="also measure what --service-counters costs the ClusterIP path: a ClusterIP target from each loaded node,"
        " one counting and one not in the same rounds, each proxied mode run twice with the roles swapped, and the"
        " counting node's /metrics checked against the connections made (kproxy.bench.dpcounters)",
    )
    bench_options.add_argument(d, "a requested mode's backend, given to the modes that declare it")
    d.add_argument("--lab-prefix", default="kpd-", help="the lab's namespace prefix (default %(default)s)")
    d.add_argument("--format", choices=("json", "table"), default="table")
    d.set_defaults(func=cmd_datapath)

    from kproxy.bench import apiscale  # light: the lab loads only when the command runs

    apiscale.register(sub)
    register_idle(sub)

    register_compare(subparsers)


def _sync_argv(args: argparse.Namespace) -> list[str]:
    return [
        "bench",
        "sync",
        "--mode",
        args.mode,
        "--services",
        str(args.services),
        "--endpoints",
        str(args.endpoints),
        "--repeat",
        str(args.repeat),
        "--format",
        args.format,
        "--state",
        args.state,
        f"--ports-every={args.ports_every}",
        f"--udp-every={args.udp_every}",
        *(f"--backend-option={opt}" for opt in args.backend_option),
        *(["--service-counters"] if args.service_counters else []),
        *(
            ["--reference", args.reference, f"--reference-max-endpoints={args.reference_max_endpoints}"]
            if args.reference
            else []
        ),
    ]


def cmd_sync(args: argparse.Namespace) -> int:
    # Imported here: the cache and the backends are only needed when a benchmark actually runs.
    from kproxy.bench.sync import BenchError, bound_failures, render, run_in_namespace, run_sync_bench

    try:  # typed, as the backend declares them (kproxy.proxier.Option)
        options = parse_option_assignments(backend_class(args.mode), args.backend_option)
    except (ValueError, BackendError) as exc:
        print(f"kproxy bench sync: {exc}", file=sys.stderr)
        return 2
    if args.reference and (args.ports_every or args.udp_every != UDP_EVERY):
        print("kproxy bench sync: --reference times its own state: no --ports-every or --udp-every", file=sys.stderr)
        return 2
    if args.mode != "fake" and not args.inside:
        return run_in_namespace(_sync_argv(args))
    try:
        result = run_sync_bench(
            args.mode,
            args.services,
            args.endpoints,
            args.repeat,
            options,
            args.state,
            args.service_counters,
            ports_every=args.ports_every,
            udp_every=args.udp_every,
        )
    except (BenchError, BackendError) as exc:
        print(f"kproxy bench sync: {exc}", file=sys.stderr)
        return 1
    if args.reference:
        from kproxy.bench.reference_nft import ReferenceError_, run_reference

        size = args.services * args.endpoints
        if size > args.reference_max_endpoints:
            result.reference_note = (
                f"not run: {args.services} x {args.endpoints} = {size} endpoints is over --reference-max-endpoints"
                f" {args.reference_max_endpoints} (upstream's layout took 68 s in nft -f at 10,000 x 10 here);"
                " raise it to time the reference at this size"
            )
        else:
            try:
                result.attach_reference(
                    run_reference(args.services, args.endpoints, args.repeat, args.reference).to_json()
                )
            except (ReferenceError_, OSError, subprocess.SubprocessError) as exc:
                print(f"kproxy bench sync: reference {args.reference}: {exc}", file=sys.stderr)
                return 1
    print(render(result, args.format))
    for failure in bound_failures(result):
        print(f"kproxy bench sync: bound failed: {failure}", file=sys.stderr)
    return 1 if bound_failures(result) else 0


def cmd_datapath(args: argparse.Namespace) -> int:
    import json
    import os

    from kproxy.bench.datapath import (
        NONE_MODE,
        DatapathConfig,
        DatapathError,
        LabError,
        check_modes,
        format_table,
        parse_sizes,
        run_datapath,
        stop_on_sigterm,
    )

    modes = [m.strip() for arg in args.mode for m in arg.split(",") if m.strip()]
    try:
        sizes = parse_sizes(args.services)
    except ValueError as exc:
        print(f"kproxy bench datapath: --services: {exc}", file=sys.stderr)
        return 2
    if args.rounds < 1 or args.seconds <= 0 or args.iperf_seconds < 1 or args.endpoints < 1:
        print("kproxy bench datapath: --rounds, --endpoints and --iperf-seconds >= 1, --seconds > 0", file=sys.stderr)
        return 2
    try:  # before anything starts: an option no requested mode declares is a typo, not a run without it
        per_mode = bench_options.parse_for_modes(modes, args.backend_option, skip=(NONE_MODE,))
    except (ValueError, BackendError) as exc:
        print(f"kproxy bench datapath: {exc}", file=sys.stderr)
        return 2
    problems = check_modes(modes)
    if problems:
        print("kproxy bench datapath: " + "; ".join(problems), file=sys.stderr)
        return 2
    if os.geteuid() != 0:
        print("kproxy bench datapath: needs root (it builds a lab of network namespaces)", file=sys.stderr)
        return 2
    config = DatapathConfig(
        rounds=args.rounds,
        seconds=args.seconds,
        iperf_seconds=args.iperf_seconds,
        endpoints=args.endpoints,
        prefix=args.lab_prefix,
        conntrack_limits=args.conntrack_limits,
        counters_cost=args.counters_cost,
        backend_options=per_mode,
    )

    def progress(msg: str, advance: int = 0) -> None:
        if msg:
            print(f"kproxy bench datapath: {msg}", file=sys.stderr, flush=True)

    from kproxy.bench.results import machine_facts

    machine = machine_facts()  # the commit and date of the run, not of whoever renders its report later
    stop_on_sigterm()
    try:
        result = run_datapath(modes, sizes, config, progress)
    except (DatapathError, LabError) as exc:
        print(f"kproxy bench datapath: {exc}", file=sys.stderr)
        return 1
    if args.format == "json":
        doc = {**result.to_json(), "machine": machine, "command": datapath_command(args, modes)}
        print(json.dumps(doc, indent=2))
    else:
        print(format_table(result))
    return 0


def datapath_command(args: argparse.Namespace, modes: list[str]) -> str:
    """The command behind a datapath results document, every option spelled out (defaults too)."""
    import shlex

    return (
        f"kproxy bench datapath --mode {','.join(modes)} --services {args.services} --endpoints {args.endpoints}"
        f" --rounds {args.rounds} --seconds {args.seconds:g} --iperf-seconds {args.iperf_seconds:g}"
        f" --{'' if args.conntrack_limits else 'no-'}conntrack-limits"
        + (" --counters-cost" if args.counters_cost else "")
        + "".join(f" --backend-option {shlex.quote(opt)}" for opt in args.backend_option)
        + f" --lab-prefix {args.lab_prefix} --format json"
    )


def register_idle(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """``kproxy bench idle`` (kproxy.bench.idle): its parser and handler live with it."""
    from kproxy.bench.idle import register

    register(sub)


def register_compare(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """``kproxy compare``: registered here so kproxy.cli wires it like the other tools."""
    from kproxy.bench.compare import register

    register(subparsers)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kproxy")
    register(parser.add_subparsers(dest="command", required=True, metavar="COMMAND"))
    args = parser.parse_args(argv)
    rc: int = args.func(args)
    return rc
