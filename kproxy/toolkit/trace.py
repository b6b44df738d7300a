"""What a rule walk (``kproxy trace``) works on: the first packet of a new connection, and each way it can go
through the rules with its probability; ``traced`` is the part every backend's ``trace`` shares."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kproxy.model import IPFamily, ServicePortName

C = TypeVar("C")
F = TypeVar("F")


@dataclass(frozen=True, slots=True)
class Packet:
    """The first packet of a new connection."""

    src: str
    proto: str  # tcp / udp / sctp
    dst: str
    dport: int
    src_local: bool = False  # sent by the node itself (a local source address)
    dst_local: bool = False  # to one of the node's addresses

    def to_dict(self) -> dict[str, Any]:
        """The packet as a trace answer names it."""
        return {
            "src": self.src,
            "proto": self.proto,
            "dst": self.dst,
            "dport": self.dport,
            "srcLocal": self.src_local,
            "dstLocal": self.dst_local,
        }


@dataclass(slots=True)
class Outcome:
    """One way through the rules: its probability, the steps taken, and where it ends."""

    probability: float = 1.0
    path: list[str] = field(default_factory=list)
    masquerade: bool = False
    dnat: str | None = None
    verdict: str | None = None

    def result(self, verdict: str, masquerade: bool, rules: list[str]) -> dict[str, Any]:
        """This way as a trace answer lists it, with the verdict and masquerade the walk decided at its end."""
        return {"probability": round(self.probability, 6), "verdict": verdict, "masquerade": masquerade, "rules": rules}


def traced(
    applied: Callable[[IPFamily], tuple[C | None, Mapping[ServicePortName, F]]],
    walk: Callable[[C, Mapping[ServicePortName, F], Packet], dict[str, Any]],
    src: str,
    proto: str,
    dst: str,
    dport: int,
    *,
    src_local: bool = False,
    dst_local: bool = False,
) -> dict[str, Any]:
    """``walk`` over what was last applied in ``dst``'s family (``applied``: the context and fragments), or an
    ``error`` when ``dst`` is not an address or nothing of its family was applied yet."""
    try:
        fam = IPFamily.of(dst)
    except ValueError:
        return {"error": f"not an address: {dst!r}"}
    ctx, fragments = applied(fam)
    if ctx is None:
        return {"error": f"no {fam.value} rules applied yet"}
    return walk(ctx, fragments, Packet(src, proto.lower(), dst, dport, src_local, dst_local))
