"""The lab's pod workload: a tiny TCP and UDP echo server that says who answered and whom it saw.

Every lab pod runs ``python -m kproxy.lab.echo --name pod-1-2`` in its own network namespace (started by
kproxy.lab.cluster). The conformance scenarios reach it through services and read the answer to learn which pod
answered and which source address the pod saw (so masquerade, source-IP preservation and load balancing are all
observable from one line of text).

Protocol, the same on every port (default 8080, 8081, 9000), on TCP and UDP, IPv4 and IPv6:

* TCP: for each line received the server answers one line ``"<podname> <source-ip> <source-port>\\n"``; a
  connection may carry many lines (long-lived connections survive proxy restarts this way). Bytes left without a
  newline when the client half-closes are answered once as if they were a line.
* UDP: each datagram is answered by one datagram with the same line.
* A request line whose first word is ``info`` gets two more words: ``port=<the server's local port>`` and
  ``proto=<tcp|udp>`` (``"pod-1-2 198.18.65.11 40000 port=8081 proto=tcp"``), so a test can tell which container
  port a service port reached; any other request gets exactly the three words.

Standard library only and a single thread (``selectors``), so it starts in a few tens of milliseconds. With
``--ready-file`` it creates that file once every socket is bound, which is how the lab knows the pod is ready.
"""

from __future__ import annotations

import argparse
import errno
import os
import selectors
import signal
import socket
import sys
from collections.abc import Sequence

DEFAULT_PORTS = (8080, 8081, 9000)
_MAX_LINE = 64 * 1024  # a client that never sends a newline is cut off rather than buffered forever


def _answer(name: str, peer: tuple[str, int], request: bytes, local_port: int, proto: str) -> bytes:
    host = peer[0].split("%", 1)[0]  # drop an IPv6 scope id; lab addresses are global
    line = f"{name} {host} {peer[1]}"
    words = request.split(None, 1)
    if words and words[0] == b"info":
        line += f" port={local_port} proto={proto}"
    return (line + "\n").encode()


class EchoServer:
    """All listening sockets of one pod, served from one selector loop."""

    def __init__(self, name: str, ports: Sequence[int], ipv6: bool = True, ipv4: bool = True) -> None:
        self.name = name
        self.sel = selectors.DefaultSelector()
        self.buffers: dict[socket.socket, bytearray] = {}
        families = ([socket.AF_INET] if ipv4 else []) + ([socket.AF_INET6] if ipv6 and socket.has_ipv6 else [])
        for family in families:
            for port in ports:
                self._listen(family, socket.SOCK_STREAM, port)
                self._listen(family, socket.SOCK_DGRAM, port)

    def _listen(self, family: socket.AddressFamily, kind: socket.SocketKind, port: int) -> None:
        s = socket.socket(family, kind)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            # separate IPv4 and IPv6 sockets, so a v4 client is reported as a.b.c.d and not ::ffff:a.b.c.d
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        try:
            s.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", port))
        except OSError as e:
            if family == socket.AF_INET6 and e.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
                s.close()  # IPv6 disabled in this namespace: serve IPv4 only
                return
            raise
        s.setblocking(False)
        if kind == socket.SOCK_STREAM:
            s.listen(512)
            self.sel.register(s, selectors.EVENT_READ, ("accept", port))
        else:
            self.sel.register(s, selectors.EVENT_READ, ("udp", port))

    def serve_forever(self) -> None:
        while True:
            for key, _ in self.sel.select():
                role, port = key.data
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                if role == "accept":
                    self._accept(sock, port)
                elif role == "udp":
                    self._udp(sock, port)
                else:
                    self._tcp(sock, port)

    def _accept(self, listener: socket.socket, port: int) -> None:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        conn.setblocking(False)
        self.buffers[conn] = bytearray()
        self.sel.register(conn, selectors.EVENT_READ, ("tcp", port))

    def _udp(self, sock: socket.socket, port: int) -> None:
        try:
            data, peer = sock.recvfrom(65535)
            sock.sendto(_answer(self.name, peer, data, port, "udp"), peer)
        except OSError:
            pass  # an ICMP error from an earlier reply, or a peer that went away: nothing to answer

    def _close(self, conn: socket.socket) -> None:
        self.sel.unregister(conn)
        self.buffers.pop(conn, None)
        conn.close()

    def _tcp(self, conn: socket.socket, port: int) -> None:
        try:
            data = conn.recv(65536)
            peer = conn.getpeername()
        except OSError:
            self._close(conn)
            return
        buf = self.buffers[conn]
        if not data:
            if buf.strip():
                self._send(conn, _answer(self.name, peer, bytes(buf), port, "tcp"))
            self._close(conn)
            return
        buf += data
        out = bytearray()
        while (nl := buf.find(b"\n")) >= 0:
            out += _answer(self.name, peer, bytes(buf[:nl]), port, "tcp")
            del buf[: nl + 1]
        if len(buf) > _MAX_LINE:
            self._close(conn)
            return
        if out and not self._send(conn, bytes(out)):
            self._close(conn)

    @staticmethod
    def _send(conn: socket.socket, data: bytes) -> bool:
        # answers are tiny; a short blocking send keeps the loop simple without a write queue
        try:
            conn.setblocking(True)
            conn.settimeout(2.0)
            conn.sendall(data)
            conn.setblocking(False)
            return True
        except OSError:
            return False


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kproxy.lab.echo", description=__doc__.splitlines()[0])
    p.add_argument("--name", required=True, help="pod name to put first in every answer")
    p.add_argument("--ports", default=",".join(map(str, DEFAULT_PORTS)), help="comma-separated ports")
    p.add_argument("--no-ipv6", action="store_true", help="serve IPv4 only")
    p.add_argument("--ready-file", help="create this file once every socket is bound")
    args = p.parse_args(argv)
    ports = [int(x) for x in args.ports.split(",") if x.strip()]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    server = EchoServer(args.name, ports, ipv6=not args.no_ipv6)
    if args.ready_file:
        tmp = f"{args.ready_file}.tmp"
        with open(tmp, "w") as f:
            f.write(f"{os.getpid()}\n")
        os.replace(tmp, args.ready_file)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
