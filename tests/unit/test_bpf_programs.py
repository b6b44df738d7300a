"""The bpf mode's held programs (``backends.bpf.programs``) without a kernel: the build digest that names program pins
(and decides whether a restart may adopt them) follows the source's compiler flags; every program's attach type is
one ``loader.attached`` reports; only pins of other builds are stale; a keeper holding nothing repairs nothing (its
caller compiles)."""

from __future__ import annotations

from pathlib import Path

from kproxy.backends.bpf import loader, programs
from kproxy.model import IPFamily


def _places(pin: Path, size: int = 1024) -> loader.Places:
    return loader.Places(pin, Path("/run/kproxy-unit-no-such-cgroup"), False, size)


def test_the_digest_names_one_build_of_the_source_and_flags(tmp_path: Path) -> None:
    a = programs.digest(_places(tmp_path / "a"))
    assert a == programs.digest(_places(tmp_path / "a")) and len(a) == 16 and int(a, 16) >= 0
    # the flags carry the map sizes and the pin paths the programs reopen: another of either is another build
    assert programs.digest(_places(tmp_path / "a", 2048)) != a
    assert programs.digest(_places(tmp_path / "b")) != a
    assert programs.digest(_places(tmp_path / "a"), peer=False) != a


def test_every_program_attaches_as_the_query_names_it() -> None:
    for name, (_fam, bcc_name, short) in loader.PROGRAMS.items():
        at = programs.attach_type(name)
        assert at in loader.ATTACH_NUMBERS and at == bcc_name.lower() and at.endswith(short.rstrip("46").lstrip("_"))


def test_only_program_pins_of_another_build_are_stale(tmp_path: Path) -> None:
    p = _places(tmp_path)
    tmp_path.mkdir(exist_ok=True)
    mine, other = "0123456789abcdef", "fedcba9876543210"
    names = [f"prog_{mine}_kp_connect4", f"prog_{other}_kp_connect4", f"prog_{other}_kp_sendmsg6", "svc4_v3", "x"]
    for n in names:
        (tmp_path / n).write_text("")
    assert programs.remove_stale(p, mine) == [f"prog_{other}_kp_connect4", f"prog_{other}_kp_sendmsg6"]
    assert sorted(f.name for f in tmp_path.iterdir()) == sorted([f"prog_{mine}_kp_connect4", "svc4_v3", "x"])
    assert programs.pin_path(p, mine, "kp_connect4") == tmp_path / f"prog_{mine}_kp_connect4"


def test_a_keeper_holding_nothing_leaves_the_repair_to_a_compile(tmp_path: Path) -> None:
    k = programs.Keeper()
    p = _places(tmp_path)
    assert not k.put_back_pins(p, {})
    assert not k.reattach(p, {("svc", IPFamily.V4): 1}, (IPFamily.V4,), "detached")
    assert k.remove_stale(p) == [] and k.compiles == 0 and k.repairs == 0
    k.close()
