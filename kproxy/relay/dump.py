"""The one dump per family of the relay's traffic counters (``counters.Tally``, ``--service-counters``) that the
collector reads (``kproxy.counters``): taken in the loop thread in one step, so it never races a relay. Apart from
``counters`` because it reads the engine and its listeners, which themselves keep a tally.
"""

from __future__ import annotations

from collections.abc import Mapping

from kproxy.counters import CounterDump, Counts, PortCounters
from kproxy.model import IPFamily, ServicePortName, endpoint_label

from .balancer import Addr
from .datapath import Engine
from .stats import Ident
from .tcp import TcpListener
from .udp import UdpListener

DUMP_TIMEOUT_S = 10.0


def endpoint_key(ep: Addr) -> str:
    return endpoint_label(ep[0], ep[1])


#: what the loop thread hands over per listener: its service port, its endpoints, and its tally's figures
_Row = tuple[ServicePortName, tuple[Addr, ...], dict[Addr, int], int, int]


def _snapshot(listeners: Mapping[Ident, TcpListener | UdpListener], family: IPFamily) -> list[_Row]:
    """Loop thread: every counting listener of ``family`` (idents ``(family, service port, role)``)."""
    rows = []
    for ident, lst in listeners.items():
        tally = lst.tally
        if tally is None or ident[0] != family:
            continue
        rows.append((ident[1], tuple(lst.balancer.endpoints), dict(tally.endpoints), tally.connections, tally.moved()))
    return rows


def dump(engine: Engine, family: IPFamily) -> CounterDump:
    """Every proxy socket's counters in ``family``, read in the loop thread in one step (``datapath.Engine``); an
    engine not running has none."""
    if engine.loop is None:
        return CounterDump(family, {})
    try:
        rows: list[_Row] = engine.run(lambda: _snapshot(engine.listeners, family), DUMP_TIMEOUT_S)
    except RuntimeError:  # stopped meanwhile
        return CounterDump(family, {})
    merged: dict[ServicePortName, tuple[dict[Addr, int], int, int]] = {}
    for spn, eps, per_ep, conns, moved in rows:
        seen, total, nbytes = merged.get(spn, ({}, 0, 0))
        for ep in eps:
            seen[ep] = seen.get(ep, 0) + per_ep.get(ep, 0)
        merged[spn] = (seen, total + conns, nbytes + moved)
    ports = {
        spn: PortCounters.of({endpoint_key(ep): Counts(seen[ep]) for ep in sorted(seen)}, Counts(total, None, nbytes))
        for spn, (seen, total, nbytes) in merged.items()
    }
    return CounterDump(family, ports)
