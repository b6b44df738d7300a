"""The one shared cache: Services, EndpointSlices and this node's Node in; ProxyState snapshots and Changes out.

Sources (list/watch threads, the manifest folder, the lab's API stand-in) feed it Kubernetes objects as plain
JSON-shaped dicts, exactly as the API returns them. Every object is validated and parsed at once into compact
internal values (the raw dicts are never kept); a bad object is logged, reported by ``errors()`` and skipped on
its own, and an invalid *update* keeps the last good version of that object, so one broken manifest loses
nothing. This module is the change tracking (upstream's ``servicechangetracker.go`` and
``endpointschangetracker.go``); what an object *means* lives below it, as upstream splits it: ``kproxy.serviceport``
(a Service into per-family ServicePort templates, ``serviceport.go``), ``kproxy.endpointslices`` (slices kept one by
one and merged per service port, ``endpointslicecache.go``), ``kproxy.objects`` (labels, Nodes, what is not ours)
and ``kproxy.topology`` (endpoint selection, ``topology.go``).

The runner thread takes ``snapshot()``: it recomputes only the services touched since the previous snapshot,
marks dirty exactly the ``ServicePortName``s whose value changed, appeared or disappeared, and returns an
immutable ``ProxyState`` plus ``Changes``. Dirty entries carry the generation in which they became dirty and are
removed only by ``commit()`` after a successful sync, so a change that arrives during a sync stays dirty and a
failed sync loses nothing (the bug upstream had: kubernetes#112604).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from operator import is_not
from types import MappingProxyType
from typing import Any

from kproxy.config import DEFAULT_MAX_SERVICE_ENTRIES
from kproxy.endpointslices import EndpointSliceCache, SliceKey, merge_endpoints, parse_slice
from kproxy.gcpause import collector_paused as _gc_paused
from kproxy.model import (
    Changes,
    IPFamily,
    NamespacedName,
    NodeInfo,
    Overlaid,
    ProxyState,
    ServicePort,
    ServicePortName,
)
from kproxy.objects import (
    ANNOTATION_TRIGGER_TIME,
    LABEL_HEADLESS,
    LABEL_SERVICE_NAME,
    LABEL_SERVICE_PROXY_NAME,
    LABEL_ZONE,
    TAINT_TO_BE_DELETED,
    Ignored,
    parse_node,
)
from kproxy.objects import clip as _clip
from kproxy.objects import label as _label
from kproxy.objects import object_label as _object_label
from kproxy.objects import object_name as _object_name
from kproxy.serviceport import ServiceInfo, as_template, parse_service, with_endpoints
from kproxy.topology import categorize_endpoints, uses_cluster_endpoints, uses_local_endpoints
from kproxy.validation import printable

# The parsers and labels were defined here before the split; importers of these names keep working.
__all__ = [
    "ANNOTATION_TRIGGER_TIME",
    "LABEL_HEADLESS",
    "LABEL_SERVICE_NAME",
    "LABEL_SERVICE_PROXY_NAME",
    "LABEL_ZONE",
    "SYNC_KINDS",
    "TAINT_TO_BE_DELETED",
    "ServiceCache",
    "parse_node",
    "parse_service",
    "parse_slice",
]

log = logging.getLogger(__name__)

SYNC_KINDS = ("services", "endpointslices", "nodes")

_GC_PAUSE_OVER = 500  # services recomputed in one snapshot
_TOO_BIG = "expands to"  # the start of an oversized Service's rejection


def _overlay_max(services: int) -> int:
    """Changes an overlay holds before a new base: ~4 x the square root of the table (1,300 at 100,000 service
    ports), so a snapshot copies at most that many entries and a new base comes at most once per that many."""
    return 4 * math.isqrt(services) + 64


class ServiceCache:
    """Thread-safe (one lock) store of this node's view of Services and EndpointSlices; see the module docstring.

    Methods fed by sources may be called from any thread; ``snapshot``/``commit`` from the runner thread.
    ``on_change`` is called outside the lock after any accepted change that may need a sync, and once when the
    cache becomes ``ready``.

    Choices worth knowing:
    - ``Changes.full`` stays set until a full ``Changes`` is committed: the first snapshot, and every snapshot
      after a change of this node's labels (topology) or of its pod CIDRs / addresses (backends read those from
      ``ProxyState.node``). An eligibility change alone (deletion, autoscaler taint) needs no sync.
    - ``Changes.trigger_times`` holds every trigger time folded into a snapshot whose sync is not committed yet,
      so a failed sync's times are reported by the sync that finally programs them; only changes that altered
      some ServicePort count.
    - A slice port without ``name`` is matched as the unnamed port (upstream skips it; hand-written manifests
      omit it), a slice port without ``port`` is skipped, as upstream.
    - ``errors()`` also lists slices that were accepted but carried duplicate endpoints (counted once).
    """

    def __init__(
        self,
        node_name: str,
        *,
        service_proxy_name: str = "",
        ip_families: Sequence[IPFamily] = (IPFamily.V4, IPFamily.V6),
        on_change: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.time,
        max_service_entries: int = DEFAULT_MAX_SERVICE_ENTRIES,
    ) -> None:
        self._node_name = node_name
        self._max_entries = max_service_entries
        self._proxy_name = service_proxy_name
        self._families = tuple(ip_families)
        self._on_change = on_change
        self._start = clock()  # slice trigger times older than this were programmed by someone else
        self._lock = threading.Lock()

        self._services: dict[NamespacedName, ServiceInfo] = {}
        self._slices = EndpointSliceCache()
        self._node = NodeInfo(node_name)
        self._node_seen = False

        # What the last snapshot handed out, per family, and which (family, port) each service contributed.
        self._current: dict[IPFamily, dict[ServicePortName, ServicePort]] = {f: {} for f in IPFamily}
        # The published mapping of each family is a base copy of ``_current`` plus an overlay of what changed since
        # (``model.Overlaid``): a snapshot copies the overlay, not the table (see ``_publish``).
        self._views: dict[IPFamily, Mapping[ServicePortName, ServicePort]] = {f: MappingProxyType({}) for f in IPFamily}
        self._bases: dict[IPFamily, dict[ServicePortName, ServicePort]] = {f: {} for f in IPFamily}
        self._overlays: dict[IPFamily, dict[ServicePortName, ServicePort | None]] = {f: {} for f in IPFamily}
        self._changed: dict[IPFamily, set[ServicePortName]] = {f: set() for f in IPFamily}  # since the last snapshot
        # the record a Service had at its last recompute, kept only from its replacement or deletion until the next
        # recompute (which removes the ports it no longer has); every other Service's record in ``_services`` is that
        # record, so nothing per service is kept for this
        self._replaced: dict[NamespacedName, ServiceInfo] = {}

        self._generation = 0
        self._touched: set[NamespacedName] = set()
        self._touched_services: set[NamespacedName] = set()
        self._touched_endpoints: set[NamespacedName] = set()
        self._pending_triggers: dict[NamespacedName, list[tuple[IPFamily, float]]] = {}
        # (generation, family, wall time) of slice changes not yet committed
        self._triggers: list[tuple[int, IPFamily, float]] = []
        self._dirty: dict[ServicePortName, int] = {}  # name -> generation in which it became dirty
        self._full_owed: int | None = 0  # a full sync is owed for changes up to this generation

        self._synced: set[str] = set()
        self._errors: dict[str, str] = {}
        self._service_changes_total = 0
        self._endpoint_changes_total = 0

    # ---------------------------------------------------------------------------------------------- sources

    def upsert_service(self, obj: Mapping[str, Any]) -> bool:
        accepted, changed = self._upsert_service(obj)
        if changed:
            self._notify()
        return accepted

    def delete_service(self, namespace: str, name: str) -> None:
        key = NamespacedName(namespace, name)
        with self._lock:
            self._errors.pop(_label("Service", namespace, name), None)
            changed = self._drop_service(key)
        if changed:
            self._notify()

    def _absorb(
        self, objs: Iterable[Mapping[str, Any]], upsert: Callable[[Mapping[str, Any]], tuple[bool, bool]]
    ) -> tuple[set[tuple[str, str]], bool]:
        """Every object of a list through ``upsert`` (the garbage collector paused meanwhile): the (namespace, name)
        of each and whether any changed the cache. A list streamed page by page that fails part-way re-raises its
        error, after asking for a sync of what it had already upserted."""
        present: set[tuple[str, str]] = set()
        changed = False
        try:
            with _gc_paused(True):
                for obj in objs:
                    present.add(_object_name(obj))
                    changed |= upsert(obj)[1]
        except BaseException:
            if changed:
                self._notify()
            raise
        return present, changed

    def replace_services(self, objs: Iterable[Mapping[str, Any]]) -> None:
        present, changed = self._absorb(objs, self._upsert_service)
        with self._lock:
            for key in [k for k in self._services if (k.namespace, k.name) not in present]:
                changed |= self._drop_service(key)
            self._forget_errors("Service", present)
            became_ready = self._mark_synced("services")
        if changed or became_ready:
            self._notify()

    def upsert_slice(self, obj: Mapping[str, Any]) -> bool:
        accepted, changed = self._upsert_slice(obj)
        if changed:
            self._notify()
        return accepted

    def delete_slice(self, namespace: str, name: str) -> None:
        with self._lock:
            self._errors.pop(_label("EndpointSlice", namespace, name), None)
            changed = self._drop_slice((namespace, name))
        if changed:
            self._notify()

    def replace_slices(self, objs: Iterable[Mapping[str, Any]]) -> None:
        present, changed = self._absorb(objs, self._upsert_slice)
        with self._lock:
            for key in [k for k in self._slices.keys() if k not in present]:
                changed |= self._drop_slice(key)
            self._forget_errors("EndpointSlice", present)
            became_ready = self._mark_synced("endpointslices")
        if changed or became_ready:
            self._notify()

    def set_node(self, obj: Mapping[str, Any] | None) -> None:
        """This node's Node object (others are ignored); None when it is absent.

        Upstream's node eligibility starts true and only a Node that is being deleted (or tainted for deletion)
        makes it false, so a Node that was seen and then vanished is ineligible, while one never seen (a manifest
        folder without a Node) leaves the node eligible."""
        label = f"Node {_clip(self._node_name)}"
        if obj is None:
            with self._lock:
                seen = self._node_seen
            node = NodeInfo(self._node_name, eligible=not seen)
        else:
            meta = obj.get("metadata") if isinstance(obj, Mapping) else None
            if isinstance(meta, Mapping) and isinstance(meta.get("name"), str) and meta["name"] != self._node_name:
                return
            try:
                node = parse_node(obj)
            except Exception as exc:  # one bad object must never take the cache down
                self._reject(label, exc)
                return
        with self._lock:
            self._errors.pop(label, None)
            self._node_seen = self._node_seen or obj is not None
            old, self._node = self._node, node
            resync = False
            if dict(old.labels) != dict(node.labels):
                # Topology labels (the zone) decide endpoint choice for every service.
                self._touched.update(self._services)
                self._touched.update(self._slices.services())
                resync = True
            if old.pod_cidrs != node.pod_cidrs or old.addresses != node.addresses:
                resync = True
            if resync:
                self._generation += 1
                self._full_owed = self._generation
        # Eligibility alone needs no resync, but whoever reports node health must hear of it.
        if resync or old.eligible != node.eligible:
            self._notify()

    def mark_synced(self, kind: str) -> None:
        if kind not in SYNC_KINDS:
            raise ValueError(f"mark_synced: unknown kind {kind!r}, expected one of {SYNC_KINDS}")
        with self._lock:
            became_ready = self._mark_synced(kind)
        if became_ready:
            self._notify()

    @property
    def ready(self) -> bool:
        """Both Services and EndpointSlices have been listed once (upstream writes no rules before that)."""
        with self._lock:
            return self._is_ready()

    # ---------------------------------------------------------------------------------------------- runner

    def snapshot(self, full: bool = False) -> tuple[ProxyState, Changes]:
        with self._lock:
            gen = self._generation
            with _gc_paused(len(self._touched) > _GC_PAUSE_OVER):
                for key in self._touched:
                    if self._recompute(key, gen):
                        for fam, when in self._pending_triggers.get(key, ()):
                            self._triggers.append((gen, fam, when))
            self._touched.clear()
            self._touched_services.clear()
            self._touched_endpoints.clear()
            self._pending_triggers.clear()
            for fam, names in self._changed.items():
                if names:
                    self._views[fam] = self._publish(fam, names)
                    names.clear()
            state = ProxyState(services=MappingProxyType(dict(self._views)), node=self._node, generation=gen)
            changes = Changes(
                full=full or self._full_owed is not None,
                services=frozenset(self._dirty),
                generation=gen,
                trigger_times=tuple((fam, t) for _, fam, t in self._triggers),
            )
        return state, changes

    def commit(self, changes: Changes, failed: Collection[ServicePortName] = ()) -> None:
        """A sync of ``changes`` succeeded (except for ``failed``): forget what it applied, keep anything newer.
        ``failed`` services are dirty afterwards whatever they were before (a full sync rewrites services that did
        not change; one the kernel refused must be retried by the next partial sync, not the next full one)."""
        gen = changes.generation
        failed_set = set(failed)
        with self._lock:
            # a new dict, not deletions: a dict never shrinks, and one that held every service after a full sync
            # would make each later snapshot's and commit's walk over it cost the whole table
            dirty = {s: g for s, g in self._dirty.items() if g > gen or s in failed_set}
            for spn in failed_set:
                dirty.setdefault(spn, gen)
            self._dirty = dirty
            self._triggers = [tr for tr in self._triggers if tr[0] > gen]
            if changes.full and self._full_owed is not None and self._full_owed <= gen:
                self._full_owed = None

    def node_info(self) -> NodeInfo:
        with self._lock:
            return self._node

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "service_changes_total": self._service_changes_total,
                "endpoint_changes_total": self._endpoint_changes_total,
                "service_changes_pending": len(self._touched_services),
                "endpoint_changes_pending": len(self._touched_endpoints),
                "services": len(self._services),
                "service_ports": sum(len(m) for m in self._current.values()),
                "endpoints": self._slices.endpoint_count,
                "invalid_objects": len(self._errors),
            }

    def errors(self) -> dict[str, str]:
        """``"Service ns/name"`` / ``"EndpointSlice ns/name"`` / ``"Node name"`` -> why the current version of
        that object was rejected (its last good version, if any, is still in use), or, for a slice accepted with
        duplicate endpoints, what was dropped."""
        with self._lock:
            return dict(self._errors)

    # ---------------------------------------------------------------------------------------------- internals

    def _notify(self) -> None:
        if self._on_change is not None:
            try:
                self._on_change()
            except Exception:  # a broken callback must not break the source thread
                log.exception("on_change callback failed")

    def _reject(self, label: str, exc: BaseException) -> None:
        reason = printable(str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}")
        log.warning("%s rejected: %s", label, reason)
        with self._lock:
            self._errors[label] = reason

    def _forget_errors(self, kind: str, present: set[tuple[str, str]]) -> None:
        listed = [k for k in self._errors if k.startswith(kind + " ")]
        if not listed:
            return  # no label per object of the list to compare with (the common case)
        wanted = {_label(kind, ns, name) for ns, name in present}
        for label in listed:
            if label not in wanted:
                del self._errors[label]

    def _is_ready(self) -> bool:
        return "services" in self._synced and "endpointslices" in self._synced

    def _mark_synced(self, kind: str) -> bool:
        was = self._is_ready()
        self._synced.add(kind)
        return not was and self._is_ready()

    def _touch(self, key: NamespacedName, endpoints: bool, when: tuple[IPFamily, float] | None) -> None:
        self._generation += 1
        self._touched.add(key)
        if endpoints:
            self._touched_endpoints.add(key)
            self._endpoint_changes_total += 1
        else:
            self._touched_services.add(key)
            self._service_changes_total += 1
        if when is not None:
            self._pending_triggers.setdefault(key, []).append(when)

    def _upsert_service(self, obj: Mapping[str, Any]) -> tuple[bool, bool]:
        """(accepted, changed)."""
        try:
            key, svc = parse_service(obj, self._families, self._proxy_name)
        except Ignored as why:
            label, ns, name = _object_label("Service", obj)
            key = NamespacedName(ns, name)
            log.debug("%s ignored: %s", label, why)
            with self._lock:
                self._errors.pop(label, None)
                changed = self._drop_service(key)
            return False, changed
        except Exception as exc:  # one bad object must never take the cache down
            self._reject(_object_label("Service", obj)[0], exc)
            return False, False
        with self._lock:
            if self._errors:
                self._errors.pop(_label("Service", key.namespace, key.name), None)
            old = self._services.get(key)
            if old == svc:
                return True, False
            # one NamespacedName per service, shared with its slices
            canonical = old.key if old is not None else self._slices.service_key(key)
            if canonical is not None and canonical is not svc.key:
                svc = ServiceInfo(canonical, svc.ports)
            self._services[key] = svc
            if old is not None:
                self._replaced.setdefault(key, old)
            self._touch(key, endpoints=False, when=None)  # as upstream, only slices carry trigger times
        return True, True

    def _drop_service(self, key: NamespacedName) -> bool:
        old = self._services.pop(key, None)
        if old is None:
            return False
        self._replaced.setdefault(key, old)
        self._touch(key, endpoints=False, when=None)
        return True

    def _upsert_slice(self, obj: Mapping[str, Any]) -> tuple[bool, bool]:
        try:
            skey, parsed = parse_slice(obj, self._families, self._node_name, self._start)
        except Ignored as why:
            label, ns, name = _object_label("EndpointSlice", obj)
            log.debug("%s ignored: %s", label, why)
            with self._lock:
                self._errors.pop(label, None)
                changed = self._drop_slice((ns, name))
            return False, changed
        except Exception as exc:  # one bad object must never take the cache down
            self._reject(_object_label("EndpointSlice", obj)[0], exc)
            return False, False
        label = _label("EndpointSlice", *skey) if parsed.warning or self._errors else ""
        if parsed.warning:
            log.warning("%s: %s", label, parsed.warning)
        with self._lock:
            if parsed.warning:
                self._errors[label] = parsed.warning
            elif self._errors:
                self._errors.pop(label, None)
            svc = self._services.get(parsed.service)
            if svc is not None:
                parsed.service = svc.key  # one NamespacedName per service, shared with the Service's record
            changed, moved_from = self._slices.update(skey, parsed)
            if not changed:
                return True, False
            if moved_from is not None:
                self._touch(moved_from, endpoints=True, when=None)
            when = None if parsed.trigger_time is None else (parsed.family, parsed.trigger_time)
            self._touch(parsed.service, endpoints=True, when=when)
        return True, True

    def _drop_slice(self, skey: SliceKey) -> bool:
        owner = self._slices.remove(skey)
        if owner is None:
            return False
        self._touch(owner, endpoints=True, when=None)
        return True

    def _bounded(
        self, key: NamespacedName, ports: dict[tuple[IPFamily, ServicePortName], ServicePort]
    ) -> dict[tuple[IPFamily, ServicePortName], ServicePort]:
        """``ports``, or nothing when the Service expands to more entries than ``--max-service-entries`` (addresses
        + endpoints summed over its ports and families: ports x externalIPs x endpoints is what blows up a small
        object); then it is reported among the rejected objects and served by no rule until it shrinks."""
        entries = 0
        for sp in ports.values():
            entries += 1 + len(sp.external_ips) + len(sp.load_balancer_ips) + (1 if sp.node_port else 0)
            entries += max(len(sp.cluster_endpoints), len(sp.local_endpoints))
        if entries <= self._max_entries:
            if self._errors:  # the label only when there is something to look it up in (not once per service)
                label = _label("Service", key.namespace, key.name)
                if label in self._errors and self._errors[label].startswith(_TOO_BIG):
                    del self._errors[label]
            return ports
        label = _label("Service", key.namespace, key.name)
        why = (
            f"{_TOO_BIG} {entries} entries (addresses + endpoints over {len(ports)} service ports), over "
            f"--max-service-entries {self._max_entries}: not served"
        )
        if self._errors.get(label) != why:
            log.warning("%s rejected: %s", label, why)
        self._errors[label] = why
        return {}

    def _publish(self, fam: IPFamily, names: set[ServicePortName]) -> Mapping[ServicePortName, ServicePort]:
        """The family's new published mapping after ``names`` changed: the base and a copy of the overlay of every
        change since it, O(changes); once the overlay outgrows ``_overlay_max`` a new base is copied from
        ``_current`` (O(services), once per that many changes: a few dict entries' copy per change, amortized)."""
        current, overlay = self._current[fam], self._overlays[fam]
        limit = _overlay_max(len(current))
        if len(names) <= limit:  # else a new base whatever the overlay held: not worth filling (a first snapshot)
            for spn in names:
                overlay[spn] = current.get(spn)
        if len(names) > limit or len(overlay) > limit:
            base = self._bases[fam] = dict(current)
            self._overlays[fam] = {}
            return MappingProxyType(base)
        return Overlaid(self._bases[fam], dict(overlay), len(current))

    def _recompute(self, key: NamespacedName, gen: int) -> bool:
        """Rebuild one service's ServicePorts; mark dirty those whose value changed. True if any did."""
        new: dict[tuple[IPFamily, ServicePortName], ServicePort] = {}
        svc = self._services.get(key)
        if svc is not None:
            slices = self._slices.for_service(key)
            zone = self._node.zone
            for tmpl in svc.ports:  # templates, or the ServicePorts the last recompute completed from them
                eps = merge_endpoints(slices, tmpl)
                if eps:
                    has_external = tmpl.has_external_addresses
                    internal, external = tmpl.internal_policy_local, tmpl.external_policy_local
                    cat = categorize_endpoints(
                        eps,
                        uses_cluster=uses_cluster_endpoints(internal, external, has_external),
                        uses_local=uses_local_endpoints(internal, external, has_external),
                        node_name=self._node_name,
                        zone=zone,
                    )
                    sp = with_endpoints(tmpl, cat, eps)
                else:
                    sp = as_template(tmpl)
                new[(sp.family, sp.name)] = sp
            new = self._bounded(key, new)
        changed = False
        before = self._replaced.pop(key, svc)
        if before is svc and new:
            before = None  # ``new`` holds every port of this very record: none of them went
        for fam, spn in ((t.family, t.name) for t in before.ports) if before is not None else ():
            # not there when that record was never recomputed, or refused as too big
            if (fam, spn) not in new and self._current[fam].pop(spn, None) is not None:
                self._dirty[spn] = gen
                self._changed[fam].add(spn)
                changed = True
        for (fam, spn), sp in new.items():
            current = self._current[fam]
            held = current.get(spn)
            if held != sp:
                current[spn] = sp
                self._dirty[spn] = gen
                self._changed[fam].add(spn)
                changed = True
            else:
                new[(fam, spn)] = held  # an equal value: keep the one object already handed out
        if svc is not None:
            self._keep(key, svc, new)
        return changed

    def _keep(
        self, key: NamespacedName, svc: ServiceInfo, new: dict[tuple[IPFamily, ServicePortName], ServicePort]
    ) -> None:
        """The Service's record holds the ServicePorts just completed in place of its templates (one object per
        port, not a template and its completed copy); without any (refused as too big), its bare templates."""
        ports = tuple(new.values()) if new else tuple(as_template(sp) for sp in svc.ports)
        if len(ports) != len(svc.ports) or any(map(is_not, ports, svc.ports)):
            self._services[key] = ServiceInfo(svc.key, ports)
