"""The contract: the mode table, backend lookup and its errors, and the FakeProxier core tests rely on."""

from __future__ import annotations

from types import MappingProxyType

import pytest

from kproxy.config import ProxyConfig
from kproxy.fake import FakeProxier
from kproxy.model import (
    Changes,
    Endpoint,
    IPFamily,
    NodeInfo,
    Protocol,
    ProxyState,
    ServicePort,
    ServicePortName,
    Verdict,
)
from kproxy.proxier import MODE_NAMES, BackendError, Proxier, availability, backend_class


def test_mode_table_order() -> None:
    assert MODE_NAMES == ("userspace", "iptables", "nftables", "bpf")


def test_unknown_mode_is_explained() -> None:
    with pytest.raises(BackendError, match="unknown mode 'ipvs'"):
        backend_class("ipvs")
    assert not availability("ipvs")
    assert "unknown mode" in availability("ipvs").reason


def test_iptables_is_installed() -> None:
    cls = backend_class("iptables")
    assert issubclass(cls, Proxier) and cls.mode == "iptables"


def test_missing_methods_name_themselves() -> None:
    class Half(Proxier):
        mode = "half"

    p = Half(ProxyConfig())
    with pytest.raises(NotImplementedError, match="'sync"):
        p.sync(ProxyState({}, NodeInfo("n")), Changes(full=True))
    with pytest.raises(NotImplementedError, match="'cleanup"):
        p.cleanup()
    with pytest.raises(NotImplementedError, match="available"):
        Half.available()


def _sp(name: str, eps: int, family: IPFamily = IPFamily.V4) -> ServicePort:
    spn = ServicePortName("ns", name, "http", Protocol.TCP)
    endpoints = tuple(Endpoint(f"198.18.65.{10 + i}", 8080) for i in range(eps))
    return ServicePort(spn, family, "198.19.0.10", 80, cluster_endpoints=endpoints, has_any_endpoints=eps > 0)


def _state(*sps: ServicePort) -> ProxyState:
    fams: dict[IPFamily, dict[ServicePortName, ServicePort]] = {IPFamily.V4: {}, IPFamily.V6: {}}
    for sp in sps:
        fams[sp.family][sp.name] = sp
    return ProxyState({f: MappingProxyType(m) for f, m in fams.items()}, NodeInfo("node-1"))


def test_fake_records_full_and_partial() -> None:
    fake = FakeProxier()
    a, b = _sp("a", 2), _sp("b", 0)
    res = fake.sync(_state(a, b), Changes(full=True))
    assert res.ok and len(fake.programmed) == 2
    assert b.internal_verdict is Verdict.REJECT and a.internal_verdict is Verdict.FORWARD
    a2 = _sp("a", 3)
    fake.sync(_state(a2), Changes(full=False, services=frozenset({a.name, b.name})))
    assert list(fake.programmed.values()) == [a2]
    desc = fake.describe()
    assert desc["services"]["ns/a:http/TCP"]["IPv4"]["internalEndpoints"] == [
        f"198.18.65.{i}:8080" for i in (10, 11, 12)
    ]


def test_fake_failures_and_rejections() -> None:
    fake = FakeProxier()
    fake.fail_next = 1
    res = fake.sync(_state(_sp("a", 1)), Changes(full=True))
    assert not res.ok and res.error
    fake.reject[_sp("a", 1).name] = "kernel says no"
    res = fake.sync(_state(_sp("a", 1), _sp("b", 1)), Changes(full=True))
    assert res.ok and dict(res.failed) == {_sp("a", 1).name: "kernel says no"}
    assert [k[1].name for k in fake.programmed] == ["b"]
