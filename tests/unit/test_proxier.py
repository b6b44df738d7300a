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
    vip = f"198.19.0.{10 + ord(name[0]) % 200}"  # one ClusterIP per service (a shared one is an address conflict)
    return ServicePort(spn, family, vip, 80, cluster_endpoints=endpoints, has_any_endpoints=eps > 0)


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


def test_a_backend_that_cannot_load_is_unavailable_with_its_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    """bcc raises OSError (not ImportError) when libbcc is missing: that mode is unavailable, nothing else breaks."""
    import importlib.metadata

    from kproxy import proxier

    class Broken(importlib.metadata.EntryPoint):
        def load(self) -> object:
            raise OSError("libbcc.so.0: cannot open shared object file")

    real = proxier._entry_points()
    broken = Broken("bpf", "kproxy.backends.bpf.proxier:BpfProxier", proxier.ENTRY_POINT_GROUP)
    monkeypatch.setattr(proxier, "_entry_points", lambda: {**real, "bpf": broken})
    avail = availability("bpf")
    assert not avail and "OSError" in avail.reason and "libbcc" in avail.reason
    assert "bpf" not in proxier.installed_backends() and "iptables" in proxier.installed_backends()
    from kproxy.cli import build_parser

    assert build_parser().parse_args(["run", "--mode", "iptables"]).func is not None  # the CLI still builds


def test_options_are_typed_flags_and_assignments() -> None:
    from kproxy.proxier import Option, option_arguments, parse_option_assignments

    class WithOptions(FakeProxier):
        options = (Option("fake_depth", int, 3, "how deep"), Option("fake_on", bool, False, "on or off"))

    assert parse_option_assignments(WithOptions, ["fake_depth=7", "fake-on=yes"]) == {"fake_depth": 7, "fake_on": True}
    with pytest.raises(ValueError, match="--fake-depth: 'x' is not a int"):
        parse_option_assignments(WithOptions, ["fake_depth=x"])
    with pytest.raises(ValueError, match="has no such option"):
        parse_option_assignments(WithOptions, ["nope=1"])
    assert option_arguments(WithOptions, {"fake_depth": 7, "fake_on": True}) == [
        "--fake-depth",
        "7",
        "--fake-on",
        "true",
    ]
    assert WithOptions.option_values({"fake_on": True}) == {"fake_depth": 3, "fake_on": True}


def test_cleanup_other_modes_runs_every_other_installed_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    from kproxy import proxier

    calls: list[tuple[str, str | None]] = []

    class Other(FakeProxier):
        mode = "userspace"

        @classmethod
        def cleanup_leftovers(cls, config: ProxyConfig, *, netns: str | None = None) -> None:
            calls.append((config.mode, netns))

    class Failing(Other):
        mode = "bpf"

        @classmethod
        def cleanup_leftovers(cls, config: ProxyConfig, *, netns: str | None = None) -> None:
            raise RuntimeError("pins busy")

    monkeypatch.setattr(
        proxier, "installed_backends", lambda: {"userspace": Other, "bpf": Failing, "fake": FakeProxier}
    )
    monkeypatch.setattr(proxier, "availability", lambda mode: proxier.Availability(True))
    out = proxier.cleanup_other_modes(ProxyConfig(mode="fake"), netns="kpx-test")
    assert out == {"userspace": None, "bpf": "RuntimeError: pins busy"} and calls == [("userspace", "kpx-test")]
