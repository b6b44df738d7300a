"""ProxyConfig: KubeProxyConfiguration files, flag precedence, validation."""

from __future__ import annotations

from pathlib import Path

import pytest

from kproxy.config import (
    ConfigError,
    ProxyConfig,
    build_config,
    load_config_file,
    parse_duration,
    parse_hostport,
    to_kube_proxy_configuration,
)
from kproxy.model import IPFamily


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("30s", 30.0), ("1m", 60.0), ("1h0m0s", 3600.0), ("500ms", 0.5), ("1m30s", 90.0), ("2", 2.0), (0.25, 0.25)],
)
def test_durations(text: str | float, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("bad", ["", "s", "10x", "1h-3m", "abc"])
def test_bad_durations(bad: str) -> None:
    with pytest.raises(ConfigError):
        parse_duration(bad)


def test_hostport() -> None:
    assert parse_hostport("0.0.0.0:10256", "x") == ("0.0.0.0", 10256)
    assert parse_hostport("[::]:10256", "x") == ("::", 10256)
    assert parse_hostport(":10249", "x") == ("", 10249)
    for bad in ("localhost:1", "1.2.3.4", "1.2.3.4:99999"):
        with pytest.raises(ConfigError):
            parse_hostport(bad, "x")


CONFIG = """
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: iptables
clusterCIDR: 198.18.64.0/18,fd00:198:18:40::/58
healthzBindAddress: 0.0.0.0:10256
metricsBindAddress: 127.0.0.1:10249
nodePortAddresses: ["198.18.0.0/24"]
iptables:
  masqueradeAll: true
  masqueradeBit: 15
  syncPeriod: 20s
  minSyncPeriod: 2s
clientConnection:
  kubeconfig: /etc/kubeconfig
"""


def test_config_file(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(CONFIG)
    cfg = build_config(load_config_file(f), {})
    assert cfg.mode == "iptables"
    assert cfg.cluster_cidrs == ("198.18.64.0/18", "fd00:198:18:40::/58")
    assert cfg.cluster_cidrs_for(IPFamily.V6) == ("fd00:198:18:40::/58",)
    assert cfg.nodeport_addresses == ("198.18.0.0/24",)
    assert cfg.masquerade_all is True
    assert cfg.masquerade_bit == 15 and cfg.masquerade_mark == "0x008000"
    assert (cfg.sync_period, cfg.min_sync_period) == (20.0, 2.0)
    assert cfg.health_timeout == 40.0
    assert cfg.kubeconfig == "/etc/kubeconfig"
    # flags given explicitly win over the file
    cfg2 = build_config(load_config_file(f), {"sync_period": 5.0, "mode": "nftables"})
    assert (cfg2.sync_period, cfg2.mode) == (5.0, "nftables")
    assert to_kube_proxy_configuration(cfg)["iptables"]["masqueradeBit"] == 15


@pytest.mark.parametrize(
    "text",
    [
        "kind: Pod\napiVersion: v1\n",
        "- a\n- b\n",
        "apiVersion: v1\nkind: KubeProxyConfiguration\n",
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nclusterCIDR: nonsense\n",
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\niptables: {syncPeriod: 1y}\n",
        ": : :\n",
    ],
)
def test_bad_config_files(tmp_path: Path, text: str) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError):
        build_config(load_config_file(f), {})


def test_validation() -> None:
    with pytest.raises(ConfigError):
        ProxyConfig(detect_local_mode="Nope").validate()
    with pytest.raises(ConfigError):
        ProxyConfig(masquerade_bit=40).validate()
    with pytest.raises(ConfigError):
        build_config({}, {"cluster_cidrs": ["198.18.0.0/16", "198.19.0.0/16"]})
    with pytest.raises(ConfigError):
        build_config({}, {"no_such_field": 1})
    assert ProxyConfig(hostname_override="Node-1 ").node_name == "node-1"
