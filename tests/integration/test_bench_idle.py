"""``kproxy bench idle`` end to end: a real ``kproxy run`` (nftables, 200 services) in a namespace and cgroup of the
benchmark's own reports every field of its idle window, and nothing of the run is left afterwards, also when it is
interrupted with Ctrl-C while the daemon runs. The figures themselves are not bounded here (benchmarks judge speed);
the prefix ``kpq-t`` keeps these runs apart from anyone else's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from modes import require_mode

from kproxy.bench import idle
from kproxy.lab import netns

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create network namespaces and cgroups"),
]

PREFIX = "kpq-t"
ROOT = Path(__file__).resolve().parents[2]


def _argv(*extra: str) -> list[str]:
    base = [sys.executable, "-m", "kproxy", "bench", "idle", "--mode", "nftables", "--services", "200"]
    return [*base, "--endpoints", "10", "--prefix", PREFIX, "--sync-timeout", "300", *extra]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _leftovers(pid: int) -> list[str]:
    """What a run of process ``pid`` could have left: its namespace (and so a daemon in it), its node cgroup."""
    name = idle.namespace_name(PREFIX, "nftables", pid)
    left = [n for n in netns.list_netns(PREFIX) if n == name]
    if (idle.CGROUP_PARENT / name).exists():
        left.append(str(idle.CGROUP_PARENT / name))
    return left


@pytest.fixture
def runs() -> Iterator[list[subprocess.Popen[str]]]:
    """The benchmark processes a test starts; killed (their places then removed as stale) if a test fails."""
    require_mode("nftables")
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(60)
        for f in (p.stdout, p.stderr):
            if f is not None:
                f.close()
    idle.remove_stale(PREFIX)


def test_report_fields(runs: list[subprocess.Popen[str]]) -> None:
    proc = subprocess.Popen(
        _argv("--seconds", "5", "--settle", "0", "--format", "json"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    runs.append(proc)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    report = json.loads(out)
    assert (report["services"], report["endpoints"], report["seconds"]) == (200, 10, 5.0)
    assert report["machine"]["cpus"] >= 1 and len(report["machine"]["loadavg_after"]) == 3
    [run] = report["modes"]
    assert (run["mode"], run["services"], run["endpoints"]) == ("nftables", 200, 10)
    assert run["window_s"] >= 5.0 and run["first_sync_s"] > 0
    assert run["cpu_s"] >= 0 and run["cpu_s_per_min"] == pytest.approx(run["cpu_s"] * 60 / run["window_s"], abs=1e-3)
    assert run["core_share"] == pytest.approx(run["cpu_s"] / run["window_s"], abs=1e-4)
    assert run["rss_mb"] > 10 and run["rss_peak_mb"] >= run["rss_mb"] and run["threads"] >= 2
    # every count came from the daemon's /metrics (None would mean "not exported"); an idle window writes nothing
    assert set(run["counts"]) == set(idle.COUNTS)
    assert all(isinstance(v, int) and v >= 0 for v in run["counts"].values()), run["counts"]
    assert run["counts"]["services_written"] == 0 and run["counts"]["drift_repairs"] == 0
    assert isinstance(run["busiest_threads"], list)
    assert _leftovers(proc.pid) == []


def _ctrl_c_reaches_it() -> None:
    """In the child before exec: SIGINT back to its default. A shell without job control starts background commands
    with SIGINT ignored, a child inherits that, and Python then leaves it ignored: the test's Ctrl-C would do
    nothing (seen when CI's command ran as `setsid bash -c '...' &`)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_while_the_daemon_runs_leaves_nothing(runs: list[subprocess.Popen[str]]) -> None:
    proc = subprocess.Popen(
        _argv("--seconds", "600"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
        preexec_fn=_ctrl_c_reaches_it,
    )
    runs.append(proc)
    assert proc.stderr is not None
    for line in proc.stderr:  # ends at the run's exit at the latest; the fixture kills it on a failure
        if "first sync after" in line:
            break
    else:
        pytest.fail(f"the run ended before its first sync: exit {proc.wait(60)}")
    name = idle.namespace_name(PREFIX, "nftables", proc.pid)
    assert name in netns.list_netns(PREFIX) and (idle.CGROUP_PARENT / name).is_dir()
    daemons = netns.netns_pids([name])[name]
    assert daemons, "the daemon is not running in the run's namespace"
    proc.send_signal(signal.SIGINT)
    assert proc.wait(200) != 0
    assert _leftovers(proc.pid) == []
    assert not any(netns.alive(p) for p in daemons)
