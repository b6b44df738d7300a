"""Localhost NodePorts, decided once in the core (``kproxy.nodeaddr``) from upstream's flag and config field
(``--iptables-localhost-nodeports``, ``iptables.localhostNodePorts``, default true) and ``--nodeport-addresses``:
the decision table, what the family context then exposes to every backend, and the flag and field themselves.
Pure: no root, no kernel."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from kproxy.cli import build_parser, config_from_args
from kproxy.config import ConfigError, ProxyConfig, build_config, load_config_file, to_kube_proxy_configuration
from kproxy.model import IPFamily, NodeInfo
from kproxy.nodeaddr import FamilyContext, localhost_nodeports, resolve

NODE = NodeInfo("node-1", addresses=("198.18.0.11", "fd00:198:18::11"))
ADDRS = ("127.0.0.1", "198.18.0.11", "::1", "fd00:198:18::11")
V4, V6 = IPFamily.V4, IPFamily.V6


@pytest.mark.parametrize(
    ("flag", "cidrs", "v4"),
    [
        (True, (), True),  # upstream's default: every local address, loopback included
        (False, (), False),  # --iptables-localhost-nodeports=false
        (True, ("0.0.0.0/0",), True),  # match-all
        (True, ("127.0.0.0/8",), True),
        (True, ("127.0.0.1/32",), True),
        (True, ("127.0.0.0/8", "198.18.0.0/15"), True),
        (True, ("0.0.0.0/1",), True),  # a CIDR around loopback
        (True, ("198.18.0.0/15",), False),  # --nodeport-addresses without loopback keeps it out
        (True, ("primary",), False),  # the Node's own addresses: no loopback
        (True, ("127.0.0.2/32",), False),  # loopback, but not 127.0.0.1 (where every mode serves them)
        (False, ("127.0.0.0/8",), False),
        (True, ("fd00:198:18::/48",), True),  # no IPv4 CIDR: every IPv4 address, as upstream
        (True, ("::/0",), True),
    ],
)
def test_decision_table(flag: bool, cidrs: tuple[str, ...], v4: bool) -> None:
    cfg = ProxyConfig(localhost_nodeports=flag, nodeport_addresses=cidrs)
    assert localhost_nodeports(cfg, NODE, V4) is v4
    # IPv6 never: [::1]:NODEPORT never worked upstream (no route_localnet for IPv6)
    assert localhost_nodeports(cfg, NODE, V6) is False
    ctx = resolve(cfg, NODE, ADDRS)
    assert ctx.family(V4).localhost_nodeports is v4
    assert ctx.family(V6).localhost_nodeports is False


def test_context_exposes_it_and_keeps_loopback_out_of_the_cidrs() -> None:
    on = resolve(ProxyConfig(nodeport_addresses=("0.0.0.0/1", "fd00:198:18::/48")), NODE, ADDRS)
    v4 = on.family(V4)
    assert v4.localhost_nodeports and not v4.nodeport_all_local
    # the CIDRs a backend matches still leave loopback out: 127.0.0.1 is the flag's alone
    assert all(not c.startswith("127.") for c in v4.nodeport_cidrs)
    assert v4.nodeport_addresses == ("127.0.0.1",)  # 198.18.0.11 is outside 0.0.0.0/1
    assert on.family(V6).nodeport_addresses == ("fd00:198:18::11",)  # never ::1
    assert v4.without_addresses().localhost_nodeports  # survives the address-free copy backends hash
    everywhere = resolve(ProxyConfig(), NODE, ADDRS).family(V4)
    assert everywhere.nodeport_addresses == ("198.18.0.11", "127.0.0.1")
    off = resolve(ProxyConfig(localhost_nodeports=False), NODE, ADDRS).family(V4)
    assert off.nodeport_addresses == ("198.18.0.11",)
    # the decision is part of the context's identity: turning it off forces a full batch in every mode
    assert off.without_addresses() != everywhere.without_addresses()
    assert FamilyContext(V4).localhost_nodeports is False  # a bare context (tests, tools) serves none


def test_flag_as_upstream_spells_it() -> None:
    parser = build_parser()
    for argv, want in (
        ([], True),
        (["--iptables-localhost-nodeports"], True),
        (["--iptables-localhost-nodeports=false"], False),
        (["--iptables-localhost-nodeports", "false"], False),
        (["--iptables-localhost-nodeports=true"], True),
    ):
        args = parser.parse_args(["run", "--manifests", "/nonexistent", *argv])
        assert config_from_args(args).localhost_nodeports is want, argv
    with pytest.raises(SystemExit):
        parser.parse_args(["run", "--iptables-localhost-nodeports=maybe"])


def test_config_field(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(
        textwrap.dedent(
            """\
            apiVersion: kubeproxy.config.k8s.io/v1alpha1
            kind: KubeProxyConfiguration
            iptables:
              localhostNodePorts: false
            """
        )
    )
    cfg = build_config(load_config_file(path), {})
    assert cfg.localhost_nodeports is False
    assert to_kube_proxy_configuration(cfg)["iptables"]["localhostNodePorts"] is False
    assert build_config(load_config_file(path), {"localhost_nodeports": True}).localhost_nodeports is True  # flag wins
    assert ProxyConfig().localhost_nodeports is True  # upstream's default
    path.write_text(path.read_text().replace("false", '"no"'))
    with pytest.raises(ConfigError, match="localhostNodePorts"):
        build_config(load_config_file(path), {})
