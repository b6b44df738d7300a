"""Integration tests of the iptables backend's chunked restores (``render.build_restores``, used on the nf_tables
flavour) when the kernel refuses one service's rules in a later payload than the first, in network namespaces of
their own (prefix ``kpt-chk-``, removed in the fixture's finalizer, also on failure).

The chunk size is made small (``proxier._chunk_lines`` monkeypatched) so ~30 services split into several payloads;
one service gets an invalid rule (``-m nosuchmatch``) either in its own chains or in its KUBE-SERVICES lines (which
go in the last payload, after an earlier chunk has already created that service's chains). The legacy flavour
writes one payload and runs the same checks. Needs root.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
from collections.abc import Iterator

import pytest

from kproxy.backends.iptables import proxier as proxier_mod
from kproxy.backends.iptables import render
from kproxy.backends.iptables.kernel import Kernel, Run
from kproxy.backends.iptables.proxier import IptablesProxier
from kproxy.config import ProxyConfig
from kproxy.model import Changes, Endpoint, IPFamily, NodeInfo, Protocol, ProxyState, ServicePort, ServicePortName

from .scratch import scratch_netns

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces, iptables)"),
    pytest.mark.skipif(shutil.which("iptables-nft-restore") is None, reason="iptables not installed"),
]

NODE = NodeInfo("node-a", pod_cidrs=("198.18.1.0/24",))
N_SERVICES = 30
BAD_INDEX = 20  # well past the first chunk
CHUNK = 20  # lines per payload: a service is 6-7 lines, so ~4 services per chunk
INVALID = "-m nosuchmatch --foo -j ACCEPT"


def name(i: int) -> ServicePortName:
    return ServicePortName("ns1", f"s{i:02d}", "http", Protocol.TCP)


BAD = name(BAD_INDEX)


def service(i: int, endpoints: int = 1) -> ServicePort:
    eps = tuple(Endpoint(f"198.18.{1 + k}.{i + 1}", 80) for k in range(endpoints))
    return ServicePort(name(i), IPFamily.V4, f"198.19.0.{i + 1}", 80, cluster_endpoints=eps, has_any_endpoints=True)


def state(sps: list[ServicePort]) -> ProxyState:
    fams: dict[IPFamily, dict[ServicePortName, ServicePort]] = {
        IPFamily.V4: {sp.name: sp for sp in sps},
        IPFamily.V6: {},
    }
    return ProxyState(fams, NODE)


@pytest.fixture
def netns() -> Iterator[str]:
    with scratch_netns("kpt-chk-") as name:
        yield name


def make_proxier(netns: str, flavour: str) -> IptablesProxier:
    config = ProxyConfig(
        cluster_cidrs=("198.18.0.0/16", "fd00:198:18::/56"), backend_options={"iptables_flavour": flavour}
    )
    return IptablesProxier(config, netns=netns)


def save(netns: str, flavour: str) -> str:
    argv = ["ip", "netns", "exec", netns, f"iptables-{flavour}-save"]
    return subprocess.run(argv, check=True, capture_output=True, text=True, timeout=60).stdout


def section(text: str, table: str) -> str:
    """One table's part of an iptables-save text; "" when the table is not there (yet: a save taken right after
    the first payload of a fresh namespace may come before the nat table exists)."""
    parts = text.split(f"*{table}\n", 1)
    return parts[1].split("COMMIT", 1)[0] if len(parts) > 1 else ""


def chains(text: str, table: str = "nat") -> set[str]:
    return {ln[1:].split(" ", 1)[0] for ln in section(text, table).splitlines() if ln.startswith(":")}


def break_service(monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    """Make BAD's fragment carry a rule the kernel refuses: in its own chain, or in KUBE-SERVICES (last payload)."""
    original = render.render_service

    def broken(sp: ServicePort, ctx: render.Context) -> render.Fragment:
        frag = original(sp, ctx)
        if sp.name != BAD:
            return frag
        if where == "own":
            return dataclasses.replace(frag, rules=frag.rules + (f"-A {frag.chains[0]} {INVALID}",))
        top = dict(frag.top)
        top[render.N_SERVICES] = top[render.N_SERVICES] + (f"-A KUBE-SERVICES {INVALID}",)
        return dataclasses.replace(frag, top=top)

    monkeypatch.setattr(render, "render_service", broken)


def record_restores(monkeypatch: pytest.MonkeyPatch, netns: str, flavour: str) -> list[tuple[str, bool, set[str]]]:
    """Every v4 restore the proxier runs: (payload, accepted, nat chains in the kernel right after it)."""
    calls: list[tuple[str, bool, set[str]]] = []
    real = Kernel.restore

    def restore(self: Kernel, family: IPFamily, text: str, *, noflush: bool = True) -> Run:
        res = real(self, family, text, noflush=noflush)
        if family == IPFamily.V4:
            calls.append((text, res.ok, chains(save(netns, flavour))))
        return res

    monkeypatch.setattr(Kernel, "restore", restore)
    return calls


def assert_programmed(text: str, sps: list[ServicePort], frags: dict[ServicePortName, render.Fragment]) -> None:
    nat = chains(text)
    services = [ln for ln in section(text, "nat").splitlines() if ln.startswith("-A KUBE-SERVICES ")]
    for sp in sps:
        assert set(frags[sp.name].chains) <= nat, sp.name
        assert sum(f"-d {sp.cluster_ip}/32 " in ln for ln in services) == 1, sp.name


@pytest.mark.parametrize("where", ["own", "top"])
def test_service_refused_in_a_later_chunk_is_skipped_and_its_chains_removed(
    netns: str, flavour: str, where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(proxier_mod, "_chunk_lines", lambda _rules: CHUNK)
    break_service(monkeypatch, where)
    calls = record_restores(monkeypatch, netns, flavour)
    sps = [service(i) for i in range(N_SERVICES)]
    bad_sp = sps[BAD_INDEX]
    good = [sp for sp in sps if sp.name != BAD]
    p = make_proxier(netns, flavour)
    bad_chains = set(render.render_service(bad_sp, render.make_context(p.config, NODE, IPFamily.V4)).chains)

    res = p.sync(state(sps), Changes(full=True))
    assert res.ok, res.error
    assert set(res.failed) == {BAD} and "nosuchmatch" in res.failed[BAD], res.failed

    refused = [i for i, (_, ok, _) in enumerate(calls) if not ok]
    assert len(refused) == 1, [ok for _, ok, _ in calls]
    first_refused = refused[0]
    if flavour == "nft":
        # several payloads per round, and the refusal was not in the first one
        assert len(p.last_payloads(IPFamily.V4)) > 3
        assert first_refused > 0 and all(ok for _, ok, _ in calls[:first_refused])
        if where == "top":
            # BAD's own chains were created by an earlier chunk of the refused round and were in the kernel then
            assert any(f":{render.service_chain(BAD)} " in t for t, _, _ in calls[:first_refused])
            assert bad_chains <= calls[first_refused][2]
        else:
            assert f":{render.service_chain(BAD)} " in calls[first_refused][0]

    text = save(netns, flavour)
    assert "nosuchmatch" not in text
    frags = {sp.name: render.render_service(sp, p.applied(IPFamily.V4)[0]) for sp in good}  # type: ignore[arg-type]
    assert_programmed(text, good, frags)
    assert not (bad_chains & chains(text)), bad_chains & chains(text)
    assert bad_sp.cluster_ip + "/32" not in text and "ns1/s20:http" not in text
    assert len({c for c in chains(text) if c.startswith("KUBE-SVC-")}) == N_SERVICES - 1
    # the jumps from the built-in chains, inserted by a payload whose filter part committed before its nat part was
    # refused, are there once each (the retry inserts only the missing ones)
    for j in render.JUMP_RULES:
        assert section(text, j.table).count(f"-A {j.chain} {j.spec}\n") == 1, j

    # fixed: a partial sync of that one service programs it, the others stay
    monkeypatch.undo()
    res = p.sync(state(sps), Changes(full=False, services=frozenset({BAD})))
    assert res.ok and not res.failed, res
    assert not res.full
    text = save(netns, flavour)
    frags[BAD] = render.render_service(bad_sp, p.applied(IPFamily.V4)[0])  # type: ignore[arg-type]
    assert_programmed(text, sps, frags)
    assert len({c for c in chains(text) if c.startswith("KUBE-SEP-")}) == N_SERVICES


def test_refused_update_in_a_later_chunk_keeps_old_rules_and_drops_new_chains(
    netns: str, flavour: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A partial sync changing every service (so it is chunked) whose KUBE-SERVICES payload refuses one service's
    update: that service keeps the rules it had, and the new endpoint chain an earlier chunk created for it is
    deleted again; every other service gets its update."""
    monkeypatch.setattr(proxier_mod, "_chunk_lines", lambda _rules: CHUNK)
    p = make_proxier(netns, flavour)
    old = [service(i) for i in range(N_SERVICES)]
    res = p.sync(state(old), Changes(full=True))
    assert res.ok and not res.failed, res
    ctx = p.applied(IPFamily.V4)[0]
    assert ctx is not None
    old_bad = render.render_service(old[BAD_INDEX], ctx)

    break_service(monkeypatch, "top")
    calls = record_restores(monkeypatch, netns, flavour)
    new = [service(i, endpoints=2) for i in range(N_SERVICES)]
    new_bad_sep = render.endpoint_chain(BAD, f"198.18.2.{BAD_INDEX + 1}:80")
    res = p.sync(state(new), Changes(full=False, services=frozenset(sp.name for sp in new)))
    assert res.ok, res.error
    assert not res.full and set(res.failed) == {BAD}, res
    if flavour == "nft":
        first_refused = next(i for i, (_, ok, _) in enumerate(calls) if not ok)
        assert first_refused > 0
        assert new_bad_sep in calls[first_refused][2]  # an earlier chunk had created it

    text = save(netns, flavour)
    assert "nosuchmatch" not in text
    nat = chains(text)
    assert new_bad_sep not in nat
    assert set(old_bad.chains) <= nat
    bad_rules = [ln for ln in section(text, "nat").splitlines() if ln.startswith(f"-A {render.service_chain(BAD)} ")]
    assert len(bad_rules) == 2 and not any("statistic" in ln for ln in bad_rules), bad_rules  # still one endpoint
    good = [sp for sp in new if sp.name != BAD]
    assert_programmed(text, good, {sp.name: render.render_service(sp, ctx) for sp in good})
    assert len({c for c in nat if c.startswith("KUBE-SEP-")}) == 2 * (N_SERVICES - 1) + 1
    assert p.describe(BAD)["services"]["ns1/s20:http/TCP"]["IPv4"]["failed"]

    monkeypatch.undo()
    res = p.sync(state(new), Changes(full=False, services=frozenset({BAD})))
    assert res.ok and not res.failed, res
    assert new_bad_sep in chains(save(netns, flavour))


def test_chunked_partial_sync_switching_target_chains(
    netns: str, flavour: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every service changes the chain KUBE-SERVICES jumps to (SVC -> SVL as internalTrafficPolicy becomes Local, or
    EXT -> FW as source ranges appear) in one chunked partial sync: the new chains come in early chunks, the last
    payload repoints KUBE-SERVICES and only then deletes the old chains, and the kernel accepts it all."""
    monkeypatch.setattr(proxier_mod, "_chunk_lines", lambda _rules: CHUNK)
    calls = record_restores(monkeypatch, netns, flavour)
    p = make_proxier(netns, flavour)

    def local_ep(i: int) -> Endpoint:
        return Endpoint(f"198.18.1.{i + 1}", 80, is_local=True, node_name="node-a")

    old: list[ServicePort] = []
    for i in range(N_SERVICES):
        sp = dataclasses.replace(service(i), cluster_endpoints=(local_ep(i),), local_endpoints=(local_ep(i),))
        if i % 2:
            sp = dataclasses.replace(sp, load_balancer_ips=(f"198.19.1.{i + 1}",))
        old.append(sp)
    res = p.sync(state(old), Changes(full=True))
    assert res.ok and not res.failed, res
    new = [
        dataclasses.replace(sp, load_balancer_source_ranges=("198.19.128.0/17",))
        if i % 2
        else dataclasses.replace(sp, internal_policy_local=True)
        for i, sp in enumerate(old)
    ]
    calls.clear()
    res = p.sync(state(new), Changes(full=False, services=frozenset(sp.name for sp in new)))
    assert res.ok and not res.failed and not res.full, res
    assert all(ok for _, ok, _ in calls)
    if flavour == "nft":
        assert len(calls) > 3
        # the last payload rewrites KUBE-SERVICES and deletes the old chains; no earlier one does either
        assert all(":KUBE-SERVICES " not in t and "\n-X " not in t for t, _, _ in calls[:-1])
        assert ":KUBE-SERVICES " in calls[-1][0] and "\n-X KUBE-SVC-" in calls[-1][0]
    text = save(netns, flavour)
    nat = chains(text)
    services = [ln for ln in section(text, "nat").splitlines() if ln.startswith("-A KUBE-SERVICES ")]
    for i, sp in enumerate(new):
        x = render.port_proto_hash(sp.name)
        if i % 2:
            assert {f"KUBE-FW-{x}", f"KUBE-EXT-{x}", f"KUBE-SVC-{x}"} <= nat
            assert any(f"-d {sp.load_balancer_ips[0]}/32 " in ln and ln.endswith(f"-j KUBE-FW-{x}") for ln in services)
            assert f"-d {sp.load_balancer_ips[0]}/32 " in section(text, "filter")  # KUBE-PROXY-FIREWALL's DROP
        else:
            assert f"KUBE-SVL-{x}" in nat and f"KUBE-SVC-{x}" not in nat
            assert any(f"-d {sp.cluster_ip}/32 " in ln and ln.endswith(f"-j KUBE-SVL-{x}") for ln in services)


def test_streamed_full_sync_whose_chain_deletion_is_refused_retries_without_deletions(
    netns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A big full sync on nf_tables is streamed (each chunk applied while the next is rendered); when its last
    payload's deletion of a stale chain is refused (another program's chain jumps to it), the sync is retried
    without deletions and goes through; once nothing jumps to the chain, the next full sync deletes it."""
    monkeypatch.setattr(proxier_mod, "_chunk_lines", lambda _rules: CHUNK)
    calls = record_restores(monkeypatch, netns, "nft")
    sps = [service(i) for i in range(N_SERVICES)]
    p = make_proxier(netns, "nft")
    assert p.sync(state(sps), Changes(full=True)).ok
    assert len(calls) > 3 and all(ok for _, ok, _ in calls)
    gone = sps[5]
    sep = render.endpoint_chain(gone.name, str(gone.cluster_endpoints[0]))
    ns_iptables = ["ip", "netns", "exec", netns, "iptables-nft", "-w", "-t", "nat"]
    subprocess.run([*ns_iptables, "-N", "OTHER-PROGRAM"], check=True, timeout=30)
    subprocess.run([*ns_iptables, "-A", "OTHER-PROGRAM", "-j", sep], check=True, timeout=30)
    calls.clear()
    rest = [sp for sp in sps if sp is not gone]

    res = p.sync(state(rest), Changes(full=True))
    assert res.ok and not res.failed, res.error
    assert [ok for _, ok, _ in calls].count(False) == 1 and not calls[-1][0].count("\n-X ")  # retried without -X
    text = save(netns, "nft")
    frags = {sp.name: render.render_service(sp, p.applied(IPFamily.V4)[0]) for sp in rest}  # type: ignore[arg-type]
    assert_programmed(text, rest, frags)
    services = [ln for ln in section(text, "nat").splitlines() if ln.startswith("-A KUBE-SERVICES ")]
    assert sep in chains(text) and not any(f"-d {gone.cluster_ip}/32" in ln for ln in services)

    subprocess.run([*ns_iptables, "-F", "OTHER-PROGRAM"], check=True, timeout=30)
    assert p.sync(state(rest), Changes(full=True)).ok
    assert sep not in chains(save(netns, "nft"))


def test_full_sync_refusing_an_update_after_its_chains_committed_restores_the_old_rules(
    netns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A streamed full sync (adopting what the kernel holds) where one service's new chains commit in an early chunk
    and its KUBE-SERVICES line is refused in the last payload: the retry must write that service's old rules back
    (the adoption read from before the sync no longer says what the kernel holds) and delete its new-only chain."""
    monkeypatch.setattr(proxier_mod, "_chunk_lines", lambda _rules: CHUNK)
    p = make_proxier(netns, "nft")
    old = [service(i) for i in range(N_SERVICES)]
    assert p.sync(state(old), Changes(full=True)).ok
    before = section(save(netns, "nft"), "nat")
    new = list(old)
    new[BAD_INDEX] = service(BAD_INDEX, endpoints=2)
    new_sep = render.endpoint_chain(BAD, str(new[BAD_INDEX].cluster_endpoints[1]))
    original = render.render_service

    def broken(sp: ServicePort, ctx: render.Context) -> render.Fragment:
        frag = original(sp, ctx)
        if sp.name != BAD or len(sp.cluster_endpoints) < 2:  # only the update is refused
            return frag
        top = dict(frag.top)
        top[render.N_SERVICES] = top[render.N_SERVICES] + (f"-A KUBE-SERVICES {INVALID}",)
        return dataclasses.replace(frag, top=top)

    monkeypatch.setattr(render, "render_service", broken)
    calls = record_restores(monkeypatch, netns, "nft")
    res = p.sync(state(new), Changes(full=True))
    assert res.ok and set(res.failed) == {BAD}, res
    refused = [i for i, (_, ok, _) in enumerate(calls) if not ok]
    assert len(refused) == 1 and new_sep in calls[refused[0]][2]  # the new chain was in the kernel then
    after = section(save(netns, "nft"), "nat")
    assert after == before and new_sep not in after
