"""What each node must have programmed, from what the API holds now, and how a node's ``/rules`` differs from it.

The expectation is computed by kproxy's own cache (``kproxy.cache.ServiceCache``, fed the API's current lists as a
fresh kproxy would be after a relist) and described with the ledger's common schema (``describe_port``). So the
comparison is exactly "every change the soak made is reflected": the meaning of each object is the conformance
suite's business; here a node that missed, reordered or kept a stale change differs from a fresh reading of the
same API. ``/verify`` (the node reading its own kernel back) is the other half, checked by ``kproxy.soak.run``.
Both are kproxy agreeing with itself; what the kernel does is judged apart, against ``kproxy.soak.model``.

Pure: tests/unit/test_soak.py feeds it objects and ``/rules`` answers.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from kproxy.cache import ServiceCache
from kproxy.model import IPFamily
from kproxy.readback import describe_port
from kproxy.toolkit.keys import service_key

# what /rules says about a service port that the expectation also says; applied/failed are checked apart
COMPARED = (
    "clusterIP",
    "port",
    "nodePort",
    "externalIPs",
    "loadBalancerIPs",
    "sessionAffinitySeconds",
    "internalTrafficPolicyLocal",
    "externalTrafficPolicyLocal",
    "internal",
    "external",
    "internalEndpoints",
    "externalEndpoints",
)
_UNORDERED = ("externalIPs", "loadBalancerIPs", "internalEndpoints", "externalEndpoints")


def expected_services(
    node_name: str,
    services: Iterable[Mapping[str, Any]],
    slices: Iterable[Mapping[str, Any]],
    node: Mapping[str, Any] | None,
    families: Sequence[IPFamily] = (IPFamily.V4, IPFamily.V6),
) -> tuple[dict[str, dict[str, dict[str, Any]]], dict[str, str]]:
    """(``ns/name:port/PROTO`` -> {``IPv4``|``IPv6``: the compared fields}, the objects the cache rejected)."""
    cache = ServiceCache(node_name, ip_families=families)
    if node is not None:
        cache.set_node(node)
    cache.replace_services(services)
    cache.replace_slices(slices)
    state, _ = cache.snapshot()
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for fam in families:
        for spn, sp in state.family(fam).items():
            desc = describe_port(sp, True, None)
            out.setdefault(service_key(spn), {})[fam.value] = _fields(desc)
    return out, cache.errors()


def _fields(desc: Mapping[str, Any]) -> dict[str, Any]:
    out = {}
    for k in COMPARED:
        v = desc.get(k)
        out[k] = sorted(v) if k in _UNORDERED and isinstance(v, list) else v
    return out


def differences(
    expected: Mapping[str, Mapping[str, Mapping[str, Any]]],
    rules: Mapping[str, Any],
    *,
    namespaces: Iterable[str] | None = None,
) -> dict[str, str]:
    """service key (with ``/IPv4``|``/IPv6``) -> what differs between the expectation and a node's ``/rules``
    (``missing``, ``unexpected``, ``not applied``, ``refused: ...`` or the fields that differ). Only keys in
    ``namespaces`` count when given (the soak's own, so someone else's objects in the lab never count)."""
    wanted_ns = set(namespaces) if namespaces is not None else None

    def ours(key: str) -> bool:
        return wanted_ns is None or key.split("/", 1)[0] in wanted_ns

    # /rules nests the backend's describe() under "backend"; a bare describe() (a test, kproxy show) is taken too
    backend = rules.get("backend")
    described: Mapping[str, Any] = backend if isinstance(backend, Mapping) else rules
    got_all: Mapping[str, Any] = described.get("services") or {}
    out: dict[str, str] = {}
    for key, fams in expected.items():
        if not ours(key):
            continue
        got_fams = got_all.get(key) or {}
        for fam, want in fams.items():
            got = got_fams.get(fam)
            where = f"{key}/{fam}"
            if got is None:
                out[where] = "missing"
                continue
            if got.get("failed"):
                out[where] = f"refused: {got['failed']}"
                continue
            if not got.get("applied", False):
                out[where] = "not applied"
                continue
            mine = _fields(got)
            diff = [f"{k}: {mine[k]!r} != {want[k]!r}" for k in COMPARED if mine[k] != want[k]]
            if diff:
                out[where] = "; ".join(diff)
    for key, fams in got_all.items():
        if not ours(key):
            continue
        for fam in fams or {}:
            if fam not in (expected.get(key) or {}):
                out[f"{key}/{fam}"] = "unexpected"
    return out
