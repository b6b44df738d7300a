"""A bpf restart never stalls a new connection (issue 24): a client in the node's cgroup makes TCP connections to a
ClusterIP one at a time, each with a 1 s timeout, through a whole restart of the bpf proxier: the old process stops
without touching the kernel (as SIGKILL leaves it), a new one starts (maps reopened, programs compiled and attached
or kept), adopts the maps in its first full sync, checks its kernel state, syncs again and removes other modes'
leftovers as the daemon does after its first sync. Every connection must be answered, none may take a second.

Its own namespace (``kpf-rs-…``), cgroup and pin folder (``bpfplace``). The service has a NodePort and a second
service has no endpoints, so the companion table exists (its nat hooks turn conntrack on) and is rewritten at the
restart's first sync; the backend answers on an address of the namespace, outside the cgroup."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import MappingProxyType

import pytest

from kproxy.config import ProxyConfig
from kproxy.model import Changes, Endpoint, IPFamily, NodeInfo, Protocol, ProxyState, ServicePort, ServicePortName
from kproxy.proxier import cleanup_other_modes

from .bpfplace import bpf_place, ns_script

pytestmark = pytest.mark.root

CG_MOUNT = Path("/run/kproxy-bpf-test/cgroup2")
BACKEND_IP = "198.18.214.1"
VIP = "198.19.0.40"
NODE = NodeInfo("node-a", addresses=(BACKEND_IP,))
#: how many connections the client makes after the restarted proxier's first sync (and how long it may take)
AFTER = 300
AFTER_S = 60.0
SLOW_S = 0.9  # a connection answered later than this stalled (a lost SYN is retransmitted after 1 s)

SERVER = f"""
import socket, threading
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("{BACKEND_IP}", 8080))
s.listen(512)
print("ready", flush=True)
while True:
    c, _ = s.accept()
    try:
        c.recv(100); c.sendall(b"ok")
    finally:
        c.close()
"""

#: one connection at a time, 1 s timeout, one JSON line each: (start, seconds, outcome); ends when stdin closes
CLIENT = f"""
import json, select, socket, sys, time
while not select.select([sys.stdin], [], [], 0)[0]:
    t = time.monotonic(); s = socket.socket(); s.settimeout(1.0)
    try:
        s.connect(("{VIP}", 80)); s.sendall(b"x"); r = "ok" if s.recv(10) == b"ok" else "bad reply"
    except OSError as e:
        r = type(e).__name__
    finally:
        s.close()
    print(json.dumps([t, time.monotonic() - t, r]), flush=True)
"""


@pytest.fixture
def place() -> Iterator[tuple[str, dict[str, str]]]:
    with bpf_place("kpf-rs-", CG_MOUNT, (BACKEND_IP,)) as got:
        yield got


def _config(opts: dict[str, str]) -> ProxyConfig:
    return ProxyConfig(
        mode="bpf", hostname_override="node-a", ip_families=(IPFamily.V4,), backend_options=MappingProxyType(opts)
    )


def _state() -> ProxyState:
    ep = (Endpoint(BACKEND_IP, 8080, node_name="node-a", is_local=True),)
    web = ServicePort(
        name=ServicePortName("ns1", "web", "p", Protocol.TCP),
        family=IPFamily.V4,
        cluster_ip=VIP,
        port=80,
        node_port=30040,
        cluster_endpoints=ep,
        local_endpoints=ep,
        has_any_endpoints=True,
    )
    empty = ServicePort(
        name=ServicePortName("ns1", "empty", "p", Protocol.TCP), family=IPFamily.V4, cluster_ip="198.19.0.41", port=80
    )
    return ProxyState({IPFamily.V4: MappingProxyType({web.name: web, empty.name: empty})}, NODE, 1)


class Client:
    """The client process (in the cgroup) and its results, read as they come by a thread of their own (a pipe left
    unread would stop the client while the restarted proxier compiles)."""

    def __init__(self, ns: str, cgroup: str) -> None:
        def pre() -> None:
            Path(cgroup, "cgroup.procs").write_text(str(os.getpid()))

        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, "-c", CLIENT],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            preexec_fn=pre,  # noqa: PLW1509 - the only way to start a process inside a cgroup before it runs
        )
        self.results: list[tuple[float, float, str]] = []
        self._more = threading.Condition()
        self._reader = threading.Thread(target=self._read, name="kpf-rs-client", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            t, d, r = json.loads(line)
            with self._more:
                self.results.append((float(t), float(d), str(r)))
                self._more.notify_all()
        with self._more:
            self._more.notify_all()

    def wait(self, count: int, since: float, timeout: float) -> None:
        """Until ``count`` connections started at ``since`` or later have ended (or ``timeout`` s, or the client
        ended)."""
        with self._more:
            self._more.wait_for(
                lambda: sum(1 for r in self.results if r[0] >= since) >= count or self.proc.poll() is not None,
                timeout,
            )

    def stop(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._reader.join(10)
        assert self.proc.stdout is not None
        self.proc.stdout.close()


@pytest.mark.parametrize("onto", ["its-own-maps", "other-maps"])
def test_a_restart_never_stalls_a_new_connection(place: tuple[str, dict[str, str]], onto: str) -> None:
    """``its-own-maps``: a restart of the same build (the programs are kept, nothing is written). ``other-maps``: the
    attached programs read maps that are not the pinned ones any more (an upgrade whose map layout changed pins new
    maps; pins lost while kproxy was down): the new process's programs replace them, and until its first sync has
    filled the new maps the old programs must keep serving."""
    from kproxy.backends.bpf import cleanup
    from kproxy.backends.bpf.proxier import BpfProxier

    ns, opts = place
    st = _state()
    config = _config(opts)
    first = BpfProxier(config, netns=ns)
    with ns_script(ns, SERVER):
        client: Client | None = None
        try:
            try:
                first.start()
                assert first.sync(st, Changes(full=True)).ok
                client = Client(ns, opts["bpf_cgroup_path"])
                client.wait(20, 0.0, 30)
                assert client.results and all(r[2] == "ok" for r in client.results), client.results
            finally:
                first.close()  # as SIGKILL leaves it: programs attached, maps pinned, the table in place
            if onto == "other-maps":
                cleanup.remove_tree(Path(opts["bpf_pin_path"]))  # the attached programs keep their maps alive
            t_stop = time.monotonic()
            second = BpfProxier(config, netns=ns)
            try:
                second.start()
                t_start = time.monotonic()
                res = second.sync(st, Changes(full=True))
                assert res.ok, res.error
                if onto == "its-own-maps":
                    assert res.family(IPFamily.V4).figures["map_writes"] == 0, "a restart with nothing changed wrote"
                t_synced = time.monotonic()
                cleanup_other_modes(config, netns=ns)  # the daemon's after_first_sync
                deadline = time.monotonic() + AFTER_S
                for n in range(25, AFTER + 25, 25):
                    client.wait(n, t_synced, max(0.0, deadline - time.monotonic()))
                    # the runner's later syncs: partial ones, each after the ledger's check when it is due
                    assert second.sync(st, Changes(full=False)).ok
            finally:
                second.close()
        finally:
            if client is not None:
                client.stop()
    assert client is not None
    after = [r for r in client.results if r[0] >= t_synced]
    assert len(after) >= AFTER, f"only {len(after)} connections after the restart's first sync"
    bad = [(round(t - t_stop, 2), round(d, 2), r) for t, d, r in client.results if r != "ok" or d > SLOW_S]
    assert not bad, (
        f"{len(bad)} of {len(client.results)} connections stalled or failed (seconds after the stop, duration, "
        f"outcome; new process started at +{t_start - t_stop:.2f}, first sync done at +{t_synced - t_stop:.2f}): "
        f"{bad[:10]}"
    )
