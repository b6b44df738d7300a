"""``kproxy compare``: the sync and data-path benchmarks for every available backend, with upstream kube-proxy's
nftables layout as a reference, written up as ``report.md``, ``results.json`` and PNG plots.

Steps, each shown on a progress display (rich: one bar over every benchmark step, with the step running now):

1. the data-path benchmark (kproxy.bench.datapath) in one lab for every mode and size (ascending, so a long run
   reaches its biggest size last), plus mode ``none`` at the smallest size (the lab's own baseline: pod IP against
   the limit with no proxy anywhere);
2. the sync benchmark (``kproxy bench sync --mode M --services N --endpoints E --format json``, in its own throwaway
   namespace) for every mode and size, ``--sync-runs`` times each (medians), and once per size ``kproxy bench sync
   --mode fake --reference upstream-nftables`` (the cache alone, and upstream's layout timed with ``nft -f`` in a
   namespace of its own; above ``--reference-max-endpoints`` services x endpoints it is skipped and the report says
   so);
3. the fairness burst (kproxy.bench.spread): per mode, ``--fairness-connections`` new connections to a service
   with several endpoints, in a small lab of its own with ``--service-counters`` on, and the spread its counters
   show (a chi-square test against the even split, the max/min share);
4. ``results.json`` (every figure and the exact command behind it), plots (kproxy.bench.plots) and ``report.md``
   (machine, kernel, versions, tables, plots, how to read them).

Modes come from ``kproxy.proxier.installed_backends()`` filtered by ``availability()``: a backend that lands later
appears without a change here.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kproxy.bench.reference_nft import DEFAULT_MAX_ENDPOINTS
from kproxy.bench.reference_nft import NAME as REFERENCE_NAME
from kproxy.bench.results import compare_results
from kproxy.bench.spread import CONNECTIONS

SYNC_TIMEOUT = 3600.0


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    c = subparsers.add_parser(
        "compare",
        help="sync and data-path benchmarks of every available backend (upstream's nftables layout beside):"
        " report.md, results.json, PNG plots",
    )
    c.add_argument("--modes", default=None, help="comma-separated modes (default: every installed, available one)")
    c.add_argument("--services", default="100,1000,10000", metavar="N[,N...]", help="sizes (default %(default)s)")
    c.add_argument("--endpoints", type=int, default=10, metavar="E", help="endpoints per service")
    c.add_argument("--out", default="kproxy-compare", metavar="DIR", help="where to write (default %(default)s)")
    c.add_argument("--sync-runs", type=int, default=3, help="runs of each sync benchmark (medians)")
    c.add_argument("--repeat", type=int, default=3, help="partial syncs per sync benchmark run")
    c.add_argument("--no-reference", action="store_true", help="skip upstream's nftables layout")
    c.add_argument(
        "--reference-max-endpoints",
        type=int,
        default=DEFAULT_MAX_ENDPOINTS,
        metavar="N",
        help="time the reference only up to services x endpoints = N (default %(default)s; 10,000 x 10 took 68 s)",
    )
    c.add_argument(
        "--datapath-services", default=None, metavar="N[,N...]", help="data-path sizes (default: --services)"
    )
    c.add_argument("--rounds", type=int, default=8, help="data-path rounds per size (medians)")
    c.add_argument("--seconds", type=float, default=0.5, help="seconds per data-path traffic phase")
    c.add_argument("--iperf-seconds", type=float, default=1.0, help="seconds per iperf3 run")
    c.add_argument("--no-sync", action="store_true", help="skip the sync benchmark")
    c.add_argument("--no-datapath", action="store_true", help="skip the data-path benchmark")
    c.add_argument("--no-baseline", action="store_true", help="skip mode none (no proxy) in the data-path run")
    c.add_argument("--no-fairness", action="store_true", help="skip the fairness burst (counters per endpoint)")
    c.add_argument(
        "--fairness-connections",
        type=int,
        default=CONNECTIONS,
        metavar="N",
        help="new connections per mode in the fairness burst (default %(default)s)",
    )
    c.add_argument(
        "--conntrack-limits",
        action="store_true",
        help="also measure the diagnostic limits every round (the limit's path with conntrack on, and with conntrack"
        " and nat on: the floor of a NAT-based proxy); 6 targets a round instead of 4, so off by default to keep a"
        " comparison of four modes inside 15 minutes here (kproxy bench datapath measures them unless"
        " --no-conntrack-limits)",
    )
    c.add_argument("--lab-prefix", default="kpd-", help="the data-path lab's prefix (default %(default)s)")
    c.set_defaults(func=cmd_compare)


def selected_modes(requested: str | None) -> tuple[list[str], dict[str, str]]:
    """(modes to run, modes skipped -> why). Default: every installed backend that is available here."""
    from kproxy.proxier import MODE_NAMES, availability, installed_backends

    names = [m.strip() for m in requested.split(",") if m.strip()] if requested else list(installed_backends())
    skipped = {}
    if not requested:
        for m in MODE_NAMES:
            if m not in names:
                skipped[m] = "not installed in this build"
    run = []
    for m in names:
        avail = availability(m)
        if avail:
            run.append(m)
        else:
            skipped[m] = avail.reason
    return run, skipped


# --- the sync benchmark ---------------------------------------------------------------------------------------------


def sync_argv(mode: str, n: int, e: int, repeat: int, reference: bool = False, ref_max: int = 0) -> list[str]:
    argv = ["bench", "sync", "--mode", mode, "--services", str(n), "--endpoints", str(e), "--repeat", str(repeat)]
    argv += ["--format", "json"]
    if reference:
        argv += ["--reference", REFERENCE_NAME, "--reference-max-endpoints", str(ref_max)]
    return argv


def run_sync(argv: Sequence[str]) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-m", "kproxy", *argv], capture_output=True, text=True, timeout=SYNC_TIMEOUT)
    if proc.returncode != 0:
        raise RuntimeError(f"kproxy {' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()[-800:]}")
    return dict(json.loads(proc.stdout))


def _median(values: Sequence[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return statistics.median(got) if got else None


def summarize_sync(mode: str, n: int, e: int, runs: list[dict[str, Any]], argv: Sequence[str]) -> dict[str, Any]:
    """Medians over the runs of one mode and size, with the command that produced them."""
    return {
        "mode": mode,
        "services": n,
        "endpoints": e,
        "runs": len(runs),
        "full_sync_s": _median([r["full_sync_s"] for r in runs]),
        "partial_sync_s": _median([r["partial_sync_s"] for r in runs]),
        "floor_s": _median([r.get("floor_s") for r in runs]),
        "partial_floor_s": _median([r.get("partial_floor_s") for r in runs]),
        "ratio": _median([r.get("ratio") for r in runs]),
        "rss_mb": _median([r["rss_mb"] for r in runs]),
        "full_sync_runs": [r["full_sync_s"] for r in runs],
        "command": "kproxy " + shlex.join(argv),
        "raw": runs,
    }


# --- the command ----------------------------------------------------------------------------------------------------


class _Display:
    """The progress display on stderr: one rich bar over all steps with the step running now on a terminal; plain
    ``[done/total] step`` lines otherwise (a log file, CI), where a live bar would print nothing until the end."""

    def __init__(self, total: int) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.console = Console(stderr=True)
        self.live = self.console.is_terminal
        self.total, self.done = total, 0
        self.progress = Progress(
            TextColumn("[bold]kproxy compare[/bold]"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.description}"),
            console=self.console,
        )
        self.task = self.progress.add_task("starting", total=total)
        self.t0 = time.monotonic()

    def __enter__(self) -> _Display:
        if self.live:
            self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.live:
            self.progress.stop()

    def say(self, msg: str, advance: int = 0) -> None:
        self.done += advance
        if self.live:
            if msg:
                self.progress.update(self.task, description=msg)
            if advance:
                self.progress.advance(self.task, advance)
        elif msg:
            elapsed = time.monotonic() - self.t0
            print(f"kproxy compare [{self.done}/{self.total} {elapsed:4.0f}s] {msg}", file=sys.stderr, flush=True)


def _parse_sizes(text: str) -> list[int]:
    from kproxy.bench.datapath import parse_sizes

    return parse_sizes(text)


def compare_command(args: argparse.Namespace) -> str:
    """The command behind a results document, every option spelled out from the parsed ones (defaults too): it
    reruns the same comparison however this one was started (``kproxy compare``, a wrapper, a test), and never
    depends on the process's own command line."""
    argv = ["compare", *(["--modes", args.modes] if args.modes else []), "--services", args.services]
    argv += ["--endpoints", str(args.endpoints), "--out", args.out]
    argv += ["--sync-runs", str(args.sync_runs), "--repeat", str(args.repeat)]
    argv += ["--reference-max-endpoints", str(args.reference_max_endpoints)]
    if args.datapath_services:
        argv += ["--datapath-services", args.datapath_services]
    argv += ["--rounds", str(args.rounds), "--seconds", str(args.seconds), "--iperf-seconds", str(args.iperf_seconds)]
    argv += ["--fairness-connections", str(args.fairness_connections)]
    flags = ("no_reference", "no_sync", "no_datapath", "no_baseline", "conntrack_limits", "no_fairness")
    argv += ["--" + flag.replace("_", "-") for flag in flags if getattr(args, flag)]
    return "kproxy " + shlex.join([*argv, "--lab-prefix", args.lab_prefix])


def cmd_compare(args: argparse.Namespace) -> int:
    if os.geteuid() != 0:
        print("kproxy compare: needs root (network namespaces for every benchmark)", file=sys.stderr)
        return 2
    try:
        sizes = _parse_sizes(args.services)
        dp_sizes = _parse_sizes(args.datapath_services) if args.datapath_services else sizes
    except ValueError as exc:
        print(f"kproxy compare: {exc}", file=sys.stderr)
        return 2
    modes, skipped = selected_modes(args.modes)
    if args.fairness_connections < 1:
        print("kproxy compare: --fairness-connections must be at least 1", file=sys.stderr)
        return 2
    if not modes:
        print("kproxy compare: no mode can run here: " + "; ".join(f"{k}: {v}" for k, v in skipped.items()))
        return 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = compare_results(
        compare_command(args), modes, skipped, sizes, [] if args.no_datapath else dp_sizes, args.endpoints
    )
    baseline = not args.no_baseline
    n_sync = 0 if args.no_sync else len(sizes) * (len(modes) * args.sync_runs + (0 if args.no_reference else 1))
    n_dp = 0
    if not args.no_datapath:
        from kproxy.bench.datapath import CONNTRACK_LIMITS

        per_round = 3 + (len(CONNTRACK_LIMITS) if args.conntrack_limits else 0)
        n_dp = len(dp_sizes) * len(modes) * args.rounds * per_round
        n_dp += args.rounds * (per_round - 1) if baseline else 0
    from kproxy.bench.datapath import stop_on_sigterm

    stop_on_sigterm()
    t_start = time.monotonic()
    try:
        n_fair = 0 if args.no_fairness else len(modes)
        with _Display(n_sync + n_dp + n_fair) as display:
            # the data path first: its lab takes the sizes in ascending order, so a long run reaches its biggest
            # (and most expensive) size last; then the sync benchmark, each run in a namespace of its own
            if not args.no_datapath:
                _datapath_steps(args, modes, dp_sizes, baseline, results, display, out)
                _write_results(out, results)
            if not args.no_fairness:  # after the data-path lab is down: its own lab, under the same prefix
                _fairness_steps(args, modes, results, display, out)
            if not args.no_sync:
                _sync_steps(args, modes, sizes, results, display)
    except (KeyboardInterrupt, SystemExit):
        results["notes"].append("interrupted: the figures are those measured until then")
        _write_results(out, results)
        print("kproxy compare: interrupted; partial results in " + str(out / "results.json"), file=sys.stderr)
        return 130
    except Exception as exc:
        results["notes"].append(f"stopped by an error: {exc}")
        _write_results(out, results)
        print(f"kproxy compare: {exc}", file=sys.stderr)
        return 1
    results["elapsed_s"] = round(time.monotonic() - t_start, 1)
    _write_results(out, results)
    from kproxy.bench import plots, report

    files = plots.write_all(results, out)
    (out / "report.md").write_text(report.render(results, files))
    print(f"kproxy compare: wrote {out / 'report.md'}, {out / 'results.json'} and {', '.join(files)}")
    return 0


def _write_results(out: Path, results: dict[str, Any]) -> None:
    tmp = out / "results.json.tmp"
    tmp.write_text(json.dumps(results, indent=2, default=str) + "\n")
    tmp.replace(out / "results.json")


def _fairness_steps(
    args: argparse.Namespace, modes: list[str], results: dict[str, Any], display: _Display, out: Path
) -> None:
    """The fairness burst in every mode, one lab for all (kproxy.bench.spread); a mode that fails is a finding."""
    from kproxy.bench.spread import ENDPOINTS, FairnessError, FairnessLab

    runs: list[dict[str, Any]] = []
    n = args.fairness_connections
    results["fairness"] = {"connections": n, "endpoints": ENDPOINTS, "runs": runs}
    try:
        with FairnessLab(args.lab_prefix, lambda msg: display.say(msg)) as lab:
            for mode in modes:
                display.say(f"fairness: {mode}, {n} connections over {ENDPOINTS} endpoints")
                try:
                    entry = lab.measure(mode, n)
                    entry["command"] = "kproxy " + shlex.join(_fairness_argv(mode, args))
                except (FairnessError, RuntimeError, OSError) as exc:  # LabError is a RuntimeError
                    entry = {"mode": mode, "connections": n, "fairness": None, "error": str(exc)[:2000]}
                runs.append(entry)
                _write_results(out, results)
                display.say("", 1)
    except (FairnessError, RuntimeError, OSError) as exc:  # the lab itself: a finding, the sync benchmark still runs
        results["notes"].append(f"fairness: not measured: {str(exc)[:2000]}")
        display.say("", len(modes) - len(runs))


def _fairness_argv(mode: str, args: argparse.Namespace) -> list[str]:
    """The comparison that measures ``mode``'s fairness burst alone."""
    argv = ["compare", "--modes", mode, "--no-sync", "--no-datapath", "--no-reference"]
    return [*argv, "--fairness-connections", str(args.fairness_connections), "--lab-prefix", args.lab_prefix]


def _sync_steps(
    args: argparse.Namespace, modes: list[str], sizes: list[int], results: dict[str, Any], display: _Display
) -> None:
    e = args.endpoints
    for n in sizes:
        if not args.no_reference:
            argv = sync_argv("fake", n, e, args.repeat, reference=True, ref_max=args.reference_max_endpoints)
            display.say(f"sync: cache alone + {REFERENCE_NAME} @ {n} x {e}")
            doc = run_sync(argv)
            display.say("", 1)
            results["cache_alone"].append(summarize_sync("fake", n, e, [doc], argv))
            ref = doc.get("reference")
            entry: dict[str, Any] = {"services": n, "endpoints": e, "command": "kproxy " + shlex.join(argv)}
            if ref:
                entry.update(ref)
            else:
                entry["note"] = doc.get("reference_note") or "not run"
            results["reference"].append(entry)
        for mode in modes:
            argv = sync_argv(mode, n, e, args.repeat)
            runs = []
            for r in range(args.sync_runs):
                display.say(f"sync: {mode} @ {n} x {e}, run {r + 1}/{args.sync_runs}")
                runs.append(run_sync(argv))
                display.say("", 1)
            results["sync"].append(summarize_sync(mode, n, e, runs, argv))


def _datapath_steps(
    args: argparse.Namespace,
    modes: list[str],
    sizes: list[int],
    baseline: bool,
    results: dict[str, Any],
    display: _Display,
    out: Path,
) -> None:
    from kproxy.bench.datapath import NONE_MODE, DatapathConfig, DatapathRun

    config = DatapathConfig(
        rounds=args.rounds,
        seconds=args.seconds,
        iperf_seconds=args.iperf_seconds,
        endpoints=args.endpoints,
        prefix=args.lab_prefix,
        conntrack_limits=args.conntrack_limits,
    )
    runs: list[dict[str, Any]] = []
    results["datapath"] = {"config": config.describe(), "runs": runs, "commands": {}}
    for mode in modes:
        results["datapath"]["commands"][mode] = "kproxy " + shlex.join(_datapath_argv(mode, sizes, args))
    if baseline:
        results["datapath"]["commands"][NONE_MODE] = "kproxy " + shlex.join(_datapath_argv(NONE_MODE, sizes[:1], args))
    # the baseline runs once, at the smallest size: with no proxy the service count cannot matter
    plan: list[tuple[int, list[str]]] = []
    for i, n in enumerate(sizes):
        plan.append((n, ([NONE_MODE] if baseline and i == 0 else []) + modes))

    def on_run(run: DatapathRun) -> None:
        runs.append(run.to_json())
        _write_results(out, results)

    def progress(msg: str, advance: int = 0) -> None:
        display.say(f"datapath: {msg}" if msg else "", advance)

    # one lab for every size and mode (sizes ascending: services are only ever added)
    _run_plan(plan, config, progress, on_run)


def _run_plan(
    plan: list[tuple[int, list[str]]],
    config: Any,
    progress: Callable[..., None],
    on_run: Callable[[Any], None],
) -> None:
    from kproxy.bench.datapath import DatapathLab, run_in_lab

    with DatapathLab(config, progress) as dl:
        for n, modes in plan:
            run_in_lab(dl, modes, n, on_run)


def _datapath_argv(mode: str, sizes: Sequence[int], args: argparse.Namespace) -> list[str]:
    return [
        "bench",
        "datapath",
        "--mode",
        mode,
        "--services",
        ",".join(map(str, sizes)),
        "--endpoints",
        str(args.endpoints),
        "--rounds",
        str(args.rounds),
        "--seconds",
        str(args.seconds),
        "--iperf-seconds",
        str(args.iperf_seconds),
        *([] if args.conntrack_limits else ["--no-conntrack-limits"]),  # as this comparison measured
    ]
