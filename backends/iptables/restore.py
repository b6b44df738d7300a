"""``iptables-restore`` payloads from fragments (pure): one payload per family, or chunks of whole services.

``build_restore`` writes only the dirty services' own chains and only the shared chains whose content changed, and
records which payload lines belong to which service, so a line the kernel refuses is traced back to it.
``build_restores`` and ``stream_restores`` split a big change into payloads of whole services (the nf_tables
flavour's ``iptables-restore`` spends time quadratic in a payload's size: docs/PERFORMANCE.md, iptables mode).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from kproxy.model import ServicePortName

from . import layout
from .layout import (
    KUBE_PROXY_CANARY,
    N_MARK_MASQ,
    N_POSTROUTING,
    Context,
    Fragment,
    JumpRule,
)

# ----------------------------------------------------------------------------------------------- payload


@dataclass(slots=True)
class Restore:
    """One ``iptables-restore`` payload and the owner of its lines (for mapping "line N failed" to a service)."""

    text: str
    owners: list[tuple[int, int, ServicePortName]] = field(default_factory=list)  # [first, last] 1-based, inclusive
    rules: dict[str, int] = field(default_factory=dict)  # rules written per table

    def owner_of(self, line: int) -> ServicePortName | None:
        for first, last, spn in self.owners:
            if first <= line <= last:
                return spn
        return None


class _Writer:
    """Appends lines, counting them, and notes which service owns each run of lines."""

    __slots__ = ("lines", "owners")

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.owners: list[tuple[int, int, ServicePortName]] = []

    def add(self, lines: Iterable[str]) -> None:
        self.lines.extend(lines)

    def owned(self, lines: Sequence[str], spn: ServicePortName) -> None:
        if lines:
            first = len(self.lines) + 1
            self.lines.extend(lines)
            self.owners.append((first, len(self.lines), spn))


def changed_top_chains(
    old: Mapping[ServicePortName, Fragment],
    new: Mapping[ServicePortName, Fragment | None],
) -> set[str]:
    """Shared chains whose content differs when the fragments in ``new`` replace those in ``old`` (None = removed)."""
    changed: set[str] = set()
    empty: Mapping[str, tuple[str, ...]] = {}
    for spn, frag in new.items():
        before = old.get(spn)
        a = before.top if before is not None else empty
        b = frag.top if frag is not None else empty
        for key in a.keys() | b.keys():
            if a.get(key) != b.get(key):
                changed.add(key)
    return changed


def build_restore(
    ctx: Context,
    fragments: Mapping[ServicePortName, Fragment],
    *,
    write: Iterable[ServicePortName] | None,
    top: Iterable[str] | None,
    delete_chains: Iterable[str] = (),
    jump_rules: Iterable[JumpRule] = (),
    canary: bool = False,
) -> Restore:
    """The restore payload for one family.

    ``fragments`` is every wanted service (in order); ``write`` the services whose own chains are written (None:
    all, a full sync); ``top`` the shared chains to rewrite (None: all); ``delete_chains`` nat chains to flush and
    delete; ``jump_rules`` built-in chain jumps to insert (those missing from the kernel); ``canary`` declares
    KUBE-PROXY-CANARY in mangle, filter and nat (full syncs).
    """
    fixed = layout.render_fixed(ctx)
    top_set = set(ctx.top_chains["filter"] + ctx.top_chains["nat"]) if top is None else set(top)
    to_write = fragments.keys() if write is None else [s for s in write if s in fragments]
    deleting = sorted(set(delete_chains))
    jumps = list(jump_rules)
    w = _Writer()
    rules = {"filter": 0, "nat": 0}

    if canary:
        w.add(("*mangle", f":{KUBE_PROXY_CANARY} - [0:0]", "COMMIT"))

    for table in ("filter", "nat"):
        keys = [k for k in ctx.top_chains[table] if k in top_set]
        own = table == "nat" and (to_write or deleting)
        tjumps = [j for j in jumps if j.table == table]
        if not keys and not own and not tjumps and not canary:
            continue
        w.add(("*" + table,))
        if canary:
            w.add((f":{KUBE_PROXY_CANARY} - [0:0]",))
        for key in keys:
            w.add((f":{key.split('/', 1)[1]} - [0:0]",))
        if table == "nat":
            w.add(f":{c} - [0:0]" for spn in to_write for c in fragments[spn].chains)
            w.add(f":{c} - [0:0]" for c in deleting)
        for key in keys:
            head, tail = fixed.get(key, ((), ()))
            w.add(head)
            rules[table] += len(head)
            for spn, frag in fragments.items():
                lines = frag.top.get(key)
                if lines:
                    w.owned(lines, spn)
                    rules[table] += len(lines)
            w.add(tail)
            rules[table] += len(tail)
        if table == "nat":
            for spn in to_write:
                lines = fragments[spn].rules
                w.owned(lines, spn)
                rules["nat"] += len(lines)
            w.add(f"-X {c}" for c in deleting)
        for j in tjumps:
            w.add((f"-I {j.chain} 1 {j.spec}",))
            rules[table] += 1
        w.add(("COMMIT",))
    text = "\n".join(w.lines) + "\n" if w.lines else ""
    return Restore(text=text, owners=w.owners, rules=rules)


def total_rules(ctx: Context, fragments: Mapping[ServicePortName, Fragment]) -> dict[str, int]:
    """Rules in kproxy's chains per table if everything were written (upstream's iptables_total gauges)."""
    out = {"filter": 0, "nat": 0}
    for key, (head, tail) in layout.render_fixed(ctx).items():
        out[key.split("/", 1)[0]] += len(head) + len(tail)
    for frag in fragments.values():
        for table, n in frag.rule_count.items():
            out[table] += n
    return out


def build_restores(
    ctx: Context,
    fragments: Mapping[ServicePortName, Fragment],
    *,
    write: Iterable[ServicePortName] | None,
    top: Iterable[str] | None,
    delete_chains: Iterable[str] = (),
    jump_rules: Iterable[JumpRule] = (),
    canary: bool = False,
    chunk_lines: int | None = None,
) -> list[Restore]:
    """``build_restore``, split into several payloads when ``chunk_lines`` is set and the change is bigger.

    Why: the nf_tables flavour's ``iptables-restore --noflush`` spends time quadratic in the size of one payload (a
    linear search per rule in userspace; the same lines in 3,000-line payloads take a small fraction of the time:
    docs/PERFORMANCE.md, iptables mode). Each chunk holds whole services' own chains,
    SEP/SVC/EXT/FW together, so every service still changes atomically; the last payload rewrites the shared chains
    (which then start pointing at the new chains), inserts missing jumps and deletes stale chains. Every state in
    between is a consistent mix of old and new services. The legacy flavour commits the whole table per payload,
    so it gets one payload.
    """
    names = list(fragments.keys()) if write is None else [s for s in write if s in fragments]
    size = sum(len(fragments[s].rules) + len(fragments[s].chains) for s in names)
    if chunk_lines is None or size <= chunk_lines:
        return [
            build_restore(
                ctx, fragments, write=names, top=top, delete_chains=delete_chains, jump_rules=jump_rules, canary=canary
            )
        ]
    # KUBE-MARK-MASQ (and KUBE-POSTROUTING with it) go first: every service chunk jumps to KUBE-MARK-MASQ.
    top_set = set(ctx.top_chains["filter"] + ctx.top_chains["nat"]) if top is None else set(top)
    early = top_set & {N_MARK_MASQ, N_POSTROUTING}
    out: list[Restore] = []
    group: list[ServicePortName] = []
    lines = 0
    for spn in names:
        frag = fragments[spn]
        group.append(spn)
        lines += len(frag.rules) + len(frag.chains)
        if lines >= chunk_lines:
            out.append(build_restore(ctx, fragments, write=group, top=() if out else early))
            group, lines = [], 0
    if group:
        out.append(build_restore(ctx, fragments, write=group, top=() if out else early))
    out.append(
        build_restore(
            ctx,
            fragments,
            write=(),
            top=top_set - early,
            delete_chains=delete_chains,
            jump_rules=jump_rules,
            canary=canary,
        )
    )
    return out


def stream_restores(
    ctx: Context,
    items: Iterable[tuple[ServicePortName, Fragment, bool]],
    *,
    top: Iterable[str] | None,
    delete_chains: Callable[[], Iterable[str]],
    jump_rules: Iterable[JumpRule] = (),
    canary: bool = False,
    chunk_lines: int,
) -> Iterator[Restore]:
    """``build_restores`` for a big full sync, yielding each chunk as soon as its services are rendered.

    ``items`` gives (service, fragment, whether its chains are written) one by one, in order, typically rendering
    each as it is asked for; the caller applies a chunk while the next one is rendered, so rendering overlaps the
    kernel's work instead of preceding it. The payloads are those ``build_restores`` makes for a change bigger than
    ``chunk_lines``: KUBE-MARK-MASQ and KUBE-POSTROUTING in the first, whole services per chunk, and a last one with
    the shared chains (every service's lines), the missing jumps and ``delete_chains()``, asked for at the end.
    """
    top_set = set(ctx.top_chains["filter"] + ctx.top_chains["nat"]) if top is None else set(top)
    early = top_set & {N_MARK_MASQ, N_POSTROUTING}
    seen: dict[ServicePortName, Fragment] = {}
    group: dict[ServicePortName, Fragment] = {}
    lines = 0
    first = True
    for spn, frag, write in items:
        seen[spn] = frag
        if not write:
            continue
        group[spn] = frag
        lines += len(frag.rules) + len(frag.chains)
        if lines >= chunk_lines:
            yield build_restore(ctx, group, write=None, top=early if first else ())
            first, group, lines = False, {}, 0
    if group or first:
        yield build_restore(ctx, group, write=None, top=early if first else ())
    yield build_restore(
        ctx,
        seen,
        write=(),
        top=top_set - early,
        delete_chains=delete_chains(),
        jump_rules=jump_rules,
        canary=canary,
    )
