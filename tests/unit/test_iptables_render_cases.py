"""More rule-by-rule unit tests of the iptables backend's renderer (``backends/iptables/render.py``): traffic-policy,
load-balancer, SCTP and dual-stack cases that tests/unit/test_iptables_render.py does not cover, and the shared chains
``changed_top_chains`` reports when a service's target chain changes. Expected lines are those upstream's
``pkg/proxy/iptables/proxier.go`` (``syncProxyRules``) writes. Pure: no root, no kernel.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import re
from typing import Any

from kproxy.backends.iptables import render
from kproxy.cache import ServiceCache
from kproxy.model import IPFamily, NodeInfo, Protocol, ServicePort, ServicePortName

from .iptables_objects import CFG, CTX4, NODE, ep, lines, spn, svc

IPV4 = re.compile(r"(?<![\w.:])\d{1,3}(?:\.\d{1,3}){3}(?:/\d+)?(?![\w.])")


def own(frag: render.Fragment, chain: str) -> list[str]:
    """The rules of one of the fragment's own chains, in order."""
    return [x for x in frag.rules if x.startswith(f"-A {chain} ")]


def h(sp: ServicePort) -> str:
    return render.port_proto_hash(sp.name)


# ------------------------------------------------------------------------------------------------ internalTrafficPolicy


def test_itp_local_with_local_endpoints_uses_svl_with_masquerade() -> None:
    l1, l2 = ep("198.18.1.5", local=True), ep("198.18.1.6", local=True)
    sp = svc("a", (), local_endpoints=(l1, l2), internal_policy_local=True, has_any_endpoints=True)
    x = h(sp)
    s1 = render.endpoint_chain(sp.name, "198.18.1.5:8080")
    s2 = render.endpoint_chain(sp.name, "198.18.1.6:8080")
    frag = render.render_service(sp, CTX4)
    assert frag.top == {
        render.N_SERVICES: (
            '-A KUBE-SERVICES -m comment --comment "ns1/a:http cluster IP" -m tcp -p tcp -d 198.18.200.1 --dport 80 '
            f"-j KUBE-SVL-{x}",
        )
    }
    assert frag.chains == (f"KUBE-SVL-{x}", s1, s2)  # no KUBE-SVC: nothing uses the cluster endpoints
    assert own(frag, f"KUBE-SVL-{x}") == [
        # upstream's internal-chain masquerade of off-cluster sources sits in the internal chain, here SVL
        f'-A KUBE-SVL-{x} -m comment --comment "ns1/a:http cluster IP" -m tcp -p tcp -d 198.18.200.1 --dport 80 '
        "! -s 198.18.0.0/16 -j KUBE-MARK-MASQ",
        f'-A KUBE-SVL-{x} -m comment --comment "ns1/a:http -> 198.18.1.5:8080" -m statistic --mode random '
        f"--probability 0.5000000000 -j {s1}",
        f'-A KUBE-SVL-{x} -m comment --comment "ns1/a:http -> 198.18.1.6:8080" -j {s2}',
    ]
    assert own(frag, s2) == [
        f"-A {s2} -m comment --comment ns1/a:http -s 198.18.1.6 -j KUBE-MARK-MASQ",
        f"-A {s2} -m comment --comment ns1/a:http -m tcp -p tcp -j DNAT --to-destination 198.18.1.6:8080",
    ]
    assert not any("KUBE-SVC-" in r for r in lines(sp))
    # masqueradeAll marks every source, still inside SVL
    ctx = render.make_context(CFG.with_(masquerade_all=True), NODE, IPFamily.V4)
    assert own(render.render_service(sp, ctx), f"KUBE-SVL-{x}")[0] == (
        f'-A KUBE-SVL-{x} -m comment --comment "ns1/a:http cluster IP" -m tcp -p tcp -d 198.18.200.1 --dport 80 '
        "-j KUBE-MARK-MASQ"
    )


def test_itp_local_with_nodeport_keeps_svc_for_external_traffic() -> None:
    local, remote = ep("198.18.1.5", local=True), ep("198.18.2.5")
    sp = svc("a", (local, remote), local_endpoints=(local,), internal_policy_local=True, node_port=30001)
    x = h(sp)
    sl = render.endpoint_chain(sp.name, "198.18.1.5:8080")
    sr = render.endpoint_chain(sp.name, "198.18.2.5:8080")
    frag = render.render_service(sp, CTX4)
    assert frag.top == {
        render.N_SERVICES: (
            '-A KUBE-SERVICES -m comment --comment "ns1/a:http cluster IP" -m tcp -p tcp -d 198.18.200.1 --dport 80 '
            f"-j KUBE-SVL-{x}",
        ),
        render.N_NODEPORTS: (
            f"-A KUBE-NODEPORTS -m comment --comment ns1/a:http -m tcp -p tcp --dport 30001 -j KUBE-EXT-{x}",
        ),
    }
    assert set(frag.chains) == {f"KUBE-EXT-{x}", f"KUBE-SVC-{x}", f"KUBE-SVL-{x}", sl, sr}
    assert len(frag.chains) == 5  # the local endpoint's SEP chain once, though both SVC and SVL jump to it
    assert own(frag, f"KUBE-EXT-{x}") == [
        f'-A KUBE-EXT-{x} -m comment --comment "masquerade traffic for ns1/a:http external destinations" '
        "-j KUBE-MARK-MASQ",
        f"-A KUBE-EXT-{x} -j KUBE-SVC-{x}",  # eTP=Cluster: external traffic to the cluster chain
    ]
    assert own(frag, f"KUBE-SVC-{x}") == [  # no cluster-IP masquerade rule here: internal traffic uses SVL
        f'-A KUBE-SVC-{x} -m comment --comment "ns1/a:http -> 198.18.1.5:8080" -m statistic --mode random '
        f"--probability 0.5000000000 -j {sl}",
        f'-A KUBE-SVC-{x} -m comment --comment "ns1/a:http -> 198.18.2.5:8080" -j {sr}',
    ]
    assert own(frag, f"KUBE-SVL-{x}") == [
        f'-A KUBE-SVL-{x} -m comment --comment "ns1/a:http cluster IP" -m tcp -p tcp -d 198.18.200.1 --dport 80 '
        "! -s 198.18.0.0/16 -j KUBE-MARK-MASQ",
        f'-A KUBE-SVL-{x} -m comment --comment "ns1/a:http -> 198.18.1.5:8080" -j {sl}',
    ]


def test_itp_local_without_local_endpoints_drops_clusterip_but_serves_external_traffic() -> None:
    sp = svc("b", (ep("198.18.2.5"),), internal_policy_local=True, node_port=30002, external_ips=("198.19.0.9",))
    x = h(sp)
    sep = render.endpoint_chain(sp.name, "198.18.2.5:8080")
    assert lines(sp) == [
        '-A KUBE-SERVICES -m comment --comment "ns1/b:http has no local endpoints" -m tcp -p tcp -d 198.18.200.1 '
        "--dport 80 -j DROP",
        '-A KUBE-SERVICES -m comment --comment "ns1/b:http external IP" -m tcp -p tcp -d 198.19.0.9 --dport 80 '
        f"-j KUBE-EXT-{x}",
        f"-A KUBE-NODEPORTS -m comment --comment ns1/b:http -m tcp -p tcp --dport 30002 -j KUBE-EXT-{x}",
        f'-A KUBE-EXT-{x} -m comment --comment "masquerade traffic for ns1/b:http external destinations" '
        "-j KUBE-MARK-MASQ",
        f"-A KUBE-EXT-{x} -j KUBE-SVC-{x}",
        f'-A KUBE-SVC-{x} -m comment --comment "ns1/b:http -> 198.18.2.5:8080" -j {sep}',
        f"-A {sep} -m comment --comment ns1/b:http -s 198.18.2.5 -j KUBE-MARK-MASQ",
        f"-A {sep} -m comment --comment ns1/b:http -m tcp -p tcp -j DNAT --to-destination 198.18.2.5:8080",
    ]  # nothing in KUBE-EXTERNAL-SERVICES: external traffic (eTP=Cluster) has endpoints


# ------------------------------------------------------------------------------------------------ load balancers


def test_lb_ip_without_source_ranges_jumps_to_ext() -> None:
    sp = svc("a", (ep("198.18.1.5"),), load_balancer_ips=("198.19.0.10",), node_port=30010)
    x = h(sp)
    frag = render.render_service(sp, CTX4)
    assert frag.top[render.N_SERVICES] == (
        '-A KUBE-SERVICES -m comment --comment "ns1/a:http cluster IP" -m tcp -p tcp -d 198.18.200.1 --dport 80 '
        f"-j KUBE-SVC-{x}",
        '-A KUBE-SERVICES -m comment --comment "ns1/a:http loadbalancer IP" -m tcp -p tcp -d 198.19.0.10 --dport 80 '
        f"-j KUBE-EXT-{x}",
    )
    assert render.F_FIREWALL not in frag.top and render.F_EXTERNAL not in frag.top
    assert not any(c.startswith("KUBE-FW-") for c in frag.chains)
    assert not any("KUBE-FW-" in r for r in lines(sp))
    assert own(frag, f"KUBE-EXT-{x}") == [
        f'-A KUBE-EXT-{x} -m comment --comment "masquerade traffic for ns1/a:http external destinations" '
        "-j KUBE-MARK-MASQ",
        f"-A KUBE-EXT-{x} -j KUBE-SVC-{x}",
    ]


def test_lb_with_source_ranges_but_no_endpoints_rejects_without_fw_chain() -> None:
    sp = svc("a", (), load_balancer_ips=("198.19.0.10",), load_balancer_source_ranges=("198.19.128.0/17",))
    frag = render.render_service(sp, CTX4)
    assert frag.chains == () and frag.rules == ()
    assert frag.top == {
        render.F_SERVICES: (
            '-A KUBE-SERVICES -m comment --comment "ns1/a:http has no endpoints" -m tcp -p tcp -d 198.18.200.1 '
            "--dport 80 -j REJECT",
        ),
        render.F_EXTERNAL: (
            '-A KUBE-EXTERNAL-SERVICES -m comment --comment "ns1/a:http has no endpoints" -m tcp -p tcp '
            "-d 198.19.0.10 --dport 80 -j REJECT",
        ),
    }  # in particular nothing in KUBE-PROXY-FIREWALL (upstream's usesFWChain needs endpoints)


def test_firewall_chain_without_node_address_in_ranges_does_not_admit_lb_ips() -> None:
    sp = svc(
        "a",
        (ep("198.18.1.5"),),
        load_balancer_ips=("198.19.0.10", "198.19.0.11"),
        load_balancer_source_ranges=("198.19.128.0/24", "198.18.64.0/18"),
    )
    x = h(sp)
    assert not any(n in r for n in NODE.addresses for r in sp.load_balancer_source_ranges)
    frag = render.render_service(sp, CTX4)
    head = f'-A KUBE-FW-{x} -m comment --comment "ns1/a:http loadbalancer IP"'
    assert own(frag, f"KUBE-FW-{x}") == [
        f"{head} -s 198.19.128.0/24 -j KUBE-EXT-{x}",
        f"{head} -s 198.18.64.0/18 -j KUBE-EXT-{x}",
        f'-A KUBE-FW-{x} -m comment --comment "other traffic to ns1/a:http will be dropped by KUBE-PROXY-FIREWALL"',
    ]
    assert frag.top[render.F_FIREWALL] == tuple(
        f'-A KUBE-PROXY-FIREWALL -m comment --comment "ns1/a:http traffic not accepted by KUBE-FW-{x}" '
        f"-m tcp -p tcp -d {ip} --dport 80 -j DROP"
        for ip in ("198.19.0.10", "198.19.0.11")
    )
    assert [r for r in frag.top[render.N_SERVICES] if "loadbalancer IP" in r] == [
        '-A KUBE-SERVICES -m comment --comment "ns1/a:http loadbalancer IP" -m tcp -p tcp '
        f"-d {ip} --dport 80 -j KUBE-FW-{x}"
        for ip in ("198.19.0.10", "198.19.0.11")
    ]
    # a node without known addresses never admits the LB IPs either
    bare = render.make_context(CFG, NodeInfo("node-a", pod_cidrs=("198.18.1.0/24",)), IPFamily.V4)
    assert not any(" -s 198.19.0.1" in r for r in own(render.render_service(sp, bare), f"KUBE-FW-{x}"))
    # and once a range holds the node address, they are admitted (the contrast that makes the above meaningful)
    wide = dataclasses.replace(sp, load_balancer_source_ranges=("198.19.128.0/17",))
    assert f"{head} -s 198.19.0.11 -j KUBE-EXT-{x}" in own(render.render_service(wide, CTX4), f"KUBE-FW-{x}")


# ------------------------------------------------------------------------------------------------ externalTrafficPolicy


def test_etp_local_without_local_endpoints_drops_external_ips_and_lb_ips() -> None:
    sp = svc(
        "a",
        (ep("198.18.2.5"),),
        external_policy_local=True,
        external_ips=("198.19.0.9",),
        load_balancer_ips=("198.19.0.10",),
        health_check_node_port=32000,
    )
    x = h(sp)
    frag = render.render_service(sp, CTX4)
    drop = '-A KUBE-EXTERNAL-SERVICES -m comment --comment "ns1/a:http has no local endpoints" -m tcp -p tcp'
    assert frag.top[render.F_EXTERNAL] == (
        f"{drop} -d 198.19.0.9 --dport 80 -j DROP",
        f"{drop} -d 198.19.0.10 --dport 80 -j DROP",
    )
    # the addresses are still captured into EXT (the short-circuit for pods and the node), the cluster IP into SVC
    assert frag.top[render.N_SERVICES] == (
        '-A KUBE-SERVICES -m comment --comment "ns1/a:http cluster IP" -m tcp -p tcp -d 198.18.200.1 --dport 80 '
        f"-j KUBE-SVC-{x}",
        '-A KUBE-SERVICES -m comment --comment "ns1/a:http external IP" -m tcp -p tcp -d 198.19.0.9 --dport 80 '
        f"-j KUBE-EXT-{x}",
        '-A KUBE-SERVICES -m comment --comment "ns1/a:http loadbalancer IP" -m tcp -p tcp -d 198.19.0.10 --dport 80 '
        f"-j KUBE-EXT-{x}",
    )
    assert render.F_SERVICES not in frag.top  # internal traffic (iTP=Cluster) is not dropped
    assert own(frag, f"KUBE-EXT-{x}") == [
        f'-A KUBE-EXT-{x} -m comment --comment "pod traffic for ns1/a:http external destinations" '
        f"-s 198.18.0.0/16 -j KUBE-SVC-{x}",
        f'-A KUBE-EXT-{x} -m comment --comment "masquerade LOCAL traffic for ns1/a:http external destinations" '
        "-m addrtype --src-type LOCAL -j KUBE-MARK-MASQ",
        f'-A KUBE-EXT-{x} -m comment --comment "route LOCAL traffic for ns1/a:http external destinations" '
        f"-m addrtype --src-type LOCAL -j KUBE-SVC-{x}",
    ]  # and no final jump to KUBE-SVL: there are no local endpoints
    assert f"KUBE-SVL-{x}" not in frag.chains
    assert frag.top[render.F_NODEPORTS] == (
        '-A KUBE-NODEPORTS -m comment --comment "ns1/a:http health check node port" -m tcp -p tcp --dport 32000 '
        "-j ACCEPT",
    )


# ------------------------------------------------------------------------------------------------ protocols, families


def test_sctp_service() -> None:
    name = spn("s", "assoc", Protocol.SCTP)
    want = base64.b32encode(hashlib.sha256(b"ns1/s:assocsctp").digest()).decode()[:16]
    assert render.service_chain(name) == "KUBE-SVC-" + want
    sp = dataclasses.replace(
        svc("s", (ep("198.18.1.5", 9999),), port=3868, node_port=30868, external_ips=("198.19.0.9",)), name=name
    )
    x = want
    sep = render.endpoint_chain(name, "198.18.1.5:9999")
    assert (
        sep == "KUBE-SEP-" + base64.b32encode(hashlib.sha256(b"ns1/s:assocsctp198.18.1.5:9999").digest()).decode()[:16]
    )
    assert lines(sp) == [
        '-A KUBE-SERVICES -m comment --comment "ns1/s:assoc cluster IP" -m sctp -p sctp -d 198.18.200.1 '
        f"--dport 3868 -j KUBE-SVC-{x}",
        '-A KUBE-SERVICES -m comment --comment "ns1/s:assoc external IP" -m sctp -p sctp -d 198.19.0.9 '
        f"--dport 3868 -j KUBE-EXT-{x}",
        f"-A KUBE-NODEPORTS -m comment --comment ns1/s:assoc -m sctp -p sctp --dport 30868 -j KUBE-EXT-{x}",
        f'-A KUBE-SVC-{x} -m comment --comment "ns1/s:assoc cluster IP" -m sctp -p sctp -d 198.18.200.1 '
        "--dport 3868 ! -s 198.18.0.0/16 -j KUBE-MARK-MASQ",
        f'-A KUBE-EXT-{x} -m comment --comment "masquerade traffic for ns1/s:assoc external destinations" '
        "-j KUBE-MARK-MASQ",
        f"-A KUBE-EXT-{x} -j KUBE-SVC-{x}",
        f'-A KUBE-SVC-{x} -m comment --comment "ns1/s:assoc -> 198.18.1.5:9999" -j {sep}',
        f"-A {sep} -m comment --comment ns1/s:assoc -s 198.18.1.5 -j KUBE-MARK-MASQ",
        f"-A {sep} -m comment --comment ns1/s:assoc -m sctp -p sctp -j DNAT --to-destination 198.18.1.5:9999",
    ]
    # no endpoints: REJECT with the sctp match; the health check node port is TCP whatever the service protocol
    empty = dataclasses.replace(sp, cluster_endpoints=(), has_any_endpoints=False, health_check_node_port=32001)
    frag = render.render_service(empty, CTX4)
    assert frag.top[render.F_SERVICES] == (
        '-A KUBE-SERVICES -m comment --comment "ns1/s:assoc has no endpoints" -m sctp -p sctp -d 198.18.200.1 '
        "--dport 3868 -j REJECT",
    )
    assert frag.top[render.F_NODEPORTS] == (
        '-A KUBE-NODEPORTS -m comment --comment "ns1/s:assoc health check node port" -m tcp -p tcp --dport 32001 '
        "-j ACCEPT",
    )


def _service_obj(**spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "type": "LoadBalancer",
        "clusterIP": "198.18.200.7",
        "clusterIPs": ["198.18.200.7", "fd00:198:18:ff::7"],
        "ipFamilies": ["IPv4", "IPv6"],
        "ipFamilyPolicy": "RequireDualStack",
        "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080, "nodePort": 30007}],
    }
    body.update(spec)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "dual", "namespace": "ns1", "resourceVersion": "1"},
        "spec": body,
        "status": {"loadBalancer": {"ingress": [{"ip": "198.19.0.20"}, {"ip": "fd00:198:18:fe::20"}]}},
    }


def _slice_obj(name: str, family: str, ip: str) -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": "ns1", "labels": {"kubernetes.io/service-name": "dual"}},
        "addressType": family,
        "endpoints": [{"addresses": [ip], "conditions": {"ready": True}, "nodeName": "node-b"}],
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
    }


def test_dual_stack_external_ips_of_one_family_stay_in_that_family() -> None:
    cache = ServiceCache("node-a")
    cache.set_node(
        {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": "node-a", "labels": {}},
            "spec": {"podCIDRs": ["198.18.1.0/24", "fd00:198:18:1::/64"], "taints": []},
            "status": {
                "addresses": [
                    {"type": "InternalIP", "address": "198.19.255.1"},
                    {"type": "InternalIP", "address": "fd00:198:18:ffff::1"},
                ]
            },
        }
    )
    assert cache.upsert_service(
        _service_obj(externalIPs=["198.19.0.9"], loadBalancerSourceRanges=["198.19.128.0/17", "fd00:198:18::/48"])
    )
    assert cache.upsert_slice(_slice_obj("dual-v4", "IPv4", "198.18.2.5"))
    assert cache.upsert_slice(_slice_obj("dual-v6", "IPv6", "fd00:198:18:2::5"))
    state, _ = cache.snapshot()
    name = spn("dual")
    sp4, sp6 = state.family(IPFamily.V4)[name], state.family(IPFamily.V6)[name]
    assert sp4.external_ips == ("198.19.0.9",) and sp6.external_ips == ()

    cfg = CFG.with_(nodeport_addresses=("198.19.0.0/16", "fd00:198:18::/48"))
    node = cache.node_info()
    ctx6 = render.make_context(cfg, node, IPFamily.V6)
    frag6 = render.render_service(sp6, ctx6)
    text6 = render.build_restore(
        ctx6, {name: frag6}, write=None, top=None, jump_rules=render.JUMP_RULES, canary=True
    ).text
    leaks = [line for line in text6.splitlines() if IPV4.search(line)]
    assert leaks == []
    x = h(sp6)
    assert [r for r in frag6.top[render.N_SERVICES] if "external IP" in r] == []  # the v4 externalIP is not here
    assert frag6.top[render.N_SERVICES] == (
        '-A KUBE-SERVICES -m comment --comment "ns1/dual:http cluster IP" -m tcp -p tcp -d fd00:198:18:ff::7 '
        f"--dport 80 -j KUBE-SVC-{x}",
        '-A KUBE-SERVICES -m comment --comment "ns1/dual:http loadbalancer IP" -m tcp -p tcp -d fd00:198:18:fe::20 '
        f"--dport 80 -j KUBE-FW-{x}",
    )
    # the nodeport tail rule uses only the v6 CIDR of --nodeport-addresses (its CIDR + dst-type LOCAL form is kproxy's
    # documented deviation from upstream's one rule per node address)
    assert (
        '-A KUBE-SERVICES -m comment --comment "kubernetes service nodeports; NOTE: this must be the last rule in '
        'this chain" -d fd00:198:18::/48 -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS'
    ) in text6
    # the node's v6 address is in the v6 range, so its v6 LB IP (only) is admitted as a source
    assert own(frag6, f"KUBE-FW-{x}") == [
        f'-A KUBE-FW-{x} -m comment --comment "ns1/dual:http loadbalancer IP" -s fd00:198:18::/48 -j KUBE-EXT-{x}',
        f'-A KUBE-FW-{x} -m comment --comment "ns1/dual:http loadbalancer IP" -s fd00:198:18:fe::20 -j KUBE-EXT-{x}',
        f'-A KUBE-FW-{x} -m comment --comment "other traffic to ns1/dual:http will be dropped by KUBE-PROXY-FIREWALL"',
    ]
    assert any(r.endswith("-j DNAT --to-destination [fd00:198:18:2::5]:8080") for r in frag6.rules)
    assert any("! -s fd00:198:18::/56 -j KUBE-MARK-MASQ" in r for r in frag6.rules)
    # the v4 ServicePort does carry it, and no v6 address leaks the other way
    lines4 = lines(sp4, render.make_context(cfg, node, IPFamily.V4))
    assert any('"ns1/dual:http external IP" -m tcp -p tcp -d 198.19.0.9 --dport 80' in r for r in lines4)
    assert not any("fd00:" in r for r in lines4)


# ------------------------------------------------------------------------------------------------ changed_top_chains


def _frags(*sps: ServicePort) -> dict[ServicePortName, render.Fragment]:
    return {sp.name: render.render_service(sp, CTX4) for sp in sps}


def test_changed_top_chains_when_itp_switches_svc_and_svl() -> None:
    local = ep("198.18.1.5", local=True)
    other = svc("o", (ep("198.18.2.9"),), cluster_ip="198.18.200.9")
    cluster = svc("a", (local, ep("198.18.2.5")), local_endpoints=(local,))
    local_policy = dataclasses.replace(cluster, internal_policy_local=True)
    x = h(cluster)
    old = _frags(cluster, other)
    new = render.render_service(local_policy, CTX4)
    assert render.changed_top_chains(old, {cluster.name: new}) == {render.N_SERVICES}
    assert new.top[render.N_SERVICES][0].endswith(f"-j KUBE-SVL-{x}")
    assert render.changed_top_chains(_frags(local_policy, other), {cluster.name: old[cluster.name]}) == {
        render.N_SERVICES
    }
    # the partial payload for that change rewrites KUBE-SERVICES (with every service's lines) and drops KUBE-SVC
    frags = dict(old)
    frags[cluster.name] = new
    stale = set(old[cluster.name].chains) - set(new.chains)
    assert stale == {f"KUBE-SVC-{x}", render.endpoint_chain(cluster.name, "198.18.2.5:8080")}
    text = render.build_restore(
        CTX4, frags, write=[cluster.name], top=render.changed_top_chains(old, {cluster.name: new}), delete_chains=stale
    ).text
    assert "*filter" not in text
    assert new.top[render.N_SERVICES][0] in text.splitlines()
    assert old[other.name].top[render.N_SERVICES][0] in text.splitlines()
    assert f"-X KUBE-SVC-{x}" in text.splitlines()
    # iTP=Local losing its local endpoints moves the cluster IP from a nat jump to a filter DROP
    gone = dataclasses.replace(local_policy, local_endpoints=(), cluster_endpoints=(ep("198.18.2.5"),))
    assert render.changed_top_chains(old, {cluster.name: render.render_service(gone, CTX4)}) == {
        render.N_SERVICES,
        render.F_SERVICES,
    }


def test_changed_top_chains_when_source_ranges_switch_ext_and_fw() -> None:
    other = svc("o", (ep("198.18.2.9"),), cluster_ip="198.18.200.9")
    plain = svc("a", (ep("198.18.1.5"),), load_balancer_ips=("198.19.0.10",), node_port=30010)
    ranged = dataclasses.replace(plain, load_balancer_source_ranges=("198.19.128.0/17",))
    x = h(plain)
    old = _frags(plain, other)
    new = render.render_service(ranged, CTX4)
    assert any(
        r.endswith(f"-j KUBE-EXT-{x}") and "loadbalancer IP" in r for r in old[plain.name].top[render.N_SERVICES]
    )
    assert any(r.endswith(f"-j KUBE-FW-{x}") and "loadbalancer IP" in r for r in new.top[render.N_SERVICES])
    assert render.changed_top_chains(old, {plain.name: new}) == {render.N_SERVICES, render.F_FIREWALL}
    back = _frags(ranged, other)
    assert render.changed_top_chains(back, {plain.name: old[plain.name]}) == {render.N_SERVICES, render.F_FIREWALL}
    # the KUBE-NODEPORTS line (always to EXT) is unchanged, so that chain is not reported
    assert new.top[render.N_NODEPORTS] == old[plain.name].top[render.N_NODEPORTS]
    # the partial payload declares and fills KUBE-PROXY-FIREWALL and the new FW chain
    frags = dict(old)
    frags[plain.name] = new
    text = render.build_restore(
        CTX4, frags, write=[plain.name], top=render.changed_top_chains(old, {plain.name: new})
    ).text.splitlines()
    assert ":KUBE-PROXY-FIREWALL - [0:0]" in text and f":KUBE-FW-{x} - [0:0]" in text
    assert new.top[render.F_FIREWALL][0] in text
    assert ":KUBE-EXTERNAL-SERVICES - [0:0]" not in text and ":KUBE-NODEPORTS - [0:0]" not in text
