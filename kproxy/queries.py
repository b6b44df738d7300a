"""The queries of kproxy's HTTP endpoints and commands: ``/trace``'s parameters and the ``ns/name[:port][/PROTO]``
service filter of ``/rules?service=``, ``kproxy show --service`` and ``kproxy top``. Pure: a ValueError names the
fault."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kproxy.model import IPFamily, ServicePortName, parse_ip

_TRUE = ("1", "true", "yes")


def parse_trace_query(query: Mapping[str, str]) -> tuple[str, str, str, int, bool, bool]:
    """``src``, ``dst``, ``dport``, ``proto`` (tcp), ``src_local``, ``dst_local``; a ValueError names the fault."""
    try:
        src, dst = parse_ip(query["src"]), parse_ip(query["dst"])
    except KeyError as exc:
        raise ValueError(f"missing query parameter {exc.args[0]!r} (need src, dst, dport)") from None
    proto = query.get("proto", "tcp").lower()
    if proto not in ("tcp", "udp", "sctp"):
        raise ValueError(f"proto {proto!r}: expected tcp, udp or sctp")
    try:
        dport = int(query.get("dport", ""))
    except ValueError:
        raise ValueError("dport must be a port number") from None
    if not 0 < dport < 65536:
        raise ValueError(f"dport {dport} out of range")
    if IPFamily.of(src) != IPFamily.of(dst):
        raise ValueError("src and dst are of different IP families")
    return (
        src,
        proto,
        dst,
        dport,
        query.get("src_local", "").lower() in _TRUE,
        query.get("dst_local", "").lower() in _TRUE,
    )


@dataclass(frozen=True)
class ServiceFilter:
    """``ns/name[:port][/PROTO]`` as given to ``kproxy show --service``: what is left out matches anything."""

    namespace: str
    name: str
    port: str | None
    protocol: str | None

    @classmethod
    def parse(cls, text: str) -> ServiceFilter:
        body, proto = text, None
        if body.count("/") == 2:
            body, _, proto = body.rpartition("/")
            proto = proto.upper()
            if proto not in ("TCP", "UDP", "SCTP"):
                raise ValueError(f"service {text!r}: protocol {proto!r} is not TCP, UDP or SCTP")
        ns, _, rest = body.partition("/")
        name, colon, port = rest.partition(":")
        if not ns or not name or "/" in rest:
            raise ValueError(f"service {text!r}: expected ns/name[:port][/PROTO]")
        return cls(ns, name, port if colon else None, proto)

    @property
    def exact(self) -> ServicePortName | None:
        """The one service port it names, when it names port and protocol."""
        if self.port is None or self.protocol is None:
            return None
        from kproxy.model import Protocol

        return ServicePortName(self.namespace, self.name, self.port, Protocol(self.protocol))

    def matches(self, described: str) -> bool:
        """Whether a ``describe()`` key (``ns/name[:port]/PROTO``) is one of the ports this names."""
        body, _, proto = described.rpartition("/")
        ns, _, rest = body.partition("/")
        name, _, port = rest.partition(":")
        return (
            (ns, name) == (self.namespace, self.name)
            and (self.port is None or port == self.port)
            and (self.protocol is None or proto.upper() == self.protocol)
        )
