"""``kproxy soak``: the command line of the soak (see ``kproxy.soak``); the run itself loads only when it runs.

Exit codes: 0 when the run passed (no lost change, no drift, every fault converged, the held connection open, no failed
new connection outside kproxy restarts, every sampled packet answered as the reference model says, the kernel view
holding exactly the model's service ports), 1 when it did not, 2 for a usage error or a run that could not start. With
``--mode all`` (``make soak``) a mode whose run could not start is reported (``{"mode", "ok": false, "error"}`` in the
JSON) and the next mode runs; the exit code is then 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

FAULTS_HELP = "none, watch_drop, http_5xx, gone_410, kproxy_kill, flush, api_restart, apply_fail"


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser(
        "soak",
        help="churn Services and EndpointSlices on the lab under faults and prove nothing is lost",
        description="A bounded run on the lab: changes at --rate per second while faults are injected on a schedule, "
        "a held TCP connection and new connections through a ClusterIP throughout; at checkpoints every node must "
        "program exactly what the API holds, read back without drift, and answer real packets.",
    )
    p.add_argument("--mode", required=True, help="the backend to soak (an available mode), or 'all': each in turn")
    p.add_argument(
        "--minutes",
        type=float,
        default=1.0,
        help="minutes of churn and faults (default 1), rounded up to whole cycles of the fault kinds",
    )
    p.add_argument(
        "--cycles", type=int, default=0, help="run this many whole cycles of the fault kinds instead of --minutes"
    )
    p.add_argument(
        "--sample",
        type=int,
        default=16,
        help="at most this many changed services tried with packets at each checkpoint (default 16)",
    )
    p.add_argument("--rate", type=float, default=5.0, help="changes per second (default 5)")
    p.add_argument("--lab-prefix", default="kps-", help="namespace prefix of the soak's lab (default kps-)")
    p.add_argument("--reuse-lab", action="store_true", help="use the running lab under the prefix if there is one")
    p.add_argument("--keep-lab", action="store_true", help="leave the lab running afterwards (for a look)")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--pods-per-node", type=int, default=3)
    p.add_argument("--no-ipv6", action="store_true", help="an IPv4-only lab")
    p.add_argument("--seed", type=int, default=1, help="the churn's random seed")
    p.add_argument(
        "--faults", default="", help=f"comma-separated fault kinds, in schedule order (default all: {FAULTS_HELP})"
    )
    p.add_argument("--fault-window", type=float, default=4.0, help="seconds of churn under each fault (default 4)")
    p.add_argument("--converge-timeout", type=float, default=40.0, help="seconds allowed to converge after a fault")
    p.add_argument(
        "--drift-check",
        choices=("verify", "kernel-view"),
        default="verify",
        help="how each node's kernel is read back: its /verify (default) or the mode's kernel_view from outside",
    )
    p.add_argument("--json", dest="json_out", default="", metavar="FILE", help="write the JSON report here too")
    p.add_argument("--format", choices=("table", "json"), default="table", help="what to print at the end")
    p.set_defaults(func=run_command)


def run_command(args: argparse.Namespace) -> int:
    from kproxy.proxier import available_backends
    from kproxy.soak.run import FAULT_KINDS, Soak, SoakError, SoakOptions, render

    # the expectation runs kproxy's own cache, which warns about every bad object the churn writes, on purpose
    logging.getLogger("kproxy.cache").setLevel(logging.ERROR)
    faults = tuple(f.strip() for f in args.faults.split(",") if f.strip()) or FAULT_KINDS
    modes = list(available_backends()) if args.mode == "all" else [args.mode]
    if not modes:
        print("kproxy soak: no mode is available here", file=sys.stderr)
        return 2
    reports: dict[str, dict[str, object]] = {}
    errors = 0
    for mode in modes:
        try:
            opts = SoakOptions(
                mode=mode,
                minutes=args.minutes,
                rate=args.rate,
                prefix=args.lab_prefix,
                reuse_lab=args.reuse_lab,
                keep_lab=args.keep_lab and len(modes) == 1,
                nodes=args.nodes,
                pods_per_node=args.pods_per_node,
                ipv6=not args.no_ipv6,
                seed=args.seed,
                cycles=args.cycles,
                sample=args.sample,
                faults=faults,
                fault_window=args.fault_window,
                converge_timeout=args.converge_timeout,
                drift_check=args.drift_check,
            )
            soak = Soak(opts, progress=lambda text: print(text, file=sys.stderr, flush=True))
            reports[mode] = soak.run()
        except SoakError as exc:
            print(f"kproxy soak --mode {mode}: {exc}", file=sys.stderr)
            if args.mode != "all":
                return 2
            errors += 1
            reports[mode] = {"mode": mode, "ok": False, "error": str(exc)}
            continue
        if args.format == "table":
            print(render(reports[mode]), flush=True)
    text = json.dumps(reports if args.mode == "all" else reports[modes[0]], indent=2)
    if args.json_out:
        Path(args.json_out).write_text(text + "\n")
    if args.format == "json":
        print(text)
    if errors:
        return 2
    return 0 if all(r["ok"] for r in reports.values()) else 1
