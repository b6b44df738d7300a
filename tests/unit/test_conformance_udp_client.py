"""The UDP client of udp-conntrack and udp-stale-flows (``sc_udp.UDP_SOCKET_SCRIPT``) on loopback: a connected
socket keeps its source port through ICMP port unreachable (the service had no endpoints) and reaches the next
listener on the same socket; with a source port, every datagram leaves from that port on a socket of its own."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kproxy.conformance.sc_udp import UDP_SOCKET_SCRIPT, _socket_log

WAIT_S = 10.0


class Echo:
    """A UDP server on 127.0.0.1:``port`` answering ``<name> <client port>``, recording the client ports."""

    def __init__(self, name: str, port: int, ports: list[int]) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", port))
        self.sock.settimeout(0.05)
        self.name, self.ports, self.stop = name, ports, threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                _, peer = self.sock.recvfrom(100)
            except TimeoutError:
                continue
            self.ports.append(peer[1])
            self.sock.sendto(f"{self.name} {peer[1]}\n".encode(), peer)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        self.sock.close()


def _until(what: str, cond: Callable[[], bool]) -> None:
    end = time.monotonic() + WAIT_S
    while not cond():
        assert time.monotonic() < end, f"not seen within {WAIT_S} s: {what}"
        time.sleep(0.02)


def _words(out: Path) -> list[str]:
    return [w for _, w in _socket_log(out)]


@pytest.mark.parametrize("src_port", [0, 1])
def test_the_client_keeps_its_source_port_through_a_refusal(tmp_path: Path, src_port: int) -> None:
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    fixed = 0
    if src_port:
        probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        probe.bind(("127.0.0.1", 0))
        fixed = probe.getsockname()[1]
        probe.close()
    out, stop = tmp_path / "log", tmp_path / "stop"
    argv = [sys.executable, "-I", "-c", UDP_SOCKET_SCRIPT, "127.0.0.1", str(port), "30", str(out), str(stop), "0.02"]
    ports: list[int] = []
    echo = Echo("A", port, ports)
    proc = subprocess.Popen(argv + ([str(fixed)] if fixed else []))
    try:
        _until("answers from A", lambda: _words(out).count("A") >= 3)
        echo.close()  # nothing listens: ICMP port unreachable, ECONNREFUSED on the connected socket
        _until("a refusal", lambda: "!ECONNREFUSED" in _words(out))
        echo = Echo("B", port, ports)
        _until("answers from B", lambda: _words(out).count("B") >= 3)
    finally:
        stop.touch()
        proc.wait(timeout=WAIT_S)
        echo.close()
    words = _words(out)
    assert not [w for w in words if w.endswith("+reconnect")], words  # the socket was never replaced
    assert set(words) <= {"A", "B", "!ECONNREFUSED", "!timeout"}, words
    assert len(set(ports)) == 1 and (not fixed or ports[0] == fixed), ports  # one source port throughout
