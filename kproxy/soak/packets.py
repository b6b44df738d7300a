"""What the soak sends at a checkpoint and how it judges what came back: targets from the reference model, verdicts.

For each chosen service, every port (TCP and UDP, the second port too) in every family (IPv4, IPv6) is tried at its
ClusterIP from one pod of each node (internalTrafficPolicy Local answers differently per node) and, for a NodePort
service, at the NodePort of every node address of the family; a deleted or rejected service's former ClusterIP is
tried once, where no pod may answer. ``kproxy.soak.model`` says what each must meet, ``kproxy.soak.sweep`` sends
the packets and ``judge`` compares:

* ``lost``: an answer was due and none came (the error is named);
* ``wrong``: an answer came from a pod or port the model does not allow (or, to an unconnected UDP socket, from
  another address than the one it was sent to), a connection that must be rejected or
  dropped was answered, a reject came as a drop or the other way round, or a removed service still answered.

Pure: tests/unit/test_soak_model.py checks the plan and the verdicts.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kproxy.soak.model import ANSWER, DROP, REJECT, Expect, Model

#: the port a removed service's former ClusterIP is tried at (every churned service has port 80)
ABSENT_PORT = 80


@dataclass(frozen=True)
class Target:
    """One address to try from one client pod; ``expect`` None: a removed service's address, no pod may answer."""

    id: str
    client: str  # the pod that sends
    proto: str  # "tcp" | "udp"
    host: str
    port: int
    what: str  # the service port, family and kind of address, for the report
    expect: Expect | None
    attempts: int
    timeout: float

    def request(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "proto": self.proto,
            "host": self.host,
            "port": self.port,
            "attempts": self.attempts,
            "timeout": self.timeout,
        }


def _addr(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def plan(
    model: Model,
    services: Iterable[str],
    clients: Mapping[str, str],
    node_ips: Mapping[str, Mapping[str, str]],
    *,
    absent: Mapping[str, Sequence[str]] | None = None,
    attempts: int = 3,
    timeout: float = 2.0,
    reject_timeout: float = 3.0,
    drop_timeout: float = 1.5,
) -> list[Target]:
    """The targets for ``services`` (``ns/name``); ``clients``: node -> the pod that sends from it; ``node_ips``:
    node -> family -> its address; ``absent``: removed service -> its former ClusterIPs.

    A reject is waited for longer than an answer: over IPv6 the kernel drops the first ICMPv6 error of a TCP
    connection that is still inside ``connect()`` (the socket is locked, ``TcpExtLockDroppedIcmps``) and reports the
    refusal only when the retransmitted SYN meets it, about a second later. A drop is waited for longer than that,
    so a late refusal is never taken for one."""
    out: list[Target] = []
    waits = {ANSWER: timeout, REJECT: reject_timeout, DROP: drop_timeout}

    def add(client: str, proto: str, host: str, port: int, what: str, expect: Expect | None) -> None:
        answer = expect is not None and expect.outcome == ANSWER
        out.append(
            Target(
                id=f"t{len(out)}",
                client=client,
                proto=proto,
                host=host,
                port=port,
                what=what,
                expect=expect,
                attempts=attempts if answer else 1,
                timeout=waits[expect.outcome] if expect is not None else timeout,
            )
        )

    for service in sorted(set(services)):
        for pm in sorted(model.of(service), key=lambda p: (p.key, p.family)):
            if pm.protocol not in ("TCP", "UDP"):
                continue
            proto = pm.protocol.lower()
            for node, pod in sorted(clients.items()):
                add(pod, proto, pm.cluster_ip, pm.port, f"{pm.key} {pm.family} ClusterIP", pm.cluster_ip_expect(node))
                if pm.node_port is None:
                    continue
                for target_node, addrs in sorted(node_ips.items()):
                    if addrs.get(pm.family):
                        what = f"{pm.key} {pm.family} NodePort of {target_node}"
                        add(pod, proto, addrs[pm.family], pm.node_port, what, pm.node_port_expect())
    first = next(iter(sorted(clients.items())), None)
    for service, former in sorted((absent or {}).items()):
        for ip in former:
            if first is not None:
                add(first[1], "tcp", ip, ABSENT_PORT, f"{service} (removed or rejected) ClusterIP", None)
    return out


def _same(source: str, host: str, port: int) -> bool:
    """Whether ``source`` (``a.b.c.d:p`` or ``[v6]:p``) is ``host``:``port``, however the address is spelt."""
    addr, _, num = source.rpartition(":")
    try:
        return ipaddress.ip_address(addr.strip("[]")) == ipaddress.ip_address(host) and int(num) == port
    except ValueError:
        return False


def _reply(result: Mapping[str, Any]) -> tuple[str, int | None]:
    """(the answering pod, the pod's own port) from an echo reply to ``info``."""
    words = str(result.get("reply") or "").split()
    port = next((int(w[5:]) for w in words[3:] if w.startswith("port=") and w[5:].isdigit()), None)
    return (words[0] if words else "?"), port


def _seen(results: Sequence[Mapping[str, Any]]) -> str:
    parts = []
    for r in results:
        if r.get("ok"):
            pod, port = _reply(r)
            parts.append(f"{pod}:{port}")
        else:
            parts.append(str(r.get("error") or "no answer"))
    return ", ".join(parts) or "no result"


def judge(t: Target, results: Sequence[Mapping[str, Any]] | None, pod_of: Mapping[str, str]) -> tuple[str, str] | None:
    """None when ``results`` meet ``t.expect``, else (``lost`` | ``wrong``, what was sent and what came back)."""
    results = list(results or [])
    sent = f"{t.what}: {len(results) or t.attempts} {t.proto} to {_addr(t.host, t.port)} from {t.client}"
    got = _seen(results)
    e = t.expect
    if e is None:
        if any(r.get("ok") for r in results):
            return "wrong", f"{sent}: got {got}, want no pod (the service is gone)"
        return None
    if e.outcome == ANSWER:
        allowed = {(pod_of.get(addr, addr), port) for addr, port in e.endpoints}
        want = ", ".join(f"{pod}:{port}" for pod, port in sorted(allowed))
        if any(r.get("ok") and _reply(r) not in allowed for r in results):
            return "wrong", f"{sent}: got {got}, want one of {want}"
        # an unconnected socket's answer must come from where it was sent
        sources = sorted({str(r["source"]) for r in results if r.get("ok") and r.get("source")})
        if any(not _same(src, t.host, t.port) for src in sources):
            return "wrong", f"{sent}: answered from {', '.join(sources)}, want {_addr(t.host, t.port)}"
        if not results or not all(r.get("ok") for r in results):
            return "lost", f"{sent}: got {got}, want one of {want}"
        return None
    want_error, want = ("refused", "rejected (refused)") if e.outcome == REJECT else ("timeout", "dropped (timeout)")
    if not results or any(r.get("ok") or r.get("error") != want_error for r in results):
        return "wrong", f"{sent}: got {got}, want {want}"
    return None
