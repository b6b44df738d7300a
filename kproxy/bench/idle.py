"""``kproxy bench idle``: what an idle node costs, per mode, at N services x E endpoints.

An idle node must cost almost nothing: a proxy that burns CPU between changes steals it from the pods. This runs the
process a node runs and watches it do nothing; the decisions:

- **A real ``kproxy run``** (``python -m kproxy run``, its drift watcher included) per mode, with kproxy's default
  sync periods, in a network namespace of its own and, as a lab node, a cgroup of its own and the backend's per-node
  options (``Proxier.lab_options``: the bpf mode's cgroup and pin folder, never the machine's shared ones).
- **Fed from a manifest folder** (``kproxy.sources.files``) holding ``kproxy bench sync``'s synthetic state, so no
  API server runs beside it. That source looks at the folder with ``stat`` once a second (a few system calls); a
  node's kube source waits on its watch instead.
- **The window** starts once the runner's first sync is done (``/rules``' sync count: ``/healthz`` answers 200 as
  soon as the rules are in, before the sync's after-work such as the conntrack reconcile, which can take minutes)
  and ``--settle`` seconds have passed; both times are reported. CPU is ``utime + stime`` of the process and
  of its children it has waited for (``/proc/PID/stat`` fields 14-17), so an ``iptables-restore`` counts; RSS from
  ``/proc/PID/status``; syncs, full syncs, services written and drift checks and repairs are the increase of the
  daemon's own ``/metrics`` counters over the window (scraped outside it). The busiest threads
  (``/proc/PID/task``) say where CPU went when a mode is not idle.
- Everything a run makes (the namespace, the cgroup, what the backend left outside the namespace, the process) goes
  when the run ends, fails or is interrupted; a namespace left by a run that was killed outright is removed by the
  next run with the same prefix.

What the figures are on a quiet machine is in docs/PERFORMANCE.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

from kproxy.bench import synthetic
from kproxy.config import ProxyConfig
from kproxy.lab import netns
from kproxy.lab.state import module_env, tail
from kproxy.proxier import LabNodeSpec, backend_class, installed_backends, option_arguments
from kproxy.toolkit.netns import in_netns

NODE = "node-1"  # synthetic's node: half of every service's endpoints are local
CLUSTER_CIDR = "198.18.64.0/18"
HEALTHZ = ("127.0.0.1", 10256)
METRICS = ("127.0.0.1", 10249)
CGROUP_MOUNT = Path("/run/kproxy-bench-idle/cgroup2")  # a cgroup2 mount of this benchmark's own
CGROUP_PARENT = CGROUP_MOUNT / "kproxy-bench-idle"  # every run's node cgroups, beside the machine's own
CLK_TCK = os.sysconf("SC_CLK_TCK")
STOP_TIMEOUT = 130.0  # kproxy's own stop waits up to 120 s for a sync in progress
Progress = Callable[[str], None]


class IdleError(RuntimeError):
    """A run that could not measure (the daemon died, never synced, a place could not be made)."""


# --- pure parts --------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ProcStat:
    """The fields of ``/proc/PID/stat`` (or ``/proc/PID/task/TID/stat``) this benchmark reads, times in clock ticks."""

    comm: str
    state: str
    utime: int
    stime: int
    cutime: int
    cstime: int
    threads: int
    rss_pages: int

    @property
    def ticks(self) -> int:
        """CPU of the process and of the children it has waited for."""
        return self.utime + self.stime + self.cutime + self.cstime


def parse_stat(text: str) -> ProcStat:
    """One ``/proc/PID/stat`` line; ``comm`` (field 2) may hold spaces and parentheses, so the fields are counted
    after the last ``)``. A ValueError names what is wrong."""
    head, sep, rest = text.rpartition(")")
    if not sep or "(" not in head:
        raise ValueError(f"not a /proc stat line: {text[:80]!r}")
    f = rest.split()  # f[0] is field 3 (state): field n is f[n - 3]
    if len(f) < 22:
        raise ValueError(f"a /proc stat line with {len(f) + 2} fields, expected at least 24")
    try:
        return ProcStat(
            comm=head.partition("(")[2],
            state=f[0],
            utime=int(f[11]),
            stime=int(f[12]),
            cutime=int(f[13]),
            cstime=int(f[14]),
            threads=int(f[17]),
            rss_pages=int(f[21]),
        )
    except ValueError:
        raise ValueError(f"a /proc stat line with a non-numeric time or count: {text[:120]!r}") from None


def status_kib(text: str, key: str) -> int | None:
    """A ``kB`` figure of ``/proc/PID/status`` (``VmRSS``, ``VmHWM``), None when absent."""
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        if sep and name == key:
            parts = value.split()
            return int(parts[0]) if parts and parts[0].isdigit() else None
    return None


#: what the report counts, from the daemon's /metrics: name -> (sample, how the IP families combine)
COUNTS: dict[str, tuple[str, str]] = {
    "syncs": ("kproxy_syncs_total", "max"),  # one sync of both families counts once
    "full_syncs": ("kubeproxy_sync_full_proxy_rules_duration_seconds_count", "max"),
    "services_written": ("kproxy_sync_services_written_total", "sum"),
    "drift_checks": ("kproxy_drift_checks_total", "max"),
    "drift_repairs": ("kproxy_drift_repairs_total", "max"),
}


def counts(exposition: str) -> dict[str, float | None]:
    """COUNTS read from one /metrics text (prometheus_client's parser): per family summed over the other labels,
    then combined over the families as COUNTS says; 0 for a declared metric without samples yet, None when the
    daemon does not declare it."""
    from prometheus_client.parser import text_string_to_metric_families

    per: dict[str, dict[str, float]] = {}
    wanted = {sample: key for key, (sample, _) in COUNTS.items()}
    for fam in text_string_to_metric_families(exposition):
        for sample, key in wanted.items():
            if sample in (fam.name, f"{fam.name}_total", f"{fam.name}_count"):
                per.setdefault(key, {})  # declared: a labelled count with no sample yet is 0
        for s in fam.samples:
            found = wanted.get(s.name)
            if found is not None:
                fams = per.setdefault(found, {})
                label = s.labels.get("ip_family", "")
                fams[label] = fams.get(label, 0.0) + s.value
    out: dict[str, float | None] = {}
    for key, (_, how) in COUNTS.items():
        if key not in per:
            out[key] = None
            continue
        values = list(per[key].values()) or [0.0]
        out[key] = sum(values) if how == "sum" else max(values)
    return out


def increase(before: Mapping[str, float | None], after: Mapping[str, float | None]) -> dict[str, int | None]:
    """How much each count grew between two ``counts`` readings (None when either lacks it)."""
    out: dict[str, int | None] = {}
    for k in COUNTS:
        a, b = before.get(k), after.get(k)
        out[k] = None if a is None or b is None else int(round(b - a))
    return out


@dataclass
class IdleRun:
    """One mode's idle window."""

    mode: str
    services: int
    endpoints: int
    first_sync_s: float  # from the start of the process to /healthz 200 (the rules are in)
    sync_done_s: float  # ... to the end of the runner's first sync (its after-sync work: the conntrack reconcile...)
    window_s: float
    cpu_s: float
    rss_mb: float
    rss_peak_mb: float
    threads: int
    counts: dict[str, int | None]
    busiest_threads: list[dict[str, Any]] = field(default_factory=list)

    @property
    def cpu_s_per_min(self) -> float:
        return self.cpu_s * 60.0 / self.window_s

    @property
    def core_share(self) -> float:
        """The share of one core the daemon used over the window (0.01: 1 %)."""
        return self.cpu_s / self.window_s

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["cpu_s_per_min"] = round(self.cpu_s_per_min, 4)
        out["core_share"] = round(self.core_share, 5)
        return out


def _count(v: int | None) -> str:
    return "-" if v is None else str(v)


def format_table(runs: Sequence[IdleRun], note: str = "") -> str:
    """The short table: one line per mode."""
    head = (
        f"{'mode':<10} {'1st sync s':>10} {'done s':>7} {'window s':>8} {'CPU s/min':>9} {'core %':>7} {'RSS MB':>7} "
        f"{'syncs':>5} {'full':>4} {'written':>7} {'checks':>6} {'repairs':>7}  busiest thread"
    )
    lines = [head, "-" * len(head)]
    for r in runs:
        c = r.counts
        busy = r.busiest_threads[0] if r.busiest_threads else None
        where = f"{busy['comm']} (tid {busy['tid']}) {busy['cpu_s']:.2f} s" if busy else "-"
        lines.append(
            f"{r.mode:<10} {r.first_sync_s:>10.1f} {r.sync_done_s:>7.1f} {r.window_s:>8.1f} {r.cpu_s_per_min:>9.3f} "
            f"{100 * r.core_share:>6.2f}% {r.rss_mb:>7.1f} {_count(c.get('syncs')):>5} "
            f"{_count(c.get('full_syncs')):>4} {_count(c.get('services_written')):>7} "
            f"{_count(c.get('drift_checks')):>6} {_count(c.get('drift_repairs')):>7}  {where}"
        )
    if note:
        lines.append(note)
    return "\n".join(lines)


# --- the process -------------------------------------------------------------------------------------------------


def read_stat(pid: int) -> ProcStat:
    return parse_stat(Path(f"/proc/{pid}/stat").read_text())


def thread_ticks(pid: int) -> dict[int, tuple[str, int]]:
    """tid -> (comm, utime + stime) of each thread of ``pid`` (threads gone meanwhile are left out)."""
    out: dict[int, tuple[str, int]] = {}
    with contextlib.suppress(OSError):
        for entry in os.scandir(f"/proc/{pid}/task"):
            try:
                st = parse_stat(Path(entry.path, "stat").read_text())
            except (OSError, ValueError):
                continue
            out[int(entry.name)] = (st.comm, st.utime + st.stime)
    return out


def busiest(before: Mapping[int, tuple[str, int]], after: Mapping[int, tuple[str, int]]) -> list[dict[str, Any]]:
    """The three threads that used most CPU between two ``thread_ticks`` readings (a thread born meanwhile from 0)."""
    used = [(ticks - before.get(tid, (comm, 0))[1], tid, comm) for tid, (comm, ticks) in after.items()]
    used.sort(reverse=True)
    return [{"tid": tid, "comm": comm, "cpu_s": round(t / CLK_TCK, 3)} for t, tid, comm in used[:3] if t > 0]


def http_get(ns: str, where: tuple[str, int], path: str, timeout: float = 10.0) -> tuple[int, str]:
    """(status, body) of one GET inside the namespace ``ns`` (a thread of this process enters it)."""

    def get() -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://{where[0]}:{where[1]}{path}", timeout=timeout) as resp:
                return int(resp.status), resp.read().decode(errors="replace")
        except urllib.error.HTTPError as exc:
            return exc.code, ""
        except OSError:
            return 0, ""

    return in_netns(ns, get, timeout=timeout + 5)


def write_manifests(folder: Path, n_services: int, n_endpoints: int) -> Path:
    """``bench sync``'s synthetic state as one ``kind: List`` manifest in ``folder``."""
    path = folder / "state.json"
    with open(path, "w", encoding="utf-8") as f:
        f.write('{"apiVersion": "v1", "kind": "List", "items": [')
        first = True
        for obj in [*synthetic.services(n_services), *synthetic.endpoint_slices(n_services, n_endpoints)]:
            f.write(("" if first else ",") + json.dumps(obj, separators=(",", ":")))
            first = False
        f.write("]}")
    return path


# --- places ------------------------------------------------------------------------------------------------------


def namespace_name(prefix: str, mode: str, pid: int | None = None) -> str:
    return f"{prefix}{os.getpid() if pid is None else pid}-{mode}"


@contextlib.contextmanager
def _namespace(name: str) -> Iterator[str]:
    subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True, timeout=30)
    try:
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True, capture_output=True, timeout=30)
        yield name
    finally:
        subprocess.run(["ip", "netns", "delete", name], check=False, capture_output=True, timeout=60)


@contextlib.contextmanager
def _node_place(mode: str, ns: str, workdir: Path) -> Iterator[tuple[dict[str, Any], Path]]:
    """A cgroup of the node's own under this benchmark's cgroup2 mount, and the backend's per-node options for it;
    afterwards what the backend left outside the namespace goes (``cleanup_leftovers``), then the cgroup."""
    netns.mount_cgroup2(CGROUP_MOUNT)
    cg = CGROUP_PARENT / ns
    cg.mkdir(parents=True, exist_ok=True)
    options: dict[str, Any] = {}
    cls = backend_class(mode)
    try:
        options = dict(cls.lab_options(LabNodeSpec(NODE, ns, cg, workdir / ns), {}))
        yield options, cg
    finally:
        try:
            if options:  # state outside the namespace (pins, attachments); the namespace takes its rules with it
                cls.cleanup_leftovers(ProxyConfig(mode=mode, backend_options=options), netns=ns)
        finally:
            netns.remove_cgroup(cg)
            _release_mount()


def _release_mount() -> None:
    """Unmount this benchmark's cgroup2 mount when no run (of any prefix) has a cgroup under it."""
    if not netns.is_cgroup2_mount(CGROUP_MOUNT):
        return
    with contextlib.suppress(OSError):
        CGROUP_PARENT.rmdir()  # fails while another run has a node cgroup there
    if not CGROUP_PARENT.exists():
        netns.umount(CGROUP_MOUNT)
        for d in (CGROUP_MOUNT, CGROUP_MOUNT.parent):
            with contextlib.suppress(OSError):
                d.rmdir()


def remove_stale(prefix: str) -> list[str]:
    """Remove what runs with ``prefix`` whose process is gone left behind (killed outright); their names."""
    gone = []
    pattern = re.compile(rf"{re.escape(prefix)}(\d+)-([a-z]+)")
    for name in netns.list_netns(prefix):
        m = pattern.fullmatch(name)
        if m is None or Path(f"/proc/{m.group(1)}").exists():
            continue
        with contextlib.ExitStack() as stack:
            stack.callback(subprocess.run, ["ip", "netns", "delete", name], check=False, capture_output=True)
            if m.group(2) in installed_backends():
                with tempfile.TemporaryDirectory(prefix="kproxy-idle-") as tmp:
                    stack.enter_context(_node_place(m.group(2), name, Path(tmp)))
        gone.append(name)
    return gone


# --- one mode ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class IdleConfig:
    services: int = 10000
    endpoints: int = 10
    seconds: float = 60.0
    settle: float = 5.0
    prefix: str = "kpq-"
    sync_timeout: float = 900.0  # first sync at 10,000 x 10 on a busy machine, bpf's compile included


def _daemon_argv(mode: str, ns: str, manifests: Path, options: Mapping[str, Any]) -> list[str]:
    argv = ["ip", "netns", "exec", ns, sys.executable, "-m", "kproxy", "run", "--mode", mode]
    argv += ["--manifests", str(manifests), "--hostname-override", NODE, "--cluster-cidr", CLUSTER_CIDR]
    argv += ["--healthz-bind-address", f"{HEALTHZ[0]}:{HEALTHZ[1]}"]
    argv += ["--metrics-bind-address", f"{METRICS[0]}:{METRICS[1]}"]
    return argv + option_arguments(backend_class(mode), options)


def _preexec(enter_cgroup: Callable[[], None] | None) -> Callable[[], None]:
    """In the child before exec: into the node's cgroup (as the lab does), and SIGTERM when this benchmark dies, so a
    daemon never outlives a run killed outright (``ip netns exec`` execs kproxy in the same process)."""
    import ctypes

    def run() -> None:
        if enter_cgroup is not None:
            enter_cgroup()
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG

    return run


@contextlib.contextmanager
def _daemon(argv: list[str], cgroup: Path, log: IO[bytes]) -> Iterator[subprocess.Popen[bytes]]:
    """``kproxy run`` in the node's cgroup, in a session of its own (a Ctrl-C reaches this benchmark, which stops it);
    SIGTERM at the end (kproxy's own stop), SIGKILL if it does not exit."""
    proc = subprocess.Popen(
        argv,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=module_env(),
        start_new_session=True,
        preexec_fn=_preexec(netns.cgroup_preexec(cgroup)),
    )
    try:
        yield proc
    finally:
        for sig, wait in ((signal.SIGTERM, STOP_TIMEOUT), (signal.SIGKILL, 30.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            try:
                proc.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue


#: ``/rules`` of one service port (service 1 of the synthetic state): its ``sync.syncs`` counts the runner's syncs
#: once each is done, its after-sync work included; asking for one port keeps the answer small at any scale
RULES_ONE = "/rules?service=" + urllib.parse.quote(f"{synthetic.NAMESPACE}/{synthetic.service_name(1)}:http/TCP")


def _synced(ns: str) -> bool:
    status, body = http_get(ns, METRICS, RULES_ONE, timeout=5.0)
    if status != 200:
        return False
    try:
        return int(json.loads(body)["sync"]["syncs"]) >= 1
    except (ValueError, KeyError, TypeError):
        return False


def _wait_first_sync(proc: subprocess.Popen[bytes], ns: str, timeout: float, log: Path) -> tuple[float, float]:
    """Seconds until /healthz answers 200 (the first sync's rules are in), and until the runner's first sync is
    done (``/rules``); IdleError (with the log's tail) when the daemon exits or does not get there in time."""
    t0 = time.monotonic()
    healthy: float | None = None
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise IdleError(f"kproxy exited with {proc.returncode}; its log ends with:\n{tail(log, 15)}")
        if healthy is None and http_get(ns, HEALTHZ, "/healthz", timeout=2.0)[0] == 200:
            healthy = time.monotonic() - t0
        if healthy is not None and _synced(ns):
            return healthy, time.monotonic() - t0
        time.sleep(0.2)
    what = "no first sync" if healthy is None else f"/healthz 200 after {healthy:.1f} s, but the first sync not done"
    raise IdleError(f"{what} within {timeout:g} s; the log ends with:\n{tail(log, 15)}")


def _idle(proc: subprocess.Popen[bytes], seconds: float, log: Path) -> None:
    """Wait ``seconds`` while the daemon lives (its exit is a failure of the run)."""
    try:
        proc.wait(seconds)
    except subprocess.TimeoutExpired:
        return
    raise IdleError(f"kproxy exited with {proc.returncode} while idle; its log ends with:\n{tail(log, 15)}")


def _scrape(ns: str) -> dict[str, float | None]:
    status, body = http_get(ns, METRICS, "/metrics")
    if status != 200:
        raise IdleError(f"/metrics answered {status or 'nothing'}")
    return counts(body)


def measure(mode: str, cfg: IdleConfig, manifests: Path, workdir: Path, progress: Progress) -> IdleRun:
    """Start ``kproxy run`` for ``mode`` in places of its own, wait for its first sync, measure the idle window."""
    ns_name = namespace_name(cfg.prefix, mode)
    log_path = workdir / f"kproxy-{mode}.log"
    with contextlib.ExitStack() as stack:
        ns = stack.enter_context(_namespace(ns_name))
        options, cgroup = stack.enter_context(_node_place(mode, ns, workdir))
        log = stack.enter_context(open(log_path, "wb"))
        proc = stack.enter_context(_daemon(_daemon_argv(mode, ns, manifests, options), cgroup, log))
        progress(f"{mode}: kproxy run started (pid {proc.pid}, namespace {ns}); waiting for its first sync")
        first, done = _wait_first_sync(proc, ns, cfg.sync_timeout, log_path)
        progress(
            f"{mode}: first sync after {first:.1f} s (done after {done:.1f} s); settling {cfg.settle:g} s, then"
            f" {cfg.seconds:g} s idle"
        )
        _idle(proc, cfg.settle, log_path)
        before_counts = _scrape(ns)
        t0, st0, th0 = time.monotonic(), read_stat(proc.pid), thread_ticks(proc.pid)
        _idle(proc, cfg.seconds, log_path)
        t1, st1, th1 = time.monotonic(), read_stat(proc.pid), thread_ticks(proc.pid)
        after_counts = _scrape(ns)
        status = Path(f"/proc/{proc.pid}/status").read_text()
    return IdleRun(
        mode=mode,
        services=cfg.services,
        endpoints=cfg.endpoints,
        first_sync_s=round(first, 2),
        sync_done_s=round(done, 2),
        window_s=round(t1 - t0, 3),
        cpu_s=round((st1.ticks - st0.ticks) / CLK_TCK, 3),
        rss_mb=round((status_kib(status, "VmRSS") or 0) / 1024, 1),
        rss_peak_mb=round((status_kib(status, "VmHWM") or 0) / 1024, 1),
        threads=st1.threads,
        counts=increase(before_counts, after_counts),
        busiest_threads=busiest(th0, th1),
    )


def run_idle(modes: Sequence[str], cfg: IdleConfig, progress: Progress) -> list[IdleRun]:
    """Each mode in turn (one daemon at a time: they would measure each other's load)."""
    for name in remove_stale(cfg.prefix):
        progress(f"removed the leftovers of an earlier run: {name}")
    runs = []
    with tempfile.TemporaryDirectory(prefix="kproxy-idle-") as tmp:
        workdir = Path(tmp)
        (workdir / "manifests").mkdir()
        write_manifests(workdir / "manifests", cfg.services, cfg.endpoints)
        for mode in modes:
            runs.append(measure(mode, cfg, workdir / "manifests", workdir, progress))
    return runs


def machine() -> dict[str, Any]:
    """What the figures were taken on: cores and load (a busy machine's figures are upper bounds)."""
    return {"cpus": os.cpu_count(), "loadavg": [round(x, 2) for x in os.getloadavg()], "kernel": os.uname().release}


# --- command line ------------------------------------------------------------------------------------------------


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """``kproxy bench idle`` (wired by kproxy.bench.cli)."""
    p = sub.add_parser(
        "idle",
        help="the CPU, memory, syncs and drift checks of an idle `kproxy run` at N services x E endpoints, per mode",
    )
    p.add_argument("--mode", action="append", required=True, help="a backend; repeat or comma-separate for several")
    p.add_argument("--services", type=int, default=10000, metavar="N")
    p.add_argument("--endpoints", type=int, default=10, metavar="E", help="endpoints per service (<= 1000)")
    p.add_argument("--seconds", type=float, default=60.0, help="the measured idle window (default %(default)s)")
    p.add_argument("--settle", type=float, default=5.0, help="seconds after the first sync before the window")
    p.add_argument("--prefix", default="kpq-", help="prefix of the namespaces it makes (default %(default)s)")
    p.add_argument("--sync-timeout", type=float, default=900.0, help="seconds to wait for the first sync")
    p.add_argument("--format", choices=("json", "table"), default="table")
    p.set_defaults(func=cmd_idle)


def _check(args: argparse.Namespace, modes: list[str]) -> str | None:
    from kproxy.bench.datapath import check_modes

    if not modes:
        return "--mode: name at least one mode"
    if not 1 <= args.services <= synthetic.MAX_SERVICES:
        return f"--services: 1..{synthetic.MAX_SERVICES}"
    if not 1 <= args.endpoints <= synthetic.MAX_ENDPOINTS:
        return f"--endpoints: 1..{synthetic.MAX_ENDPOINTS} (one EndpointSlice per service)"
    if args.seconds <= 0 or args.settle < 0 or args.sync_timeout <= 0:
        return "--seconds and --sync-timeout > 0, --settle >= 0"
    try:
        netns.check_name(namespace_name(args.prefix, "userspace"))
    except ValueError:
        return f"--prefix {args.prefix!r}: letters, digits, '.', '_', '-'"
    problems = check_modes(modes)
    if problems:
        return "; ".join(problems)
    if os.geteuid() != 0:
        return "needs root (it makes network namespaces and cgroups)"
    return None


def cmd_idle(args: argparse.Namespace) -> int:
    from kproxy.bench.datapath import stop_on_sigterm

    modes = [m.strip() for arg in args.mode for m in arg.split(",") if m.strip()]
    problem = _check(args, modes)
    if problem:
        print(f"kproxy bench idle: {problem}", file=sys.stderr)
        return 2
    cfg = IdleConfig(args.services, args.endpoints, args.seconds, args.settle, args.prefix, args.sync_timeout)

    def progress(msg: str) -> None:
        print(f"kproxy bench idle: {msg}", file=sys.stderr, flush=True)

    stop_on_sigterm()  # SIGTERM unwinds like Ctrl-C: every place and process goes
    before = machine()
    try:
        runs = run_idle(modes, cfg, progress)
    except (IdleError, OSError, subprocess.SubprocessError) as exc:
        print(f"kproxy bench idle: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # everything the run made is gone by now (the places unwound)
        print("kproxy bench idle: interrupted; its namespaces, cgroups and processes are removed", file=sys.stderr)
        return 130
    after = machine()
    if args.format == "json":
        report = {
            "services": cfg.services,
            "endpoints": cfg.endpoints,
            "seconds": cfg.seconds,
            "settle": cfg.settle,
            "machine": {**before, "loadavg_after": after["loadavg"]},
            "modes": [r.to_json() for r in runs],
        }
        print(json.dumps(report, indent=2))
    else:
        note = f"{before['cpus']} cores; load average {before['loadavg']} before, {after['loadavg']} after"
        print(format_table(runs, note))
    return 0
