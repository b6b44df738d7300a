"""One frozen configuration object, built from a KubeProxyConfiguration YAML file and command-line flags.

Flag names and YAML field names are upstream kube-proxy's where they exist, so a DaemonSet written for
kube-proxy carries over. Precedence: defaults < ``--config`` file < flags given explicitly on the command line.
Backend-specific options (``--nftables-...``, ``--bpf-...``) are declared by the backends themselves and land in
``ProxyConfig.backend_options`` untouched.
"""

from __future__ import annotations

import ipaddress
import math
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

import yaml

from kproxy.model import IPFamily

DEFAULT_HEALTHZ = "0.0.0.0:10256"
DEFAULT_METRICS = "127.0.0.1:10249"
FULL_SYNC_PERIOD = 3600.0  # upstream proxyutil.FullSyncPeriod: the runner's max interval
DETECT_LOCAL_MODES = ("ClusterCIDR", "NodeCIDR", "BridgeInterface", "InterfaceNamePrefix")


# an interface name as the kernel allows it (IFNAMSIZ 16 with the NUL), in the characters rules can carry unquoted
_IFNAME = re.compile(r"[A-Za-z0-9_.@-]{1,15}")


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field."""


_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|h|m|s)")
_SECONDS = re.compile(r"-?\d+(?:\.\d+)?")
_UNIT = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
# Go's longest time.Duration (2^63 - 1 ns, about 292 years): upstream cannot even parse a longer one.
MAX_DURATION = (2**63 - 1) / 1e9
_MAX_TEXT = "2562047h47m16s"  # MAX_DURATION, as Go prints it (less the fraction)


def parse_duration(value: str | int | float, what: str = "duration") -> float:
    """Parse a Go duration (``1h0m0s``, ``30s``, ``500ms``, ``-1s``) or a number of seconds into seconds.

    ConfigError, naming `what`, for anything else: ``nan``, ``inf``, ``1e999``, a bool, or more than Go's longest
    duration (a non-finite period made the runner spin). The sign is kept: whether a negative duration is allowed is
    the field's business (``ProxyConfig.validate``)."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ConfigError(f"{_field(what)}{value!r} is not a duration")
    if isinstance(value, str):
        total = _parse_duration_text(value.strip(), what)
    else:
        total = float(value)
    return _finite_duration(total, what, value)


def _parse_duration_text(text: str, what: str) -> float:
    if _SECONDS.fullmatch(text):
        return float(text)
    body = text[1:] if text[:1] in "+-" else text
    pos, total = 0, 0.0
    for m in _DURATION.finditer(body):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _UNIT[m.group(2)]
        pos = m.end()
    if pos != len(body) or not body:
        raise ConfigError(f"{_field(what)}invalid duration {text[:60]!r} (want e.g. 30s, 1m30s, 500ms)")
    return -total if text.startswith("-") else total


def _finite_duration(seconds: float, what: str, given: object) -> float:
    if not math.isfinite(seconds) or abs(seconds) > MAX_DURATION:
        raise ConfigError(f"{_field(what)}{str(given)[:60]!r} is out of range (at most {_MAX_TEXT})")
    return seconds


def _field(what: str) -> str:
    return f"{what}: " if what else ""


def parse_hostport(value: str, what: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[V6]:PORT`` into a (host, port) pair; an empty host means all addresses."""
    text = value.strip()
    if text.startswith("["):
        host, _, port = text[1:].partition("]:")
    else:
        host, _, port = text.rpartition(":")
    try:
        num = int(port)
    except ValueError:
        raise ConfigError(f"{what}: {value!r} is not HOST:PORT") from None
    if not 0 <= num <= 65535:
        raise ConfigError(f"{what}: port {num} out of range")
    if host:
        try:
            ipaddress.ip_address(host)
        except ValueError:
            raise ConfigError(f"{what}: {host!r} is not an IP address") from None
    return host, num


def _cidrs(values: list[str] | tuple[str, ...], what: str, keywords: tuple[str, ...] = ()) -> tuple[str, ...]:
    out = []
    for raw in values:
        for item in str(raw).split(","):
            item = item.strip()
            if not item:
                continue
            if item in keywords:
                out.append(item)
                continue
            try:
                out.append(str(ipaddress.ip_network(item, strict=False)))
            except ValueError:
                raise ConfigError(f"{what}: {item!r} is not a CIDR") from None
    return tuple(out)


#: entries (addresses + endpoints, summed over its ports) one Service may expand to: a Service with 10 ports of 10,000
#: endpoints fits; one that lists 1,000 externalIPs on 100 ports (17 KB of YAML, 100,100 iptables rules) does not
DEFAULT_MAX_SERVICE_ENTRIES = 100_000
MAX_SERVICE_ENTRIES_LIMIT = 10_000_000


@dataclass(frozen=True, slots=True)
class ProxyConfig:
    """Everything kproxy's core and backends are told at start-up."""

    mode: str = ""  # empty: the mode table's default (kproxy.proxier.DEFAULT_MODE), resolved by the CLI
    hostname_override: str = ""
    cluster_cidrs: tuple[str, ...] = ()
    detect_local_mode: str = "ClusterCIDR"
    pod_bridge_interface: str = ""  # detectLocal.bridgeInterface (BridgeInterface mode)
    pod_interface_name_prefix: str = ""  # detectLocal.interfaceNamePrefix (InterfaceNamePrefix mode)
    nodeport_addresses: tuple[str, ...] = ()  # CIDRs, or ("primary",); empty = every local address
    masquerade_all: bool = False
    #: upstream's ``iptables.localhostNodePorts`` (``--iptables-localhost-nodeports``, default true): NodePorts answer
    #: on 127.0.0.1 too, when ``--nodeport-addresses`` lets loopback in; IPv4 only (``kproxy.nodeaddr``). Every mode
    #: honours it here, not only iptables.
    localhost_nodeports: bool = True
    masquerade_bit: int = 14
    min_sync_period: float = 1.0
    sync_period: float = 30.0
    full_sync_period: float = FULL_SYNC_PERIOD
    healthz_bind_address: str = DEFAULT_HEALTHZ
    metrics_bind_address: str = DEFAULT_METRICS
    kubeconfig: str = ""
    master: str = ""
    manifests: str = ""  # a folder of YAML manifests: the files source instead of an API server
    service_proxy_name: str = ""  # services labelled service-proxy-name=<this> are ours; empty: none are
    ip_families: tuple[IPFamily, ...] = (IPFamily.V4, IPFamily.V6)
    backend_options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    #: a Service whose ports expand to more entries (the sum over its ports of addresses + endpoints) is refused
    #: whole: one small object must not expand without bound (kproxy.cache)
    max_service_entries: int = DEFAULT_MAX_SERVICE_ENTRIES
    #: per-service traffic counters (kproxy.counters): off by default, so the default data path is unchanged
    service_counters: bool = False

    @property
    def node_name(self) -> str:
        """Upstream: ``--hostname-override`` lower-cased, else the host name; must equal the Node's name."""
        return (self.hostname_override or socket.gethostname()).strip().lower()

    @property
    def masquerade_mark(self) -> str:
        """The packet mark for masquerading, formatted as upstream formats it (``0x004000`` for bit 14)."""
        return f"{1 << self.masquerade_bit:#08x}"

    @property
    def health_timeout(self) -> float:
        """Upstream: healthz fails when an update stays queued longer than twice the sync period."""
        return 2 * self.sync_period

    def cluster_cidrs_for(self, family: IPFamily) -> tuple[str, ...]:
        return tuple(c for c in self.cluster_cidrs if IPFamily.of(c) == family)

    def validate(self) -> ProxyConfig:
        if self.detect_local_mode not in DETECT_LOCAL_MODES:
            raise ConfigError(f"detectLocalMode: {self.detect_local_mode!r} not one of {DETECT_LOCAL_MODES}")
        if self.detect_local_mode == "BridgeInterface" and not _IFNAME.fullmatch(self.pod_bridge_interface):
            raise ConfigError("detectLocalMode BridgeInterface needs --pod-bridge-interface (an interface name)")
        if self.detect_local_mode == "InterfaceNamePrefix" and not _IFNAME.fullmatch(self.pod_interface_name_prefix):
            raise ConfigError("detectLocalMode InterfaceNamePrefix needs --pod-interface-name-prefix (a name prefix)")
        if not 0 <= self.masquerade_bit <= 31:
            raise ConfigError(f"masqueradeBit: {self.masquerade_bit} not in 0..31")
        self._validate_periods()
        if isinstance(self.max_service_entries, bool) or not isinstance(self.max_service_entries, int):
            raise ConfigError(f"maxServiceEntries (--max-service-entries): {self.max_service_entries!r} is no number")
        if not 1 <= self.max_service_entries <= MAX_SERVICE_ENTRIES_LIMIT:
            raise ConfigError(
                f"maxServiceEntries (--max-service-entries): {self.max_service_entries}, must be between 1 and "
                f"{MAX_SERVICE_ENTRIES_LIMIT}"
            )
        if not isinstance(self.localhost_nodeports, bool):
            raise ConfigError(
                f"iptables.localhostNodePorts (--iptables-localhost-nodeports): {self.localhost_nodeports!r} is not "
                "true or false"
            )
        if not isinstance(self.service_counters, bool):
            raise ConfigError(f"serviceCounters (--service-counters): {self.service_counters!r} is not true or false")
        parse_hostport(self.healthz_bind_address, "healthzBindAddress")
        parse_hostport(self.metrics_bind_address, "metricsBindAddress")
        if len(self.cluster_cidrs) > 2 or len({IPFamily.of(c) for c in self.cluster_cidrs}) < len(self.cluster_cidrs):
            raise ConfigError("clusterCIDR: at most one CIDR per IP family")
        return self

    def _validate_periods(self) -> None:
        """Upstream's checks (KubeProxyConfiguration validation), plus finite and within Go's duration range."""
        for name, value in (
            ("syncPeriod (--sync-period)", self.sync_period),
            ("minSyncPeriod (--min-sync-period)", self.min_sync_period),
            ("the full sync period", self.full_sync_period),
        ):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"{name}: {value!r} is not a number of seconds")
            _finite_duration(value, name, value)
        if self.sync_period <= 0:
            raise ConfigError(f"syncPeriod (--sync-period): {self.sync_period:g}s, must be greater than 0")
        if self.min_sync_period < 0:
            raise ConfigError(
                f"minSyncPeriod (--min-sync-period): {self.min_sync_period:g}s, must be greater than or equal to 0"
            )
        if self.min_sync_period > self.sync_period:
            raise ConfigError(
                f"syncPeriod (--sync-period): {self.sync_period:g}s, must be greater than or equal to minSyncPeriod"
                f" (--min-sync-period, {self.min_sync_period:g}s)"
            )
        if self.full_sync_period < self.min_sync_period:
            raise ConfigError("the full sync period must not be shorter than minSyncPeriod")

    def with_(self, **changes: Any) -> ProxyConfig:
        return replace(self, **changes).validate()


# KubeProxyConfiguration (kubeproxy.config.k8s.io/v1alpha1) field -> ProxyConfig field and converter.
def _yaml_fields(doc: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    ipt = doc.get("iptables") or {}
    simple = {
        "mode": ("mode", str),
        "hostnameOverride": ("hostname_override", str),
        "detectLocalMode": ("detect_local_mode", str),
        "healthzBindAddress": ("healthz_bind_address", str),
        "metricsBindAddress": ("metrics_bind_address", str),
    }
    for key, (name, conv) in simple.items():
        if doc.get(key) not in (None, ""):
            out[name] = conv(doc[key])
    detect = doc.get("detectLocal") or {}
    if detect.get("bridgeInterface"):
        out["pod_bridge_interface"] = str(detect["bridgeInterface"])
    if detect.get("interfaceNamePrefix"):
        out["pod_interface_name_prefix"] = str(detect["interfaceNamePrefix"])
    if doc.get("clusterCIDR"):
        out["cluster_cidrs"] = _cidrs([doc["clusterCIDR"]], "clusterCIDR")
    if doc.get("nodePortAddresses"):
        out["nodeport_addresses"] = _cidrs(list(doc["nodePortAddresses"]), "nodePortAddresses", ("primary",))
    masq_all = doc.get("iptables", {}).get("masqueradeAll") if ipt else None
    if masq_all is not None:
        out["masquerade_all"] = bool(masq_all)
    if ipt.get("localhostNodePorts") is not None:
        out["localhost_nodeports"] = ipt["localhostNodePorts"]  # a bool, or validate() says what it is
    if ipt.get("masqueradeBit") is not None:
        out["masquerade_bit"] = int(ipt["masqueradeBit"])
    for src, prefix in (
        (ipt, "iptables."),
        (doc, ""),
    ):  # newer configs have top-level syncPeriod/minSyncPeriod; they win
        if src.get("syncPeriod") is not None:
            out["sync_period"] = parse_duration(src["syncPeriod"], f"{prefix}syncPeriod")
        if src.get("minSyncPeriod") is not None:
            out["min_sync_period"] = parse_duration(src["minSyncPeriod"], f"{prefix}minSyncPeriod")
    if doc.get("maxServiceEntries") is not None:  # kproxy's own field
        out["max_service_entries"] = int(doc["maxServiceEntries"])
    if doc.get("serviceCounters") is not None:  # kproxy's own field
        out["service_counters"] = doc["serviceCounters"]  # a bool, or validate() says what it is
    if doc.get("portRange") not in (None, ""):  # upstream's field for the userspace mode's proxy ports
        out.setdefault("backend_options", {})["proxy_port_range"] = str(doc["portRange"])
    kubeconfig = (doc.get("clientConnection") or {}).get("kubeconfig")
    if kubeconfig:
        out["kubeconfig"] = str(kubeconfig)
    return out


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a KubeProxyConfiguration YAML file into ProxyConfig field values; ConfigError on anything odd."""
    try:
        doc = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"--config {path}: {exc}") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"--config {path}: not a mapping")
    kind = doc.get("kind")
    if kind != "KubeProxyConfiguration":
        raise ConfigError(f"--config {path}: kind is {kind!r}, expected KubeProxyConfiguration")
    api = str(doc.get("apiVersion", ""))
    if not api.startswith("kubeproxy.config.k8s.io/"):
        raise ConfigError(f"--config {path}: apiVersion {api!r} is not kubeproxy.config.k8s.io/*")
    try:
        return _yaml_fields(doc)
    except (TypeError, ValueError, AttributeError) as exc:
        raise ConfigError(f"--config {path}: {exc}") from None


def build_config(file_values: Mapping[str, Any], flag_values: Mapping[str, Any]) -> ProxyConfig:
    """Merge defaults, file values and explicitly given flags (flags win), and validate."""
    names = {f.name for f in fields(ProxyConfig)}
    merged: dict[str, Any] = {}
    for src in (file_values, flag_values):
        for key, value in src.items():
            if key not in names:
                raise ConfigError(f"unknown configuration field {key!r}")
            if key == "backend_options":  # a mode's flags win over the file's values one by one
                value = {**merged.get(key, {}), **value}
            merged[key] = value
    if "cluster_cidrs" in merged:
        merged["cluster_cidrs"] = _cidrs(list(merged["cluster_cidrs"]), "--cluster-cidr")
    if "nodeport_addresses" in merged:
        merged["nodeport_addresses"] = _cidrs(list(merged["nodeport_addresses"]), "--nodeport-addresses", ("primary",))
    if "backend_options" in merged:
        merged["backend_options"] = MappingProxyType(dict(merged["backend_options"]))
    return ProxyConfig(**merged).validate()


def to_kube_proxy_configuration(cfg: ProxyConfig) -> dict[str, Any]:
    """The effective configuration in KubeProxyConfiguration shape, for ``/configz``."""
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "mode": cfg.mode,
        "hostnameOverride": cfg.hostname_override,
        "clusterCIDR": ",".join(cfg.cluster_cidrs),
        "detectLocalMode": cfg.detect_local_mode,
        "detectLocal": {
            "bridgeInterface": cfg.pod_bridge_interface,
            "interfaceNamePrefix": cfg.pod_interface_name_prefix,
        },
        "nodePortAddresses": list(cfg.nodeport_addresses),
        "healthzBindAddress": cfg.healthz_bind_address,
        "metricsBindAddress": cfg.metrics_bind_address,
        "syncPeriod": f"{cfg.sync_period:g}s",
        "minSyncPeriod": f"{cfg.min_sync_period:g}s",
        "iptables": {
            "masqueradeAll": cfg.masquerade_all,
            "masqueradeBit": cfg.masquerade_bit,
            "localhostNodePorts": cfg.localhost_nodeports,
        },
        "clientConnection": {"kubeconfig": cfg.kubeconfig},
        "serviceCounters": cfg.service_counters,  # kproxy's own field
        "backendOptions": {k: v for k, v in cfg.backend_options.items() if isinstance(v, (str, int, float, bool))},
    }
