"""`kproxy apiserver`: the command line of the API stand-in, small enough to load with every `kproxy` command.

``register`` adds the sub-command to the `kproxy` parser; the stand-in itself (``kproxy.lab.apistore``,
``kproxy.lab.apihttp``) is imported only when the command runs, so `kproxy run` and the other commands never load
it. For the same reason the help states the store's defaults (history length, service CIDRs) as text; a unit test
holds them equal to ``kproxy.lab.apistore``'s.
"""

from __future__ import annotations

import argparse
import logging
import sys

log = logging.getLogger("kproxy.lab.apiserver")


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add `apiserver` to a command line; the handler is set as the `func` default and returns an exit code."""
    p = subparsers.add_parser(
        "apiserver",
        help="run the in-memory Kubernetes API stand-in (for the lab and tests)",
        description="An in-memory Kubernetes API server for Services, EndpointSlices, Nodes and Events.",
    )
    p.add_argument(
        "--listen",
        action="append",
        default=[],
        metavar="[NETNS/]HOST:PORT",
        help="address to listen on, optionally inside a network namespace (repeatable; default 127.0.0.1:6443)",
    )
    p.add_argument("--port-file", default="", help="write the first bound port to this file (for port 0)")
    p.add_argument("--load", default="", metavar="DIR", help="preload the YAML/JSON manifests in this folder")
    p.add_argument("--history", type=int, default=None, help="watch events kept for resuming watches (default 10000)")
    p.add_argument("--bookmark-interval", type=float, default=5.0, help="seconds between watch BOOKMARK events")
    p.add_argument(
        "--service-cidr",
        action="append",
        default=[],
        help="ClusterIP range(s) to allocate from (default 198.19.128.0/17 and fd00:198:18:ffff::/108)",
    )
    p.set_defaults(func=run_command)


def run_command(args: argparse.Namespace) -> int:
    import signal
    import threading
    from pathlib import Path

    from kproxy.gcpause import collector_paused
    from kproxy.lab.apihttp import parse_listen, serve
    from kproxy.lab.apistore import DEFAULT_HISTORY, DEFAULT_SERVICE_CIDRS

    try:
        listens = [parse_listen(text) for text in (args.listen or ["127.0.0.1:6443"])]
    except ValueError as exc:
        print(f"kproxy apiserver: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()

    def on_signal(_signum: int, _frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        api = serve(
            listens,
            history=DEFAULT_HISTORY if args.history is None else args.history,
            bookmark_interval=args.bookmark_interval,
            service_cidrs=args.service_cidr or DEFAULT_SERVICE_CIDRS,
        )
    except OSError as exc:
        print(f"kproxy apiserver: cannot listen: {exc}", file=sys.stderr)
        return 1
    try:
        if args.load:
            count = api.load(args.load)
            log.info("apiserver: loaded %d objects from %s", count, args.load)
        if args.port_file:
            tmp = Path(f"{args.port_file}.tmp")
            tmp.write_text(f"{api.ports[0]}\n")
            tmp.replace(args.port_file)
        log.info(
            "apiserver: listening on %s",
            ", ".join(f"{lst.netns or '-'}/{lst.host}:{port}" for lst, port in zip(listens, api.ports, strict=True)),
        )
        # the store holds every object of a scale run (100,000 Services and EndpointSlices: millions of dicts) and a
        # churn keeps replacing them: the collector's full walks of that heap (one every ~50 s of a 1,000/s churn,
        # a second or more each) stalled every watch stream meanwhile, which the nodes' programming latency then
        # counted as kproxy's. Settled each second as kproxy's own heap is (kproxy.gcpause)
        while not stop.wait(1.0):
            collector_paused.settle()
    finally:
        api.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kproxy.lab.apiserver")
    sub = parser.add_subparsers(dest="command", required=True)
    register(sub)
    args = parser.parse_args(argv if argv is not None else ["apiserver", *sys.argv[1:]])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    return int(args.func(args))
