"""The bpf mode's root-cgroup guard (issue 19): the root of the machine's cgroup v2 hierarchy is refused wherever it
is mounted (the bpf overlay mounts the host's at /run/kproxy/cgroupv2, a path the guard did not know), unless the
operator chooses it with ``--bpf-allow-root-cgroup true``; a child cgroup is fine either way.

Mounts a cgroup2 instance of its own at a fresh temporary path (the machine's hierarchy, seen from there) and makes
one child cgroup in it, removed again.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kproxy.backends.bpf import loader
from kproxy.backends.bpf.proxier import BpfProxier

pytestmark = pytest.mark.root


@pytest.fixture
def cgroup2(tmp_path: Path) -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("mounting cgroup2 needs root")
    at = tmp_path / "cgroupv2"
    at.mkdir()
    subprocess.run(["mount", "-t", "cgroup2", "none", str(at)], check=True, timeout=30)
    child = at / f"kproxy-test-{uuid.uuid4().hex[:8]}"
    try:
        child.mkdir()
        yield at
    finally:
        if child.exists():
            child.rmdir()
        subprocess.run(["umount", str(at)], check=True, timeout=30)


def test_root_cgroup_at_any_mount_point_is_refused_unless_chosen(cgroup2: Path) -> None:
    pin = "/sys/fs/bpf/kproxy/test-root-guard"
    (child,) = [p for p in cgroup2.iterdir() if p.name.startswith("kproxy-test-")]
    refused = loader.places({"bpf_cgroup_path": str(cgroup2), "bpf_pin_path": pin})
    with pytest.raises(ValueError, match="root cgroup.*--bpf-allow-root-cgroup"):
        loader.check_places(refused)
    assert loader.is_root_cgroup(cgroup2) and not loader.is_root_cgroup(child)
    loader.check_places(loader.places({"bpf_cgroup_path": str(child), "bpf_pin_path": pin}))
    chosen = loader.places({"bpf_cgroup_path": str(cgroup2), "bpf_pin_path": pin, "bpf_allow_root_cgroup": True})
    assert chosen.root_ok
    loader.check_places(chosen)


def test_the_choice_is_a_flag() -> None:
    (opt,) = [o for o in BpfProxier.options if o.name == "bpf_allow_root_cgroup"]
    assert opt.flag == "--bpf-allow-root-cgroup" and opt.default is False
    assert opt.convert("true") is True and opt.convert("false") is False
