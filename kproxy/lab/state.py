"""The lab's state on disk and its processes' records: the state folder of a prefix, the locks that serialise
``up``/``down`` between processes, pid files (pid plus start time, so a recycled pid is never signalled) and the
atomically written ``state.json`` another process attaches to.

One lab exists at a time per prefix; the default prefix's state lives in /run/kproxy-lab, another prefix's in
/run/kproxy-lab/prefix/<word>.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kproxy.lab import netns
from kproxy.lab.plan import DEFAULT_PREFIX, Plan, check_prefix

STATE_ROOT = Path("/run/kproxy-lab")
CGROUP_MOUNT = STATE_ROOT / "cgroup2"


# Every process the lab starts in this interpreter, by pid: the lab outlives the objects that started it, and a
# Popen dropped while its process runs would warn (ResourceWarning) when collected; down() reaps them from here.
LIVE: dict[int, subprocess.Popen[bytes]] = {}


def reap_live(pids: set[int] | None = None) -> None:
    for pid, proc in list(LIVE.items()):
        if (pids is None or pid in pids) and proc.poll() is not None:
            del LIVE[pid]


def lab_is_live(state: dict[str, Any] | None, processes_alive: bool, owner_alive: bool) -> bool:
    """Whether a recorded lab is someone's running lab (to be left alone) rather than a leftover (to be cleaned).

    A lab is live when any process it started still runs and it is either ready or still being built by a process
    that is alive. A lab whose processes are all gone (killed, crashed) or whose build was abandoned half-way (its
    builder died) is a leftover, which the next ``up`` and ``down`` remove silently.
    """
    if state is None or not processes_alive:
        return False
    return bool(state.get("ready")) or owner_alive


def state_dir_for(prefix: str) -> Path:
    check_prefix(prefix)  # every lookup of a lab goes through here, `down` included
    return STATE_ROOT if prefix == DEFAULT_PREFIX else STATE_ROOT / "prefix" / prefix.rstrip("-")


@contextlib.contextmanager
def locked(state_dir: Path | None) -> Iterator[None]:
    """Serialise up/down/state writes between processes (a conformance runner and a `kproxy lab` typed meanwhile).

    One lock per lab; ``None`` is the lock for the cgroup2 mount, which every prefix's lab shares.
    """
    STATE_ROOT.mkdir(parents=True, exist_ok=True)
    lock = STATE_ROOT / (f".lock-{state_dir.name}" if state_dir is not None else ".lock-cgroup2")
    fd = os.open(lock, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)


def write_pidfile(state_dir: Path, key: str, pid: int) -> None:
    d = state_dir / "pids"
    d.mkdir(parents=True, exist_ok=True)
    st = netns.proc_starttime(pid)
    (d / f"{key}.pid").write_text(f"{pid} {st if st is not None else 0}\n")


def read_pidfile(path: Path) -> tuple[int, int] | None:
    try:
        pid, st = path.read_text().split()[:2]
        return int(pid), int(st)
    except (OSError, ValueError):
        return None


def stdlib_module_argv(module: str) -> list[str]:
    """Run one of the lab's standard-library-only modules (echo, probe) as fast as Python starts: ``-S`` skips
    site-packages (a few dozen milliseconds per probe), so the package is found through PYTHONPATH
    (:func:`module_env`)."""
    return [sys.executable, "-S", "-m", module]


def module_env() -> dict[str, str]:
    """This environment with the folder holding the kproxy package first on PYTHONPATH."""
    env = dict(os.environ)
    root = str(Path(__file__).parent.parent.parent)  # the folder holding the kproxy package
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def initial_state(
    plan: Plan,
    state_dir: Path,
    mode: str | None,
    kproxy_args: Sequence[str],
    echo_ports: Sequence[int],
    backend_options: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """The record of a lab about to be built (``ready`` False, its builder this process): what ``state.json`` holds
    before the first namespace exists, so a run killed half-way still leaves a record for ``down``."""
    return {
        "version": 1,
        "prefix": plan.prefix,
        "state_dir": str(state_dir),
        "ipv6": plan.ipv6,
        "mode": mode,
        "kproxy_args": list(kproxy_args),
        "fabric_ns": plan.fabric_ns,
        "bridge": plan.bridge,
        "external_ns": plan.external_ns,
        "external_ip4": plan.external_ip4,
        "external_ip6": plan.external_ip6,
        "nodes": [asdict(n) for n in plan.nodes],
        "pods": [asdict(p) for p in plan.pods],
        "api_port": 0,
        "echo_ports": list(echo_ports),
        "backend_options": dict(backend_options or {}),
        "created": time.time(),
        # the process building it: a lab not ready yet is "being built" only while this one lives
        "owner": {"pid": os.getpid(), "starttime": netns.proc_starttime(os.getpid()) or 0},
        "ready": False,
    }
