"""The lab's traffic probe: real TCP, UDP and HTTP exchanges from inside a lab namespace, reported as JSON.

kproxy.lab.cluster runs it as ``ip netns exec NS <venv python> -m kproxy.lab.probe MODE ...`` (so it runs in the
client's network namespace and cgroup) and parses the JSON list it prints into :class:`ProbeResult` objects; the
conformance scenarios read those. Standard library only, so it starts fast.

Modes:

* ``tcp``: per attempt, connect (with a timeout), send the payload line, read one answer line.
* ``udp``: per attempt, a *connected* UDP socket (so an ICMP port-unreachable surfaces as ECONNREFUSED), send the
  payload, wait for one datagram; ``--src-port`` pins the source port (SO_REUSEADDR, a new socket per attempt).
* ``http``: one GET; status, headers and body.
* ``hold``: one TCP connection, one exchange every ``--interval`` seconds for ``--seconds`` seconds, one result per
  exchange. After the first exchange it prints ``ready`` on a line of its own (so a caller knows the connection is
  established), then the JSON list at the end; SIGTERM ends it early and still prints the results.

Errors are reported as words the scenarios compare against: ``refused`` (ECONNREFUSED or a reset), ``timeout``,
``unreachable`` (EHOSTUNREACH / ENETUNREACH), ``closed`` (the peer closed without answering), else the errno text.
Every loop is bounded in count and in time.
"""

from __future__ import annotations

import argparse
import errno
import json
import signal
import socket
import sys
import time

TYPE_CHECKING = False  # typing is not imported at run time, to keep the probe's start-up short
if TYPE_CHECKING:
    from collections.abc import Sequence
    from typing import Any

MAX_COUNT = 10_000
MAX_SECONDS = 600.0


class ProbeResult:
    """One exchange. ``reply`` is the echo server's line without its newline (``"pod-1-2 198.18.65.11 40000"``).

    ``ok`` is True when an answer came back (for http: any status; see ``status``, ``headers``, ``body``); else
    ``error`` says why. A plain class rather than a dataclass: this module starts once per probe, and importing
    dataclasses (and typing) would cost more than the rest of its imports together.
    """

    __slots__ = ("ok", "reply", "error", "seconds", "status", "headers", "body", "at")
    FIELDS = __slots__

    def __init__(
        self,
        ok: bool,
        reply: str = "",
        error: str = "",
        seconds: float = 0.0,
        status: int | None = None,
        headers: dict[str, str] | None = None,
        body: str | None = None,
        at: float | None = None,
    ) -> None:
        self.ok = ok
        self.reply = reply
        self.error = error
        self.seconds = seconds
        self.status = status
        self.headers = headers
        self.body = body
        self.at = at  # a held connection's exchange: when it started, in seconds from the hold's start

    def __repr__(self) -> str:
        shown = ", ".join(
            f"{k}={getattr(self, k)!r}"
            for k in self.FIELDS
            if k in ("ok", "reply", "error", "seconds") or getattr(self, k) is not None
        )
        return f"ProbeResult({shown})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ProbeResult):
            return NotImplemented
        return all(getattr(self, k) == getattr(other, k) for k in self.FIELDS)

    __hash__ = None  # type: ignore[assignment]  # mutable, like the dataclass it replaces

    @property
    def pod(self) -> str | None:
        """The answering pod's name (first word of the reply)."""
        words = self.reply.split()
        return words[0] if self.ok and words else None

    @property
    def seen_ip(self) -> str | None:
        """The source address the pod saw (second word)."""
        words = self.reply.split()
        return words[1] if self.ok and len(words) > 1 else None

    @property
    def seen_port(self) -> int | None:
        """The source port the pod saw (third word)."""
        words = self.reply.split()
        return int(words[2]) if self.ok and len(words) > 2 and words[2].isdigit() else None

    @property
    def local_port(self) -> int | None:
        """The pod's own port, present when the payload started with ``info`` (``port=N`` word)."""
        for w in self.reply.split()[3:]:
            if w.startswith("port="):
                return int(w[5:])
        return None

    def to_json(self) -> dict[str, object]:
        return {k: getattr(self, k) for k in self.FIELDS}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ProbeResult:
        return cls(
            ok=bool(d.get("ok")),
            reply=str(d.get("reply") or ""),
            error=str(d.get("error") or ""),
            seconds=float(d.get("seconds") or 0.0),
            status=d.get("status"),
            headers=d.get("headers"),
            body=d.get("body"),
            at=None if d.get("at") is None else float(d["at"]),
        )


def error_word(e: BaseException) -> str:
    if isinstance(e, (socket.timeout, TimeoutError)):
        return "timeout"
    if isinstance(e, (ConnectionRefusedError, ConnectionResetError)):
        return "refused"
    if isinstance(e, OSError) and e.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH):
        return "unreachable"
    if isinstance(e, OSError) and e.errno in (errno.ECONNREFUSED, errno.ECONNRESET):
        return "refused"
    if isinstance(e, OSError) and e.errno == errno.ETIMEDOUT:
        return "timeout"
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return str(e) or type(e).__name__


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _strip(host: str) -> str:
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def _readline(sock: socket.socket, deadline: float) -> str:
    buf = b""
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0:
            raise socket.timeout("timed out")
        sock.settimeout(left)
        chunk = sock.recv(4096)
        if not chunk:
            if buf:
                break
            raise EOFError("closed")
        buf += chunk
    return buf.split(b"\n", 1)[0].decode(errors="replace")


def _result(start: float, reply: str = "", error: BaseException | None = None) -> ProbeResult:
    secs = round(time.monotonic() - start, 6)
    if error is not None:
        word = "closed" if isinstance(error, EOFError) else error_word(error)
        return ProbeResult(ok=False, error=word, seconds=secs)
    return ProbeResult(ok=True, reply=reply, seconds=secs)


def tcp_once(host: str, port: int, timeout: float, payload: str, src_port: int | None = None) -> ProbeResult:
    start = time.monotonic()
    deadline = start + timeout
    sock = socket.socket(_family(host), socket.SOCK_STREAM)
    try:
        if src_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("::" if _family(host) == socket.AF_INET6 else "0.0.0.0", src_port))
        sock.settimeout(timeout)
        sock.connect((host, port))
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        sock.sendall((payload + "\n").encode())
        return _result(start, _readline(sock, deadline))
    except (OSError, EOFError) as e:
        return _result(start, error=e)
    finally:
        sock.close()


def udp_once(host: str, port: int, timeout: float, payload: str, src_port: int | None = None) -> ProbeResult:
    start = time.monotonic()
    sock = socket.socket(_family(host), socket.SOCK_DGRAM)
    try:
        if src_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("::" if _family(host) == socket.AF_INET6 else "0.0.0.0", src_port))
        sock.connect((host, port))
        sock.settimeout(timeout)
        sock.send((payload + "\n").encode())
        data = sock.recv(65535)
        return _result(start, data.decode(errors="replace").split("\n", 1)[0])
    except OSError as e:
        return _result(start, error=e)
    finally:
        sock.close()


def http_once(url: str, timeout: float) -> ProbeResult:
    import http.client  # only http probes pay for it
    from urllib.parse import urlsplit

    start = time.monotonic()
    u = urlsplit(url)
    host = u.hostname or ""
    port = u.port or (443 if u.scheme == "https" else 80)
    conn_cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
    conn = conn_cls(host, port, timeout=timeout)
    try:
        path = (u.path or "/") + (f"?{u.query}" if u.query else "")
        conn.request("GET", path, headers={"Connection": "close"})
        resp = conn.getresponse()
        body = resp.read(1 << 20).decode(errors="replace")
        r = _result(start, reply=f"{resp.status} {resp.reason}")
        r.status, r.headers, r.body = resp.status, {k: v for k, v in resp.getheaders()}, body
        return r
    except (OSError, http.client.HTTPException) as e:
        return _result(start, error=e)
    finally:
        conn.close()


class _Stop(Exception):
    pass


def hold(host: str, port: int, seconds: float, interval: float, timeout: float, payload: str) -> list[ProbeResult]:
    """One connection, an exchange every ``interval`` s until ``seconds`` have passed; stops at the first failure."""
    results: list[ProbeResult] = []
    interval = max(interval, 0.01)
    end = time.monotonic() + min(seconds, MAX_SECONDS)
    start = began = time.monotonic()
    sock = socket.socket(_family(host), socket.SOCK_STREAM)

    def stop(*_: object) -> None:
        raise _Stop()

    signal.signal(signal.SIGTERM, stop)
    try:
        try:
            sock.settimeout(timeout)
            sock.connect((host, port))
        except OSError as e:
            results.append(_result(start, error=e))
            return results
        for _ in range(MAX_COUNT):
            start = time.monotonic()
            try:
                sock.settimeout(timeout)
                sock.sendall((payload + "\n").encode())
                r = _result(start, _readline(sock, start + timeout))
            except (OSError, EOFError) as e:
                r = _result(start, error=e)
            r.at = start - began
            results.append(r)
            if not r.ok:
                break
            if len(results) == 1:
                print("ready", flush=True)
            if time.monotonic() + interval > end:
                break
            time.sleep(interval)
    except _Stop:
        pass
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        sock.close()
    return results


def run(args: argparse.Namespace) -> list[ProbeResult]:
    host = _strip(args.host or "")
    count = max(1, min(args.count, MAX_COUNT))
    timeout = max(0.001, args.timeout)
    if args.mode == "http":
        return [http_once(args.url, timeout)]
    if args.mode == "hold":
        return hold(host, args.port, args.seconds, args.interval, timeout, args.payload)
    once = tcp_once if args.mode == "tcp" else udp_once
    results: list[ProbeResult] = []
    budget_end = time.monotonic() + MAX_SECONDS
    for i in range(count):
        results.append(once(host, args.port, timeout, args.payload, args.src_port))
        if time.monotonic() > budget_end:
            break
        if args.interval > 0 and i + 1 < count:
            time.sleep(args.interval)
    return results


def build_argv(
    kind: str,
    host: str = "",
    port: int = 0,
    *,
    count: int = 1,
    timeout: float = 1.0,
    src_port: int | None = None,
    payload: str = "hello",
    interval: float = 0.0,
    seconds: float = 0.0,
    url: str = "",
) -> list[str]:
    """The probe's command-line arguments (after ``-m kproxy.lab.probe``); used by kproxy.lab.cluster."""
    if kind not in ("tcp", "udp", "http", "hold"):
        raise ValueError(f"unknown probe kind {kind!r}")
    if "\n" in payload:
        raise ValueError("payload must be one line")
    argv = [kind, "--count", str(count), "--timeout", str(timeout), "--interval", str(interval)]
    argv += ["--seconds", str(seconds), f"--payload={payload}"]
    if kind == "http":
        argv += [f"--url={url}"]
    else:
        argv += [f"--host={host}", "--port", str(port)]
    if src_port:
        argv += ["--src-port", str(src_port)]
    return argv


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kproxy.lab.probe", description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=["tcp", "udp", "http", "hold"])
    p.add_argument("--host", default="")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--url", default="")
    p.add_argument("--count", type=int, default=1)
    p.add_argument("--timeout", type=float, default=1.0)
    p.add_argument("--src-port", type=int, default=None)
    p.add_argument("--payload", default="hello")
    p.add_argument("--interval", type=float, default=0.0)
    p.add_argument("--seconds", type=float, default=0.0)
    args = p.parse_args(argv)
    results = run(args)
    print(json.dumps([r.to_json() for r in results]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
