"""The bpf mode's packet explainer (``/trace``, ``kproxy trace``): where a new connection would go, read from the maps
themselves (a few lookups, no lock): the frontend's master entry, each slot's backend id and the backend's address.
A socket of the node's cgroup is translated at connect; other packets meet the companion table, whose elements of
the destination are listed too (from the fragments the ledger records as applied)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kproxy.model import IPFamily, ServicePortName

from . import maps
from .companion import TABLE
from .render import Fragment


def _hostport(family: IPFamily, a: str, p: int) -> str:
    return f"{a}:{p}" if family == IPFamily.V4 else f"[{a}]:{p}"


def companion_lines(
    applied: Mapping[ServicePortName, Fragment], proto: str, dst: str, dport: int, dst_local: bool
) -> list[str]:
    """The companion table's elements a packet to ``dst:dport`` meets."""
    p = proto.lower()
    return [
        f"nft {TABLE}: {m} {k} : {v}"
        for frag in applied.values()
        for m, k, v in frag.nft.elements
        if k.startswith(f"{dst} . {p} . {dport}") or (dst_local and k == f"{p} . {dport}")
    ]


def explain(
    fds: Mapping[str, int],
    applied: Mapping[ServicePortName, Fragment],
    proto: str,
    dst: str,
    dport: int,
    *,
    src_local: bool = False,
    dst_local: bool = False,
) -> dict[str, Any]:
    """The outcomes of a new connection to ``dst:dport/proto`` (``fds``: role -> fd of the family's maps)."""
    fam = IPFamily.of(dst)
    pnum = maps.PROTO_NUMBERS.get(proto.upper(), 0)
    ks = maps.key_sizes(fam)
    front = _hostport(fam, dst, dport) + f"/{proto.upper()}"
    raw = maps.lookup(fds["svc"], maps.lb_key(fam, dst, dport, pnum, 0), ks["svc"][1])
    companion = companion_lines(applied, proto, dst, dport, dst_local)
    if raw is None:
        return {"outcomes": [{"probability": 1.0, "verdict": "not a frontend: not translated", "rules": companion}]}
    _bid, aff, count, rev, flags = maps.decode_service(raw)
    name_raw = maps.lookup(fds["name"], maps.name_key(rev), maps.NAME_VAL.size)
    name = maps.decode_name(name_raw) if name_raw else f"rev_nat_id {rev}"
    head = [f"{TABLE} svc {front} slot 0: count={count} flags={flags:#x} affinity={aff}s rev_nat={rev} ({name})"]
    if flags & maps.F_REJECT:
        verdict = "reject: connect()/sendmsg() fail with ECONNREFUSED" if src_local else "reject (companion table)"
        return {"service": name, "outcomes": [{"probability": 1.0, "verdict": verdict, "rules": head + companion}]}
    if flags & maps.F_DROP or count == 0:
        verdict = "not translated; dropped by the companion table"
        return {"service": name, "outcomes": [{"probability": 1.0, "verdict": verdict, "rules": head + companion}]}
    outcomes = []
    for slot in range(1, count + 1):
        sraw = maps.lookup(fds["svc"], maps.lb_key(fam, dst, dport, pnum, slot), ks["svc"][1])
        if sraw is None:
            continue
        bid = maps.decode_service(sraw)[0]
        braw = maps.lookup(fds["be"], maps.backend_key(bid), ks["be"][1])
        if braw is None or not any(braw):  # an array entry of no backend is all zero
            continue
        a, p, _ = maps.decode_backend(fam, braw)
        target = _hostport(fam, a, p)
        rules = [*head, f"slot {slot} -> backend {bid} {target}"]
        outcomes.append(
            {
                "probability": round(1.0 / count, 4),
                "verdict": f"socket connected to {target}" if src_local else f"DNAT to {target}",
                "masquerade": False,
                "rules": rules if src_local else rules + companion,
            }
        )
    return {"service": name, "affinitySeconds": aff if flags & maps.F_AFFINITY else 0, "outcomes": outcomes}
