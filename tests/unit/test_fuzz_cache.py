"""Fuzzed input for the cache: generated Services and EndpointSlices, valid and malformed, with hostile text in every
string field (quotes, newlines, ``;``, ``#``, ``}``, NULs, shell and iptables/nft syntax, wrong types).

Properties (hypothesis, derandomized and bounded so CI sees the same examples every run):
- the cache never raises, whatever it is fed (upserts, deletes, relists, snapshots);
- an object it does not take is either listed in ``errors()`` with a reason or is one it ignores by design
  (headless, ExternalName, FQDN, another proxy's), never silently dropped;
- a rejected object never changes the programmed state of any service: the snapshot is the one before it;
- an accepted object changes no service but its own (a slice: the service it names).
The kernel side of the same generated objects is tests/integration/test_fuzz_render.py.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kproxy.cache import ServiceCache
from kproxy.endpointslices import parse_slice
from kproxy.model import IPFamily, NamespacedName
from kproxy.objects import Ignored
from kproxy.objects import object_label as _object_label
from kproxy.serviceport import parse_service

NODE = "node-1"
FAMILIES = (IPFamily.V4, IPFamily.V6)
SETTINGS = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,  # derandomized: nothing to remember between runs, and no .hypothesis folder in the tree
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# Text that breaks naive rendering: quoting, line and statement ends, comments, blocks, escapes, shell, NUL.
NASTY = (
    '"',
    "'",
    "\n",
    "\r\n",
    ";",
    "#",
    "}",
    "{",
    "\\",
    "\\n",
    "\x00",
    " ",
    "\t",
    "$(reboot)",
    "`id`",
    '" -j ACCEPT #',
    "-A KUBE-SERVICES -j ACCEPT",
    '"; flush ruleset; #',
    "} ; add rule ip kproxy x accept #",
    "web\ncommit",
    "é",
    "\u202e",
    "a" * 300,
)
nasty_text = st.one_of(
    st.sampled_from(NASTY),
    st.builds(
        lambda a, n, b: a + n + b,
        st.sampled_from(("web", "ns", "10.0.0.1", "")),
        st.sampled_from(NASTY),
        st.sampled_from(("", "x", "80")),
    ),
    st.text(max_size=12),
)
wrong_type = st.one_of(
    st.none(), st.integers(-5, 70000), st.booleans(), st.lists(st.integers(), max_size=2), st.just({})
)


def bad_value() -> st.SearchStrategy[Any]:
    return st.one_of(nasty_text, nasty_text, wrong_type)


# Each generated object draws how hostile it is: about half are valid through and through, the rest carry hostile
# values in a few or many fields, so accepted and rejected objects both come up often (--hypothesis-show-statistics).
hostility = st.sampled_from((0.0, 0.0, 0.0, 0.03, 0.1, 0.4))


def pick(draw: st.DrawFn, rate: float, good: st.SearchStrategy[Any]) -> Any:
    if rate and draw(st.floats(0, 1)) < rate:
        return draw(bad_value())
    return draw(good)


names = st.sampled_from(("web", "db", "api", "a-b", "x1"))
namespaces = st.sampled_from(("default", "fuzz"))
ip4 = st.builds(lambda a, b: f"198.18.{a}.{b}", st.integers(0, 255), st.integers(1, 254))
ip6 = st.builds(lambda a: f"fd00:198:18::{a:x}", st.integers(1, 0xFFFF))
cluster_ip4 = st.builds(lambda b: f"198.19.0.{b}", st.integers(1, 254))
bad_ip = st.sampled_from(
    ("198.18.0.300", "not-an-ip", "198.18.0.1/24", "fe80::1%eth0", "", "::ffff:1.2.3.4", "010.1.2.3")
)
protocols = st.sampled_from(("TCP", "UDP", "SCTP"))
port_numbers = st.integers(1, 65535)
port_names = st.sampled_from(("", "http", "dns", "p-1"))


@st.composite
def service_ports(draw: st.DrawFn, rate: float) -> dict[str, Any]:
    port: dict[str, Any] = {
        "name": pick(draw, rate, port_names),
        "port": pick(draw, rate, port_numbers),
        "protocol": pick(draw, rate, protocols),
        "targetPort": pick(draw, rate, st.one_of(port_numbers, port_names)),
    }
    if draw(st.booleans()):
        port["nodePort"] = pick(draw, rate, st.integers(30000, 32767))
    return port


@st.composite
def services(draw: st.DrawFn) -> dict[str, Any]:
    rate = draw(hostility)
    families = pick(draw, rate, st.sampled_from((["IPv4"], ["IPv6"], ["IPv4", "IPv6"])))
    fam_ips = {"IPv4": cluster_ip4, "IPv6": ip6}
    if isinstance(families, list):
        ips: Any = [draw(fam_ips[f]) if f in fam_ips else draw(cluster_ip4) for f in families]
    else:
        ips = [draw(cluster_ip4)]
    if rate and draw(st.floats(0, 1)) < rate:
        ips = draw(st.one_of(st.lists(st.one_of(bad_ip, cluster_ip4, ip6), max_size=3), bad_value()))
    spec: dict[str, Any] = {
        "type": pick(
            draw, rate, st.sampled_from(("ClusterIP", "ClusterIP", "NodePort", "LoadBalancer", "ExternalName"))
        ),
        "clusterIP": ips[0] if isinstance(ips, list) and ips else pick(draw, rate, st.sampled_from(("None", ""))),
        "clusterIPs": ips,
        "ipFamilies": families,
        "ports": draw(st.lists(service_ports(rate), min_size=1, max_size=3, unique_by=lambda p: repr(p.get("name"))))
        if not rate or draw(st.floats(0, 1)) > rate
        else draw(bad_value()),
        "externalIPs": pick(draw, rate, st.lists(ip4, max_size=2)),
        "sessionAffinity": pick(draw, rate, st.sampled_from(("None", "ClientIP"))),
        "sessionAffinityConfig": pick(draw, rate, st.just({"clientIP": {"timeoutSeconds": 60}})),
        "externalTrafficPolicy": pick(draw, rate, st.sampled_from(("Cluster", "Local"))),
        "internalTrafficPolicy": pick(draw, rate, st.sampled_from(("Cluster", "Local"))),
        "loadBalancerSourceRanges": pick(
            draw, rate, st.lists(st.sampled_from(("198.18.0.0/16", "198.19.1.0/24")), max_size=2)
        ),
        "healthCheckNodePort": pick(draw, rate, st.integers(30000, 32767)),
    }
    optional = sorted(set(spec) - {"ports", "clusterIP", "clusterIPs", "ipFamilies"})
    for key in draw(st.lists(st.sampled_from(optional), max_size=3)):
        spec.pop(key, None)  # fields left out, as hand-written manifests do
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": pick(draw, rate, names),
            "namespace": pick(draw, rate, namespaces),
            "labels": pick(draw, rate, st.dictionaries(st.sampled_from(("app", "tier")), names, max_size=2)),
            "annotations": draw(st.dictionaries(nasty_text, nasty_text, max_size=2)),  # free text by design
            "resourceVersion": pick(draw, rate, st.just("1")),
        },
        "spec": spec if not rate or draw(st.floats(0, 1)) > rate / 4 else draw(bad_value()),
        "status": {
            "loadBalancer": {"ingress": [{"ip": pick(draw, rate, ip4)} for _ in range(draw(st.integers(0, 2)))]}
        },
    }


@st.composite
def endpoints(draw: st.DrawFn, rate: float, family: Any) -> dict[str, Any]:
    addr = ip6 if family == "IPv6" else ip4
    return {
        "addresses": pick(
            draw, rate, st.lists(st.one_of(addr, addr, addr, bad_ip) if rate else addr, min_size=1, max_size=2)
        ),
        "conditions": {
            "ready": pick(draw, rate, st.booleans()),
            "serving": pick(draw, rate, st.booleans()),
            "terminating": pick(draw, rate, st.booleans()),
        },
        "nodeName": pick(draw, rate, st.sampled_from((NODE, "node-2"))),
        "zone": pick(draw, rate, st.sampled_from(("zone-a", "zone-b"))),
        "hostname": pick(draw, rate, names),
        "targetRef": {"kind": "Pod", "name": pick(draw, rate, names)},
    }


@st.composite
def slices(draw: st.DrawFn) -> dict[str, Any]:
    rate = draw(hostility)
    family = pick(draw, rate, st.sampled_from(("IPv4", "IPv4", "IPv6", "FQDN")))
    ports = [
        {
            "name": pick(draw, rate, port_names),
            "port": pick(draw, rate, port_numbers),
            "protocol": pick(draw, rate, protocols),
            "appProtocol": pick(draw, rate, names),
        }
        for _ in range(draw(st.integers(0, 3)))
    ]
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": pick(draw, rate, st.builds(lambda n, i: f"{n}-{i}", names, st.integers(0, 3))),
            "namespace": pick(draw, rate, namespaces),
            "labels": {"kubernetes.io/service-name": pick(draw, rate, names)},
            "annotations": draw(st.dictionaries(nasty_text, nasty_text, max_size=2)),
        },
        "addressType": family,
        "endpoints": [draw(endpoints(rate, family)) for _ in range(draw(st.integers(0, 3)))],
        "ports": ports if not rate or draw(st.floats(0, 1)) > rate / 4 else draw(bad_value()),
    }


# A fixed, good baseline: what a rejected or unrelated object must leave alone.
def _baseline() -> list[tuple[str, dict[str, Any]]]:
    out: list[tuple[str, dict[str, Any]]] = []
    for ns, name, ip in (
        ("default", "web", "198.19.0.10"),
        ("fuzz", "db", "198.19.0.11"),
        ("keep", "keep", "198.19.0.12"),
    ):
        out.append(
            (
                "Service",
                {
                    "metadata": {"name": name, "namespace": ns},
                    "spec": {
                        "clusterIP": ip,
                        "clusterIPs": [ip],
                        "ipFamilies": ["IPv4"],
                        "ports": [{"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"}],
                    },
                },
            )
        )
        out.append(
            (
                "EndpointSlice",
                {
                    "metadata": {
                        "name": f"{name}-0",
                        "namespace": ns,
                        "labels": {"kubernetes.io/service-name": name},
                    },
                    "addressType": "IPv4",
                    "endpoints": [
                        {"addresses": ["198.18.65.11"], "conditions": {"ready": True}, "nodeName": NODE},
                        {"addresses": ["198.18.66.11"], "conditions": {"ready": True}, "nodeName": "node-2"},
                    ],
                    "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
                },
            )
        )
    return out


def _cache() -> ServiceCache:
    cache = ServiceCache(NODE, ip_families=FAMILIES)
    for kind, obj in _baseline():
        assert (cache.upsert_service if kind == "Service" else cache.upsert_slice)(obj)
    cache.mark_synced("services")
    cache.mark_synced("endpointslices")
    return cache


def _by_service(cache: ServiceCache) -> dict[tuple[IPFamily, NamespacedName], Any]:
    state, _ = cache.snapshot()
    out: dict[tuple[IPFamily, NamespacedName], Any] = {}
    for fam in FAMILIES:
        for spn, sp in state.family(fam).items():
            out.setdefault((fam, NamespacedName(spn.namespace, spn.name)), {})[spn] = sp
    return out


def _owner(kind: str, obj: Any) -> NamespacedName | None:
    """The service an object belongs to, when it can be told (a slice names it in a label)."""
    _, ns, name = _object_label(kind, obj)
    if kind == "Service":
        return NamespacedName(ns, name)
    meta = obj.get("metadata") if isinstance(obj, dict) else None
    labels = meta.get("labels") if isinstance(meta, dict) else None
    svc = labels.get("kubernetes.io/service-name") if isinstance(labels, dict) else None
    return NamespacedName(ns, svc) if isinstance(svc, str) else None


def _previous_owner(kind: str, obj: Any) -> NamespacedName | None:
    """The baseline service that owned the slice with this object's namespace and name, if any."""
    if kind != "EndpointSlice":
        return None
    _, ns, name = _object_label(kind, obj)
    for k, base in _baseline():
        if k == kind and (base["metadata"]["namespace"], base["metadata"]["name"]) == (ns, name):
            return NamespacedName(ns, base["metadata"]["labels"]["kubernetes.io/service-name"])
    return None


def _ignored(kind: str, obj: Any) -> bool:
    try:
        if kind == "Service":
            parse_service(obj, FAMILIES, "")
        else:
            parse_slice(obj, FAMILIES, NODE, 0.0)
    except Ignored:
        return True
    except Exception:
        return False
    return False


@pytest.fixture(autouse=True)
def _quiet(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.CRITICAL, logger="kproxy.cache")  # every rejection warns, on purpose


def _check_one(kind: str, obj: dict[str, Any]) -> None:
    cache = _cache()
    before = _by_service(cache)
    upsert = cache.upsert_service if kind == "Service" else cache.upsert_slice
    accepted = upsert(obj)  # must not raise
    after = _by_service(cache)
    label = _object_label(kind, obj)[0]
    errors = cache.errors()
    event(f"{kind}: {'accepted' if accepted else 'rejected' if label in errors else 'ignored'}")
    if not accepted:
        assert label in errors or _ignored(kind, obj), f"{label} was dropped without a reason: {obj!r}"
    if label in errors and not accepted:
        # rejected: nothing anywhere changed (an invalid update keeps the last good version)
        assert after == before, f"rejected {label} ({errors[label]}) changed the programmed state"
        return
    # accepted (or ignored): no service but its own may change, and for a slice the service that owned the slice of
    # that name before (a slice whose service label changed moves, as upstream's slice cache moves it)
    owners = {_owner(kind, obj), _previous_owner(kind, obj)}
    for key in set(before) | set(after):
        if key[1] not in owners:
            assert before.get(key) == after.get(key), f"{label} changed another service {key[1]}"


@SETTINGS
@given(services())
def test_fuzzed_service(obj: dict[str, Any]) -> None:
    _check_one("Service", obj)


@SETTINGS
@given(slices())
def test_fuzzed_slice(obj: dict[str, Any]) -> None:
    _check_one("EndpointSlice", obj)


@SETTINGS
@given(
    st.lists(
        st.one_of(st.tuples(st.just("Service"), services()), st.tuples(st.just("EndpointSlice"), slices())), max_size=8
    )
)
def test_fuzzed_streams_never_raise(objs: list[tuple[str, dict[str, Any]]]) -> None:
    """A stream of upserts, deletes, relists and snapshots with commits: nothing raises, duplicates and conflicting
    slices included (the same names come up again with other content), and the baseline service nobody names
    (``keep/keep``) stays exactly as it was."""
    cache = _cache()
    keep = NamespacedName("keep", "keep")
    before = {k: v for k, v in _by_service(cache).items() if k[1] == keep}
    for i, (kind, obj) in enumerate(objs):
        if kind == "Service":
            cache.upsert_service(obj)
        else:
            cache.upsert_slice(obj)
        if i % 3 == 2:
            _, ns, name = _object_label(kind, obj)
            (cache.delete_service if kind == "Service" else cache.delete_slice)(ns, name)
        state, changes = cache.snapshot()
        cache.commit(changes)
    base = _baseline()
    cache.replace_services([o for k, o in base if k == "Service"] + [o for k, o in objs if k == "Service"])
    cache.replace_slices([o for k, o in base if k == "EndpointSlice"] + [o for k, o in objs if k == "EndpointSlice"])
    after = {k: v for k, v in _by_service(cache).items() if k[1] == keep}
    assert after == before
    assert isinstance(cache.errors(), dict) and isinstance(cache.stats(), dict)
