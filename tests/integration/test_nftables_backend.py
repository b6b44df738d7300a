"""The nftables backend against the real kernel, in throwaway namespaces (``kpm-nft-…``): transactions the kernel
takes, partial syncs that write only element changes, restart adoption that writes nothing, repair after someone
deletes the table, refusal mapped to its service, cleanup, and real TCP through the DNAT and the reject."""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from types import MappingProxyType
from typing import Any

import pytest

from kproxy.backends.nftables import render
from kproxy.backends.nftables.proxier import NftablesProxier
from kproxy.config import ProxyConfig
from kproxy.model import Changes, Endpoint, IPFamily, NodeInfo, Protocol, ProxyState, ServicePort, ServicePortName
from kproxy.nftkernel import Nft, available
from kproxy.proxier import LocalProbe

from .scratch import scratch_netns

pytestmark = pytest.mark.root

CFG = ProxyConfig(cluster_cidrs=("198.18.64.0/18",), ip_families=(IPFamily.V4, IPFamily.V6))
NODE = NodeInfo("node-a", addresses=("198.18.0.1",))


@pytest.fixture
def netns() -> Iterator[str]:
    if available() is not None:
        pytest.skip(f"libnftables unusable: {available()}")
    with scratch_netns("kpm-nft-", lo_up=True) as ns:
        yield ns


def spn(name: str, proto: Protocol = Protocol.TCP) -> ServicePortName:
    return ServicePortName("ns1", name, "p", proto)


def sp(name: str, ip: str, eps: tuple[str, ...], proto: Protocol = Protocol.TCP, **kw: object) -> ServicePort:
    endpoints = tuple(Endpoint(e, 8080, node_name="node-b") for e in eps)
    base: dict[str, object] = dict(
        name=spn(name, proto),
        family=IPFamily.V4,
        cluster_ip=ip,
        port=80,
        cluster_endpoints=endpoints,
        has_any_endpoints=bool(endpoints),
        serving_endpoints=endpoints,
    )
    base.update(kw)
    return ServicePort(**base)  # type: ignore[arg-type]


def state(*sps: ServicePort, gen: int = 1) -> ProxyState:
    return ProxyState(
        services=MappingProxyType({IPFamily.V4: MappingProxyType({s.name: s for s in sps})}), node=NODE, generation=gen
    )


def nft_list(ns: str, *args: str) -> str:
    return subprocess.run(["ip", "netns", "exec", ns, "nft", *args], capture_output=True, text=True, check=True).stdout


def test_full_partial_restart_repair_cleanup(netns: str) -> None:
    p = NftablesProxier(CFG, netns=netns)
    try:
        a = sp("a", "198.19.0.1", ("198.18.1.2", "198.18.1.3"))
        b = sp("b", "198.19.0.2", (), proto=Protocol.UDP)
        c = sp("c", "198.19.0.3", ("198.18.1.4",), node_port=30080, affinity_timeout=60)
        res = p.sync(state(a, b, c), Changes(full=True))
        assert res.ok, res.error
        listing = nft_list(netns, "list", "map", "ip", "kproxy", "service-ips")
        assert "198.19.0.1 . tcp . 80" in listing and "goto lb-i-2" in listing
        assert "198.19.0.2 . udp . 80" in listing and "goto reject-chain" in listing
        assert "table ip6 kproxy" in nft_list(netns, "list", "tables")

        # partial: one endpoint changes -> element changes only, no chain written
        a2 = sp("a", "198.19.0.1", ("198.18.1.2", "198.18.1.9"))
        res = p.sync(state(a2, b, c, gen=2), Changes(full=False, services=frozenset({a.name})))
        assert res.ok, res.error
        tx = p.last_transaction(IPFamily.V4)
        assert "chain" not in tx and "delete element ip kproxy backends-tcp {\n198.19.0.1 . tcp . 80 . 1\n}" in tx
        # its entry keeps its verdict: not rewritten (a verdict-map element added costs a validation of the whole
        # table at commit); its digest element is
        assert "service-ips" not in tx and "add element ip kproxy service-digests {\n198.19.0.1 . tcp . 80 " in tx
        assert "198.18.1.9 . 8080" in nft_list(netns, "list", "map", "ip", "kproxy", "backends-tcp")

        # a new endpoint count creates its shared chain once, in the same transaction
        a3 = sp("a", "198.19.0.1", ("198.18.1.2", "198.18.1.9", "198.18.1.10"))
        assert p.sync(state(a3, b, c, gen=3), Changes(full=False, services=frozenset({a.name}))).ok
        assert "add chain ip kproxy lb-i-3" in p.last_transaction(IPFamily.V4)

        # restart: a fresh process adopts and writes nothing
        q = NftablesProxier(CFG, netns=netns)
        try:
            res = q.sync(state(a3, b, c, gen=3), Changes(full=True))
            assert res.ok, res.error
            assert q.last_transaction(IPFamily.V4) == "" and q.last_transaction(IPFamily.V6) == ""
            # a service deleted while kproxy was down is removed by the adopting full sync
            res = NftablesProxier(CFG, netns=netns).sync(state(a3, c, gen=4), Changes(full=True))
            assert res.ok, res.error
            assert res.families[IPFamily.V4].written == 1  # no delta names it: it counts as written all the same
            assert "198.19.0.2" not in nft_list(netns, "list", "map", "ip", "kproxy", "service-ips")
            # someone deletes the table: noticed at the next partial sync, rebuilt
            subprocess.run(["ip", "netns", "exec", netns, "nft", "delete", "table", "ip", "kproxy"], check=True)
            time.sleep(1.1)
            res = q.sync(state(a3, c, gen=5), Changes(full=False, services=frozenset({b.name})))
            assert res.ok and res.full, res
            assert "198.19.0.1 . tcp . 80" in nft_list(netns, "list", "map", "ip", "kproxy", "service-ips")
        finally:
            q.close()

        # kernel view and remnants through a probe; cleanup removes both tables
        probe = LocalProbe(netns)
        view = NftablesProxier.kernel_view(probe, IPFamily.V4) or {}
        entry = [line for line in view["ns1/a:p/TCP"] if line.startswith("service-ips: 198.19.0.1 . tcp . 80 counter ")]
        assert len(entry) == 1 and 'packets 0 bytes 0 comment "ns1/a:p/TCP" : goto lb-i-3' in entry[0], view
        assert any(
            line.startswith('service-digests: 198.19.0.1 . tcp . 80 comment "ns1/a:p/TCP #')
            for line in view["ns1/a:p/TCP"]
        )
        # slots carry no comment in the kernel; the view names their service through the entry they extend
        assert any(line.startswith("backends-tcp: 198.19.0.1 . tcp . 80 . 2 ") for line in view["ns1/a:p/TCP"])
        assert sorted(NftablesProxier.remnants(probe)) == ["table ip kproxy", "table ip6 kproxy"]
        NftablesProxier.cleanup_leftovers(CFG, netns=netns)
        assert NftablesProxier.remnants(probe) == []
    finally:
        p.close()


def test_refused_service_is_named_and_the_rest_applies(netns: str) -> None:
    p = NftablesProxier(CFG, netns=netns)
    try:
        good = sp("a-good", "198.19.0.1", ("198.18.1.2",))
        clash = sp("b-clash", "198.19.0.1", ("198.18.1.3",))  # the same address . protocol . port
        res = p.sync(state(good, clash), Changes(full=True))
        assert res.ok and not res.failed  # the core refuses the second ClusterIP claim before rendering
        assert list(res.refused) == [clash.name] and "held by ns1/a-good" in res.refused[clash.name]
        assert "198.18.1.2 . 8080" in nft_list(netns, "list", "map", "ip", "kproxy", "backends-tcp")
        # a command the kernel refuses is mapped back to its service through the transaction's lines
        nft = Nft(netns)
        try:
            tx = render.Transaction(IPFamily.V4)
            tx.delete_keys([(render.SERVICE_IPS, "198.19.9.9 . tcp . 80")], clash.name)
            res2 = nft.run(tx.text())
            assert not res2.ok and tx.owner_of(res2.error_lines()[0]) == clash.name
        finally:
            nft.close()
    finally:
        p.close()


def _serve(ns: str, ip: str, port: int, stop: threading.Event) -> threading.Thread:
    """A TCP server inside ``ns`` answering its own address, for ``stop``'s lifetime."""
    from pyroute2 import netns as pr_netns

    ready = threading.Event()

    def run() -> None:
        pr_netns.setns(ns, flags=0)
        with socket.socket() as srv:
            srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            srv.bind((ip, port))
            srv.listen()
            srv.settimeout(0.2)
            ready.set()
            while not stop.is_set():
                try:
                    conn, _ = srv.accept()
                except TimeoutError:
                    continue
                with conn:
                    conn.sendall(b"hello")

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert ready.wait(5)
    return t


def _connect(ns: str, ip: str, port: int) -> str:
    code = (
        "import socket,sys\n"
        "s=socket.socket(); s.settimeout(2)\n"
        "try:\n"
        f"  s.connect(('{ip}',{port})); print(s.recv(10).decode())\n"
        "except OSError as e: print(type(e).__name__)\n"
    )
    out = subprocess.run(["ip", "netns", "exec", ns, "python3", "-c", code], capture_output=True, text=True, timeout=20)
    return out.stdout.strip()


def test_real_packets_dnat_and_reject(netns: str) -> None:
    """A client namespace behind the node (as a pod): DNAT to a server in the node, ICMP reject without endpoints."""
    with scratch_netns("kpm-nftc-", lo_up=True) as client:
        run = ["ip", "-n", netns]
        subprocess.run(
            [*run, "link", "add", "kpmv0", "type", "veth", "peer", "name", "kpmv1", "netns", client], check=True
        )
        subprocess.run([*run, "addr", "add", "198.18.0.1/24", "dev", "kpmv0"], check=True)
        subprocess.run([*run, "link", "set", "kpmv0", "up"], check=True)
        subprocess.run([*run, "addr", "add", "198.18.9.1/32", "dev", "lo"], check=True)
        crun = ["ip", "-n", client]
        subprocess.run([*crun, "addr", "add", "198.18.0.2/24", "dev", "kpmv1"], check=True)
        subprocess.run([*crun, "link", "set", "kpmv1", "up"], check=True)
        subprocess.run([*crun, "route", "add", "default", "via", "198.18.0.1"], check=True)
        stop = threading.Event()
        t = _serve(netns, "198.18.9.1", 8080, stop)
        p = NftablesProxier(CFG, netns=netns)
        try:
            ok = sp("ok", "198.19.0.1", ("198.18.9.1",))
            gone = sp("gone", "198.19.0.2", ())
            assert p.sync(state(ok, gone), Changes(full=True)).ok
            assert _connect(client, "198.19.0.1", 80) == "hello"
            # the entry's counter counts new connections (the nat chains see a connection's first packet only)
            assert "198.19.0.1 . tcp . 80 counter packets 1 " in nft_list(
                netns, "list", "map", "ip", "kproxy", "service-ips"
            )
            # an ICMP reject: refused at once (a drop would end in the client's 2 s timeout, "TimeoutError"); the
            # interpreter's start in the namespace is not timed
            assert _connect(client, "198.19.0.2", 80) == "ConnectionRefusedError"
            tr = p.trace("198.18.0.2", "tcp", "198.19.0.1", 80)
            assert tr["outcomes"][0]["verdict"] == "DNAT 198.18.9.1:8080"
            assert tr["outcomes"][0]["masquerade"]  # 198.18.0.2 is outside --cluster-cidr 198.18.64.0/18
        finally:
            stop.set()
            t.join(5)
            p.close()


def test_big_full_sync_in_chunks_of_whole_services(netns: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from kproxy.backends.nftables import plan

    monkeypatch.setattr(plan, "CHUNK", 40)
    monkeypatch.setattr(plan, "NETLINK_CHUNK", 60)
    sps = [sp(f"s{i:03d}", f"198.19.1.{i}", tuple(f"198.18.2.{i % 200 + j}" for j in range(3))) for i in range(60)]
    p = NftablesProxier(CFG, netns=netns)
    try:
        res = p.sync(state(*sps), Changes(full=True))
        assert res.ok, res.error
        figures = res.family(IPFamily.V4).figures
        assert figures["transactions"] > 5
        # the fixed part and shared chains through libnftables, every chunk of services as a netlink batch
        assert figures["netlink_batches"] == figures["transactions"] - 1 and figures["netlink_refused"] == 0
        report = p.verify(state(*sps))
        assert report["drift"] == 0 and not report["errors"] and not report["extra"], report
        listing = nft_list(netns, "list", "map", "ip", "kproxy", "service-ips")
        assert all(f"198.19.1.{i} . tcp . 80" in listing for i in range(60))
        assert listing.count("goto lb-i-3") == 60
        # a restart adopts all of it and writes nothing; one service changed while it was down is rewritten alone
        changed = sp("s007", "198.19.1.7", ("198.18.9.9",))
        q = NftablesProxier(CFG, netns=netns)
        try:
            res = q.sync(state(*sps[:7], changed, *sps[8:], gen=2), Changes(full=True))
            assert res.ok, res.error
            tx = q.last_transaction(IPFamily.V4)
            assert "198.18.9.9 . 8080" in tx and "s006" not in tx and "s008" not in tx
        finally:
            q.close()
    finally:
        p.close()


def test_the_floor_renders_the_fresh_transaction_again(netns: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The benchmark's floor is the transaction that builds the table from nothing, rendered again when asked
    (``fresh_transaction``): the same text, chunks included, as the full sync into the empty namespace wrote; it
    follows the table after a partial sync; the kernel takes it in another empty namespace. A last transaction over
    LAST_TEXT_KEPT is not kept between syncs (70 MB at 100,000 x 10)."""
    from kproxy.backends.nftables import plan
    from kproxy.backends.nftables import proxier as proxier_mod

    monkeypatch.setattr(plan, "CHUNK", 40)
    monkeypatch.setattr(plan, "NETLINK_CHUNK", 60)
    sps = [sp(f"s{i:03d}", f"198.19.1.{i}", tuple(f"198.18.2.{i % 200 + j}" for j in range(3))) for i in range(30)]
    p = NftablesProxier(CFG, netns=netns)
    try:
        assert p.fresh_transaction(IPFamily.V4) == "" and p.measure_floor(netns) is None  # no full sync yet
        aff = sp("aff", "198.19.2.1", ("198.18.3.1",), affinity_timeout=60)  # chains and a set of its own
        res = p.sync(state(*sps, aff), Changes(full=True))
        assert res.ok, res.error
        assert res.family(IPFamily.V4).figures["transactions"] > 1
        for fam in (IPFamily.V4, IPFamily.V6):
            assert p.fresh_transaction(fam) == p.last_transaction(fam) != ""
        moved = sp("s003", "198.19.1.3", ("198.18.9.9",))  # three endpoints before, one now; aff removed
        changes = Changes(full=False, services=frozenset({moved.name, aff.name}))
        assert p.sync(state(*sps[:3], moved, *sps[4:], gen=2), changes).ok
        fresh = p.fresh_transaction(IPFamily.V4)
        assert "198.19.1.3 . tcp . 80 . 0 : 198.18.9.9 . 8080" in fresh and "198.19.1.3 . tcp . 80 . 1" not in fresh
        assert "aff" not in fresh
        with scratch_netns("kpm-nft-", lo_up=True) as other:
            assert (p.measure_floor(other) or 0) > 0
            listing = nft_list(other, "list", "map", "ip", "kproxy", "backends-tcp")
            assert "198.18.9.9 . 8080" in listing and "198.19.1.3 . tcp . 80 . 1 " not in listing
        monkeypatch.setattr(proxier_mod, "LAST_TEXT_KEPT", 100)
        assert p.sync(state(*sps, gen=3), Changes(full=True)).ok
        assert p.last_transaction(IPFamily.V4).startswith("# not kept: ")
    finally:
        p.close()


def test_affinity_service_removed_at_a_full_sync_and_stale_chains_swept(netns: str) -> None:
    p = NftablesProxier(CFG, netns=netns)
    try:
        sticky = sp("sticky", "198.19.0.5", ("198.18.1.2", "198.18.1.3"), affinity_timeout=30)
        other = sp("other", "198.19.0.6", ("198.18.1.4",), affinity_timeout=60)
        assert p.sync(state(sticky, other), Changes(full=True)).ok
        chains = nft_list(netns, "list", "chains", "ip")
        assert chains.count("chain ep-") == 3 and chains.count("chain pick-") == 2
        # removed with a full (periodic) sync: the delta removes it, nothing is deleted twice
        res = p.sync(state(other, gen=2), Changes(full=True))
        assert res.ok, res.error
        chains = nft_list(netns, "list", "chains", "ip")
        assert chains.count("chain ep-") == 1 and chains.count("chain pick-") == 1
        # removed while kproxy was down: a fresh process sweeps its chains and sets
        q = NftablesProxier(CFG, netns=netns)
        try:
            res = q.sync(state(gen=3), Changes(full=True))
            assert res.ok, res.error
            assert res.families[IPFamily.V4].written == 1
        finally:
            q.close()
        chains = nft_list(netns, "list", "chains", "ip")
        assert "chain ep-" not in chains and "chain pick-" not in chains and "chain svc-" not in chains
        assert "aff-" not in nft_list(netns, "list", "sets", "ip")
    finally:
        p.close()


def _zoo(variant: int) -> list[ServicePort]:
    """One service of every shape, its endpoints shifted by ``variant``."""
    e = tuple(f"198.18.3.{variant + j}" for j in range(3))
    local = (Endpoint(f"198.18.3.{variant}", 8080, is_local=True, node_name="node-a"),)
    return [
        sp("np", "198.19.2.1", e, node_port=30001, external_ips=("198.18.100.1",)),
        sp(
            "etp",
            "198.19.2.2",
            e,
            node_port=30002,
            external_policy_local=True,
            local_endpoints=local,
            load_balancer_ips=("198.18.150.2",),
        ),  # fmt: skip
        sp("etp0", "198.19.2.3", e, node_port=30003, external_policy_local=True),
        sp(
            "fw",
            "198.19.2.4",
            e,
            load_balancer_ips=("198.18.150.4",),
            load_balancer_source_ranges=("203.0.113.0/24", "198.18.0.0/16"),
        ),  # fmt: skip
        sp(
            "aff",
            "198.19.2.5",
            e,
            node_port=30005,
            affinity_timeout=30 + variant,
            external_policy_local=True,
            local_endpoints=local,
            load_balancer_ips=("198.18.150.5",),
            load_balancer_source_ranges=("10.0.0.0/8",),
        ),
        sp("udp", "198.19.2.6", e, proto=Protocol.UDP, node_port=30006),
        sp("sctp", "198.19.2.7", e, proto=Protocol.SCTP),
        sp("itp", "198.19.2.8", e, internal_policy_local=True, local_endpoints=local),
    ]


def test_every_shape_through_full_partial_and_changed_restart(netns: str) -> None:
    p = NftablesProxier(CFG, netns=netns)
    try:
        res = p.sync(state(*_zoo(0)), Changes(full=True))
        assert res.ok and not res.failed, res
        names = frozenset(s.name for s in _zoo(0))
        res = p.sync(state(*_zoo(1), gen=2), Changes(full=False, services=names))
        assert res.ok and not res.failed, res
        # a fresh process finds every service changed (variant 2): it rewrites them from the adopted skeleton
        q = NftablesProxier(CFG, netns=netns)
        try:
            res = q.sync(state(*_zoo(2), gen=3), Changes(full=True))
            assert res.ok and not res.failed, res
            assert res.family(IPFamily.V4).written == len(names)
            # and a second fresh process with nothing changed writes nothing
            r = NftablesProxier(CFG, netns=netns)
            try:
                res = r.sync(state(*_zoo(2), gen=3), Changes(full=True))
                assert res.ok and r.last_transaction(IPFamily.V4) == "", r.last_transaction(IPFamily.V4)
                # everything removed while kproxy was down: only the fixed part is left
                res = r.sync(state(gen=4), Changes(full=True))
                assert res.ok, res.error
            finally:
                r.close()
        finally:
            q.close()
        s = NftablesProxier(CFG, netns=netns)
        try:
            res = s.sync(state(gen=5), Changes(full=True))
            assert res.ok and s.last_transaction(IPFamily.V4) == ""
        finally:
            s.close()
        table = nft_list(netns, "list", "table", "ip", "kproxy")
        assert 'comment "ns1/' not in table  # no element of any service is left
        chains = [ln.split()[1] for ln in nft_list(netns, "list", "chains", "ip").splitlines() if "chain " in ln]
        assert sorted(chains) == sorted([*render.FIXED_CHAINS, render.layout_chain(IPFamily.V4)])
    finally:
        p.close()


def test_a_refusal_in_a_later_chunk_keeps_what_earlier_chunks_committed(
    netns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A service the kernel refuses (here: a verdict naming a chain that does not exist) in the third of several
    transactions: the ledger's retry round starts from what the first two committed, and everything else lands."""
    from kproxy.backends.nftables import plan

    monkeypatch.setattr(plan, "CHUNK", 40)
    monkeypatch.setattr(plan, "NETLINK_CHUNK", 60)
    sps = [sp(f"s{i:03d}", f"198.19.1.{i}", tuple(f"198.18.2.{i % 200 + j}" for j in range(3))) for i in range(60)]
    bad = sps[45].name
    p = NftablesProxier(CFG, netns=netns)
    real = p.render

    def render_(s: ServicePort, ctx: object) -> render.Fragment:
        frag = real(s, ctx)  # type: ignore[arg-type]
        if s.name != bad:
            return frag
        els = tuple((m, k, "goto no-such-chain" if m == render.SERVICE_IPS else v) for m, k, v in frag.elements)
        return render.Fragment.of(frag.key, els, frag.shared, frag.chains, frag.sets, frag.hairpin, frag.digest)

    monkeypatch.setattr(p, "render", render_)
    try:
        res = p.sync(state(*sps), Changes(full=True))
        assert res.ok, res.error
        assert list(res.failed) == [bad]
        listing = nft_list(netns, "list", "map", "ip", "kproxy", "service-ips")
        assert sum(f"198.19.1.{i} . tcp . 80" in listing for i in range(60)) == 59
        assert "198.19.1.45 . tcp . 80" not in listing
        assert res.family(IPFamily.V4).kernel_refusals == 1
    finally:
        p.close()


def element_lines(text: str) -> int:
    """The element lines of an nft text (inside ``add element`` / ``delete element`` blocks)."""
    commands = ("add ", "delete ", "flush ", "}", "table ", "#")
    return sum(1 for line in text.splitlines() if line and not line.startswith(commands))


@pytest.mark.parametrize("services", [70, 76, 82])
def test_what_libnftables_parses_stays_near_chunk_when_batches_grow(
    netns: str, monkeypatch: pytest.MonkeyPatch, services: int
) -> None:
    """Netlink-written chunks grow to NETLINK_CHUNK, but a transaction libnftables parses stays near CHUNK: a full
    resync that removes a shared chain (``lb-i-3``: every service drops to two endpoints) cuts the services' last
    chunk before the removal instead of adding the removal to it, and every chunk of services is a netlink batch."""
    from kproxy.backends.nftables import plan

    monkeypatch.setattr(plan, "CHUNK", 40)
    monkeypatch.setattr(plan, "NETLINK_CHUNK", 100)
    three = [
        sp(f"s{i:03d}", f"198.19.1.{i}", tuple(f"198.18.2.{i % 200 + j}" for j in range(3))) for i in range(services)
    ]
    two = [sp(f"s{i:03d}", s.cluster_ip, tuple(e.ip for e in s.cluster_endpoints[:2])) for i, s in enumerate(three)]
    p = NftablesProxier(CFG, netns=netns)
    try:
        assert p.sync(state(*three), Changes(full=True)).ok
        parsed: list[str] = []
        real = p.nft.submit

        def submit(text: str, **kw: Any) -> Any:
            parsed.append(text)
            return real(text, **kw)

        monkeypatch.setattr(p.nft, "submit", submit)
        res = p.sync(state(*two, gen=2), Changes(full=True))
        assert res.ok, res.error
        figures = res.family(IPFamily.V4).figures
        assert figures["netlink_batches"] >= 2 and figures["netlink_refused"] == 0
        assert any("delete chain ip kproxy lb-i-3" in t for t in parsed)
        assert all(element_lines(t) < plan.CHUNK for t in parsed), [element_lines(t) for t in parsed]
        report = p.verify(state(*two, gen=2))
        assert report["drift"] == 0 and not report["errors"] and not report["extra"], report
    finally:
        p.close()


def test_a_chunked_full_sync_removes_services_before_it_adds_their_addresses(
    netns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every service renamed at once, each keeping its ClusterIP, in a full sync of many chunks: the old names'
    removals go first, so no new name's entry meets the old one's in the kernel (chunks are separate transactions)."""
    from kproxy.backends.nftables import plan

    monkeypatch.setattr(plan, "CHUNK", 40)
    monkeypatch.setattr(plan, "NETLINK_CHUNK", 60)
    old = [sp(f"s{i:03d}", f"198.19.1.{i}", tuple(f"198.18.2.{i % 200 + j}" for j in range(3))) for i in range(70)]
    new = [sp(f"t{i:03d}", s.cluster_ip, tuple(e.ip for e in s.cluster_endpoints[:2])) for i, s in enumerate(old)]
    p = NftablesProxier(CFG, netns=netns)
    try:
        assert p.sync(state(*old), Changes(full=True)).ok
        res = p.sync(state(*new, gen=2), Changes(full=True))
        assert res.ok, res.error
        assert res.family(IPFamily.V4).figures["transactions"] > 3
        report = p.verify(state(*new, gen=2))
        assert report["drift"] == 0 and not report["errors"] and not report["extra"], report
        listing = nft_list(netns, "list", "map", "ip", "kproxy", "service-ips")
        assert "ns1/t069:p/TCP" in listing and "ns1/s000:p/TCP" not in listing
    finally:
        p.close()
