"""The bpf mode puts back detached programs and removed pins from the programs it holds, without a compile (issue 24:
drift repaired within a second): the same programs attached again, the same maps pinned again (their contents kept),
in well under the time of one compile, and a client in the cgroup reaches the service through them again. A restart
of the same build adopts the pinned programs without a compile; pins of another build are never adopted; maps
replaced by someone else (not removed) leave nothing the held programs can serve, and the repair compiles.

Each test makes a namespace ``kpr-ra-…``, a cgroup in a cgroup2 mount of its own and a pin folder of its own
(``bpfplace``), all removed in the fixture's finalizer, also on failure. The proxier is driven directly (``sync``,
``needs_full``: the check the drift watcher's poll runs), so every step is awaited, none timed by sleeping."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kproxy.model import Changes, IPFamily, ProxyState

from .bpfplace import bpf_place, ns_script
from .test_bpf_backend import BACKEND_IP, SERVERS, _config, in_cgroup, sp, state

pytestmark = pytest.mark.root

CG_MOUNT = Path("/run/kproxy-bpf-test/cgroup2")
VIP = "198.19.0.60"
#: a repair from the held programs: a few bpf(2) calls; a compile takes seconds (tens on a busy machine)
HELD_REPAIR_S = 0.5

CLIENT = f"""
import socket
s = socket.create_connection(("{VIP}", 80), timeout=3)
print(s.recv(100).decode()); s.close()
"""


@pytest.fixture
def place() -> Iterator[tuple[str, dict[str, str]]]:
    with bpf_place("kpr-ra-", CG_MOUNT, (BACKEND_IP,)) as got:
        with ns_script(got[0], SERVERS):
            yield got


def _state() -> ProxyState:
    return state(sp("web", VIP, (BACKEND_IP,)))


def _answered(ns: str, opts: dict[str, str]) -> bool:
    out = in_cgroup(ns, opts["bpf_cgroup_path"], CLIENT)
    return out.returncode == 0 and out.stdout.startswith("tcp ")


def _attached_ids(cgroup: str) -> list[int]:
    from kproxy.backends.bpf import loader

    return sorted(int(d["id"]) for d in loader.ours(loader.attached(Path(cgroup))))


def _program_pins(pin: Path) -> list[str]:
    from kproxy.backends.bpf import programs

    return sorted(f.name for f in pin.iterdir() if f.name.startswith(programs.PIN_PREFIX)) if pin.is_dir() else []


def test_detached_programs_and_removed_pins_come_back_from_the_held_ones_without_a_compile(
    place: tuple[str, dict[str, str]],
) -> None:
    from kproxy.backends.bpf import cleanup, loader, programs
    from kproxy.backends.bpf.proxier import BpfProxier

    ns, opts = place
    cg, pin = Path(opts["bpf_cgroup_path"]), Path(opts["bpf_pin_path"])
    p = BpfProxier(_config(opts), netns=ns)
    try:
        p.start()
        assert p.programs.compiles == 1  # a fresh pin folder: nothing to adopt
        assert p.sync(_state(), Changes(full=True)).ok
        places = loader.places(opts, ns)
        build = programs.digest(places)
        assert _program_pins(pin) == sorted(f"prog_{build}_{n}" for n in loader.PROGRAMS)
        ids, maps_before = _attached_ids(str(cg)), loader.pinned_ids(places)
        assert len(ids) == 8 and _answered(ns, opts)

        def detach() -> None:
            loader.detach_all(cg)

        def unpin() -> None:
            cleanup.remove_tree(pin)

        def both() -> None:  # what another process's cleanup does to the programs and pins
            detach()
            unpin()

        for damage in (detach, unpin, both):
            damage()
            assert loader.programs_problem(places, loader.pinned_ids(places), (IPFamily.V4,)) is not None
            t0 = time.perf_counter()
            assert p.needs_full(IPFamily.V4), f"{damage.__name__}: not seen"
            took = time.perf_counter() - t0
            assert took < HELD_REPAIR_S, f"{damage.__name__}: repaired in {took:.3f} s"
            # the same maps pinned again (contents kept), the same programs attached and pinned again
            assert loader.pinned_ids(places) == maps_before, damage.__name__
            assert _attached_ids(str(cg)) == ids, damage.__name__
            assert _program_pins(pin) == sorted(f"prog_{build}_{n}" for n in loader.PROGRAMS)
            assert loader.programs_problem(places, maps_before, (IPFamily.V4,)) is None
            res = p.sync(_state(), Changes(full=True))  # the full sync the repair owes (it reads the maps back)
            assert res.ok and res.family(IPFamily.V4).figures["map_writes"] == 0, damage.__name__  # nothing lost
            assert _answered(ns, opts), damage.__name__
        assert p.programs.compiles == 1, "a repair compiled"
        assert p.programs.repairs == 4  # detach, unpin, and both (pins, then the programs)
    finally:
        p.close()


def test_a_restart_adopts_the_pinned_programs_of_its_build_and_never_another_builds(
    place: tuple[str, dict[str, str]],
) -> None:
    from kproxy.backends.bpf import loader, programs
    from kproxy.backends.bpf.proxier import BpfProxier

    ns, opts = place
    pin = Path(opts["bpf_pin_path"])
    first = BpfProxier(_config(opts), netns=ns)
    try:
        first.start()
        assert first.sync(_state(), Changes(full=True)).ok
        ids = _attached_ids(opts["bpf_cgroup_path"])
    finally:
        first.close()  # as SIGKILL leaves it: programs attached and pinned, maps pinned
    second = BpfProxier(_config(opts), netns=ns)
    try:
        t0 = time.perf_counter()
        second.start()
        took = time.perf_counter() - t0
        assert second.programs.compiles == 0 and _attached_ids(opts["bpf_cgroup_path"]) == ids
        res = second.sync(_state(), Changes(full=True))
        assert res.ok and res.family(IPFamily.V4).figures["map_writes"] == 0
        assert _answered(ns, opts), f"adopted in {took:.3f} s but not serving"
    finally:
        second.close()
    # the same programs under another build's name (an older kproxy's pins): not adopted, compiled, and then stale
    build = programs.digest(loader.places(opts, ns))
    other = "0" * 16 if build != "0" * 16 else "1" * 16
    for name in loader.PROGRAMS:
        (pin / f"prog_{build}_{name}").rename(pin / f"prog_{other}_{name}")
    third = BpfProxier(_config(opts), netns=ns)
    try:
        third.start()
        assert third.programs.compiles == 1
        assert _program_pins(pin) == sorted(f"prog_{build}_{n}" for n in loader.PROGRAMS)  # the other build's gone
        assert third.sync(_state(), Changes(full=True)).ok and _answered(ns, opts)
    finally:
        third.close()


def test_maps_replaced_by_someone_else_leave_nothing_held_to_serve_and_the_repair_compiles(
    place: tuple[str, dict[str, str]],
) -> None:
    from kproxy.backends.bpf import cleanup, loader, maps
    from kproxy.backends.bpf.proxier import BpfProxier

    ns, opts = place
    p = BpfProxier(_config(opts), netns=ns)
    try:
        p.start()
        assert p.sync(_state(), Changes(full=True)).ok
        places = loader.places(opts, ns)
        before = loader.pinned_ids(places)
        cleanup.remove_tree(Path(opts["bpf_pin_path"]))
        places.pin_real.mkdir()
        for fam in (IPFamily.V4, IPFamily.V6):  # someone else's maps at kproxy's paths (empty, of the same spec)
            for role in maps.ROLES:
                fd = loader.open_or_create(places, role, fam)
                os.close(fd)
        assert p.needs_full(IPFamily.V4)
        assert p.programs.repairs == 1 and p._reattach  # the program pins put back; the programs need a compile
        res = p.sync(_state(), Changes(full=True))  # refills the new maps, then compiles and attaches
        assert res.ok, res.error
        assert p.programs.compiles == 2 and not p._reattach
        now = loader.pinned_ids(places)
        assert now[("svc", IPFamily.V4)] != before[("svc", IPFamily.V4)]
        assert loader.programs_problem(places, now, (IPFamily.V4,)) is None
        assert _answered(ns, opts)
    finally:
        p.close()
