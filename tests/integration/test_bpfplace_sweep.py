"""``bpfplace``'s sweep of what killed runs left: a run of ``bpf_place`` in a child process, with a pinned map in its
pin folder and a process in a cgroup below its own, killed with SIGKILL (its ``finally`` never runs); the sweep
removes its pin folder and cgroups and kills the process left there, and leaves the live run's places (the test's
own ``bpf_place``), and look-alikes that are not a dead run's folders, alone.

Everything is the test's own: the ``kh4-sw-`` namespaces, the cgroups in the shared test cgroup2 mount, the pin
folders and pins in bpffs; the finalizers remove whatever is left, also on failure."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest

from . import bpfplace
from .bpfplace import BPFFS, OWNED, bpf_place, owner_gone, owner_tag

PREFIX = "kh4-sw-"
CG_MOUNT = Path("/run/kproxy-bpf-test/cgroup2")
ROOT = Path(__file__).resolve().parents[2]
CHILD = """
import json, os, subprocess, sys
from pathlib import Path
from tests.integration.bpfplace import bpf_place
from kproxy.backends.bpf import maps

with bpf_place(sys.argv[1], Path(sys.argv[2])) as (ns, opts):
    pins, cg = Path(opts["bpf_pin_path"]), Path(opts["bpf_cgroup_path"])
    pins.mkdir()
    fd = maps.create_map(maps.MAP_HASH, 4, 4, 16, maps.BPF_F_NO_PREALLOC)
    maps.obj_pin(fd, str(pins / "m"))
    os.close(fd)
    (cg / "sub").mkdir()
    stray = subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"], start_new_session=True)
    (cg / "sub" / "cgroup.procs").write_text(str(stray.pid))
    print(json.dumps({"ns": ns, "stray": stray.pid, **opts}), flush=True)
    sys.stdin.read()  # until the test kills this run
"""


def state(pid: int) -> str | None:
    """The process's state letter (``Z``: ended, not yet reaped), None when there is no such process."""
    try:
        return Path(f"/proc/{pid}/stat").read_bytes().rpartition(b")")[2].split()[0].decode()
    except OSError:
        return None


def test_a_place_name_says_whose_it_is_and_whether_its_owner_is_gone() -> None:
    mine = f"{PREFIX}{owner_tag()}0123abcd"
    m = OWNED.search(mine)
    assert m is not None and int(m["pid"]) == os.getpid()
    assert not owner_gone(mine) and not owner_gone(f"{mine}-b")  # this process's, and a sibling a test made
    assert owner_gone(mine.replace(f"-{m['start']}-", f"-{int(m['start']) + 1}-"))  # its pid, another process
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, check=True)
    pid = int(ended.stdout)
    assert owner_gone(f"{PREFIX}bpl{m['pidns']}-{pid}-{m['start']}-0123abcd")  # no such process any more
    assert not owner_gone(f"{PREFIX}bpl{int(m['pidns']) + 1}-{pid}-1-0123abcd")  # another pid namespace's: unknown
    assert not owner_gone(f"{PREFIX}0123abcd") and not owner_gone("kproxy")  # not bpf_place's naming
    assert not owner_gone(mine.replace("0123abcd", "0123abcz"))  # the random part is hex


@contextmanager
def killed_run() -> Iterator[dict[str, str]]:
    """A ``bpf_place`` run in a child, killed inside its block: its options, namespace and stray process's pid."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, PREFIX, str(CG_MOUNT)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=env,
    )
    got: dict[str, str] = {}
    try:
        assert child.stdout is not None
        line = child.stdout.readline()
        assert line, "the child run ended before its place was made"
        got = json.loads(line)
        child.kill()  # SIGKILL: no finally of the child's runs
        child.wait(30)
        yield got
    finally:
        child.kill()
        child.wait(30)
        for f in (child.stdin, child.stdout):
            if f is not None:
                f.close()
        if got:
            if state(int(got["stray"])) not in (None, "Z"):
                os.kill(int(got["stray"]), signal.SIGKILL)
            bpfplace._remove_cgroup(Path(got["bpf_cgroup_path"]))
            from kproxy.backends.bpf import cleanup

            cleanup.remove_tree(Path(got["bpf_pin_path"]))
            subprocess.run(["ip", "netns", "delete", got["ns"]], check=False, timeout=30)


@pytest.mark.root
def test_the_sweep_removes_a_killed_runs_places_and_nothing_else() -> None:
    with ExitStack() as stack:
        ns, live = stack.enter_context(bpf_place(PREFIX, CG_MOUNT))  # swept once already: nothing of ours
        live_pin, live_cg = Path(live["bpf_pin_path"]), Path(live["bpf_cgroup_path"])
        live_pin.mkdir()
        dead = stack.enter_context(killed_run())  # its own bpf_place swept first: the live run is not touched
        pin, cg = Path(dead["bpf_pin_path"]), Path(dead["bpf_cgroup_path"])
        assert live_pin.is_dir() and live_cg.is_dir()
        assert (pin / "m").exists() and (cg / "sub").is_dir()  # left behind, with a process still running there
        assert state(int(dead["stray"])) not in (None, "Z")
        m = OWNED.search(pin.name)
        assert m is not None
        others = [
            CG_MOUNT / f"{PREFIX}other",  # not bpf_place's naming
            CG_MOUNT / f"{PREFIX}bpl{int(m['pidns']) + 1}-{m['pid']}-{m['start']}-0123abcd",  # another pid ns
            BPFFS / f"{PREFIX}other",
        ]
        for d in others:
            d.mkdir()
            stack.callback(d.rmdir)
        pinned = BPFFS / f"{PREFIX}bpl{m['pidns']}-{m['pid']}-{m['start']}-0123abcd"  # a dead run's name, not a folder
        stack.callback(pinned.unlink, missing_ok=True)
        from kproxy.backends.bpf import maps

        fd = maps.create_map(maps.MAP_HASH, 4, 4, 16, maps.BPF_F_NO_PREALLOC)
        maps.obj_pin(fd, str(pinned))
        os.close(fd)

        gone = bpfplace.sweep(CG_MOUNT)

        assert {pin, cg} <= set(gone) and not pin.exists() and not cg.exists()
        assert state(int(dead["stray"])) in (None, "Z")  # the process left in its cgroup was killed
        assert live_pin.is_dir() and live_cg.is_dir() and ns
        assert all(d.is_dir() for d in others) and pinned.exists()
        assert all(owner_gone(p.name) for p in gone)
