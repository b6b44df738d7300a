"""The soak's traffic client: one held TCP connection and a new connection every few hundred milliseconds.

Runs inside a lab pod's network namespace (``ip netns exec NS python -S -m kproxy.soak.traffic ...``, started by
``kproxy.soak.run``) against a ClusterIP and the lab's echo servers, which answer each line with one line
(``kproxy.lab.echo``). It prints one JSON object per line as things happen, so the soak sees the state live:

* ``{"kind": "hold", "t": ..., "ok": true, "reply": "pod-2-1 ..."}`` for each exchange on the held connection
  (every ``--hold-interval`` s); the first failure ends the held connection for good (``ok`` false, ``error``),
  since the point is that the *same* connection survives everything;
* ``{"kind": "conn", "t": ..., "ok": ..., "error": ..., "seconds": ...}`` for each new connection (connect, one
  line, its answer) every ``--conn-interval`` s;
* ``{"kind": "end", ...}`` with the counts when ``--seconds`` have passed or SIGTERM came.

Standard library only and bounded in time (``--seconds``, at most ``MAX_SECONDS``) and count.
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import sys
import threading
import time

MAX_SECONDS = 7200.0
MAX_EVENTS = 200_000
_out_lock = threading.Lock()


def emit(record: dict[str, object]) -> None:
    with _out_lock:
        sys.stdout.write(json.dumps(record) + "\n")
        sys.stdout.flush()


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _error(e: BaseException) -> str:
    if isinstance(e, ConnectionRefusedError | ConnectionResetError):
        return "refused"
    if isinstance(e, TimeoutError | socket.timeout):
        return "timeout"
    if isinstance(e, EOFError):
        return "closed"
    return f"{type(e).__name__}: {e}"


def _exchange(sock: socket.socket, payload: bytes, timeout: float) -> str:
    sock.settimeout(timeout)
    sock.sendall(payload)
    data = b""
    deadline = time.monotonic() + timeout
    while not data.endswith(b"\n"):
        if time.monotonic() > deadline:
            raise TimeoutError("no full line")
        chunk = sock.recv(4096)
        if not chunk:
            raise EOFError("closed")
        data += chunk
    return data.decode(errors="replace").strip()


def hold(host: str, port: int, interval: float, timeout: float, stop: threading.Event, counts: dict[str, int]) -> None:
    start = time.monotonic()
    sock = socket.socket(_family(host), socket.SOCK_STREAM)
    try:
        try:
            sock.settimeout(timeout)
            sock.connect((host, port))
            local = sock.getsockname()[1]
        except OSError as e:
            emit({"kind": "hold", "t": time.time(), "ok": False, "error": _error(e), "phase": "connect"})
            counts["hold_failed"] += 1
            return
        for _ in range(MAX_EVENTS):
            t0 = time.monotonic()
            try:
                reply = _exchange(sock, b"hold\n", timeout)
            except (OSError, EOFError) as e:
                emit({"kind": "hold", "t": time.time(), "ok": False, "error": _error(e), "local_port": local})
                counts["hold_failed"] += 1
                return
            counts["hold_ok"] += 1
            emit(
                {
                    "kind": "hold",
                    "t": time.time(),
                    "ok": True,
                    "reply": reply,
                    "seconds": round(time.monotonic() - t0, 4),
                    "age": round(time.monotonic() - start, 1),
                    "local_port": local,
                }
            )
            if stop.wait(interval):
                return
    finally:
        sock.close()


def connections(
    host: str, port: int, interval: float, timeout: float, stop: threading.Event, counts: dict[str, int]
) -> None:
    for _ in range(MAX_EVENTS):
        t0 = time.monotonic()
        sock = socket.socket(_family(host), socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout)
            sock.connect((host, port))
            reply = _exchange(sock, b"new\n", timeout)
            counts["conn_ok"] += 1
            emit(
                {
                    "kind": "conn",
                    "t": time.time(),
                    "ok": True,
                    "reply": reply,
                    "seconds": round(time.monotonic() - t0, 4),
                }
            )
        except (OSError, EOFError) as e:
            counts["conn_failed"] += 1
            emit(
                {
                    "kind": "conn",
                    "t": time.time(),
                    "ok": False,
                    "error": _error(e),
                    "seconds": round(time.monotonic() - t0, 4),
                }
            )
        finally:
            sock.close()
        if stop.wait(max(0.0, interval - (time.monotonic() - t0))):
            return


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kproxy.soak.traffic", description=__doc__.splitlines()[0])
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--seconds", type=float, required=True)
    p.add_argument("--hold-interval", type=float, default=0.5)
    p.add_argument("--conn-interval", type=float, default=0.3)
    p.add_argument("--timeout", type=float, default=1.0)
    args = p.parse_args(argv)
    host = args.host.strip("[]")
    stop = threading.Event()
    counts = {"hold_ok": 0, "hold_failed": 0, "conn_ok": 0, "conn_failed": 0}

    def on_term(*_: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    threads = [
        threading.Thread(
            target=hold, args=(host, args.port, max(0.05, args.hold_interval), args.timeout, stop, counts)
        ),
        threading.Thread(
            target=connections, args=(host, args.port, max(0.05, args.conn_interval), args.timeout, stop, counts)
        ),
    ]
    for t in threads:
        t.daemon = True
        t.start()
    stop.wait(min(max(args.seconds, 0.0), MAX_SECONDS))
    stop.set()
    for t in threads:
        t.join(timeout=args.timeout + 2)
    emit({"kind": "end", "t": time.time(), **counts})
    return 0


if __name__ == "__main__":
    sys.exit(main())
