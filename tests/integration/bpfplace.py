"""Where a bpf proxier under test runs: a network namespace, a cgroup v2 directory and a bpffs pin folder, all of the
test's own (bpffs and cgroups are shared by the whole machine) and removed afterwards, also on failure.

A run that is killed (SIGKILL, a timeout of the whole job) never reaches its ``finally``, so its pin folder and
cgroup stay. Their names say whose they are: ``<prefix>bpl<pid namespace>-<pid>-<start time>-<random>`` (the
start time in clock ticks since boot, ``/proc/<pid>/stat``'s 22nd field, so a pid used again is not taken for the
owner). Each process's first ``bpf_place`` of a cgroup mount sweeps what earlier runs left there and in bpffs: only
names of that form, only when their owner is gone (another pid namespace's cannot be told, and stays), the processes
still in such a cgroup killed (``cgroup.kill``) before it is removed. The namespace and the places record
(``/run/kproxy/bpf``) of a killed run are not swept (the namespace's name carries no owner; a record names its
namespace's cookie, so a later namespace never acts on it)."""

from __future__ import annotations

import os
import re
import select
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from modes import require_mode

from .scratch import scratch_netns

BPFFS = Path("/sys/fs/bpf")
OWNED = re.compile(r"bpl(?P<pidns>\d+)-(?P<pid>\d+)-(?P<start>\d+)-[0-9a-f]{8}(?=-|$)")
_swept: set[Path] = set()  # the cgroup mounts this process has swept (leftovers appear only when a process dies)


def start_time(pid: int) -> int | None:
    """When the process ``pid`` of this pid namespace started (clock ticks since boot); None when there is none."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses; the start time is field 22
    return int(stat.rpartition(b")")[2].split()[19])


def owner_tag(pid: int | None = None) -> str:
    """The part of a place's name that names its owner: this process (or ``pid``) in this pid namespace."""
    pid = os.getpid() if pid is None else pid
    return f"bpl{os.stat('/proc/self/ns/pid').st_ino}-{pid}-{start_time(pid)}-"


def owner_gone(name: str) -> bool:
    """Whether ``name`` is a place ``bpf_place`` made for a process that has ended. False for any other name, and
    for one made in another pid namespace (its pids are not this namespace's)."""
    m = OWNED.search(name)
    if m is None or int(m["pidns"]) != os.stat("/proc/self/ns/pid").st_ino:
        return False
    return start_time(int(m["pid"])) != int(m["start"])


def _dirs(parent: Path) -> list[Path]:
    try:
        return [d for d in parent.iterdir() if d.is_dir() and not d.is_symlink()]
    except OSError:
        return []


def _unpopulated(cg: Path, timeout: float) -> bool:
    """Wait until no process is left in ``cg`` or below it (``cgroup.events`` wakes a poll on each change)."""
    deadline = time.monotonic() + timeout
    try:
        with open(cg / "cgroup.events", "rb", buffering=0) as f:
            poll = select.poll()
            poll.register(f, select.POLLPRI | select.POLLERR)
            while True:
                f.seek(0)
                if b"populated 0" in f.read():
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                poll.poll(left * 1000)
    except OSError:
        return False


def _remove_cgroup(cg: Path, timeout: float = 10.0) -> bool:
    """Remove ``cg`` with the cgroups below it, after killing the processes left in them; whether it is gone."""
    try:
        (cg / "cgroup.kill").write_text("1")  # every process of cg and below (kernel 5.14 and later)
    except OSError:
        pass  # none, or an older kernel: the rmdir below says whether it is empty
    _unpopulated(cg, timeout)
    below = sorted((d for d in cg.rglob("*") if d.is_dir()), key=lambda d: len(d.parts), reverse=True)
    for d in [*below, cg]:
        try:
            d.rmdir()
        except FileNotFoundError:
            pass  # another run's sweep was first
        except OSError:
            return False
    return True


def sweep(cg_mount: Path) -> list[Path]:
    """Remove the pin folders (in bpffs) and cgroups (in ``cg_mount``) of earlier ``bpf_place`` runs whose process
    is gone; what was removed."""
    from kproxy.backends.bpf import cleanup

    gone: list[Path] = []
    for pin in _dirs(BPFFS):
        if owner_gone(pin.name):
            cleanup.remove_tree(pin)
            if not pin.exists():
                gone.append(pin)
    for cg in _dirs(cg_mount):
        if owner_gone(cg.name) and _remove_cgroup(cg):
            gone.append(cg)
    return gone


@contextmanager
def bpf_place(
    prefix: str,
    cg_mount: Path,
    addresses: Sequence[str] = (),
    setup: Callable[[str], None] | None = None,
) -> Iterator[tuple[str, dict[str, str]]]:
    """(namespace, bpf options) with ``addresses`` on the namespace's lo and ``setup(namespace)`` run first; the
    cgroup (and any child a test made under it), the pins, the places record and the namespace go afterwards, and
    ``cg_mount`` is unmounted when this call mounted it. Earlier runs' leftovers are swept first (``sweep``)."""
    require_mode("bpf")  # skipped with the reason on a machine without bcc; a failure where bpf is required
    cg_mount.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mountpoint", "-q", str(cg_mount)], check=False).returncode == 0
    if not mounted:
        subprocess.run(["mount", "-t", "cgroup2", "none", str(cg_mount)], check=True, timeout=30)
    if cg_mount not in _swept:
        _swept.add(cg_mount)
        sweep(cg_mount)
    tag = owner_tag() + uuid.uuid4().hex[:8]
    cg = cg_mount / f"{prefix}{tag}"
    cg.mkdir()
    pin = Path(f"/sys/fs/bpf/{prefix}{tag}")
    opts = {"bpf_cgroup_path": str(cg), "bpf_pin_path": str(pin)}
    from kproxy.backends.bpf import cleanup
    from kproxy.config import ProxyConfig

    try:
        with scratch_netns(prefix, lo_up=True) as ns:
            for a in addresses:
                subprocess.run(["ip", "-n", ns, "addr", "add", f"{a}/32", "dev", "lo"], check=True, timeout=30)
            if setup is not None:
                setup(ns)
            try:
                yield ns, opts
            finally:
                try:
                    cleanup.cleanup_leftovers(ProxyConfig(backend_options=opts), netns=ns)
                finally:
                    cleanup.remove_tree(pin)
                    cleanup._record_path(ns).unlink(missing_ok=True)
    finally:
        for d in sorted(cg_mount.glob(f"{prefix}{tag}*"), reverse=True):
            for _ in range(50):  # processes of the cgroup may take a moment to be reaped
                try:
                    d.rmdir()
                    break
                except OSError:
                    time.sleep(0.1)
        if not mounted:
            subprocess.run(["umount", str(cg_mount)], check=False, timeout=30)
            for d in (cg_mount, cg_mount.parent):
                try:
                    d.rmdir()
                except OSError:
                    pass


@contextmanager
def ns_script(ns: str, script: str) -> Iterator[None]:
    """A Python ``script`` running in ``ns`` (outside any test cgroup) until the block ends; it must print ``ready``
    once it serves."""
    proc = subprocess.Popen(
        ["ip", "netns", "exec", ns, sys.executable, "-c", script], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        yield
    finally:
        proc.kill()
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()
