"""A packet explainer over the rendered rules (in the spirit of upstream's ``tracePacket`` test helper).

Given the fragments the proxier last applied, ``trace`` walks a new connection's first packet through kproxy's
chains: nat ``KUBE-SERVICES`` (and what it jumps to), then, for a packet not translated, kproxy's jumps in the
filter hook it passes (INPUT, FORWARD or OUTPUT, from the packet's ``src_local`` / ``dst_local``) in the kernel's
order, down to the first ACCEPT, DROP or REJECT. Probabilistic rules (``statistic``) fork the walk, so the answer
lists every endpoint the packet may reach and with what chance.
Only the matches kproxy itself writes are understood; ClientIP affinity (``recent --rcheck``) is assumed to have no
entry yet. Pure: no kernel, so ``kproxy show`` and ``/rules`` can answer "where would this packet go" anywhere.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kproxy.model import ServicePortName
from kproxy.toolkit.cidr import in_any
from kproxy.toolkit.trace import Outcome as Outcome
from kproxy.toolkit.trace import Packet as Packet

from . import render

_MAX_STEPS = 200  # chains jump only forward in this layout; bounded anyway


@dataclass(frozen=True, slots=True)
class Rule:
    chain: str
    text: str
    matches: tuple[tuple[bool, str, str], ...]  # (negated, kind, value)
    target: str
    probability: float | None = None
    to: str | None = None


def parse(line: str) -> Rule:
    words = shlex.split(line)
    chain = words[1]
    matches: list[tuple[bool, str, str]] = []
    target = ""
    prob: float | None = None
    to: str | None = None
    neg = False
    i = 2
    while i < len(words):
        w = words[i]
        nxt = words[i + 1] if i + 1 < len(words) else ""
        if w == "!":
            neg = True
            i += 1
            continue
        if w in ("-s", "-d", "-p", "--dport", "--src-type", "--dst-type"):
            matches.append((neg, w, nxt))
            i += 2
        elif w == "--mark":
            matches.append((neg, "mark", nxt))
            i += 2
        elif w == "--ctstate":
            matches.append((neg, "ctstate", nxt))
            i += 2
        elif w == "--rcheck":
            matches.append((False, "rcheck", ""))
            i += 1
        elif w == "--probability":
            prob = float(nxt)
            i += 2
        elif w == "-j":
            target = nxt
            i += 2
        elif w == "--to-destination":
            to = nxt
            i += 2
        elif w in ("-m", "--comment", "--mode", "--name", "--seconds", "--or-mark", "--xor-mark"):
            i += 2
        else:
            i += 1
        neg = False
    return Rule(chain, line, tuple(matches), target, prob, to)


def _matches(rule: Rule, pkt: Packet, marked: bool) -> bool:
    for neg, kind, value in rule.matches:
        if kind == "-s":
            ok = in_any(pkt.src, (value,))
        elif kind == "-d":
            ok = in_any(pkt.dst, (value,))
        elif kind == "-p":
            ok = pkt.proto == value
        elif kind == "--dport":
            ok = str(pkt.dport) == value
        elif kind == "--src-type":
            ok = pkt.src_local
        elif kind == "--dst-type":
            ok = pkt.dst_local
        elif kind == "rcheck":
            ok = False  # no affinity entry yet
        elif kind == "ctstate":
            ok = "NEW" in value.split(",")  # the first packet of a new connection
        elif kind == "mark":
            ok = marked  # kproxy matches only its masquerade mark
        else:
            ok = True
        if ok == neg:
            return False
    return True


def _walk(chains: Mapping[str, list[Rule]], chain: str, pkt: Packet, out: Outcome, depth: int = 0) -> list[Outcome]:
    """Every way through ``chain``: a list of outcomes whose probabilities add up to the input's."""
    if depth > _MAX_STEPS:
        return [out]
    results: list[Outcome] = []
    current = [out]
    for rule in chains.get(chain, []):
        nxt: list[Outcome] = []
        for o in current:
            if o.dnat is not None or o.verdict is not None or not _matches(rule, pkt, o.masquerade):
                nxt.append(o)
                continue
            p = rule.probability if rule.probability is not None else 1.0
            taken = Outcome(o.probability * p, [*o.path, rule.text], o.masquerade, o.dnat, o.verdict)
            if rule.target == "KUBE-MARK-MASQ":
                taken.masquerade = True
                nxt.append(taken)
            elif rule.target == "DNAT":
                taken.dnat = rule.to
                nxt.append(taken)
            elif rule.target in ("REJECT", "DROP", "ACCEPT"):
                taken.verdict = rule.target
                nxt.append(taken)
            elif rule.target == "RETURN":
                results.append(taken)
            elif rule.target in chains:
                nxt.extend(_walk(chains, rule.target, pkt, taken, depth + 1))
            else:
                nxt.append(taken)
            if p < 1.0:
                nxt.append(Outcome(o.probability * (1 - p), list(o.path), o.masquerade, o.dnat, o.verdict))
        current = nxt
    return results + current


def chains_of(
    ctx: render.Context, fragments: Mapping[ServicePortName, render.Fragment]
) -> dict[str, dict[str, list[Rule]]]:
    """table -> chain -> parsed rules, as the kernel holds them after a full sync of ``fragments``."""
    out: dict[str, dict[str, list[Rule]]] = {"nat": {}, "filter": {}}
    fixed = render.render_fixed(ctx)
    for key in render.ALL_TOP:
        table = key.split("/", 1)[0]
        head, tail = fixed.get(key, ((), ()))
        lines = list(head)
        for frag in fragments.values():
            lines.extend(frag.top.get(key, ()))
        lines.extend(tail)
        out[table][key.split("/", 1)[1]] = [parse(x) for x in lines]
    for frag in fragments.values():
        for line in frag.rules:
            rule = parse(line)
            out["nat"].setdefault(rule.chain, []).append(rule)
    return out


def hook(pkt: Packet) -> str:
    """The filter table's built-in chain a packet passes: OUTPUT when the node sends it, INPUT when it is for one of
    the node's addresses, FORWARD otherwise."""
    if pkt.src_local:
        return "OUTPUT"
    return "INPUT" if pkt.dst_local else "FORWARD"


def hook_rules(chain: str) -> list[Rule]:
    """kproxy's jumps in a built-in filter chain, in the kernel's order: each is inserted at position 1 in
    ``render.JUMP_RULES``' order (as upstream prepends ``iptablesJumpChains``), so the last one ends up first."""
    jumps = [j for j in render.JUMP_RULES if j.table == "filter" and j.chain == chain]
    return [parse(f"-A {chain} {j.spec}") for j in reversed(jumps)]


def trace(ctx: render.Context, fragments: Mapping[ServicePortName, render.Fragment], pkt: Packet) -> dict[str, Any]:
    """Where the first packet of a new connection goes: the nat decision (with probabilities), then filter's."""
    tables = chains_of(ctx, fragments)
    outcomes = _walk(tables["nat"], "KUBE-SERVICES", pkt, Outcome())
    builtin = hook(pkt)
    tables["filter"][builtin] = hook_rules(builtin)
    results: list[dict[str, Any]] = []
    for o in outcomes:
        verdict = f"DNAT {o.dnat}" if o.dnat else "no service rule"
        path = list(o.path)
        if o.dnat is None:
            # not translated: kproxy's chains hooked into this built-in chain decide, in order (the first verdict
            # wins: a firewall DROP, a healthCheckNodePort ACCEPT, a REJECT / DROP for a port without endpoints)
            walked = _walk(tables["filter"], builtin, pkt, Outcome(masquerade=o.masquerade))
            hit = [x for x in walked if x.verdict]
            if hit:
                verdict = hit[0].verdict or verdict
                path.extend(hit[0].path)
        results.append(o.result(verdict, o.masquerade, path))
    return {"packet": pkt.to_dict(), "hook": builtin, "outcomes": results}
