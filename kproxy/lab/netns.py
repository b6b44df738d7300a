"""Thin helpers over ``ip`` for network namespaces, processes and cgroup v2, used by kproxy.lab.cluster.

Only kproxy's lab (and tests that build their own namespaces) use these. Each helper does one kernel-facing thing;
policy (what to build, what to remove) lives in cluster.py. Links and addresses are configured with one
``ip -n NS -batch -`` per namespace (one process per namespace instead of one per command), so a lab comes up in a
fraction of a second; nothing is ever configured in the machine's own namespace (``ip -n`` enters the target
namespace in the ``ip`` process only). No shell is ever used; every name that reaches a batch line is validated.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

NETNS_DIR = Path("/run/netns")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
_TOKEN = re.compile(r"^[^\s\"'\\#]+$")


class NetnsError(RuntimeError):
    """An ``ip`` invocation failed; the message carries its stderr."""


def check_name(name: str) -> str:
    if not _NAME.match(name):
        raise ValueError(f"invalid namespace or link name {name!r}")
    return name


def check_line(line: str) -> str:
    # batch lines are split on whitespace by ip; a token with quotes, backslashes or '#' could change its meaning
    for tok in line.split():
        if not _TOKEN.match(tok):
            raise ValueError(f"unsafe token {tok!r} in ip batch line {line!r}")
    if "\n" in line:
        raise ValueError("newline in ip batch line")
    return line


def list_netns(prefix: str) -> list[str]:
    """Names of the named network namespaces that start with ``prefix``."""
    try:
        return sorted(n for n in os.listdir(NETNS_DIR) if n.startswith(prefix))
    except FileNotFoundError:
        return []


def start_batch(ns: str | None, lines: Sequence[str]) -> subprocess.Popen[bytes]:
    """Start ``ip [-n NS] -batch -`` fed with ``lines``; pair with :func:`wait_batch`."""
    argv = ["ip"] + (["-n", check_name(ns)] if ns else []) + ["-batch", "-"]
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    data = "".join(check_line(line) + "\n" for line in lines).encode()
    assert proc.stdin is not None
    # batches are a few kilobytes at most, well under a pipe's buffer, so this write never blocks
    proc.stdin.write(data)
    proc.stdin.close()
    proc.stdin = None  # so communicate() only collects output
    return proc


def wait_batch(proc: subprocess.Popen[bytes], what: str, timeout: float = 30) -> None:
    out, err = proc.communicate(timeout=timeout)
    if proc.returncode != 0:
        raise NetnsError(f"{what}: ip -batch failed ({proc.returncode}): {err.decode(errors='replace').strip()}")


def run_batch(ns: str | None, lines: Sequence[str], timeout: float = 30) -> None:
    wait_batch(start_batch(ns, lines), f"netns {ns or '(machine)'}", timeout)


def run_batches(batches: Mapping[str, Sequence[str]], timeout: float = 30) -> None:
    """Run one batch per namespace, all at once (the namespaces are independent)."""
    procs = {ns: start_batch(ns, lines) for ns, lines in batches.items() if lines}
    errors = []
    for ns, proc in procs.items():
        try:
            wait_batch(proc, f"netns {ns}", timeout)
        except NetnsError as e:
            errors.append(str(e))
    if errors:
        raise NetnsError("; ".join(errors))


def add_netns(names: Iterable[str]) -> None:
    run_batch(None, [f"netns add {check_name(n)}" for n in names])


def delete_netns(names: Iterable[str]) -> None:
    """Delete named namespaces; a leftover mount file that ``ip`` cannot remove is unmounted and unlinked here."""
    names = [check_name(n) for n in names]
    if not names:
        return
    subprocess.run(
        ["ip", "-force", "-batch", "-"],
        input="".join(f"netns del {n}\n" for n in names).encode(),
        capture_output=True,
        timeout=30,
    )
    for n in names:
        path = NETNS_DIR / n
        if path.exists():
            subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=10)
            try:
                path.unlink()
            except OSError:
                pass


def exec_argv(ns: str, argv: Sequence[str]) -> list[str]:
    """``ip netns exec NS argv...``: ip enters the namespace and execs argv in place, so the pid is argv's."""
    return ["ip", "netns", "exec", check_name(ns), *argv]


def sysctl_argv(ns: str, settings: Mapping[str, str | int]) -> list[str]:
    for k, v in settings.items():
        if not re.match(r"^[a-z0-9_./-]+$", k) or not re.match(r"^[A-Za-z0-9_.-]+$", str(v)):
            raise ValueError(f"invalid sysctl {k}={v}")
    return exec_argv(ns, ["sysctl", "-q", "-w", *(f"{k}={v}" for k, v in settings.items())])


def run_parallel(argvs: Mapping[str, Sequence[str]], timeout: float = 30) -> None:
    """Run independent commands at once; raise with every failure's stderr."""
    procs = {
        key: subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for key, argv in argvs.items()
    }
    errors = []
    for key, proc in procs.items():
        _, err = proc.communicate(timeout=timeout)
        if proc.returncode != 0:
            errors.append(f"{key}: {err.decode(errors='replace').strip()}")
    if errors:
        raise NetnsError("; ".join(errors))


# --- processes ---------------------------------------------------------------------------------------------------


def proc_starttime(pid: int) -> int | None:
    """The process's start time in clock ticks (field 22 of /proc/PID/stat), None if gone or a zombie.

    Stored next to every pid the lab records, so a later ``down`` never signals a recycled pid.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    rest = stat.rsplit(")", 1)[1].split()
    if rest[0] in ("Z", "X"):
        return None
    return int(rest[19])


def alive(pid: int, starttime: int | None = None) -> bool:
    st = proc_starttime(pid)
    return st is not None and (starttime is None or st == starttime)


def reap(pid: int) -> None:
    """Collect a dead child of ours so it does not linger as a zombie (no-op for other processes)."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def netns_pids(names: Iterable[str]) -> dict[str, set[int]]:
    """Pids of processes whose network namespace is one of the named ones (what ``ip netns pids`` does)."""
    ids: dict[tuple[int, int], str] = {}
    for name in names:
        try:
            st = os.stat(NETNS_DIR / name)
        except OSError:
            continue
        ids[(st.st_dev, st.st_ino)] = name
    found: dict[str, set[int]] = {n: set() for n in ids.values()}
    if not ids:
        return found
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            st = os.stat(f"/proc/{entry}/ns/net")
        except OSError:
            continue
        n = ids.get((st.st_dev, st.st_ino))
        if n is not None:
            found[n].add(int(entry))
    return found


def pids_with_arg(fragment: str) -> set[int]:
    """Pids whose command line contains ``fragment`` (used to find lab processes whose pid file was lost)."""
    found = set()
    me = os.getpid()
    needle = fragment.encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if needle in cmdline:
            found.add(int(entry))
    return found


def terminate(pids: Iterable[int], grace: float = 3.0) -> set[int]:
    """SIGTERM, wait up to ``grace`` seconds, SIGKILL the rest, wait again; returns pids still alive."""
    import signal

    pending = {p for p in pids if p > 1 and p != os.getpid() and alive(p)}
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 3.0)):
        for p in pending:
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while pending and time.monotonic() < deadline:
            for p in list(pending):
                reap(p)
                if not alive(p):
                    pending.discard(p)
            if pending:
                time.sleep(0.02)
        if not pending:
            break
    return pending


# --- cgroup v2 -----------------------------------------------------------------------------------------------------


def mounts() -> list[tuple[str, str]]:
    """(mount point, filesystem type) of every mount seen by this process."""
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fields = left.split()
        fstype = right.split()[0] if right else ""
        out.append((fields[4].replace("\\040", " "), fstype))
    return out


def is_cgroup2_mount(path: Path) -> bool:
    return any(mp == str(path) and fs == "cgroup2" for mp, fs in mounts())


def mount_cgroup2(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    if not is_cgroup2_mount(path):
        r = subprocess.run(["mount", "-t", "cgroup2", "none", str(path)], capture_output=True, timeout=10)
        if r.returncode != 0:
            raise NetnsError(f"mount cgroup2 at {path}: {r.stderr.decode(errors='replace').strip()}")


def umount(path: Path) -> None:
    while any(mp == str(path) for mp, _ in mounts()):
        r = subprocess.run(["umount", str(path)], capture_output=True, timeout=10)
        if r.returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=10)
            break


def cgroup_procs(path: Path) -> set[int]:
    try:
        return {int(x) for x in (path / "cgroup.procs").read_text().split()}
    except OSError:
        return set()


def remove_cgroup(path: Path) -> None:
    """Kill whatever is left in a cgroup of ours and remove it (children first)."""
    if not path.is_dir():
        return
    for child in [p for p in path.iterdir() if p.is_dir()]:
        remove_cgroup(child)
    if cgroup_procs(path):
        try:
            (path / "cgroup.kill").write_text("1")
        except OSError:
            terminate(cgroup_procs(path), grace=0.5)
    deadline = time.monotonic() + 5
    while True:
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def cgroup_preexec(path: Path | None) -> Callable[[], None] | None:
    """A ``preexec_fn`` that moves the child into cgroup ``path`` before it execs (so no packet escapes the hook)."""
    if path is None:
        return None
    procs = str(path / "cgroup.procs")

    def enter() -> None:
        fd = os.open(procs, os.O_WRONLY)
        try:
            os.write(fd, b"0")  # "0" means the writing process itself
        finally:
            os.close(fd)

    return enter
