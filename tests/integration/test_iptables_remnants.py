"""The iptables mode read back from the kernel (``backends/iptables/cleanup.py``), and the start-up removal of other
modes' leftovers (``kproxy.proxier.cleanup_other_modes``) over real KUBE- chains with a stub second backend.

Each test makes a namespace ``kpj-ins-<random>`` (removed in the finalizer, also on failure); both iptables
flavours run. Needs root.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest

import kproxy.proxier as proxier_mod
from kproxy.backends.iptables import cleanup
from kproxy.backends.iptables.proxier import IptablesProxier
from kproxy.config import ProxyConfig
from kproxy.model import Changes, Endpoint, IPFamily, ServicePort
from kproxy.proxier import Availability, LocalProbe, Proxier, cleanup_other_modes

from .scratch import scratch_netns
from .test_iptables_backend import SP_A, SP_LOCAL, kubelets_chains, ns_run, proxier, state

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces, iptables)"),
    pytest.mark.skipif(shutil.which("iptables-nft-restore") is None, reason="iptables not installed"),
]

A_KEY = "ns1/a:http/TCP"


@pytest.fixture
def netns() -> Iterator[str]:
    with scratch_netns("kpj-ins-", lo_up=True) as name:
        yield name


def connect_through(netns: str, ip: str, port: int) -> None:
    """One SYN from the namespace to ip:port through nat OUTPUT (a default route into a veth whose peer is down
    swallows it): the service's
    rules count one packet."""
    code = (
        "import socket\n"
        "s = socket.socket(); s.setblocking(False)\n"
        f"s.connect_ex(({ip!r}, {port}))\n"
        "import time; time.sleep(0.05); s.close()\n"
    )
    subprocess.run(["ip", "netns", "exec", netns, "python3", "-c", code], check=True, timeout=30)


def with_route(netns: str) -> None:
    for argv in (
        ["ip", "link", "add", "d0", "type", "veth", "peer", "name", "d1"],
        ["ip", "addr", "add", "198.18.0.2/16", "dev", "d0"],
        ["ip", "link", "set", "d0", "up"],
        ["ip", "route", "add", "default", "dev", "d0"],
    ):
        ns_run(netns, *argv)


def counted(lines: list[str]) -> list[int]:
    """The packet counters in a view's lines (only the service's own chains carry them)."""
    out = []
    for ln in lines:
        rest = ln.split(": ", 1)[1]
        if rest.startswith("["):
            out.append(int(rest[1:].split(":", 1)[0]))
    return out


def test_kernel_view_groups_each_service_and_its_counters_tell_a_rewrite(netns: str, flavour: str) -> None:
    with_route(netns)
    p = proxier(netns, flavour)
    assert p.sync(state(SP_A, SP_LOCAL), Changes(full=True)).ok
    probe = LocalProbe(netns)
    view = cleanup.kernel_view(probe, IPFamily.V4)
    assert set(view) == {A_KEY, "ns1/local:http/TCP"}, sorted(view)
    a = view[A_KEY]
    # the shared chains' entries (no counters) and the service's own chains, each endpoint's included
    assert any(" -A KUBE-SERVICES " in ln and "198.19.0.1/32" in ln and "[" not in ln.split(": ", 1)[1][:1] for ln in a)
    assert any(" -A KUBE-NODEPORTS " in ln and "--dport 30080" in ln for ln in a)
    assert sum("DNAT --to-destination 198.18.1.1:80" in ln for ln in a) == 1
    assert sum("DNAT --to-destination 198.18.1.2:80" in ln for ln in a) == 1
    assert all(ln.startswith(f"{flavour} ") for ln in a)
    assert not any("198.19.0.5" in ln for ln in a) and not any("ns1/a:" in ln for ln in view["ns1/local:http/TCP"])
    assert any(":KUBE-SVL-" in ln for ln in view["ns1/local:http/TCP"])
    assert set(counted(a)) == {0}
    for _ in range(3):
        connect_through(netns, "198.19.0.1", 80)
    busy = cleanup.kernel_view(probe, IPFamily.V4)[A_KEY]
    assert sum(counted(busy)) >= 3
    # a sync of another service leaves A's rules and counters alone ...
    moved = ServicePort(
        SP_LOCAL.name, IPFamily.V4, "198.19.0.5", 80, node_port=30085, external_policy_local=True,
        cluster_endpoints=(Endpoint("198.18.1.6", 80, is_local=True),),
        local_endpoints=(Endpoint("198.18.1.6", 80, is_local=True),), has_any_endpoints=True,
    )  # fmt: skip
    assert p.sync(state(SP_A, moved), Changes(full=False, services=frozenset({SP_LOCAL.name}))).ok
    assert cleanup.kernel_view(probe, IPFamily.V4)[A_KEY] == busy
    # ... and writing A's KUBE-SVC- chain again, rule for rule, resets its counters: what dual-stack looks for
    restore = ["ip", "netns", "exec", netns, f"iptables-{flavour}-restore", "--noflush"]
    subprocess.run(restore, input=_rewrite_payload(busy), text=True, check=True, timeout=30)
    rewritten = cleanup.kernel_view(probe, IPFamily.V4)[A_KEY]
    assert [ln.split("] ", 1)[-1] for ln in rewritten] == [ln.split("] ", 1)[-1] for ln in busy]
    assert sum(counted(rewritten)) < sum(counted(busy))


def _rewrite_payload(view_lines: list[str]) -> str:
    """An iptables-restore payload that writes the service's KUBE-SVC- chain again, rule for rule."""
    chain_lines = [ln.split(": ", 1)[1] for ln in view_lines if " -A KUBE-SVC-" in ln]
    rules = [ln.split("] ", 1)[1] if ln.startswith("[") else ln for ln in chain_lines]
    chain = rules[0].split()[1]
    return "*nat\n" + f":{chain} - [0:0]\n" + "".join(r + "\n" for r in rules) + "COMMIT\n"


def test_remnants_see_every_kube_line_but_kubelets(netns: str, flavour: str) -> None:
    kubelets_chains(netns, flavour)
    probe = LocalProbe(netns)
    assert cleanup.remnants(probe) == []  # kubelet's chains alone are nobody's leftovers
    ipt = f"iptables-{flavour}"
    ns_run(netns, ipt, "-t", "nat", "-N", "KUBE-SOMETHING-NEW")  # a chain cleanup does not know by name
    ns_run(netns, f"ip6tables-{flavour}", "-t", "filter", "-N", "KUBE-OTHER")
    left = cleanup.remnants(probe)
    assert any(
        ln.endswith(":KUBE-SOMETHING-NEW - [0:0]") and ln.startswith(f"iptables-{flavour}-save: ") for ln in left
    )
    assert any(ln.startswith(f"ip6tables-{flavour}-save: ") and "KUBE-OTHER" in ln for ln in left)


# ---------------------------------------------------------------------------------------- start-up, other modes


class StubMode(Proxier):
    """A second installed mode with no kernel of its own: records its cleanups; can be made to fail."""

    mode: ClassVar[str] = "userspace"
    cleanups: ClassVar[list[tuple[str, str | None]]] = []
    fail: ClassVar[bool] = False

    @classmethod
    def available(cls) -> Availability:
        return Availability(True)

    @classmethod
    def cleanup_leftovers(cls, config: ProxyConfig, *, netns: str | None = None) -> None:
        cls.cleanups.append((config.mode, netns))
        if cls.fail:
            raise RuntimeError("stub cleanup failed")

    @classmethod
    def remnants(cls, probe: Any) -> list[str]:
        return []


@pytest.fixture
def two_modes(monkeypatch: pytest.MonkeyPatch) -> type[StubMode]:
    """iptables and the stub installed and available (nothing else), as cleanup_other_modes looks them up."""
    StubMode.cleanups = []
    StubMode.fail = False
    modes: dict[str, type[Proxier]] = {"iptables": IptablesProxier, "userspace": StubMode}
    monkeypatch.setattr(proxier_mod, "installed_backends", lambda: dict(modes))
    monkeypatch.setattr(proxier_mod, "availability", lambda mode: Availability(mode in modes))
    return StubMode


def test_starting_another_mode_removes_iptables_leftovers(netns: str, flavour: str, two_modes: type[StubMode]) -> None:
    kubelets_chains(netns, flavour)
    p = proxier(netns, flavour)
    assert p.sync(state(SP_A, SP_LOCAL), Changes(full=True)).ok
    probe = LocalProbe(netns)
    assert any(":KUBE-SVL-" in ln for ln in cleanup.remnants(probe))
    config = ProxyConfig(mode="userspace", backend_options={"iptables_flavour": flavour})
    assert cleanup_other_modes(config, netns=netns) == {"iptables": None}
    assert cleanup.remnants(probe) == []
    assert two_modes.cleanups == []  # the mode that starts keeps what is its own
    assert ":KUBE-KUBELET-CANARY" in ns_run(netns, f"iptables-{flavour}-save", "-t", "nat")


def test_starting_iptables_removes_the_other_mode_and_keeps_its_own(
    netns: str, flavour: str, two_modes: type[StubMode]
) -> None:
    p = proxier(netns, flavour)
    assert p.sync(state(SP_A), Changes(full=True)).ok
    probe = LocalProbe(netns)
    before = cleanup.remnants(probe)
    assert cleanup_other_modes(ProxyConfig(mode="iptables"), netns=netns) == {"userspace": None}
    assert two_modes.cleanups == [("userspace", netns)]
    assert cleanup.remnants(probe) == before
    # one mode's cleanup failing is reported and stops nobody
    two_modes.fail = True
    out = cleanup_other_modes(ProxyConfig(mode="nftables"), netns=netns)
    assert out == {"iptables": None, "userspace": "RuntimeError: stub cleanup failed"}
    assert cleanup.remnants(probe) == []


def test_a_failing_save_is_an_error_not_nothing_left() -> None:
    class Broken:
        options: dict[str, Any] = {}

        def run(self, argv: Any, *, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
            return subprocess.CompletedProcess(list(argv), 4, "", "iptables-save: lock held")

    with pytest.raises(proxier_mod.BackendError, match="lock held"):
        cleanup.remnants(Broken())
    with pytest.raises(proxier_mod.BackendError, match="lock held"):
        cleanup.kernel_view(Broken(), IPFamily.V4)
