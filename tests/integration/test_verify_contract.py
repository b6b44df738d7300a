"""``verify``'s contract, once for every mode: the kernel read back and diffed against what the state wants, never
kproxy's memory. Real kernel state in a namespace of the test's own (for bpf also a cgroup and a pin folder); each mode
through the same steps with mode-neutral damage only:

- after a full sync, verify is clean (no drift, no error);
- the mode's own ``cleanup_leftovers`` run by someone else (another process, an operator): every service is drift,
  and a full sync puts everything back;
- a service the kernel holds that the state no longer wants is reported as extra, not as a service's drift;
- a service without endpoints (reject) is no drift.

What each mode can damage in its own way (a rule, an element, a socket, a program) stays in its own
``test_verify_<mode>.py``."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest
from modes import all_modes, require_mode

from kproxy.config import ProxyConfig
from kproxy.model import Changes, Endpoint, IPFamily, NodeInfo, Protocol, ProxyState, ServicePort, ServicePortName
from kproxy.proxier import Proxier, backend_class

from .bpfplace import bpf_place
from .scratch import scratch_netns

pytestmark = pytest.mark.root

CG_MOUNT = Path("/run/kproxy-bpf-test/cgroup2")
POD = "198.18.221.1"
NODE = NodeInfo("node-a", addresses=(POD,), pod_cidrs=("198.18.221.0/24",))
A = ServicePortName("ns1", "a", "http", Protocol.TCP)
B = ServicePortName("ns1", "b", "http", Protocol.TCP)
C = ServicePortName("ns1", "c", "dns", Protocol.UDP)
KA, KB, KC = "ns1/a:http/TCP", "ns1/b:http/TCP", "ns1/c:dns/UDP"


def _ep(ip: str) -> Endpoint:
    return Endpoint(ip, 8080, node_name="node-a", is_local=True)


SP_A = ServicePort(
    A, IPFamily.V4, "198.19.2.1", 80, cluster_endpoints=(_ep(POD), _ep("198.18.221.2")),
    local_endpoints=(_ep(POD), _ep("198.18.221.2")), has_any_endpoints=True,
)  # fmt: skip
SP_B = ServicePort(
    B, IPFamily.V4, "198.19.2.2", 80, node_port=30081, cluster_endpoints=(_ep(POD),), local_endpoints=(_ep(POD),),
    has_any_endpoints=True,
)  # fmt: skip
SP_C = ServicePort(C, IPFamily.V4, "198.19.2.3", 53)  # no endpoints: reject


def state(*sps: ServicePort, generation: int = 1) -> ProxyState:
    return ProxyState({IPFamily.V4: MappingProxyType({s.name: s for s in sps})}, NODE, generation=generation)


@pytest.fixture(params=all_modes())
def made(request: pytest.FixtureRequest) -> Iterator[tuple[Proxier, ProxyConfig, str]]:
    """(a started proxier of the mode, its config, its namespace); all of it removed afterwards."""
    mode: str = request.param
    require_mode(mode)
    with ExitStack() as stack:
        options: dict[str, Any] = {}
        if mode == "bpf":
            ns, options = stack.enter_context(bpf_place("kpv-", CG_MOUNT, (POD,)))
        else:
            ns = stack.enter_context(scratch_netns("kpv-", lo_up=True))
        config = ProxyConfig(
            mode=mode,
            hostname_override="node-a",
            cluster_cidrs=("198.18.0.0/16",),
            ip_families=(IPFamily.V4,),
            backend_options=MappingProxyType(options),
        )
        cls = backend_class(mode)
        p = cls(config, netns=ns)
        stack.callback(cls.cleanup_leftovers, config, netns=ns)
        stack.callback(p.close)
        p.start()
        yield p, config, ns


def _drifted(report: dict[str, Any]) -> set[str]:
    assert not report["errors"], report
    return set(report["services"])


def _clean(report: dict[str, Any]) -> None:
    assert report["drift"] == 0 and not report["services"] and not report["extra"] and not report["errors"], report


def test_a_full_sync_verifies_clean_and_someone_elses_cleanup_is_drift_until_a_full_sync(
    made: tuple[Proxier, ProxyConfig, str],
) -> None:
    p, config, ns = made
    st = state(SP_A, SP_B, SP_C)
    assert p.sync(st, Changes(full=True)).ok
    _clean(p.verify(st))
    type(p).cleanup_leftovers(config, netns=ns)  # what another process (or an operator) removes
    report = p.verify(st)
    assert report["drift"] >= 2 and {KA, KB} <= _drifted(report) | {x.split(":")[0] for x in report["errors"]}, report
    assert p.sync(st, Changes(full=True)).ok
    _clean(p.verify(st))


def test_what_the_state_no_longer_wants_is_extra_not_a_service_drift(made: tuple[Proxier, ProxyConfig, str]) -> None:
    p, _, _ = made
    assert p.sync(state(SP_A, SP_B), Changes(full=True)).ok
    report = p.verify(state(SP_A, generation=2))  # b is gone from the state; the kernel still holds it
    assert not report["services"] and not report["errors"], report
    assert report["extra"] and report["drift"] == len(report["extra"]), report
    assert p.sync(state(SP_A, generation=2), Changes(full=False, services=frozenset({B}))).ok
    _clean(p.verify(state(SP_A, generation=2)))


def test_a_service_without_endpoints_is_no_drift(made: tuple[Proxier, ProxyConfig, str]) -> None:
    p, _, _ = made
    st = state(SP_A, SP_C)
    assert p.sync(st, Changes(full=True)).ok
    _clean(p.verify(st))
