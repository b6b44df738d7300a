"""The backend toolkit's pure helpers (``kproxy.toolkit``): the key text, CIDR helpers, libnftables JSON elements,
refused lines mapped to their owners, the trace entry and the verify findings."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from kproxy.model import IPFamily, Protocol, ServicePortName
from kproxy.nftkernel import Result
from kproxy.toolkit import cidr, nft, trace, verify
from kproxy.toolkit.keys import service_key
from kproxy.toolkit.netns import in_netns


def test_service_key_is_the_name_then_the_protocol() -> None:
    named = ServicePortName("ns", "web", "http", Protocol.TCP)
    unnamed = ServicePortName("ns", "dns", "", Protocol.UDP)
    assert service_key(named) == "ns/web:http/TCP" == f"{named}/{named.protocol.value}"
    assert service_key(unnamed) == "ns/dns/UDP" == f"{unnamed}/{unnamed.protocol.value}"


def test_collapsed_drops_other_families_overlaps_and_host_prefix_lengths() -> None:
    got = cidr.collapsed(["198.18.0.0/16", "198.18.5.0/24", "198.19.0.7", "fd00:198:18::/48", "junk"], IPFamily.V4)
    assert got == ("198.18.0.0/16", "198.19.0.7")
    assert cidr.collapsed(["fd00:198:18::1/128", "198.18.0.0/16"], IPFamily.V6) == ("fd00:198:18::1",)


def test_membership_ignores_garbage_and_other_families() -> None:
    assert cidr.any_contains(["198.18.0.0/15", "bad"], ["fd00:198:18::1", "198.19.3.4"])
    assert not cidr.any_contains(["198.18.0.0/15"], [])
    assert not cidr.any_contains(["fd00:198:18::/48"], ["198.18.0.1"])
    assert cidr.in_any("198.18.0.1", ["junk", "198.18.0.0/24"])
    assert not cidr.in_any("not-an-ip", ["198.18.0.0/24"])
    assert not cidr.in_any("::ffff:198.18.0.1", ["198.18.0.0/24"])


def test_all_but_loopback_and_spans() -> None:
    nets = cidr.all_but_loopback(IPFamily.V4)
    assert cidr.in_any("198.18.0.1", [str(n) for n in nets])
    assert not cidr.in_any("127.0.0.1", [str(n) for n in nets])
    assert nets == sorted(nets)
    # the same addresses in three spellings compare equal
    assert cidr.spans(["198.18.0.0/17", "198.18.128.0/17"]) == cidr.spans(["198.18.0.0/16"])
    assert cidr.spans(["198.18.0.0-198.18.255.255"]) == cidr.spans(["198.18.0.0/16"])
    assert cidr.spans(["198.18.0.1", "198.18.0.2"]) == cidr.spans(["198.18.0.1-198.18.0.2"])
    assert cidr.network_text(cidr.networks(["198.18.0.1/32"])[0]) == "198.18.0.1"


LISTING: list[dict[str, Any]] = [
    {"metainfo": {"version": "1.0.6"}},
    {
        "map": {
            "name": "service-ips",
            "elem": [
                [
                    {
                        "elem": {
                            "val": {"concat": ["198.18.200.1", "tcp", 80]},
                            "comment": "ns/web:http/TCP #d1",
                            "counter": {"packets": 3, "bytes": 180},
                        }
                    },
                    {"goto": {"target": "lb-i-3"}},
                ],
                [{"concat": ["198.18.200.2", "udp", 53]}, {"continue": None}],
            ],
        }
    },
    {"map": {"name": "backends", "elem": [["198.18.200.1 . tcp . 80 . 0", {"concat": ["198.18.7.1", 8080]}]]}},
    {
        "set": {
            "name": "cidrs",
            "elem": [{"prefix": {"addr": "198.18.0.0", "len": 16}}, {"range": ["198.19.0.1", "198.19.0.9"]}],
        }
    },
    {"chain": {"name": "services"}},
]


def test_elements_in_nft_text_spelling() -> None:
    got = nft.elements(LISTING)
    assert got[0] == nft.Element(
        "service-ips", "198.18.200.1 . tcp . 80", "goto lb-i-3", "ns/web:http/TCP #d1", (3, 180)
    )
    assert got[1] == nft.Element("service-ips", "198.18.200.2 . udp . 53", "continue", "", None)
    assert got[2].value == "198.18.7.1 . 8080"  # map data that is a concatenation
    assert [e.key for e in got[3:]] == ["198.18.0.0/16", "198.19.0.1-198.19.0.9"]
    assert len(got) == 5
    assert nft.element_line(got[0]) == (
        'service-ips: 198.18.200.1 . tcp . 80 counter packets 3 bytes 180 comment "ns/web:http/TCP #d1" : goto lb-i-3'
    )
    assert nft.element_line(got[2], "ns/web:http/TCP") == (
        'backends: 198.18.200.1 . tcp . 80 . 0 comment "ns/web:http/TCP" : 198.18.7.1 . 8080'
    )


def test_a_refused_line_names_its_owner() -> None:
    web = ServicePortName("ns", "web", "", Protocol.TCP)
    owners: list[ServicePortName | None] = [None, web, None]
    error = (
        "/proc/self/fd/7:2:34-46: Error: interval overlaps with an existing one\n"
        "add element ip kproxy service-ips { 198.18.0.1 . tcp . 80 : goto x }\n"
        "                                 ^^^^^^^^^^^^~~~~~\n"
    )
    summary, refused = nft.refused(Result(1, "", error, 0.0), lambda n: nft.owner_at(owners, n))
    assert refused == {web: summary}
    assert "^" not in summary and summary.startswith("/proc/self/fd/7:2:34-46: Error: interval overlaps")
    assert nft.owner_at(owners, 0) is None and nft.owner_at(owners, 4) is None
    summary, refused = nft.refused(Result(1, "", "internal:1:1-5: Error: oops", 0.0), lambda n: nft.owner_at(owners, n))
    assert refused == {} and summary == "internal:1:1-5: Error: oops"
    assert nft.summary("") == "nft refused the transaction"
    assert nft.delete_text("ip6", "t") == "add table ip6 t\ndelete table ip6 t\n"


def test_traced_checks_the_address_and_what_was_applied() -> None:
    seen: list[trace.Packet] = []

    def applied(fam: IPFamily) -> tuple[str | None, dict[ServicePortName, int]]:
        return ("ctx" if fam == IPFamily.V4 else None), {}

    def walk(ctx: str, fragments: Any, pkt: trace.Packet) -> dict[str, Any]:
        seen.append(pkt)
        return {"ctx": ctx}

    assert trace.traced(applied, walk, "198.18.0.9", "UDP", "nonsense", 53) == {"error": "not an address: 'nonsense'"}
    assert trace.traced(applied, walk, "fd00:198:18::9", "tcp", "fd00:198:18::1", 80) == {
        "error": "no IPv6 rules applied yet"
    }
    assert trace.traced(applied, walk, "198.18.0.9", "UDP", "198.18.0.1", 53, dst_local=True) == {"ctx": "ctx"}
    assert seen == [trace.Packet("198.18.0.9", "udp", "198.18.0.1", 53, False, True)]
    assert seen[0].to_dict()["dstLocal"] is True
    assert trace.Outcome(probability=1 / 3).result("DNAT x", False, ["a"])["probability"] == 0.333333


def test_findings_tell_missing_from_different() -> None:
    f = verify.Findings()
    f.check("m: k", None, "v")
    assert f.verdict() == "missing"
    f.check("m: k2", "w", "v")
    assert f.verdict() == "different: m: k missing; m: k2 is 'w', wanted 'v'"
    ok = verify.Findings()
    ok.check("m: k", "v", "v")
    assert ok.verdict() is None and ok.found == 1


def test_in_netns_without_a_namespace_runs_here_and_a_missing_one_is_an_error() -> None:
    assert in_netns(None, threading.get_ident) == threading.get_ident()
    with pytest.raises(FileNotFoundError):
        in_netns("kptk-no-such-namespace", threading.get_ident, timeout=10)
