"""A proxy socket of the relay: bound on one address and port, listening for TCP (the userspace mode's wildcard
proxy ports, the nftables mode's localhost NodePorts)."""

from __future__ import annotations

import socket

BACKLOG = 4096  # accept queue of a TCP proxy socket: bursts of new connections wait here, not in SYN retries


def listening_socket(af: int, proto: str, address: str, port: int) -> socket.socket:
    """A socket of family ``af`` bound on ``address:port`` (``""``: the wildcard), listening for TCP, IPv6 only for
    IPv6; closed again when bind or listen fails."""
    kind = socket.SOCK_STREAM if proto == "tcp" else socket.SOCK_DGRAM
    sock = socket.socket(af, kind | socket.SOCK_CLOEXEC)
    try:
        if af == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        if kind == socket.SOCK_STREAM:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # rebind over TIME_WAIT on restart
        sock.bind((address or ("0.0.0.0" if af == socket.AF_INET else "::"), port))
        if kind == socket.SOCK_STREAM:
            sock.listen(BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock
