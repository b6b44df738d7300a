"""``kproxy bench sync``'s restart runs in a new process (kproxy.bench.restart) in the run's network namespace, and
no kernel state of the run is left afterwards: not when the restart succeeds (the restart's process removes it), nor
when that process fails, is killed at its time limit, or writes what it should not (the run's process removes it).

nftables keeps everything in the namespace; bpf keeps its cgroup hook, pins and places record outside it. The command
line runs keep the bpf defaults (a cgroup ``kproxy-net-<inode>`` of the machine's hierarchy); the failure runs call
``run_sync_bench`` in a namespace entered with ``nsenter --net`` (the machine's bpffs stays in view, unlike under
``ip netns exec``) with a cgroup and pin folder of the test's own (``bpfplace``), so a pin left behind would stay
where the test sees it. Each failure is made in the test's own script by replacing a module attribute of the run's
process (the spec it hands the restart's process, the time limit): production code has no hook for it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from modes import missing, require_mode, run_mode_cli

from kproxy.bench.sync import NETNS_PREFIX

from .bpfplace import bpf_place
from .scratch import scratch_netns

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create network namespaces"),
]

CG_MOUNT = Path("/run/kproxy-bpf-test/cgroup2")
RECORDS = Path("/run/kproxy/bpf")


def _cgroup2_mounts() -> list[Path]:
    with open("/proc/self/mounts") as f:
        return [Path(ln.split()[1]) for ln in f if ln.split()[2] == "cgroup2"]


def _live_namespaces() -> set[int]:
    """The inodes of the network namespaces that exist now: named ones, and those a process is in."""
    out = set()
    for ns in [*Path("/run/netns").glob("*"), *Path("/proc").glob("[0-9]*/ns/net")]:
        try:
            out.add(ns.stat().st_ino)
        except OSError:
            continue  # deleted or ended meanwhile
    return out


def _orphaned_places() -> set[Path]:
    """What bpf backends of default options left outside a namespace that is gone: a cgroup ``kproxy-net-<inode>``
    (seen through every cgroup2 mount here) or a places record ``net-<inode>.json``. Another run's places, while its
    namespace lives, are not counted (the machine is shared)."""
    live = {f"net-{ino}" for ino in _live_namespaces()}
    places = [cg for mount in _cgroup2_mounts() for cg in mount.glob("kproxy-net-*")] + list(RECORDS.glob("net-*.json"))
    return {p for p in places if p.name.removeprefix("kproxy-").removesuffix(".json") not in live}


@pytest.mark.parametrize("mode", ["nftables", "bpf"])
def test_the_restart_is_a_new_process_and_leaves_nothing(mode: str) -> None:
    """50 x 3 through the command line: the restart wrote nothing, its figures and memory phases are there, it ran
    in another process than the phases before it, and neither the namespace nor a cgroup or record is left."""
    require_mode(mode)
    before = _orphaned_places()
    args = ["bench", "sync", "--mode", mode, "--services", "50", "--endpoints", "3", "--repeat", "2"]
    pid, stdout = run_mode_cli(mode, [*args, "--format", "json"])
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    assert f"{NETNS_PREFIX}{pid}" not in out.split()
    assert _orphaned_places() <= before
    doc = json.loads(stdout)
    assert doc["restart_writes"] == 0 and doc["partial_writes"] == [1, 1]
    assert doc["restart_pid"] not in (None, doc["pid"]) and doc["pid"] > 0
    restart = doc["restart_absorb_s"] + doc["restart_snapshot_s"] + doc["restart_sync_s"]
    assert doc["restart_total_s"] == pytest.approx(restart) and doc["restart_sync_s"] > 0
    assert {"adopt", "render", "total"} <= set(doc["restart_parts"])
    phases = doc["memory"]["phases"]
    want = ["absorb", "snapshot", "full_sync", "partial", "restart_absorb", "restart_snapshot", "restart_sync"]
    assert list(phases) == want
    # the restart's own process: its peak is at least each of its phases' (and never the run's process's)
    assert doc["restart_rss_mb"] >= max(phases[p]["peak_mb"] for p in phases if p.startswith("restart_")) > 0
    assert doc["memory"]["restart_bytes_per_port"]["total"] > 0


RUN = """
import json, sys
from kproxy.bench import restart, sync
mode, kind, options = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
spec = restart._spec
if kind == "refused":  # the restart's process refuses its spec before it builds a backend
    restart._spec = lambda *a: {**spec(*a), "state": "no-such-state"}
elif kind == "wrote":  # it lists the objects without the partial syncs' changes: its sync writes those 2 back
    restart._spec = lambda *a: {**spec(*a), "variants": {}}
elif kind == "overran":  # killed long before it can have synced
    restart.RESTART_TIMEOUT = 0.05
elif kind == "orphaned":  # this process dies while the restart's process is inside its restart (ORPHAN, below)
    exec(sys.argv[4])
try:
    b = sync.run_sync_bench(mode, 50, 3, 2, options)
except sync.BenchError as exc:
    print(json.dumps({"error": str(exc)}))
else:
    print(json.dumps({"error": None, "bench": b.to_json(), "bound": sync.bound_failures(b)}))
"""


# the run's process starts the restart's process as usual, waits until it holds the backend's kernel handles (a
# netlink socket, a BPF object: it is inside its restart), stops it, tells its pid and kills itself: what RUN_TIMEOUT
# does to a run that overran. The child, continued, finds its parent dead.
ORPHAN = """
import os, signal, subprocess, time
real = subprocess.run

def handles(pid):
    links = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            links.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            continue
    return any(x.startswith(("socket:", "anon_inode:bpf")) for x in links)

def run(argv, input=None, **kw):
    if restart.MODULE not in argv:
        return real(argv, input=input, **kw)
    child = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    child.stdin.write(input)
    child.stdin.close()
    deadline = time.monotonic() + 60
    while not handles(child.pid) and time.monotonic() < deadline and child.poll() is None:
        time.sleep(0.005)
    os.kill(child.pid, signal.SIGSTOP)
    print(json.dumps({"child": child.pid}), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)

subprocess.run = run
"""

# the test's stand-in for init: the orphaned restart's process becomes its child (PR_SET_CHILD_SUBREAPER), so its exit
# code can be read; it is continued once its parent is dead
REAPER = """
import ctypes, json, os, signal, subprocess, sys
assert ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
run = subprocess.Popen(sys.argv[1:], stdout=subprocess.PIPE, text=True)
line = run.stdout.readline()
run.wait()
child = json.loads(line)["child"]
signal.alarm(120)  # bounded: the child's restart is 50 x 3
os.kill(child, signal.SIGCONT)
_, status = os.waitpid(child, 0)
print(json.dumps({"parent": run.returncode, "child": os.waitstatus_to_exitcode(status)}))
"""


@contextmanager
def _place(mode: str) -> Iterator[tuple[str, dict[str, str]]]:
    if mode == "bpf":
        with bpf_place("kpb-rs-", CG_MOUNT) as (ns, opts):
            yield ns, opts
    else:
        require_mode(mode)
        with scratch_netns("kpb-rs-", lo_up=True) as ns:
            yield ns, {}


def _left(mode: str, ns: str, opts: dict[str, str]) -> list[str]:
    """The run's kernel state still there: the namespace's tables, and bpf's pins, cgroup hooks and record."""
    out = subprocess.run(["ip", "netns", "exec", ns, "nft", "list", "tables"], capture_output=True, text=True)
    left = [f"nft {line}" for line in out.stdout.splitlines() if line.strip()]
    if mode == "bpf":
        from kproxy.backends.bpf import cleanup, loader

        pins = Path(opts["bpf_pin_path"])
        left += [f"pin {p}" for p in pins.iterdir()] if pins.exists() else []
        left += [f"hook {d['name']}" for d in loader.ours(loader.attached(Path(opts["bpf_cgroup_path"])))]
        left += [f"record {r}" for r in [cleanup._record_path(ns)] if r.exists()]
    return left


@pytest.mark.parametrize("mode", ["nftables", "bpf"])
def test_a_restart_whose_run_dies_removes_the_kernel_state_itself(mode: str) -> None:
    """The run's process is killed (as at the run's time limit) while the restart's process is inside its restart:
    that process gets SIGTERM from the kernel (``PR_SET_PDEATHSIG``), removes the kernel state, and exits with
    ``ORPHANED`` instead of running on; nothing is left."""
    from kproxy.bench.restart import ORPHANED

    with _place(mode) as (ns, opts):
        run = ["nsenter", f"--net=/run/netns/{ns}", sys.executable, "-P", "-c", RUN, mode, "orphaned", json.dumps(opts)]
        run.append(ORPHAN)
        proc = subprocess.run(
            [sys.executable, "-c", REAPER, *run], capture_output=True, text=True, timeout=280, check=False
        )
        assert proc.returncode == 0, proc.stderr
        doc = json.loads(proc.stdout.strip().splitlines()[-1])
        assert doc == {"parent": -9, "child": ORPHANED}, proc.stderr
        assert not _left(mode, ns, opts), proc.stderr


@pytest.mark.parametrize("kind", ["ok", "refused", "overran", "wrote"])
@pytest.mark.parametrize("mode", ["nftables", "bpf"])
def test_a_restart_that_fails_leaves_nothing(mode: str, kind: str) -> None:
    """The restart's process succeeds, refuses its spec (exit code 1), is killed at its time limit, or writes 2
    services: the run fails with the reason (the refusal's message from the child's stderr), or reports the bound
    failure of a restart that wrote, and every time the run's kernel state is gone afterwards."""
    with _place(mode) as (ns, opts):
        argv = ["nsenter", f"--net=/run/netns/{ns}", sys.executable, "-P", "-c", RUN, mode, kind, json.dumps(opts)]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=280, check=False)
        if "is not available here" in proc.stdout:
            missing(mode, proc.stdout.strip())
        assert proc.returncode == 0, proc.stderr
        doc = json.loads(proc.stdout.strip().splitlines()[-1])
        assert not _left(mode, ns, opts), proc.stderr
    if kind == "ok":
        assert doc["error"] is None and doc["bound"] == [] and doc["bench"]["restart_writes"] == 0
        assert doc["bench"]["restart_pid"] != doc["bench"]["pid"]
    elif kind == "refused":
        assert "the restart's process failed (exit code 1)" in doc["error"]
        assert "--state: one of default, mixed, not 'no-such-state'" in doc["error"]
    elif kind == "overran":
        assert "the restart's process overran 0.05 s and was killed" in doc["error"]
    else:
        assert doc["error"] is None and doc["bench"]["restart_writes"] == 2
        assert doc["bound"] == ["the restarted backend wrote 2 services, though nothing changed"]
