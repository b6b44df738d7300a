"""A restarted bpf proxier reads its maps back while the ledger renders: adoption's ``bpf(2)`` reads release the GIL,
and the ledger renders every wanted service before its first comparison, so the two overlap (at 100,000 service ports
the read is a large share of a restart). Shown by order of events, not by time: the read waits for the first render
(bounded); a read done before any render, as one inside ``adopt`` is, waits in vain. The restart still writes
nothing. Its own namespace (``kpf-ov-…``), cgroup and pin folder (``bpfplace``); no programs are attached."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest

from kproxy.config import ProxyConfig
from kproxy.model import Changes, Endpoint, IPFamily, NodeInfo, Protocol, ProxyState, ServicePort, ServicePortName

from .bpfplace import bpf_place

pytestmark = pytest.mark.root

CG_MOUNT = Path("/run/kproxy-bpf-test/cgroup2")
NODE = NodeInfo("node-a", addresses=("198.18.215.1",))
WAIT_S = 20.0  # a bound: the read waits at most this long for the first render


@pytest.fixture
def place() -> Iterator[tuple[str, dict[str, str]]]:
    with bpf_place("kpf-ov-", CG_MOUNT, ("198.18.215.1",)) as got:
        yield got


def _state(n: int) -> ProxyState:
    ports = {}
    for i in range(1, n + 1):
        name = ServicePortName("ns1", f"s{i}", "p", Protocol.TCP)
        eps = tuple(Endpoint(f"198.18.{216 + i // 200}.{1 + i % 200}", 8080 + j) for j in range(3))
        ports[name] = ServicePort(
            name=name, family=IPFamily.V4, cluster_ip=f"198.19.{i // 250}.{1 + i % 250}", port=80,
            cluster_endpoints=eps, local_endpoints=(), has_any_endpoints=True,
        )  # fmt: skip
    return ProxyState({IPFamily.V4: MappingProxyType(ports)}, NODE, 1)


def test_the_restarts_read_of_the_maps_overlaps_the_render(
    place: tuple[str, dict[str, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    from kproxy.backends.bpf import kernel
    from kproxy.backends.bpf.proxier import BpfProxier

    ns, opts = place
    config = ProxyConfig(
        mode="bpf", hostname_override="node-a", ip_families=(IPFamily.V4,), backend_options=MappingProxyType(opts)
    )
    st = _state(300)
    first = BpfProxier(config, netns=ns)
    try:
        res = first.sync(st, Changes(full=True))
        assert res.ok, res.error
    finally:
        first.close()
    rendered = threading.Event()
    seen: list[bool] = []
    real_read, real_render = kernel.read_maps, BpfProxier.render

    def read(*args: Any) -> Any:
        seen.append(rendered.wait(WAIT_S))  # the render began while this read was still to come
        return real_read(*args)

    def render(self: BpfProxier, *args: Any) -> Any:
        rendered.set()
        return real_render(self, *args)

    monkeypatch.setattr(kernel, "read_maps", read)
    monkeypatch.setattr(BpfProxier, "render", render)
    second = BpfProxier(config, netns=ns)
    try:
        res = second.sync(st, Changes(full=True))
        assert res.ok, res.error
        assert seen == [True], "the maps were read before the ledger rendered anything"
        fam = res.family(IPFamily.V4)
        assert fam.written == 0 and fam.figures["map_writes"] == 0 and fam.figures["service_entries"] == 300 * 4
    finally:
        second.close()


def test_a_partial_sync_after_start_starts_no_thread_and_learns_no_map(
    place: tuple[str, dict[str, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a started proxier needs once is done at ``start``, not in the first partial sync after it: the UDP
    reaper's worker thread (a UDP service losing a backend hands its sockets to it) and the names of the maps the
    held programs read (the first check of kernel state puts back pins from them). Counted: threads started and map
    names read while the check and the partial sync run."""
    from kproxy.backends.bpf import objects
    from kproxy.backends.bpf.proxier import BpfProxier

    ns, opts = place
    config = ProxyConfig(
        mode="bpf", hostname_override="node-a", ip_families=(IPFamily.V4,), backend_options=MappingProxyType(opts)
    )
    from kproxy.backends.bpf.proxier import MAX_FRESH_REAP

    names = [ServicePortName("ns1", f"dns{i}", "p", Protocol.UDP) for i in range(MAX_FRESH_REAP + 1)]
    name = names[0]

    def state(n_eps: int, gen: int) -> ProxyState:
        """UDP services, more than a first sync looks for sockets of (so it hands the reaper nothing); the first
        with ``n_eps`` endpoints, the others with two."""
        ports = {}
        for i, spn in enumerate(names):
            eps = tuple(Endpoint(f"198.18.{216 + i // 100}.{10 + (i % 100) * 2 + j}", 53) for j in range(2))
            ports[spn] = ServicePort(
                name=spn, family=IPFamily.V4, cluster_ip=f"198.19.1.{1 + i}", port=53,
                cluster_endpoints=eps[:n_eps] if i == 0 else eps, local_endpoints=(), has_any_endpoints=True,
            )  # fmt: skip
        return ProxyState({IPFamily.V4: MappingProxyType(ports)}, NODE, gen)

    p = BpfProxier(config, netns=ns)
    try:
        p.start()
        assert p.attached
        assert p.sync(state(2, 1), Changes(full=True)).ok and p.last_reap is None  # nothing to reap yet
        started: list[str] = []
        learnt: list[int] = []
        real_start, real_name = threading.Thread.start, objects.map_name

        def start(self: threading.Thread) -> None:
            started.append(self.name)
            real_start(self)

        def map_name(fd: int) -> str:
            learnt.append(fd)
            return real_name(fd)

        monkeypatch.setattr(threading.Thread, "start", start)
        monkeypatch.setattr(objects, "map_name", map_name)
        assert not p.check_now(IPFamily.V4)  # the kernel state is all there
        res = p.sync(state(1, 2), Changes(full=False, services=frozenset({name})))
        assert res.ok and res.family(IPFamily.V4).written == 1
        assert p.last_reap is not None and p.last_reap.result(timeout=60) == 0  # handed over; no socket to end
        assert started == [] and learnt == [], (started, learnt)
    finally:
        p.close()
