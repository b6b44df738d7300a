"""The bpf mode's options and places without root: typed options with a default that holds 10,000 x 50, per-node
lab options (the node's own cgroup and pin folder, never the machine's), per-namespace defaults, refusal of the
machine's shared places."""

from __future__ import annotations

from pathlib import Path

import pytest

from kproxy.backends.bpf import loader
from kproxy.backends.bpf.proxier import BpfProxier
from kproxy.proxier import LabNodeSpec, option_arguments


def test_options_are_typed_and_the_default_map_size_holds_10000_services_of_50() -> None:
    opts = {o.name: o for o in BpfProxier.options}
    assert set(opts) == {"bpf_cgroup_path", "bpf_pin_path", "bpf_map_size", "bpf_allow_root_cgroup"}
    assert opts["bpf_map_size"].type is int
    assert opts["bpf_map_size"].default >= 10_000 * (1 + 50)
    assert opts["bpf_map_size"].convert("4096") == 4096
    with pytest.raises(ValueError):
        opts["bpf_map_size"].convert("lots")


def test_lab_options_give_each_node_its_own_cgroup_and_pin_folder(monkeypatch: pytest.MonkeyPatch) -> None:
    def mounts() -> None:
        raise AssertionError("lab_options returns option values: it must not mount anything")

    monkeypatch.setattr(loader, "ensure_host_bind", mounts)
    node = LabNodeSpec("node-1", "kpx-n1", Path("/run/kproxy-lab/cgroup2/kpx-n1"), Path("/tmp/x"))
    got = BpfProxier.lab_options(node, {})
    assert got == {
        "bpf_cgroup_path": "/run/kproxy-lab/cgroup2/kpx-n1",
        "bpf_pin_path": "/sys/fs/bpf/kproxy/lab-kpx-n1",
    }
    assert option_arguments(BpfProxier, got) == [
        "--bpf-cgroup-path",
        "/run/kproxy-lab/cgroup2/kpx-n1",
        "--bpf-pin-path",
        "/sys/fs/bpf/kproxy/lab-kpx-n1",
    ]
    # what the lab was asked for wins
    assert BpfProxier.lab_options(node, {"bpf_pin_path": "/sys/fs/bpf/mine"}) == {
        "bpf_cgroup_path": "/run/kproxy-lab/cgroup2/kpx-n1"
    }


def test_defaults_are_per_network_namespace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loader, "netns_inode", lambda netns: 4242 if netns == "a" else 77)
    a, b = loader.places({}, "a"), loader.places({}, "b")
    assert a.pin_dir == Path("/sys/fs/bpf/kproxy/net-4242") and a.own_cgroup
    assert a.cgroup == loader.CGROUP_ROOT / "kproxy-net-4242"
    assert b.pin_dir != a.pin_dir and b.cgroup != a.cgroup
    given = loader.places({"bpf_pin_path": "/sys/fs/bpf/x", "bpf_cgroup_path": "/run/cg/x", "bpf_map_size": 64})
    assert (given.pin_dir, given.cgroup, given.own_cgroup, given.map_size) == (
        Path("/sys/fs/bpf/x"),
        Path("/run/cg/x"),
        False,
        64,
    )


@pytest.mark.parametrize(
    ("pin", "cgroup"),
    [
        ("/sys/fs/bpf", "/run/cg/x"),
        ("/sys/fs/bpf/x", "/sys/fs/cgroup"),
        ("/sys/fs/bpf/x", "/sys/fs/cgroup/unified"),
        ("/sys/fs/bpf/x", str(loader.CGROUP_ROOT)),
    ],
)
def test_the_machines_shared_places_are_refused(pin: str, cgroup: str) -> None:
    with pytest.raises(ValueError):
        loader.check_places(loader.Places(Path(pin), Path(cgroup), False, 64))


def test_no_scenario_is_declared_not_applicable() -> None:
    assert dict(BpfProxier.not_applicable({})) == {}


def test_lab_prepare_binds_the_machines_bpffs(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the node needs prepared on the machine is ``lab_prepare``'s, which the lab calls before it starts a
    node's kproxy."""
    calls: list[str] = []
    monkeypatch.setattr(loader, "ensure_host_bind", lambda: calls.append("bind"))
    node = LabNodeSpec("node-1", "kpx-n1", Path("/run/kproxy-lab/cgroup2/kpx-n1"), Path("/tmp/x"))
    BpfProxier.lab_prepare(node, {})
    assert calls == ["bind"]


def test_the_writer_lowers_the_switch_interval_only_while_it_runs() -> None:
    """The pipelined writer needs the GIL back quickly after each bpf(2) call; the interpreter-wide switch interval
    is lowered only while it runs and restored after, also when a write fails."""
    import sys

    from kproxy.backends.bpf import kernel
    from kproxy.model import IPFamily

    before = sys.getswitchinterval()
    with pytest.raises(KeyError), kernel.Writer({}, IPFamily.V4) as w:
        assert sys.getswitchinterval() == min(before, kernel.WRITER_SWITCH_INTERVAL)
        w.submit([("svc", "put", [b"k"], [b"v"])])  # no such map: the write fails
        w.finish()
    assert sys.getswitchinterval() == before


def test_the_writer_restores_the_switch_interval_when_its_thread_does_not_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``__exit__`` does not run when ``__enter__`` raises: the writer restores the interval itself."""
    import sys
    import threading

    from kproxy.backends.bpf import kernel
    from kproxy.model import IPFamily

    def refuse(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    before = sys.getswitchinterval()
    writer = kernel.Writer({}, IPFamily.V4)
    monkeypatch.setattr(threading.Thread, "start", refuse)
    with pytest.raises(RuntimeError, match="can't start new thread"), writer:
        pass
    assert sys.getswitchinterval() == before
