"""Small pure checks for the fields of Kubernetes objects, each raising ValueError with a precise message.

The cache (``kproxy.cache``) parses every Service, EndpointSlice and Node through these before it believes a
single field, so one malformed object is rejected with a reason that names the field, and never reaches a
backend (whose rule text or map keys are built from these values). The rules follow the API server's own
validation where it has one (name formats, port ranges, IP syntax); this module is deliberately independent of
the API server, because the files source and the lab's API stand-in do not validate anything.

It sits in the model layer's shadow: it imports only ``model``.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Callable, Mapping, Sequence
from itertools import islice
from typing import Any

from kproxy.model import IPFamily, Protocol, shared_text

_DNS1123_LABEL = re.compile(r"[a-z0-9](?:[-a-z0-9]*[a-z0-9])?\Z")
_DNS1035_LABEL = re.compile(r"[a-z](?:[-a-z0-9]*[a-z0-9])?\Z")
_DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9](?:[-a-z0-9]*[a-z0-9])?(?:\.[a-z0-9](?:[-a-z0-9]*[a-z0-9])?)*\Z")
_LABEL_VALUE = re.compile(r"(?:[A-Za-z0-9](?:[-A-Za-z0-9_.]*[A-Za-z0-9])?)?\Z")

_PROTOCOLS = {p.value: p for p in Protocol}
_FAMILIES = {f.value: f for f in IPFamily}


def printable(text: str) -> str:
    """`text` with every non-printable character escaped (``\\n``, ``\\x1b``, ``\\u202e``): a name or value from an
    object must not forge a log line (a newline) or hide part of one (a terminal escape, a bidi override)."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


_SHOW_ITEMS = 4  # elements of a list or object shown


def _brief(value: Any, depth: int) -> str:
    """A repr of `value` that looks at only a bounded part of it (the first characters and elements)."""
    if isinstance(value, str):
        return repr(value[:60]) + ("..." if len(value) > 60 else "")
    if value is None or isinstance(value, (bool, float)):
        return repr(value)
    if isinstance(value, int):
        return repr(value) if value.bit_length() <= 128 else f"<int of {value.bit_length()} bits>"
    if isinstance(value, Mapping):
        if depth <= 0:
            return "{...}"
        shown = [f"{_brief(k, depth - 1)}: {_brief(v, depth - 1)}" for k, v in islice(value.items(), _SHOW_ITEMS)]
        return "{" + ", ".join(shown + (["..."] if len(value) > _SHOW_ITEMS else [])) + "}"
    if isinstance(value, (list, tuple)):
        if depth <= 0:
            return "[...]"
        shown = [_brief(v, depth - 1) for v in islice(value, _SHOW_ITEMS)]
        return "[" + ", ".join(shown + (["..."] if len(value) > _SHOW_ITEMS else [])) + "]"
    return f"<{type(value).__name__}>"


def _show(value: Any) -> str:
    """A short, log-safe rendering of a bad value: bounded before it is rendered (an absurd value must not flood
    the log, nor cost a full repr), control characters escaped (repr does that)."""
    text = _brief(value, 2)
    if isinstance(value, str) and len(value) > 60:
        return f"{text}({len(value)} chars)"
    return text if len(text) <= 200 else f"{text[:160]}..."


def mapping(value: Any, what: str) -> Mapping[str, Any]:
    # a dict (what JSON gives) without the Mapping ABC's instance check: this runs several times per object
    if type(value) is not dict and not isinstance(value, Mapping):
        raise ValueError(f"{what}: expected an object, got {type(value).__name__} {_show(value)}")
    return value


def optional_mapping(value: Any, what: str) -> Mapping[str, Any]:
    return {} if value is None else mapping(value, what)


def sequence(value: Any, what: str) -> Sequence[Any]:
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{what}: expected a list, got {type(value).__name__} {_show(value)}")
    return value


def optional_sequence(value: Any, what: str) -> Sequence[Any]:
    return () if value is None else sequence(value, what)


def string(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{what}: expected a string, got {type(value).__name__} {_show(value)}")
    return value


def optional_string(value: Any, what: str, default: str = "") -> str:
    return default if value is None else string(value, what)


def integer(value: Any, what: str) -> int:
    # bool is an int subclass in Python, but `true` is never a valid number in a Kubernetes object.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what}: expected an integer, got {type(value).__name__} {_show(value)}")
    return value


def optional_bool(value: Any, what: str) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    raise ValueError(f"{what}: expected true/false, got {type(value).__name__} {_show(value)}")


def port_number(value: Any, what: str, *, allow_zero: bool = False) -> int:
    """A TCP/UDP/SCTP port number in 1..65535 (0 too when it means "not set")."""
    num = integer(value, what)
    low = 0 if allow_zero else 1
    if not low <= num <= 65535:
        raise ValueError(f"{what}: port {num} out of range {low}..65535")
    return num


def protocol(value: Any, what: str) -> Protocol:
    """``TCP`` (the default when absent), ``UDP`` or ``SCTP``."""
    if value is None:
        return Protocol.TCP
    proto = _PROTOCOLS.get(string(value, what))
    if proto is None:
        raise ValueError(f"{what}: unknown protocol {_show(value)} (TCP, UDP or SCTP)")
    return proto


def ip_family(value: Any, what: str) -> IPFamily:
    fam = _FAMILIES.get(string(value, what))
    if fam is None:
        raise ValueError(f"{what}: unknown IP family {_show(value)} (IPv4 or IPv6)")
    return fam


def one_of(value: Any, allowed: Sequence[str], what: str, default: str) -> str:
    if value is None or value == "":
        return default
    text = string(value, what)
    if text not in allowed:
        raise ValueError(f"{what}: {_show(value)} is not one of {', '.join(allowed)}")
    return text


def _name(value: Any, what: str, pattern: re.Pattern[str], limit: int, kind: str) -> str:
    text = string(value, what)
    if not text:
        raise ValueError(f"{what}: must not be empty")
    if len(text) > limit:
        raise ValueError(f"{what}: {len(text)} characters, more than the {limit} a {kind} may have")
    if not pattern.match(text):
        raise ValueError(f"{what}: {_show(text)} is not a valid {kind}")
    return text


def dns1123_label(value: Any, what: str) -> str:
    """A namespace name: lowercase alphanumerics and '-', at most 63 characters."""
    return _name(value, what, _DNS1123_LABEL, 63, "DNS-1123 label")


def dns1035_label(value: Any, what: str) -> str:
    """A Service name: like a DNS-1123 label but starting with a letter."""
    return _name(value, what, _DNS1035_LABEL, 63, "DNS-1035 label")


def dns1123_subdomain(value: Any, what: str) -> str:
    """An EndpointSlice or Node name: dot-separated DNS-1123 labels, at most 253 characters."""
    return _name(value, what, _DNS1123_SUBDOMAIN, 253, "DNS-1123 subdomain")


def port_name(value: Any, what: str) -> str:
    """A Service or EndpointSlice port name: empty (unnamed) or a DNS-1123 label (<= 63 characters), as the API
    server validates them (container ports, not these, are IANA_SVC_NAMEs)."""
    text = optional_string(value, what)
    if not text:
        return ""
    if len(text) > 63:
        raise ValueError(f"{what}: {len(text)} characters, more than the 63 a port name may have")
    if not _DNS1123_LABEL.match(text):
        raise ValueError(f"{what}: {_show(text)} is not a valid port name (DNS-1123 label)")
    return text


def label_value(value: Any, what: str) -> str:
    """A label value (for example a zone): at most 63 characters of alphanumerics, '-', '_' and '.'."""
    text = string(value, what)
    if len(text) > 63 or not _LABEL_VALUE.match(text):
        raise ValueError(f"{what}: {_show(text)} is not a valid label value")
    return text


class Known:
    """Valid names of one kind that many objects repeat (namespaces, node names, zones): each is checked once, then
    known, and handed out as one shared string (``model.shared_text``). Bounded, since input decides what goes in:
    past ``limit`` names, a new one is checked every time, as an unknown one is. ``known`` is the table itself, for
    a hot path's own lookup before it calls ``shared``."""

    def __init__(self, check: Callable[[Any, str], str], limit: int) -> None:
        self._check, self._limit = check, limit
        self.known: dict[str, str] = {}

    def __call__(self, value: Any, what: str) -> str:
        """``value`` checked (a ValueError naming ``what`` when it is bad), as its shared string."""
        if type(value) is str:
            known = self.known.get(value)
            if known is not None:
                return known
        text = shared_text(self._check(value, what))
        if type(text) is str and len(self.known) < self._limit:
            self.known[text] = text
        return text

    def shared(self, value: str) -> str | None:
        """The shared string of ``value`` when it is valid, None when not (its message is left to the caller)."""
        try:
            return self(value, "")
        except ValueError:
            return None


def string_map(value: Any, what: str) -> dict[str, str]:
    """Labels or annotations: an object of strings to strings (absent means empty).

    Every object carries labels, so the common case (a dict of plain ``str``, as JSON gives) is checked without
    building the message of each entry; anything else takes the entry-by-entry path, which names the bad one."""
    if type(value) is dict:
        for key, item in value.items():
            if type(key) is not str or type(item) is not str:
                break
        else:
            return dict(value)
    out: dict[str, str] = {}
    for key, item in optional_mapping(value, what).items():
        out[string(key, f"{what} key")] = string(item, f"{what}[{printable(key[:100])}]")
    return out


def plain_key(items: Sequence[Any], fields: tuple[str, ...]) -> tuple[tuple[Any, ...], ...] | None:
    """The values of ``fields`` in each of ``items`` as one hashable key, when every item is a dict and every value
    is None, a str or an int (exactly those types: not a bool, not a subclass); None otherwise. A parser that reads
    only those fields (a missing one read as null) gives the same answer for two lists with the same key, so it can
    be memoized on it: most objects of a cluster repeat a few port lists. Anything unusual takes the parser itself,
    which names what is wrong."""
    key = []
    for item in items:
        if type(item) is not dict:
            return None
        values = tuple([item.get(f) for f in fields])
        for x in values:
            if x is not None and type(x) is not str and type(x) is not int:
                return None
        key.append(values)
    return tuple(key)


def from_key(key: tuple[tuple[Any, ...], ...], fields: tuple[str, ...]) -> list[dict[str, Any]]:
    """The items a ``plain_key`` stands for (nulls where a field was missing: the same to its parser)."""
    return [dict(zip(fields, values, strict=True)) for values in key]


def _unsloppy(text: str) -> str:
    """Go's ``ParseIPSloppy`` (upstream parses every address with it): an IPv4 dotted quad whose parts carry
    leading zeros, which API servers before Kubernetes 1.22 accepted and still hold, is read as decimal
    (``010.001.2.3`` is 10.1.2.3). Anything else is returned unchanged."""
    parts = text.split(".")
    if len(parts) != 4 or not all(p.isascii() and p.isdigit() for p in parts):
        return text
    return ".".join(str(int(p)) for p in parts)


def ip_address(value: Any, what: str) -> tuple[str, IPFamily, int]:
    """Canonical text, family and integer value of an IP address (no CIDR, no zone; IPv4 parts with leading zeros
    are read as decimal, as upstream's ParseIPSloppy)."""
    text = string(value, what)
    try:
        # Fast path for the common case: glibc's inet_pton accepts only strict dotted quads, which are
        # already canonical; it is ~10x cheaper than ipaddress and this runs once per endpoint.
        packed = socket.inet_pton(socket.AF_INET, text)
        return text, IPFamily.V4, int.from_bytes(packed, "big")
    except OSError:
        pass
    try:
        addr = ipaddress.ip_address(_unsloppy(text))
    except ValueError:
        raise ValueError(f"{what}: {_show(text)} is not an IP address") from None
    if addr.version == 4:
        return str(addr), IPFamily.V4, int(addr)
    if isinstance(addr, ipaddress.IPv6Address) and addr.scope_id:
        raise ValueError(f"{what}: {_show(text)} carries a zone index")
    return str(addr), IPFamily.V6, int(addr)


def cidr(value: Any, what: str) -> tuple[str, IPFamily]:
    """Canonical text and family of a CIDR; host bits are cleared (the API server accepts them), spaces trimmed,
    IPv4 parts with leading zeros read as decimal (upstream's ParseCIDRSloppy)."""
    text = string(value, what).strip()
    if "/" not in text:
        raise ValueError(f"{what}: {_show(text)} is not a CIDR (no prefix length)")
    try:
        addr, _, prefix = text.partition("/")
        net = ipaddress.ip_network(f"{_unsloppy(addr)}/{prefix}", strict=False)
    except ValueError:
        raise ValueError(f"{what}: {_show(text)} is not a CIDR") from None
    return str(net), IPFamily.V6 if net.version == 6 else IPFamily.V4
