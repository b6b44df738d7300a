"""Reading a ledger from any thread: ``describe`` (what is programmed, for ``/rules`` and ``kproxy show``) and
``verify`` (what the kernel holds against what the state wants, for ``kproxy verify``, ``/verify`` and the drift
metric). Both copy what they need from a family's record under its lock, so they never wait for a sync: a full sync
holds the lock only to swap its dictionaries in, a partial one to change its few entries."""

from __future__ import annotations

from typing import Any

from kproxy.batch import A, C, F, S, V
from kproxy.ledger import Ledger
from kproxy.model import IPFamily, ProxyState, ServicePort, ServicePortName
from kproxy.nodeaddr import NodeContext, resolve
from kproxy.proxier import Description, ServiceDescription, VerifyReport
from kproxy.toolkit.keys import service_key


def describe_port(
    sp: ServicePort | None, applied: bool, failed: str | None, refused: str | None = None
) -> ServiceDescription:
    """The common part of ``describe()`` for one service port of one family."""
    if sp is None:
        return {"applied": applied, "failed": failed or refused, "refused": refused}
    return {
        "clusterIP": sp.cluster_ip,
        "port": sp.port,
        "nodePort": sp.node_port,
        "externalIPs": list(sp.external_ips),
        "loadBalancerIPs": list(sp.load_balancer_ips),
        "loadBalancerSourceRanges": list(sp.load_balancer_source_ranges),
        "sessionAffinitySeconds": sp.affinity_timeout,
        "internalTrafficPolicyLocal": sp.internal_policy_local,
        "externalTrafficPolicyLocal": sp.external_policy_local,
        "internal": sp.internal_verdict.value,
        "external": sp.external_verdict.value,
        "internalEndpoints": [str(e) for e in sp.internal_endpoints],
        "externalEndpoints": [str(e) for e in sp.external_endpoints],
        "applied": applied,
        "failed": failed or refused,
        "refused": refused,
    }


def _family_view(
    ledger: Ledger[F, C, A, V, S], fam: IPFamily, key: ServicePortName | None
) -> list[tuple[ServicePortName, ServicePort | None, F | None, str | None, str | None]]:
    """(name, applied version, fragment, failed, refused) of one family, copied under the record's lock."""
    rec = ledger.records[fam]
    book = ledger.books[fam]
    # the admission book changes in the sync's thread outside the record's lock: dict.copy() takes it in one step
    # (a C-level clone with the stored hashes, no Python code in between), where iterating it raced a sync that
    # refused or admitted a service port meanwhile ("dictionary changed size during iteration")
    held = book.refused.copy()
    with rec.lock:
        refused = {spn: f"{r.reason}: {r.message}" for spn, r in held.items()}
        if key is not None:
            known = key in rec.services or key in rec.failed or key in refused
            names = [key] if known else []
        else:
            names = sorted(set(rec.services) | set(rec.failed) | set(refused))
        return [
            (spn, rec.services.get(spn), rec.fragments.get(spn), rec.failed.get(spn), refused.get(spn)) for spn in names
        ]


def describe(ledger: Ledger[F, C, A, V, S], key: ServicePortName | None = None) -> Description:
    """What the ledger records as programmed, with the backend's detail beside it; never waits for a sync."""
    backend = ledger.backend
    services: dict[str, dict[str, ServiceDescription]] = {}
    detail: dict[str, dict[str, Any]] = {}
    for fam in ledger.families:
        for spn, sp, frag, failed, refused in _family_view(ledger, fam, key):
            k = service_key(spn)
            services.setdefault(k, {})[fam.value] = describe_port(sp, frag is not None, failed, refused)
            if frag is not None:
                detail.setdefault(k, {})[fam.value] = backend.detail(spn, fam, frag)
    return {
        "mode": backend.mode,
        "generation": ledger.generation,
        "services": services,
        "detail": {"services": detail, **backend.detail_global()},
    }


def verify(ledger: Ledger[F, C, A, V, S], state: ProxyState, node: NodeContext | None = None) -> VerifyReport:
    """Read back what the kernel holds (``verify_view``: never the ledger's memory) and diff it against what
    ``state`` wants, per service: ``missing``, ``different`` (with what), and ``extra`` objects no wanted service
    accounts for. Services the kernel refused (the ledger knows why) are listed apart under ``refused``: known,
    reported in metrics, not drift. ``drift`` counts the rest. Read-only; any thread (the reads race a sync in
    progress, so a caller that must be exact runs it between syncs)."""
    backend = ledger.backend
    node = node or resolve(ledger.config, state.node, families=ledger.families)
    drifted: dict[str, dict[str, str]] = {}
    refused: dict[str, dict[str, str]] = {}
    extra: list[str] = []
    errors: list[str] = []
    for fam in ledger.families:
        ctx = backend.context(node.family(fam), state)
        try:
            view = backend.verify_view(fam, ctx)
        except Exception as exc:
            errors.append(f"{fam.value}: reading the kernel failed: {type(exc).__name__}: {exc}")
            continue
        problem = "the mode cannot read its kernel state back" if view is None else backend.verify_error(view)
        if view is None or problem:
            errors.append(f"{fam.value}: cannot read back the kernel state: {problem}")
            continue
        rec, book = ledger.records[fam], ledger.books[fam]
        with rec.lock:
            failed = dict(rec.failed)
        wanted: dict[ServicePortName, F] = {}
        for spn, wanted_sp in state.family(fam).items():
            sp = book.admitted[spn] if spn in book.altered else wanted_sp
            if sp is None:
                continue  # refused by the core (reported in ``/rules``): nothing of it is wanted in the kernel
            frag = wanted[spn] = backend.render(sp, ctx)
            why = backend.verify_service(view, spn, frag)
            if why is None:
                continue
            if spn in failed:
                refused.setdefault(service_key(spn), {})[fam.value] = f"{why} (refused: {failed[spn]})"
            else:
                drifted.setdefault(service_key(spn), {})[fam.value] = why
        extra.extend(f"{fam.value}: {line}" for line in backend.verify_extra(view, wanted))
    return {
        "mode": backend.mode,
        "generation": state.generation,
        "drift": len(drifted) + len(extra) + len(errors),
        "services": drifted,
        "extra": extra,
        "refused": refused,
        "errors": errors,
    }
