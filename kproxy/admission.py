"""Who may serve which address, and what fits: decided once, in the core, the same in every mode.

Every backend is handed service ports that have passed this gate (``kproxy.ledger`` runs it per family before it
renders anything), so no backend needs a collision or capacity rule of its own, and four modes cannot answer the same
question four ways. Two rules:

**Address ownership.** A service port *claims* ``address . protocol . port`` for its ClusterIP, each externalIP and
each load-balancer IP, and ``protocol . nodePort`` for its NodePort. A claim another service port already holds is
refused:

- a ClusterIP claim beats an externalIP or load-balancer claim (the external claim is taken away, so no Service can
  take a cluster service's address, e.g. kube-dns's, by listing it as one of its externalIPs);
- between claims of the same kind, the service port that holds the key keeps it, through partial syncs, full syncs and
  restarts: a process that starts with an empty book asks the backend's adoption who holds a contested key (the one
  whose fragment the kernel holds exactly), and only when nobody does, the older Service (creationTimestamp), then the
  name, wins;
- a refused externalIP, load-balancer IP or NodePort is taken out of the claimant's ServicePort (its other addresses
  keep working); a refused ClusterIP refuses the whole service port. Removing or changing the holder hands the key to a
  waiting claimant in the same sync, and deleting a refused claimant never touches the holder's entries.

**Capacity.** A backend declares its ``Limits`` (id widths, map sizes, port ranges); a service port that does not fit
is left out with the reason, and the family keeps syncing. A service port never counts against a limit it was refused
by, and one refused for capacity is admitted as soon as something else frees room (or when it changes).

Refusals are policy, not kernel failures: they are reported (``SyncResult.refused``, ``/rules``, ``kproxy show``, a
metric, an Event) but not retried every sync, since retrying cannot change the answer; the book re-decides when a
holder or a claimant changes. The work per sync is O(changed service ports) plus, on full syncs, an identity check per
service port.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from kproxy.model import ServicePort, ServicePortName

#: ``(address, protocol, port)``; the address is "" for a NodePort (it is served on every NodePort address)
Key = tuple[str, str, int]  # the protocol by its value: an Enum member's hash is a Python call


class Kind(enum.IntEnum):
    """A claim's strength: lower wins a contest."""

    CLUSTER_IP = 0
    EXTERNAL = 1  # externalIPs and load-balancer ingress IPs
    NODE_PORT = 2


_KIND_TEXT = {Kind.CLUSTER_IP: "ClusterIP", Kind.EXTERNAL: "externalIP/load-balancer IP", Kind.NODE_PORT: "NodePort"}


def key_text(key: Key) -> str:
    addr, proto, port = key
    if not addr:
        return f"nodePort {port}/{proto}"
    return f"[{addr}]:{port}/{proto}" if ":" in addr else f"{addr}:{port}/{proto}"


@dataclass(frozen=True, slots=True)
class Limits:
    """What a backend can hold in one IP family (None: no limit). Checked per service port before it is rendered.

    ``service_ports``: service ports (bpf: reverse-NAT ids; userspace: proxy ports); ``endpoints_per_port``: endpoints
    of one service port (bpf: the 16-bit slot count); ``entries``: frontends x (1 + endpoints) summed over service
    ports, where a frontend is each address and each NodePort address (bpf: service map entries); ``endpoints``:
    endpoints summed over service ports (bpf: the backend array)."""

    service_ports: int | None = None
    endpoints_per_port: int | None = None
    entries: int | None = None
    endpoints: int | None = None


UNLIMITED = Limits()


class Cost(NamedTuple):
    """What one admitted service port uses of each limit (a tuple: one is made per service port and sync)."""

    service_ports: int
    endpoints: int
    entries: int


def cost(sp: ServicePort, nodeport_addresses: int) -> Cost:
    """What one admitted service port uses of a family's ``Limits``."""
    eps = max(len(sp.cluster_endpoints), len(sp.local_endpoints))
    fronts = 1 + len(sp.external_ips) + len(sp.load_balancer_ips) + (nodeport_addresses if sp.node_port else 0)
    return Cost(1, eps, fronts * (1 + eps))


def claims(sp: ServicePort) -> dict[Key, Kind]:
    """Every key ``sp`` claims, each once, with its strongest kind (an externalIP equal to the service's own ClusterIP
    is the ClusterIP claim)."""
    proto, port = sp.name.protocol.value, sp.port
    out: dict[Key, Kind] = {(sp.cluster_ip, proto, port): Kind.CLUSTER_IP}
    for ip in sp.external_ips:
        out.setdefault((ip, proto, port), Kind.EXTERNAL)
    for ip in sp.load_balancer_ips:
        out.setdefault((ip, proto, port), Kind.EXTERNAL)
    if sp.node_port:
        out.setdefault(("", proto, sp.node_port), Kind.NODE_PORT)
    return out


def _plain(sp: ServicePort) -> bool:
    """No externalIP, load-balancer IP or NodePort: the one-claim fast path."""
    return not (sp.external_ips or sp.load_balancer_ips or sp.node_port)


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why (part of) a service port was refused: ``reason`` is ``address-conflict`` or ``capacity``."""

    reason: str
    message: str


#: ``(name, the kernel holds exactly this version of it)``: asked only for contested keys on an empty book
AdoptedHolder = Callable[[ServicePortName, ServicePort], bool]


@dataclass(slots=True)
class Book:
    """One family's decisions: who holds which key, who waits for one, what each service port uses."""

    limits: Limits = UNLIMITED
    nodeport_addresses: int = 0
    holder: dict[Key, ServicePortName] = field(default_factory=dict)
    #: the last ServicePort asked for, per name (the cache's value, before anything was taken out)
    wanted: dict[ServicePortName, ServicePort] = field(default_factory=dict)
    #: what was admitted, for the service ports in ``altered`` only (None: refused whole); the others as wanted
    admitted: dict[ServicePortName, ServicePort | None] = field(default_factory=dict)
    waiting: dict[Key, set[ServicePortName]] = field(default_factory=dict)
    refused: dict[ServicePortName, Refusal] = field(default_factory=dict)
    usage: dict[ServicePortName, Cost] = field(default_factory=dict)
    totals: list[int] = field(default_factory=lambda: [0, 0, 0])  # service ports, endpoints, entries
    over_capacity: set[ServicePortName] = field(default_factory=set)
    room_freed: bool = False  # a service port gave back capacity since the last check
    #: the service ports whose admitted version is not the wanted one (refused, trimmed, or a duplicate dropped)
    altered: set[ServicePortName] = field(default_factory=set)

    # -- the one entry point ----------------------------------------------------------------------------------

    def admit(
        self,
        changed: Iterable[tuple[ServicePortName, ServicePort | None]],
        *,
        adopted_holder: AdoptedHolder | None = None,
    ) -> dict[ServicePortName, ServicePort | None]:
        """Decide ``changed`` (every wanted service port on a full sync, the dirty ones otherwise; None: removed).
        ``version`` then gives each one's admitted version; returned: the admitted version of every *other* service
        port that gained or lost a key or room because of them (a caller must write those too)."""
        out: dict[ServicePortName, ServicePort | None] = {}
        touched: dict[ServicePortName, ServicePort] = {}
        freed: list[Key] = []
        first = not self.wanted
        wanted, refused = self.wanted, self.refused
        for spn, sp in changed:
            if first:  # nothing decided yet: nothing to release (a ServicePortName's hash is a Python call: spare it)
                if sp is not None:
                    touched[spn] = sp
                continue
            if sp is not None and wanted.get(spn) is sp and (not refused or spn not in refused):
                continue  # decided before, unchanged: its admitted version stands
            self._release(spn, sp, freed)
            if sp is None:
                out[spn] = None
            else:
                wanted[spn] = sp
                touched[spn] = sp
        if first:
            wanted.update(touched)  # a dict's own entries: no hash computed again
        # claimants waiting for a key that was just freed try again now
        retried: list[ServicePortName] = []
        while freed:
            key = freed.pop()
            for w in sorted(self.waiting.pop(key, ())):
                if w not in touched and w in wanted:
                    touched[w] = wanted[w]
                    retried.append(w)
        evicted = self._decide(touched, adopted_holder if first else None)
        decided = [(spn, self._admitted_version(spn, sp)) for spn, sp in touched.items()]
        others: dict[ServicePortName, ServicePort | None] = {}
        for spn in retried:
            others[spn] = self.version(spn, wanted[spn])
        for spn in evicted:
            if spn not in touched:
                others[spn] = self._admitted_version(spn, wanted[spn])
        self._fit(decided, out, others)
        return others

    def version(self, spn: ServicePortName, sp: ServicePort) -> ServicePort | None:
        """The admitted version of ``spn`` after ``admit`` (``sp`` when the book has not refused any of it)."""
        return self.admitted[spn] if spn in self.altered else sp

    def forget(self) -> None:
        limits, addrs = self.limits, self.nodeport_addresses
        self.__init__(limits, addrs)  # type: ignore[misc]

    # -- ownership ------------------------------------------------------------------------------------------------

    def _release(self, spn: ServicePortName, sp: ServicePort | None, freed: list[Key]) -> None:
        """Give up the keys ``spn`` holds that ``sp`` no longer claims (all of them when removed), and its waits."""
        old = self.wanted.get(spn)
        if old is None:
            return
        new_claims = claims(sp) if sp is not None else {}
        for key in claims(old):
            if key in new_claims:
                continue
            if self.holder.get(key) == spn:
                del self.holder[key]
                freed.append(key)
            else:
                waiters = self.waiting.get(key)
                if waiters is not None:
                    waiters.discard(spn)
                    if not waiters:
                        del self.waiting[key]
        if sp is None:
            del self.wanted[spn]
            self.admitted.pop(spn, None)
            self.refused.pop(spn, None)
            self.altered.discard(spn)
            self.over_capacity.discard(spn)
            self._use(spn, None)

    def _decide(
        self, touched: Mapping[ServicePortName, ServicePort], adopted_holder: AdoptedHolder | None
    ) -> set[ServicePortName]:
        """Hand out the keys ``touched`` claims and does not hold yet; return the holders that lost one."""
        evicted: set[ServicePortName] = set()
        holder = self.holder
        fresh: set[Key] = set()  # keys handed out in this call (their holder held nothing before)

        def hand_out(wants: Iterable[tuple[Key, ServicePortName]]) -> None:
            contested: dict[Key, list[ServicePortName]] = {}
            for key, spn in wants:
                h = holder.get(key)
                if h is None:
                    holder[key] = spn
                    fresh.add(key)
                elif h is not spn and h != spn:
                    contested.setdefault(key, [h]).append(spn)
            for key, names in contested.items():
                self._contest(key, names, key in fresh, adopted_holder, evicted)

        # ClusterIP keys first: a service port refused its ClusterIP claims nothing else
        hand_out(((sp.cluster_ip, sp.name.protocol.value, sp.port), spn) for spn, sp in touched.items())
        hand_out(
            (key, spn)
            for spn, sp in touched.items()
            if not _plain(sp) and holder.get((sp.cluster_ip, sp.name.protocol.value, sp.port)) == spn
            for key, kind in claims(sp).items()
            if kind is not Kind.CLUSTER_IP
        )
        return evicted

    def _contest(
        self,
        key: Key,
        names: list[ServicePortName],
        fresh: bool,
        adopted_holder: AdoptedHolder | None,
        evicted: set[ServicePortName],
    ) -> None:
        """``names[0]`` holds ``key`` now (since before this call unless ``fresh``); the others claim it too. Give it
        to the strongest claim: the kind, then who held it, then (a restart) whose version the kernel holds, then
        the older Service, then the name."""
        current = names[0]

        def rank(spn: ServicePortName) -> tuple[int, int, str, ServicePortName]:
            sp = self.wanted[spn]
            if spn == current and not fresh:
                holds = 0  # held before this sync: keeps it against its equals
            elif adopted_holder is not None and adopted_holder(spn, sp):
                holds = 0  # a restart: the kernel holds this one's version
            else:
                holds = 1
            return (int(claims(sp)[key]), holds, sp.created, spn)

        candidates = list(dict.fromkeys(names))
        winner = min(candidates, key=rank)
        self.holder[key] = winner
        for spn in candidates:
            if spn == winner:
                continue
            self.waiting.setdefault(key, set()).add(spn)
            if spn == current and not fresh:
                evicted.add(spn)

    def _admitted_version(self, spn: ServicePortName, sp: ServicePort) -> ServicePort | None:
        """``sp`` (``spn``'s wanted ServicePort) less the keys it does not hold (None when it does not hold its
        ClusterIP)."""
        wanted_sp = sp
        holder = self.holder
        proto, port = sp.name.protocol.value, sp.port
        cip_holder = holder.get((sp.cluster_ip, proto, port))
        if cip_holder is not spn and cip_holder != spn:
            self.refused[spn] = Refusal(
                "address-conflict", f"ClusterIP {key_text((sp.cluster_ip, proto, port))} is held by {cip_holder}"
            )
            return self._set(spn, None, wanted_sp)
        if _plain(sp):
            if self.refused:
                self.refused.pop(spn, None)
            return self._set(spn, sp, wanted_sp)
        lost: list[str] = []

        def mine(ip: str, what: str) -> bool:
            if ip == sp.cluster_ip:
                return False  # its own ClusterIP: served as the ClusterIP already
            key = (ip, proto, port)
            h = holder.get(key)
            if h == spn:
                return True
            lost.append(f"{what} {key_text(key)} is held by {h}")
            return False

        ext = tuple(dict.fromkeys(ip for ip in sp.external_ips if mine(ip, "externalIP")))
        seen = set(ext)
        lbs = tuple(dict.fromkeys(ip for ip in sp.load_balancer_ips if ip not in seen and mine(ip, "load-balancer IP")))
        node_port = sp.node_port
        if node_port:
            h = holder.get(("", proto, node_port))
            if h != spn:
                lost.append(f"{key_text(('', proto, node_port))} is held by {h}")
                node_port = 0
        if ext != sp.external_ips or lbs != sp.load_balancer_ips or node_port != sp.node_port:
            sp = dataclasses.replace(sp, external_ips=ext, load_balancer_ips=lbs, node_port=node_port)
        if lost:
            self.refused[spn] = Refusal("address-conflict", "; ".join(lost))
        else:
            self.refused.pop(spn, None)
        return self._set(spn, sp, wanted_sp)

    def _set(self, spn: ServicePortName, sp: ServicePort | None, wanted_sp: ServicePort | None) -> ServicePort | None:
        if sp is wanted_sp:
            if self.altered:
                self.altered.discard(spn)
                self.admitted.pop(spn, None)
        else:
            self.altered.add(spn)
            self.admitted[spn] = sp
        return sp

    # -- capacity -------------------------------------------------------------------------------------------------

    def _use(self, spn: ServicePortName, c: Cost | None) -> None:
        old = self.usage.pop(spn, None)
        t = self.totals
        if old is not None:
            self.room_freed = True
            t[0] -= old.service_ports
            t[1] -= old.endpoints
            t[2] -= old.entries
        if c is not None:
            self.usage[spn] = c
            t[0] += c.service_ports
            t[1] += c.endpoints
            t[2] += c.entries

    def _fit(
        self,
        decided: list[tuple[ServicePortName, ServicePort | None]],
        removed: Mapping[ServicePortName, ServicePort | None],
        others: dict[ServicePortName, ServicePort | None],
    ) -> None:
        """Check the admitted versions just decided against the limits: one that does not fit becomes None (in the
        book, and in ``others`` for the others); one that waited for room and fits now joins ``others``."""
        lim = self.limits
        if lim == UNLIMITED:
            return
        for spn in removed:
            self._use(spn, None)
        # the cache's order: stable from one sync to the next (``others`` may name a service port of ``decided``
        # again: a retried claimant, one by one then)
        todo = [*decided, *others.items()]
        if not others and self._fit_all(decided):
            todo = []
        for spn, sp in todo:
            if sp is None:
                self._use(spn, None)
                continue
            why = self._misfit(spn, sp)
            if why is None:
                self.over_capacity.discard(spn)
                continue
            self._use(spn, None)
            self._set(spn, None, self.wanted.get(spn))
            if spn in others:
                others[spn] = None
            self.refused[spn] = Refusal("capacity", why)
            self.over_capacity.add(spn)
        released, self.room_freed = self.room_freed, False
        if released and self.over_capacity:
            done = {spn for spn, _ in decided}
            for spn in sorted(self.over_capacity - done - others.keys()):
                sp = self._admitted_version(spn, self.wanted[spn])
                if sp is not None and self._misfit(spn, sp) is None:
                    self.over_capacity.discard(spn)
                    others[spn] = sp
                elif sp is not None:
                    self._set(spn, None, self.wanted[spn])
                    self.refused[spn] = Refusal("capacity", self._misfit(spn, sp) or "")

    def _fit_all(self, todo: list[tuple[ServicePortName, ServicePort | None]]) -> bool:
        """Count ``todo`` (each name once) at once when every one of them fits whatever the order (the totals plus
        every growth fit each limit, no port over the per-port limit): the one-by-one path's outcome (with a first
        sync's empty book, exactly the sum of the costs), for a hash and a tuple per service port instead of
        ``_misfit``'s lookups; False (nothing counted) when some might not fit."""
        lim = self.limits
        npa, usage = self.nodeport_addresses, self.usage
        names = [spn for spn, sp in todo if sp is not None]
        costs = [cost(sp, npa) for sp in (sp for _, sp in todo) if sp is not None]
        per_port = lim.endpoints_per_port
        if per_port is not None and any(c.endpoints > per_port for c in costs):
            return False
        olds = [usage.get(spn) for spn in names] if usage else []
        if any(o is not None for o in olds):
            grow = [0, 0, 0]
            for c, old in zip(costs, olds, strict=True):
                for k in range(3):
                    grow[k] += max(0, c[k] - (old[k] if old is not None else 0))
        else:  # a first sync, or only new service ports
            olds = []
            grow = [sum(c.service_ports for c in costs), sum(c.endpoints for c in costs), sum(c.entries for c in costs)]
        t = self.totals
        for limit, total, more in zip((lim.service_ports, lim.endpoints, lim.entries), t, grow, strict=True):
            if limit is not None and total + more > limit:
                return False
        for spn, sp in todo:
            if sp is None:
                self._use(spn, None)
        if olds:
            for spn in names:
                self._use(spn, None)  # the old costs out first (and room_freed, as one by one)
        usage.update(zip(names, costs, strict=True))
        for k in range(3):
            t[k] += sum(c[k] for c in costs)
        if self.over_capacity:
            self.over_capacity.difference_update(names)
        return True

    def _misfit(self, spn: ServicePortName, sp: ServicePort) -> str | None:
        """None when ``sp`` fits (and then it is counted), else why not."""
        lim = self.limits
        c = cost(sp, self.nodeport_addresses)
        if lim.endpoints_per_port is not None and c.endpoints > lim.endpoints_per_port:
            return f"{c.endpoints} endpoints, over this mode's {lim.endpoints_per_port} per service port"
        old = self.usage.get(spn)
        t = self.totals
        checks = (
            ("service ports", lim.service_ports, t[0], c.service_ports, old.service_ports if old else 0),
            ("endpoints", lim.endpoints, t[1], c.endpoints, old.endpoints if old else 0),
            ("map entries", lim.entries, t[2], c.entries, old.entries if old else 0),
        )
        for what, limit, total, need, had in checks:
            if limit is not None and total - had + need > limit:
                return f"needs {need} {what}; this mode holds at most {limit} per family ({total - had} in use)"
        self._use(spn, c)
        return None
