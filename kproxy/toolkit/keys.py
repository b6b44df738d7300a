"""A service port's key text, the one spelling used in comments, ``describe()``, ``kernel_view()`` and the bpf
names map."""

from __future__ import annotations

from kproxy.model import ServicePortName


def service_key(name: ServicePortName) -> str:
    """``ns/name[:port]/PROTO``. Spelled out (no ``str(name)``, no enum ``.value`` property): a full sync asks for
    it a few times per service."""
    p = name.port
    proto = name.protocol._value_
    return f"{name.namespace}/{name.name}:{p}/{proto}" if p else f"{name.namespace}/{name.name}/{proto}"
