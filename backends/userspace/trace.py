"""The userspace mode's packet explainer (``kproxy trace``): where a new connection's first packet goes through
what was last applied: the redirect element it meets (or the reject / drop / firewall verdict), the proxy socket's
port and the endpoints that socket balances over. Pure: it reads the ledger's applied fragments and the proxy ports
the proxier holds, never the kernel."""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from typing import Any

from kproxy.model import IPFamily, ServicePortName
from kproxy.nodeaddr import FamilyContext
from kproxy.toolkit.trace import Packet

from . import render
from .ports import Ident
from .render import Entry, Fragment


def _hit(fragments: Mapping[ServicePortName, Fragment], pkt: Packet, key: str) -> tuple[ServicePortName, Entry] | None:
    """The element the packet meets: its address . protocol . port, or (to a local address) its node port."""
    for spn, frag in fragments.items():
        for e in frag.entries:
            if (e.map == render.SERVICE_IPS and e.key == key) or (
                pkt.dst_local and e.map == render.SERVICE_NODEPORTS and e.key == f"{pkt.proto} . {pkt.dport}"
            ):
                return spn, e
    return None


def _outcome(
    ports: Mapping[Ident, int], fam: IPFamily, frag: Fragment, spn: ServicePortName, e: Entry, pkt: Packet
) -> tuple[dict[str, Any], list[str]]:
    """What becomes of a packet that met element ``e`` of ``spn``: the outcome and the steps after the element."""
    path: list[str] = []
    if e.verdict == render.V_FIREWALL:
        nets = [k.rsplit(" . ", 1)[1] for k in frag.firewall]
        allowed = any(ipaddress.ip_address(pkt.src) in ipaddress.ip_network(n) for n in nets)
        path.append(f"firewall: source {pkt.src} {'in' if allowed else 'not in'} {', '.join(nets) or '-'}")
        if not allowed:
            e = Entry(e.map, e.key, render.V_DROP)
    if not e.role:
        verdict = "REJECT (ICMP port unreachable)" if e.verdict == render.V_REJECT else "DROP"
        return {"verdict": verdict}, path
    port = ports.get((fam, spn, e.role))
    lst = next(x for x in frag.listeners if x.role == e.role)
    local = "loopback" if pkt.src_local else "the receiving interface's address"
    path.append(f"redirect to {local}:{port} (proxy socket {e.role} of {render.service_key(spn)})")
    outcome = {
        "verdict": f"REDIRECT :{port}",
        "proxyPort": port,
        "endpoints": [f"[{ip}]:{pt}" if ":" in ip else f"{ip}:{pt}" for ip, pt in lst.endpoints],
        "balancing": "round robin" + (f", ClientIP affinity {lst.affinity} s" if lst.affinity else ""),
    }
    return outcome, path


def walk(
    ports: Mapping[Ident, int], ctx: FamilyContext, fragments: Mapping[ServicePortName, Fragment], pkt: Packet
) -> dict[str, Any]:
    """The trace answer for ``pkt`` (see the module docstring); ``ports``: the proxier's proxy ports by socket."""
    fam = IPFamily.of(pkt.dst)
    key = f"{ipaddress.ip_address(pkt.dst)} . {pkt.proto} . {pkt.dport}"
    hit = _hit(fragments, pkt, key)
    outcome: dict[str, Any]
    if hit is None:
        nodeports = " or @service-nodeports" if pkt.dst_local else ""
        outcome = {"verdict": "no service rule"}
        path = [f"services: no element {key} in @{render.SERVICE_IPS}{nodeports}"]
    else:
        spn, e = hit
        path = [f"services: @{e.map}[{e.key}] = {e.verdict} ({render.service_key(spn)})"]
        outcome, more = _outcome(ports, fam, fragments[spn], spn, e, pkt)
        path += more
    outcome["rules"] = path
    return {
        "packet": pkt.to_dict(),
        "hook": "output" if pkt.src_local else "prerouting",
        "outcomes": [outcome],
    }
