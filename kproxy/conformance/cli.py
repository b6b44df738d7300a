"""``kproxy conformance``: run the conformance scenarios on a lab with one backend and report.

Prints a table (scenario x backend) or the JSON report on stdout, progress on stderr, optionally writes JUnit XML and
the JSON to files, and exits 1 when any scenario FAILs or could not be checked because of the lab (too few nodes or
pods, no IPv6; a mode's own not-applicable scenarios are not failures), 2 when the suite cannot run. ``--mode`` may be
repeated, or ``all`` (every installed mode this host can run): each mode gets its own fresh lab, one after the other;
the JSON is then a list with one report per mode.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kproxy.conformance.report import FAIL, Report, Result, format_table, to_json, to_junit
from kproxy.conformance.scenarios import SCENARIO_IDS
from kproxy.proxier import BackendError, backend_class, parse_option_assignments


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser(
        "conformance",
        help="run the conformance scenarios on a lab with one backend",
        description="Run BEHAVIOUR.md's scenarios on real packets in a network-namespace lab (needs root). "
        "Scenarios: " + ", ".join(SCENARIO_IDS),
    )
    p.add_argument("--mode", action="append", help="the backend to test (repeatable; 'all': every available one)")
    p.add_argument("--list", action="store_true", help="list the scenarios and exit")
    p.add_argument("--scenario", action="append", default=[], metavar="ID", help="run only these (repeatable)")
    p.add_argument("--format", choices=("table", "json"), default="table", help="what to print on stdout")
    p.add_argument("--junit", metavar="FILE", help="also write JUnit XML here")
    p.add_argument("--json", dest="json_file", metavar="FILE", help="also write the JSON report here")
    p.add_argument("--keep-lab", action="store_true", help="leave the lab running afterwards")
    p.add_argument("--reuse-lab", action="store_true", help="use the running lab (and keep it) instead of a fresh one")
    p.add_argument(
        "--replace-lab",
        action="store_true",
        help="take down a lab already running under the prefix and bring up a fresh one (without this, or "
        "--reuse-lab, a running lab is left alone and the run refuses to start)",
    )
    p.add_argument("--lab-prefix", default=None, help="namespace prefix of the lab (default: the lab's own, kpl-)")
    p.add_argument(
        "--backend-option",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an option of the tested mode's backend for every node (repeatable), e.g. iptables_flavour=legacy",
    )
    p.set_defaults(func=cmd_conformance)


def _progress(result: Result) -> None:
    word = {"pass": "pass", "fail": "FAIL", "not-applicable": "n/a"}[result.status]
    line = f"{result.scenario:<26} {word:<5} {result.seconds:6.1f} s"
    if result.detail and result.status != "pass":
        line += f"  {result.detail}"
    print(line, file=sys.stderr, flush=True)


def _modes(requested: list[str]) -> list[str]:
    from kproxy.proxier import availability, installed_backends

    if "all" not in requested:
        return list(dict.fromkeys(requested))
    modes = []
    for mode in installed_backends():
        avail = availability(mode)
        if avail:
            modes.append(mode)
        else:
            print(f"kproxy conformance: skipping {mode}: {avail.reason}", file=sys.stderr)
    return modes


def cmd_conformance(args: argparse.Namespace) -> int:
    from kproxy.conformance.runner import ConformanceError, run

    if args.list:
        from kproxy.conformance.scenarios import SCENARIOS

        for sc in SCENARIOS:
            needs = f"  (needs {', '.join(sorted(sc.needs))})" if sc.needs else ""
            print(f"{sc.id:<26}{sc.title}{needs}")
        return 0
    if not args.mode:
        print("kproxy conformance: --mode is required", file=sys.stderr)
        return 2
    reports: list[Report] = []
    modes = _modes(args.mode)
    if not modes:
        print("kproxy conformance: no mode to test", file=sys.stderr)
        return 2
    for mode in modes:
        print(f"--- {mode}", file=sys.stderr, flush=True)
        try:
            options = parse_option_assignments(backend_class(mode), args.backend_option)
        except (ValueError, BackendError) as exc:
            print(f"kproxy conformance: {exc}", file=sys.stderr)
            return 2
        try:
            reports.append(
                run(
                    mode,
                    args.scenario or None,
                    keep_lab=args.keep_lab and mode == modes[-1],
                    reuse_lab=args.reuse_lab,
                    replace_lab=args.replace_lab,
                    prefix=args.lab_prefix,
                    progress=_progress,
                    backend_options=options,
                )
            )
        except ConformanceError as exc:
            print(f"kproxy conformance: {exc}", file=sys.stderr)
            return 2
    if args.junit:
        Path(args.junit).write_text(to_junit(reports))
    text = to_json(reports[0]) if len(reports) == 1 else "[\n" + ",\n".join(to_json(r) for r in reports) + "\n]"
    if args.json_file:
        Path(args.json_file).write_text(text + "\n")
    print(text if args.format == "json" else format_table(reports))
    gaps = sorted({s for rep in reports for s in rep.lab_gaps})
    if gaps:
        print(
            f"kproxy conformance: {len(gaps)} scenario(s) not checked, this lab cannot run them: {', '.join(gaps)}"
            " (a lab with the defaults, 2 nodes x 3 pods with IPv6, runs them all)",
            file=sys.stderr,
        )
    return 1 if gaps or any(r.status == FAIL for rep in reports for r in rep.results) else 0


def main(argv: list[str] | None = None) -> int:
    """``python -m kproxy.conformance.cli --mode iptables ...`` without the rest of the kproxy command."""
    parser = argparse.ArgumentParser(prog="kproxy")
    sub = parser.add_subparsers(dest="command", required=True)
    register(sub)
    args = parser.parse_args(["conformance", *(argv if argv is not None else sys.argv[1:])])
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
