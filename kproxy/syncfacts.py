"""What the daemon derives from each synced state for metrics and the service health servers, kept up to date from
the changes alone: a partial sync at 100,000 services must not walk every service to count the ones without local
endpoints or to find the few with a ``healthCheckNodePort``. A full sync rebuilds it all. Whether the health part
changed at all is kept too (``take_health_changed``), so the daemon hands the service health servers their whole
table only when there is something new in it."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kproxy.model import Changes, IPFamily, NamespacedName, ProxyState, ServicePort, ServicePortName, Verdict


@dataclass(frozen=True, slots=True)
class _Part:
    """One service port's share of the facts in one family."""

    internal_drop: bool  # internalTrafficPolicy Local and no local endpoint: dropped
    external_drop: bool  # externalTrafficPolicy Local and no local endpoint: dropped
    health_port: int  # its service's healthCheckNodePort (0: none)
    ready_local: frozenset[str]  # local ready endpoint IPs (only kept with a health port)


_NONE: frozenset[str] = frozenset()


def _part(sp: ServicePort) -> _Part | None:
    """``sp``'s share, or None when it has none: no drop and no health port, as most service ports (kept only for
    the others: 100,000 parts of nothing held about 35 MB)."""
    hc = sp.health_check_node_port or 0
    internal = sp.internal_policy_local and sp.internal_verdict is Verdict.DROP
    external = sp.external_policy_local and sp.external_verdict is Verdict.DROP
    if not (hc or internal or external):
        return None
    ready = frozenset(ep.ip for ep in sp.serving_endpoints if ep.is_local and ep.ready) if hc else _NONE
    return _Part(internal, external, hc, ready)


class SyncFacts:
    """Upstream's ``sync_proxy_rules_no_local_endpoints_total`` counts per family, the ``healthCheckNodePort`` per
    service and upstream's LocalReadyEndpoints per service (``local_ready``), updated in O(changes)."""

    def __init__(self, families: Iterable[IPFamily]) -> None:
        self.families = tuple(families)
        self._reset()

    def _reset(self) -> None:
        self._parts: dict[tuple[ServicePortName, IPFamily], _Part] = {}  # only the ports that have a share
        self._drops: dict[IPFamily, list[int]] = {f: [0, 0] for f in self.families}
        self._health: dict[NamespacedName, set[tuple[ServicePortName, IPFamily]]] = {}  # ports with a health port
        self._ready: dict[NamespacedName, int] = {}
        self._ports: dict[NamespacedName, int] = {}
        self._health_changed = True  # the health part may differ from what was last taken

    def update(self, state: ProxyState, changes: Changes) -> None:
        """Take ``state`` (what was just synced); ``changes`` says which service ports may differ from the last."""
        if changes.full:
            self._reset()  # a full sync starts from nothing
            names: Iterable[ServicePortName] = {sp.name for sp in state}
        else:
            names = changes.services
        touched: set[NamespacedName] = set()
        for spn in names:
            for fam in self.families:
                self._replace(spn, fam, state.family(fam).get(spn), touched)
        for svc in touched:
            self._recount(svc)

    def _replace(
        self, spn: ServicePortName, fam: IPFamily, sp: ServicePort | None, touched: set[NamespacedName]
    ) -> None:
        key = (spn, fam)
        old = self._parts.pop(key, None)
        drops = self._drops[fam]
        if old is not None:
            drops[0] -= old.internal_drop
            drops[1] -= old.external_drop
            if old.health_port:
                self._health[spn.service].discard(key)
                touched.add(spn.service)
        new = _part(sp) if sp is not None else None
        if new is None:
            return
        self._parts[key] = new
        drops[0] += new.internal_drop
        drops[1] += new.external_drop
        if new.health_port:
            self._health.setdefault(spn.service, set()).add(key)
            touched.add(spn.service)

    def _recount(self, svc: NamespacedName) -> None:
        """A service's health port and LocalReadyEndpoints from its ports' parts: per family the unique IPs over all
        of its ports, the larger family's count kept (a dual-stack pod is one endpoint, as upstream)."""
        before = self._ports.get(svc), self._ready.get(svc)
        keys = self._health.get(svc)
        if not keys:
            self._health.pop(svc, None)
            self._ports.pop(svc, None)
            self._ready.pop(svc, None)
        else:
            ips: dict[IPFamily, set[str]] = {}
            for spn, fam in keys:
                part = self._parts[(spn, fam)]
                self._ports[svc] = part.health_port
                ips.setdefault(fam, set()).update(part.ready_local)
            self._ready[svc] = max(len(found) for found in ips.values())
        if (self._ports.get(svc), self._ready.get(svc)) != before:
            self._health_changed = True

    def no_local_endpoints(self, family: IPFamily) -> tuple[int, int]:
        """(internal, external): service ports whose Local policy drops traffic for want of local endpoints."""
        internal, external = self._drops[family]
        return internal, external

    def take_health_changed(self) -> bool:
        """Whether ``health_ports`` or ``local_ready`` may differ from when this was last asked."""
        changed, self._health_changed = self._health_changed, False
        return changed

    def health_ports(self) -> dict[NamespacedName, int]:
        """``healthCheckNodePort`` per service (eTP=Local load balancers), for the service health servers."""
        return dict(self._ports)

    def local_ready(self) -> dict[NamespacedName, int]:
        """Upstream's LocalReadyEndpoints per service with a health port."""
        return dict(self._ready)
