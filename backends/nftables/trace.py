"""A packet explainer over the nftables layout kproxy last applied (in the spirit of upstream's ``tracePacket``).

Given the applied fragments and the family's context, ``trace`` walks a new connection's first packet the way the
kernel would through kproxy's table: the ``services`` chain's lookups in ``service-ips`` (address . protocol . port)
and, for a packet to one of the node's own addresses in ``nodeport-cidrs``, ``service-nodeports``; then the chain the
element's verdict names (shared ``lb-i-3``-style chains, rendered from their names, or the service's own affinity
chains), with ``numgen`` forking the walk into every slot of the backends maps with its probability; reject and
drop verdicts; and nat-postrouting's masquerade (the conntrack label set on the way, or a hairpin). Only the
matches kproxy writes are understood; an affinity set is assumed to hold no entry yet, and ``iifname`` (interface
based local-traffic detection) cannot be known for a hypothetical packet, so it is reported as not matching.
Pure: no kernel, so ``kproxy show --trace`` and ``/rules`` can answer anywhere.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from typing import Any

from kproxy.model import IPFamily, ServicePortName
from kproxy.nodeaddr import FamilyContext
from kproxy.toolkit.cidr import in_any
from kproxy.toolkit.trace import Outcome as Outcome
from kproxy.toolkit.trace import Packet as Packet

from . import layout, render

_MAX_DEPTH = 20


class _Step(enum.Enum):
    """A rule the packet passes on to the next (a walk's steps return it, or outcomes, or None for "not
    understood")."""

    NEXT = "next"


_NEXT = _Step.NEXT


_DNAT_MAP = re.compile(r"^meta l4proto (\w+) dnat ip6? to (.+) \. numgen random mod (\d+) map @(\S+)$")
_DNAT_CONST = re.compile(r"^meta l4proto \w+ dnat ip6? to \[?([0-9a-fA-F:.]+?)\]?:(\d+)$")
_VMAP = re.compile(r"^numgen random mod (\d+) vmap \{ (.*) \}$")


class _Walker:
    def __init__(self, ctx: FamilyContext, fragments: Mapping[ServicePortName, render.Fragment], pkt: Packet):
        self.ctx = ctx
        self.pkt = pkt
        self.family = ctx.family
        self.maps: dict[str, dict[str, str]] = {}
        self.firewall: list[tuple[str, str]] = []
        self.chains: dict[str, tuple[str, ...]] = {}
        self.hairpin: set[str] = set()
        for frag in fragments.values():
            for m, k, v in frag.elements:
                if m == layout.FIREWALL:
                    prefix, _, cidr = k.rpartition(" . ")
                    self.firewall.append((prefix, cidr))
                else:
                    self.maps.setdefault(m, {})[k] = v
            self.chains.update(frag.chains)
            self.hairpin.update(frag.hairpin)
        self.ctx_sets = layout.context_elements(ctx)
        self.notes: list[str] = []

    def rules(self, chain: str) -> tuple[str, ...]:
        if chain in self.chains:
            return self.chains[chain]
        if layout.is_shared_chain(chain):
            return layout.shared_chain_rules(chain, self.family)
        return layout.fixed_chain_rules(self.family).get(chain, ())

    def local_pod(self) -> bool:
        return in_any(self.pkt.src, self.ctx_sets[layout.LOCAL_CIDRS])

    def verdict(self, v: str, out: Outcome, depth: int) -> list[Outcome]:
        if v == "drop":
            out.verdict = "DROP"
            return [out]
        if v.startswith("goto "):
            target = v[5:]
            if target == layout.REJECT_CHAIN:
                out.path.append(f"{target}: reject")
                out.verdict = "REJECT"
                return [out]
            return self.walk(target, out, depth + 1)
        out.verdict = v.upper()
        return [out]

    def walk(self, chain: str, out: Outcome, depth: int) -> list[Outcome]:
        if depth > _MAX_DEPTH:
            out.verdict = "LOOP"
            return [out]
        for rule in self.rules(chain):
            here = f"{chain}: {rule}"
            got = self._source_rule(chain, rule, here, out, depth)
            if got is None:
                got = self._target_rule(rule, here, out, depth)
            if got is _NEXT:
                continue
            if got is not None:
                return got
            out.path.append(f"{here} (not understood by the explainer)")
        return [out]

    def _source_rule(self, chain: str, rule: str, here: str, out: Outcome, depth: int) -> list[Outcome] | _Step | None:
        """Rules that decide by the packet's source (masquerade, local pods, the node, firewall, affinity):
        ``_NEXT`` when the packet goes on to the next rule, None when ``rule`` is not one of them."""
        p = self.pkt
        fam = "ip6" if self.family == IPFamily.V6 else "ip"
        if rule == f"jump {layout.MASQ_INTERNAL}":
            if not self.local_pod():
                out.masquerade = True
                out.path.append(f"{here} (source is not a local pod: masquerade)")
            else:
                out.path.append(f"{here} (source is a local pod: no masquerade)")
            return _NEXT
        if rule == f"ct label set {layout.MASQ_LABEL}":
            out.masquerade = True
            out.path.append(here)
            return _NEXT
        if rule.startswith(f"{fam} saddr @{layout.LOCAL_CIDRS} goto "):
            if self.local_pod():
                out.path.append(here)
                return self.walk(rule.rsplit(" ", 1)[1], out, depth + 1)
            return _NEXT
        if rule.startswith(f"iifname @{layout.LOCAL_IFACES} "):
            if self.ctx_sets[layout.LOCAL_IFACES]:
                self.notes.append("interface-based local detection is not evaluated for a hypothetical packet")
            return _NEXT
        if rule.startswith("fib saddr type local "):
            if p.src_local:
                out.masquerade = True
                out.path.append(here)
                return self.walk(rule.rsplit(" ", 1)[1], out, depth + 1)
            return _NEXT
        if f"@{layout.FIREWALL} goto " in rule:
            prefix = f"{p.dst} . {p.proto} . {p.dport}"
            allowed = [c for k, c in self.firewall if k == prefix]
            if in_any(p.src, tuple(allowed)):
                out.path.append(f"{here} (source allowed)")
                return self.walk(rule.rsplit(" ", 1)[1], out, depth + 1)
            out.path.append(f"{chain}: source {p.src} not in loadBalancerSourceRanges")
            return _NEXT
        if rule.startswith((f"{fam} saddr @aff-", "update @")):
            return _NEXT  # no affinity entry yet
        return None

    def _target_rule(self, rule: str, here: str, out: Outcome, depth: int) -> list[Outcome] | _Step | None:
        """Rules that end the walk or fork it: drop, goto, DNAT from a slot map or to a constant, a numgen vmap."""
        if rule == "drop":
            out.path.append(here)
            out.verdict = "DROP"
            return [out]
        if rule.startswith("goto "):
            out.path.append(here)
            return self.walk(rule[5:], out, depth + 1)
        m = _DNAT_MAP.match(rule)
        if m:
            return self._dnat_slots(m, here, out) if m.group(1) == self.pkt.proto else _NEXT
        m = _DNAT_CONST.match(rule)
        if m:
            ip, port = m.group(1), m.group(2)
            out.path.append(here)
            out.dnat = f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
            return [out]
        m = _VMAP.match(rule)
        if m:
            k = int(m.group(1))
            results = []
            for item in m.group(2).split(", "):
                _, _, target = item.partition(" : goto ")
                o = Outcome(out.probability / k, [*out.path, here], out.masquerade)
                results.extend(self.walk(target, o, depth + 1))
            return results
        return None

    def _dnat_slots(self, m: re.Match[str], here: str, out: Outcome) -> list[Outcome]:
        """``numgen random mod K map @slots``: one outcome per slot, each with probability 1/K."""
        p = self.pkt
        k, mapname = int(m.group(3)), m.group(4)
        base = f"{p.dst} . {p.proto} . {p.dport}" if "daddr" in m.group(2) else f"{p.proto} . {p.dport}"
        results = []
        for i in range(k):
            value = self.maps.get(mapname, {}).get(f"{base} . {i}")
            o = Outcome(out.probability / k, [*out.path, here, f"@{mapname}[{base} . {i}] = {value}"], out.masquerade)
            if value is None:
                o.verdict = "no backend in slot (inconsistent map)"
            else:
                ip, _, port = value.partition(" . ")
                o.dnat = f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
            results.append(o)
        return results


def trace(ctx: FamilyContext, fragments: Mapping[ServicePortName, render.Fragment], pkt: Packet) -> dict[str, Any]:
    """Where the first packet of a new connection goes: the DNAT choices with probabilities, or the verdict."""
    w = _Walker(ctx, fragments, pkt)
    start = Outcome()
    key = f"{pkt.dst} . {pkt.proto} . {pkt.dport}"
    outcomes: list[Outcome]
    v = w.maps.get(layout.SERVICE_IPS, {}).get(key)
    if v is not None:
        start.path.append(f"services: @{layout.SERVICE_IPS}[{key}] = {v}")
        outcomes = w.verdict(v, start, 0)
    elif pkt.dst_local and in_any(pkt.dst, w.ctx_sets[layout.NODEPORT_CIDRS]):
        npkey = f"{pkt.proto} . {pkt.dport}"
        v = w.maps.get(layout.SERVICE_NODEPORTS, {}).get(npkey)
        if v is None:
            start.path.append(f"services: no element {npkey} in @{layout.SERVICE_NODEPORTS}")
            outcomes = [start]
        else:
            start.path.append(f"services: @{layout.SERVICE_NODEPORTS}[{npkey}] = {v}")
            outcomes = w.verdict(v, start, 0)
    else:
        start.path.append(f"services: no element {key} in @{layout.SERVICE_IPS}")
        outcomes = [start]
    results = []
    for o in outcomes:
        masq = o.masquerade
        if o.dnat is not None and not masq:
            ip = o.dnat.rsplit(":", 1)[0].strip("[]")
            if ip == pkt.src and f"{ip} . {ip}" in w.hairpin:
                masq = True
                o.path.append(f"nat-postrouting: hairpin {ip} . {ip}: masquerade")
        verdict = f"DNAT {o.dnat}" if o.dnat else (o.verdict or "no service rule")
        results.append(o.result(verdict, masq and o.dnat is not None, o.path))
    out: dict[str, Any] = {
        "packet": pkt.to_dict(),
        "hook": "output" if pkt.src_local else "prerouting",
        "outcomes": results,
    }
    if w.notes:
        out["notes"] = sorted(set(w.notes))
    return out
