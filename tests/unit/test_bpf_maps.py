"""The bpf mode's map encoding without root: struct formats against their ctypes mirrors and the C header, byte
layouts of keys and values, round trips, pin names."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import pytest

from kproxy.backends.bpf import maps
from kproxy.model import IPFamily

HEADER = Path(__file__).resolve().parents[2] / "bpf" / "kproxy_lb.h"


@pytest.mark.parametrize(("fmt", "mirror"), maps.MIRRORS, ids=lambda x: getattr(x, "__name__", str(x)))
def test_struct_formats_match_their_ctypes_mirrors(fmt: object, mirror: type[ctypes.Structure]) -> None:
    assert fmt.size == ctypes.sizeof(mirror)  # type: ignore[attr-defined]


def test_sizes_match_the_c_header() -> None:
    """Each packed struct of bpf/kproxy_lb.h has the size its Python format says (fields summed from the header)."""
    text = re.sub(r"/\*.*?\*/", "", HEADER.read_text(), flags=re.S)
    sizes = {"__be32": 4, "__u32": 4, "__be16": 2, "__u16": 2, "__u8": 1, "__u64": 8, "char": 1}
    structs = dict(re.findall(r"struct (kp_\w+) \{(.*?)\}", text, re.S))
    got = {}
    for name, body in structs.items():
        total = 0
        for typ, _field, count in re.findall(r"(\w+) (\w+)(?:\[(\d+)\])?;", body):
            total += sizes[typ] * (int(count) if count else 1)
        got[name] = total
    assert got["kp_lb4_key"] == maps.LB4_KEY.size == 12
    assert got["kp_lb6_key"] == maps.LB6_KEY.size == 24
    assert got["kp_lb_service"] == maps.LB_SERVICE.size == 16
    assert got["kp_lb4_backend"] == maps.LB4_BACKEND.size == 8
    assert got["kp_lb6_backend"] == maps.LB6_BACKEND.size == 20
    assert got["kp_rev4_key"] == maps.REV4_KEY.size
    assert got["kp_rev4_val"] == maps.REV4_VAL.size
    assert got["kp_rev6_key"] == maps.REV6_KEY.size
    assert got["kp_rev6_val"] == maps.REV6_VAL.size
    assert got["kp_aff_key"] == maps.AFF_KEY.size
    assert got["kp_aff_val"] == maps.AFF_VAL.size
    assert got["kp_svc_name"] == maps.NAME_VAL.size


def test_lb4_key_bytes_are_network_order_address_and_port() -> None:
    raw = maps.lb_key(IPFamily.V4, "198.19.0.10", 80, 6, 3)
    assert raw == bytes([198, 19, 0, 10, 0, 80, 3, 0, 6, 0, 0, 0])
    key = maps.Lb4Key.from_buffer_copy(raw)
    assert bytes(key.address) == bytes([198, 19, 0, 10])
    assert bytes(key.dport) == b"\x00\x50"
    assert key.slot == 3 and key.proto == 6
    assert maps.decode_lb_key(IPFamily.V4, raw) == ("198.19.0.10", 80, 6, 3)


def test_lb6_key_round_trip() -> None:
    raw = maps.lb_key(IPFamily.V6, "fd00:198:18:ff::a", 8443, 17, 0)
    assert len(raw) == 24
    assert maps.decode_lb_key(IPFamily.V6, raw) == ("fd00:198:18:ff::a", 8443, 17, 0)


def test_master_and_slot_values() -> None:
    m = maps.Master(count=3, flags=maps.F_AFFINITY, affinity=10800, rev_nat_id=7)
    raw = maps.master_value(m)
    s = maps.LbService.from_buffer_copy(raw)
    assert (s.backend_id, s.affinity_timeout, s.count, s.rev_nat_id, s.flags) == (0, 10800, 3, 7, maps.F_AFFINITY)
    assert maps.decode_service(maps.slot_value(42)) == (42, 0, 0, 0, 0)


def test_backend_values_round_trip() -> None:
    raw = maps.backend_value(IPFamily.V4, "198.18.65.11", 8080, 6)
    assert raw == bytes([198, 18, 65, 11, 0x1F, 0x90, 6, 0])
    assert maps.decode_backend(IPFamily.V4, raw) == ("198.18.65.11", 8080, 6)
    raw6 = maps.backend_value(IPFamily.V6, "fd00:198:18:41::b", 53, 17)
    assert maps.decode_backend(IPFamily.V6, raw6) == ("fd00:198:18:41::b", 53, 17)
    assert maps.backend_key(5) == b"\x05\x00\x00\x00"


def test_names_are_nul_padded_and_cut() -> None:
    raw = maps.name_value("ns/web:http/TCP")
    assert len(raw) == 128 and maps.decode_name(raw) == "ns/web:http/TCP"
    assert len(maps.decode_name(maps.name_value("x" * 300))) == 127


def test_pin_names_are_versioned_per_family_and_role() -> None:
    names = maps.all_pin_names()
    assert len(names) == len(set(names)) == 2 * len(maps.ROLES)
    assert maps.pin_name("svc", IPFamily.V4) == f"svc4_{maps.MAPS_VERSION}"
    assert all(n.endswith("_" + maps.MAPS_VERSION) for n in names)


def test_key_sizes_cover_every_role() -> None:
    for fam in (IPFamily.V4, IPFamily.V6):
        assert set(maps.key_sizes(fam)) == set(maps.ROLES)


def test_packed_entries_read_as_the_byte_strings_they_were_built_from() -> None:
    items = [bytes([i]) * 4 for i in range(5)]
    packed = maps.Packed(b"".join(items), 4)
    assert len(packed) == 5 and list(packed) == items and packed == items
    assert packed[-1] == items[-1] and list(packed[1:3]) == items[1:3] and packed[::2] == items[::2]
    assert maps._joined(packed, 0, 5) is packed.blob  # a whole batch is handed over without a copy
    assert maps._joined(packed, 1, 2) == b"".join(items[1:3]) == maps._joined(items, 1, 2)
    with pytest.raises(IndexError):
        packed[5]
    with pytest.raises(ValueError, match="whole entries"):
        maps.Packed(b"12345", 4)
