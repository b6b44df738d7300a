"""``verify`` on the nftables mode: the whole table read back (slot elements included, which adoption's digests do
not look at; every chain's rules by their comments) and diffed against what the state wants. It must find a map
element changed by hand, an entry deleted by hand, a stray element, a table someone deleted, a rule deleted by hand
and a table someone flushed, and say nothing once a full sync repaired them (real kernel state, in a namespace of
the test's own)."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from types import MappingProxyType

import pytest

from kproxy.backends.nftables import render
from kproxy.backends.nftables.proxier import CHECK_INTERVAL, NftablesProxier
from kproxy.config import ProxyConfig
from kproxy.model import Changes, Endpoint, IPFamily, NodeInfo, Protocol, ProxyState, ServicePort, ServicePortName

from .scratch import scratch_netns

pytestmark = pytest.mark.root

NODE = NodeInfo("node-a", pod_cidrs=("198.18.1.0/24",))
A = ServicePortName("ns1", "a", "http", Protocol.TCP)
B = ServicePortName("ns1", "b", "http", Protocol.TCP)
SP_A = ServicePort(
    A, IPFamily.V4, "198.19.0.1", 80, cluster_endpoints=(Endpoint("198.18.1.1", 80), Endpoint("198.18.1.2", 80)),
    has_any_endpoints=True,
)  # fmt: skip
SP_B = ServicePort(
    B, IPFamily.V4, "198.19.0.2", 80, node_port=30080, cluster_endpoints=(Endpoint("198.18.1.3", 80),),
    has_any_endpoints=True,
)  # fmt: skip
STATE = ProxyState({IPFamily.V4: MappingProxyType({A: SP_A, B: SP_B})}, NODE, generation=1)


@pytest.fixture
def netns() -> Iterator[str]:
    with scratch_netns("kpt-vfn-", lo_up=True) as name:
        yield name


def nft(netns: str, command: str) -> None:
    subprocess.run(["ip", "netns", "exec", netns, "nft", command], check=True, timeout=30)


def test_verify_finds_hand_made_drift_and_a_full_sync_repairs_it(netns: str) -> None:
    p = NftablesProxier(ProxyConfig(cluster_cidrs=("198.18.0.0/16",), ip_families=(IPFamily.V4,)), netns=netns)
    try:
        assert p.sync(STATE, Changes(full=True)).ok
        clean = p.verify(STATE)
        assert clean["drift"] == 0 and not clean["services"] and not clean["extra"] and not clean["errors"], clean
        frag_a = p.applied_fragments(IPFamily.V4)[A]

        # a backend slot of a changed by hand: it now sends to another pod (adoption's digest would not see it)
        slot_map, slot_key, _ = next(e for e in frag_a.elements if e[0].startswith("backends-"))
        nft(netns, f"delete element ip {render.TABLE} {slot_map} {{ {slot_key} }}")
        nft(netns, f"add element ip {render.TABLE} {slot_map} {{ {slot_key} : 198.18.1.9 . 80 }}")
        report = p.verify(STATE)
        assert set(report["services"]) == {"ns1/a:http/TCP"} and report["drift"] == 1, report
        assert "198.18.1.9" in report["services"]["ns1/a:http/TCP"]["IPv4"]

        # a full sync trusts the digests in the entries' comments (that keeps a restart at 10k services to reading
        # two small maps), so it does not rewrite a slot edited by hand: verify is what finds it, and the
        # kproxy_drift_services gauge after each periodic full sync reports it; a rebuilt table clears it
        assert p.sync(STATE, Changes(full=True)).ok and p.verify(STATE)["drift"] == 1
        nft(netns, f"delete table ip {render.TABLE}")
        assert p.sync(STATE, Changes(full=True)).ok and p.verify(STATE)["drift"] == 0

        # b's entry in service-ips deleted by hand (its other entry still carries the digest, so the full sync must
        # compare the entries, not only the digest, to rewrite it); a stray element nobody accounts for
        frag_b = p.applied_fragments(IPFamily.V4)[B]
        entry = next(e for e in frag_b.elements if e[0] == render.SERVICE_IPS)
        nft(netns, f"delete element ip {render.TABLE} {render.SERVICE_IPS} {{ {entry[1]} }}")
        nft(netns, f"add element ip {render.TABLE} {render.SERVICE_IPS} {{ 198.19.9.9 . tcp . 80 : drop }}")
        report = p.verify(STATE)
        assert set(report["services"]) == {"ns1/b:http/TCP"}, report
        assert any("198.19.9.9" in x for x in report["extra"]), report
        assert p.sync(STATE, Changes(full=True)).ok
        assert p.verify(STATE)["drift"] == 0  # b's entry written again, the stray element (no owner) removed

        # someone deleted the table: everything is missing
        nft(netns, f"delete table ip {render.TABLE}")
        report = p.verify(STATE)
        assert report["services"] == {
            "ns1/a:http/TCP": {"IPv4": "missing"},
            "ns1/b:http/TCP": {"IPv4": "missing"},
        }, report

        assert p.sync(STATE, Changes(full=True)).ok
        assert p.verify(STATE)["drift"] == 0
    finally:
        p.close()


def test_verify_finds_a_deleted_rule_and_a_flushed_table(netns: str) -> None:
    p = NftablesProxier(ProxyConfig(cluster_cidrs=("198.18.0.0/16",), ip_families=(IPFamily.V4,)), netns=netns)
    try:
        assert p.sync(STATE, Changes(full=True)).ok
        assert p.verify(STATE)["drift"] == 0

        # a rule deleted by hand: the DNAT of a's shared chain (lb-i-2, two endpoints); b (lb-i-1) is untouched
        listing = subprocess.run(
            ["ip", "netns", "exec", netns, "nft", "-a", "list", "chain", "ip", render.TABLE, "lb-i-2"],
            capture_output=True, text=True, check=True, timeout=30,
        ).stdout  # fmt: skip
        handle = next(ln.rsplit(" ", 1)[1] for ln in listing.splitlines() if "tcp dport" in ln and "# handle" in ln)
        nft(netns, f"delete rule ip {render.TABLE} lb-i-2 handle {handle}")
        report = p.verify(STATE)
        assert set(report["services"]) == {"ns1/a:http/TCP"}, report
        assert p.sync(STATE, Changes(full=True)).ok and p.verify(STATE)["drift"] == 0

        # someone flushed the table: every chain empty (no service is reached), the maps and elements left
        nft(netns, f"flush table ip {render.TABLE}")
        report = p.verify(STATE)
        assert set(report["services"]) == {"ns1/a:http/TCP", "ns1/b:http/TCP"}, report
        assert p.sync(STATE, Changes(full=True)).ok and p.verify(STATE)["drift"] == 0
        rules = subprocess.run(
            ["ip", "netns", "exec", netns, "nft", "list", "chain", "ip", render.TABLE, render.SERVICES],
            capture_output=True, text=True, check=True, timeout=30,
        ).stdout  # fmt: skip
        assert "vmap @service-ips" in rules, rules
    finally:
        p.close()


def test_a_partial_sync_notices_a_flushed_table_and_repairs_it(netns: str) -> None:
    """The check before a partial sync (at most every CHECK_INTERVAL) reads the fixed chains' rules by their comments:
    a flushed table (chains, maps and elements left, no rule) makes that sync a full one, which writes it again."""
    p = NftablesProxier(ProxyConfig(cluster_cidrs=("198.18.0.0/16",), ip_families=(IPFamily.V4,)), netns=netns)
    try:
        assert p.sync(STATE, Changes(full=True)).ok
        nft(netns, f"flush table ip {render.TABLE}")
        time.sleep(CHECK_INTERVAL + 0.1)
        res = p.sync(STATE, Changes(full=False, services=frozenset({A})))
        assert res.ok and res.family(IPFamily.V4).full, res
        assert p.verify(STATE)["drift"] == 0
    finally:
        p.close()
