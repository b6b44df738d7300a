"""Which endpoints this node may use for a service port: traffic policies, topology hints, terminating fallback.

This is upstream kube-proxy's ``pkg/proxy/topology.go`` (``CategorizeEndpoints`` and ``topologyModeFromHints``)
and the ``UsesClusterEndpoints`` / ``UsesLocalEndpoints`` rules of ``pkg/proxy/serviceport.go``, as pure
functions over ``model.Endpoint`` values, so the semantics every backend inherits are decided and table-tested
in one place without a kernel.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kproxy.model import Endpoint

PREFER_SAME_NODE = "PreferSameNode"
PREFER_SAME_ZONE = "PreferSameZone"


@dataclass(frozen=True, slots=True)
class Categorized:
    """The endpoint sets of one service port as seen from this node.

    ``cluster`` is empty when the port never uses Cluster policy, ``local`` when it never uses Local policy;
    ``all_reachable`` is their union (every endpoint some traffic from this node may reach); ``has_any`` says
    whether the service has usable endpoints anywhere in the cluster (true even when none is usable here).
    """

    cluster: tuple[Endpoint, ...] = ()
    local: tuple[Endpoint, ...] = ()
    all_reachable: tuple[Endpoint, ...] = ()
    has_any: bool = False


_EMPTY = Categorized()


def uses_cluster_endpoints(internal_local: bool, external_local: bool, has_external: bool) -> bool:
    """Upstream ``UsesClusterEndpoints``: internal policy Cluster, or the port takes external traffic at all.

    Even with externalTrafficPolicy=Local the Cluster set is needed for upstream's short-circuit (traffic from a
    local pod or from the node itself to an external address goes to any endpoint), so ``external_local`` does
    not matter here; it is accepted so both helpers share one signature.
    """
    del external_local
    return not internal_local or has_external


def uses_local_endpoints(internal_local: bool, external_local: bool, has_external: bool) -> bool:
    """Upstream ``UsesLocalEndpoints``: internal policy Local, or external policy Local on a port with external
    addresses."""
    return internal_local or (external_local and has_external)


def topology_mode(endpoints: Sequence[Endpoint], node_name: str, zone: str | None) -> str:
    """Upstream ``topologyModeFromHints`` (PreferSameTrafficDistribution enabled), over READY endpoints only:
    ``PreferSameNode`` when every ready endpoint has node hints and one names this node; else ``PreferSameZone``
    when every ready endpoint has zone hints and one names this node's zone (never without a zone label);
    else ``""`` (no topology filtering)."""
    has_ready = False
    all_node_hints = True
    for_node = False
    all_zone_hints = True
    for_zone = False
    for ep in endpoints:
        if not ep.ready:
            continue
        has_ready = True
        if not ep.node_hints:
            all_node_hints = False
        elif node_name in ep.node_hints:
            for_node = True
        if not ep.zone_hints:
            all_zone_hints = False
        elif zone is not None and zone in ep.zone_hints:
            for_zone = True
        if not all_node_hints and not all_zone_hints:
            return ""  # a ready endpoint without hints of either kind: nothing later can make a mode (the common case)
    if not has_ready:
        return ""
    if all_node_hints and for_node:
        return PREFER_SAME_NODE
    if all_zone_hints and for_zone:
        return PREFER_SAME_ZONE
    return ""


def _same_or(endpoints: Sequence[Endpoint], chosen: tuple[Endpoint, ...]) -> tuple[Endpoint, ...]:
    """``endpoints`` itself when the choice kept every one of them and it is a tuple: the snapshot's service ports
    then share one tuple (of a slice's, or of the merge) instead of holding equal copies."""
    if len(chosen) == len(endpoints) and isinstance(endpoints, tuple):
        return endpoints
    return chosen


def categorize_endpoints(
    endpoints: Sequence[Endpoint],
    *,
    uses_cluster: bool,
    uses_local: bool,
    node_name: str,
    zone: str | None,
) -> Categorized:
    """Upstream ``CategorizeEndpoints``.

    Cluster set: ready endpoints (filtered by topology when the hints are usable); if none, the serving and
    terminating ones, topology ignored. Local set: this node's ready endpoints; if none, its serving and
    terminating ones. ``has_any``: a non-empty cluster set, or (when Local policy is used) any ready or
    serving-terminating endpoint anywhere.
    """
    if not endpoints:
        return _EMPTY

    mode = ""
    cluster: tuple[Endpoint, ...] = ()
    has_any = False
    if uses_cluster:
        mode = topology_mode(endpoints, node_name, zone)
        if mode == PREFER_SAME_NODE:
            cluster = tuple(ep for ep in endpoints if ep.ready and node_name in ep.node_hints)
        elif mode == PREFER_SAME_ZONE:
            cluster = tuple(ep for ep in endpoints if ep.ready and zone in ep.zone_hints)
        else:
            cluster = _same_or(endpoints, tuple([ep for ep in endpoints if ep.ready]))
        if not cluster:
            # Topology already fell back to "none" if no ready endpoint matched it, so the only reason to get
            # here is that nothing is ready anywhere: use what is still serving while it terminates.
            cluster = tuple(ep for ep in endpoints if ep.serving and ep.terminating)
        has_any = bool(cluster)

    if not uses_local:
        return Categorized(cluster=cluster, all_reachable=cluster, has_any=has_any)

    local_ready = False
    local_serving_terminating = False
    for ep in endpoints:
        if ep.ready:
            has_any = True
            if ep.is_local:
                local_ready = True
        elif ep.serving and ep.terminating:
            has_any = True
            if ep.is_local:
                local_serving_terminating = True

    local: tuple[Endpoint, ...] = ()
    terminating_fallback = False
    if local_ready:
        local = _same_or(endpoints, tuple([ep for ep in endpoints if ep.is_local and ep.ready]))
    elif local_serving_terminating:
        terminating_fallback = True
        local = tuple(ep for ep in endpoints if ep.is_local and ep.serving and ep.terminating)

    if not uses_cluster:
        return Categorized(local=local, all_reachable=local, has_any=has_any)

    if mode == "" and not terminating_fallback:
        # The cluster set holds every ready endpoint and the local set only ready ones: a superset already.
        return Categorized(cluster=cluster, local=local, all_reachable=cluster, has_any=has_any)

    merged: dict[str, Endpoint] = {}
    for ep in cluster:
        merged[str(ep)] = ep
    for ep in local:
        merged.setdefault(str(ep), ep)
    return Categorized(cluster=cluster, local=local, all_reachable=tuple(merged.values()), has_any=has_any)
