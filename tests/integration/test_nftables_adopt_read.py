"""Adoption's netlink element dumps against the real kernel, in a throwaway namespace (``kpm-nfta-…``): for a table
holding every shape of service in both families, what ``adopt.read_entries`` reads over netlink is exactly what
libnftables lists for the same maps and set (keys spelled alike, verdicts, comments, elements without a comment), and
a fresh process adopting that table writes nothing."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from types import MappingProxyType

import pytest

from kproxy.backends.nftables import adopt, layout, setdump
from kproxy.backends.nftables.proxier import NftablesProxier
from kproxy.config import ProxyConfig
from kproxy.model import Changes, Endpoint, IPFamily, NodeInfo, Protocol, ProxyState, ServicePort, ServicePortName
from kproxy.nftkernel import available
from kproxy.toolkit.nft import elements

from .scratch import scratch_netns

pytestmark = pytest.mark.root

CFG = ProxyConfig(cluster_cidrs=("198.18.64.0/18", "fd00:198:18:7f::/64"), ip_families=(IPFamily.V4, IPFamily.V6))
NODE = NodeInfo("node-a", addresses=("198.18.0.1", "fd00:198:18::1"))


@pytest.fixture
def netns() -> Iterator[str]:
    if available() is not None:
        pytest.skip(f"libnftables unusable: {available()}")
    with scratch_netns("kpm-nfta-", lo_up=True) as ns:
        yield ns


def shapes(family: IPFamily) -> list[ServicePort]:
    """A ClusterIP, UDP and SCTP ports, no endpoints (reject), Local policy without local endpoints (drop), a
    NodePort with an externalIP and a load-balancer IP behind source ranges, ClientIP affinity."""
    v4 = family is IPFamily.V4
    ip = (lambda i: f"198.19.0.{i}") if v4 else (lambda i: f"fd00:198:18:ff:1::{i:x}")
    ep_ip = (lambda i: f"198.18.1.{i}") if v4 else (lambda i: f"fd00:198:18:7f::{i:x}")
    eps = tuple(
        Endpoint(ep_ip(i), 8080, node_name="node-a" if i % 2 else "node-b", is_local=bool(i % 2)) for i in (2, 3)
    )
    remote = (Endpoint(ep_ip(4), 8080, node_name="node-b"),)

    def port(
        name: str, i: int, proto: Protocol = Protocol.TCP, endpoints: tuple[Endpoint, ...] = eps, **kw: object
    ) -> ServicePort:
        base: dict[str, object] = dict(
            name=ServicePortName("ns1", name, "p", proto),
            family=family,
            cluster_ip=ip(i),
            port=80,
            cluster_endpoints=endpoints,
            serving_endpoints=endpoints,
            has_any_endpoints=bool(endpoints),
        )
        base.update(kw)
        return ServicePort(**base)  # type: ignore[arg-type]

    lb = (("198.18.250.7",) if v4 else ("fd00:198:18:fa::7",), ("198.18.0.0/16",) if v4 else ("fd00:198:18::/48",))
    return [
        port("web", 1),
        port("dns", 2, Protocol.UDP),
        port("assoc", 3, Protocol.SCTP),
        port("empty", 4, endpoints=()),
        port("local", 5, endpoints=remote, local_endpoints=(), external_policy_local=True, node_port=30085),
        port(
            "edge",
            6,
            node_port=30086 if v4 else 30096,
            external_ips=("198.18.250.6",) if v4 else ("fd00:198:18:fa::6",),
            load_balancer_ips=lb[0],
            load_balancer_source_ranges=lb[1],
        ),
        port("sticky", 7, affinity_timeout=60),
    ]


def state() -> ProxyState:
    by_family = {f: MappingProxyType({s.name: s for s in shapes(f)}) for f in (IPFamily.V4, IPFamily.V6)}
    return ProxyState(services=MappingProxyType(by_family), node=NODE, generation=1)


def test_the_netlink_read_equals_libnftables_listing_and_a_restart_writes_nothing(netns: str) -> None:
    p = NftablesProxier(CFG, netns=netns)
    try:
        res = p.sync(state(), Changes(full=True))
        assert res.ok and not res.failed and not res.refused, res.error
        for family in (IPFamily.V4, IPFamily.V6):
            fam = "ip" if family is IPFamily.V4 else "ip6"
            # an element nobody owns (no comment), as someone might add by hand
            stray = "198.19.9.9 . tcp . 80" if family is IPFamily.V4 else "fd00:198:18:ff:1::99 . tcp . 80"
            assert p.nft.run(f"add element {fam} kproxy service-ips {{ {stray} : drop }}").ok
            got, err = adopt.read_entries(p.nft, family)
            assert got is not None, err
            for name in adopt.DUMPED:
                kind = "map" if name in (layout.SERVICE_IPS, layout.SERVICE_NODEPORTS) else "set"
                objs, err = p.nft.read(f"list {kind} {fam} kproxy {name}")
                assert objs is not None, err
                listed = sorted((el.key, el.value, el.comment) for el in elements(objs))
                assert listed and sorted(got[name]) == listed, (name, got[name], listed)
            assert (stray, "drop", "") in got[layout.SERVICE_IPS]
            assert p.nft.run(f"delete element {fam} kproxy service-ips {{ {stray} }}").ok
    finally:
        p.close()
    again = NftablesProxier(CFG, netns=netns)  # a restarted process: adopts, writes nothing
    try:
        res = again.sync(state(), Changes(full=True))
        assert res.ok, res.error
        assert all(f.written == 0 for f in res.families.values()), res.families
        assert {k for k in res.timings if k.startswith("adopt_")} >= {"adopt_dump", "adopt_parse", "adopt_group"}
    finally:
        again.close()


def test_a_dump_given_up_ends_at_once_and_the_next_read_is_whole(netns: str) -> None:
    """``setdump.raw_dumps`` with a cancel flag (a restart's entry-map read that nothing needed): once it is set, the
    next dump is not started (Cancelled, the socket closed), and a read after it gets every element."""
    p = NftablesProxier(CFG, netns=netns)
    try:
        assert p.sync(state(), Changes(full=True)).ok
        cancel = threading.Event()

        def run() -> tuple[list[str], BaseException | None]:
            taken: list[str] = []
            try:
                for name, _ in setdump.raw_dumps(IPFamily.V4, (*adopt.FIRST, *adopt.ENTRY_MAPS), cancel):
                    taken.append(name)
                    cancel.set()
            except setdump.Cancelled as exc:
                return taken, exc
            return taken, None

        taken, stopped = p.nft.call(run)
        assert taken == [layout.SERVICE_DIGESTS] and isinstance(stopped, setdump.Cancelled), (taken, stopped)
        got, err = adopt.read_entries(p.nft, IPFamily.V4)
        assert got is not None, err
        assert len(got[layout.SERVICE_IPS]) == len(got[layout.SERVICE_DIGESTS]) + 2  # "edge": an externalIP, an LB IP
    finally:
        p.close()
