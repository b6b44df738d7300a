"""Where a bpf proxier under test runs: a network namespace, a cgroup v2 directory and a bpffs pin folder, all of the
test's own (bpffs and cgroups are shared by the whole machine) and removed afterwards, also on failure."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from modes import require_mode

from .scratch import scratch_netns


@contextmanager
def bpf_place(
    prefix: str,
    cg_mount: Path,
    addresses: Sequence[str] = (),
    setup: Callable[[str], None] | None = None,
) -> Iterator[tuple[str, dict[str, str]]]:
    """(namespace, bpf options) with ``addresses`` on the namespace's lo and ``setup(namespace)`` run first; the
    cgroup (and any child a test made under it), the pins, the places record and the namespace go afterwards, and
    ``cg_mount`` is unmounted when this call mounted it."""
    require_mode("bpf")  # skipped with the reason on a machine without bcc; a failure where bpf is required
    cg_mount.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mountpoint", "-q", str(cg_mount)], check=False).returncode == 0
    if not mounted:
        subprocess.run(["mount", "-t", "cgroup2", "none", str(cg_mount)], check=True, timeout=30)
    tag = uuid.uuid4().hex[:8]
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
