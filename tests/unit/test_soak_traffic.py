"""kproxy.soak.traffic against a line echo server on loopback: the held connection's exchanges, new connections,
the end record, and what a server that goes away looks like (the held connection ends for good, new ones fail)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest


class Echo:
    """Answers each line with ``echo <line>``; ``stop()`` closes the listener and every connection."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        self.closed = threading.Event()
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        buf = b""
        with conn:
            while not self.closed.is_set():
                try:
                    data = conn.recv(4096)
                except OSError:
                    return
                if not data:
                    return
                buf += data
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    try:
                        conn.sendall(b"echo " + line + b"\n")
                    except OSError:  # stop() shut the connection down while it answered
                        return

    def stop(self) -> None:
        self.closed.set()
        self.sock.close()
        for c in self.conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


@pytest.fixture
def echo() -> Iterator[Echo]:
    server = Echo()
    yield server
    server.stop()


def _run(port: int, seconds: float) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "kproxy.soak.traffic", "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--seconds", str(seconds), "--hold-interval", "0.1", "--conn-interval", "0.1", "--timeout", "0.5"]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _events(out: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def test_hold_and_new_connections(echo: Echo) -> None:
    proc = _run(echo.port, 1.5)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    evs = _events(out)
    holds = [e for e in evs if e["kind"] == "hold"]
    conns = [e for e in evs if e["kind"] == "conn"]
    end = evs[-1]
    assert end["kind"] == "end"
    assert len(holds) >= 5 and all(e["ok"] for e in holds)
    assert {e["local_port"] for e in holds} == {holds[0]["local_port"]}, "one connection held throughout"
    assert all(e["reply"] == "echo hold" for e in holds)
    assert len(conns) >= 5 and all(e["ok"] and e["reply"] == "echo new" for e in conns)
    assert end["hold_ok"] == len(holds) and end["conn_ok"] == len(conns) and end["conn_failed"] == 0


def test_a_server_that_goes_away(echo: Echo) -> None:
    proc = _run(echo.port, 3.0)
    time.sleep(1.0)
    echo.stop()
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    evs = _events(out)
    holds = [e for e in evs if e["kind"] == "hold"]
    assert holds[0]["ok"] and not holds[-1]["ok"], "the held connection's end is recorded"
    assert sum(1 for e in holds if not e["ok"]) == 1, "and nothing after it: the same connection or none"
    failed = [e for e in evs if e["kind"] == "conn" and not e["ok"]]
    assert failed and {e["error"] for e in failed} <= {"refused", "timeout", "closed"}
    assert evs[-1]["kind"] == "end" and evs[-1]["hold_failed"] == 1


def test_sigterm_ends_it_with_the_counts(echo: Echo) -> None:
    proc = _run(echo.port, 60.0)
    time.sleep(0.8)
    proc.terminate()
    out, _ = proc.communicate(timeout=30)
    evs = _events(out)
    assert evs[-1]["kind"] == "end" and evs[-1]["hold_ok"] >= 1
