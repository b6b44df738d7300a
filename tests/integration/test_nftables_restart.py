"""Restart adoption of the nftables backend: a fresh process adopting a loaded table with nothing changed writes
nothing, and how long its first sync takes (``restart_sync_s``, a figure ``kproxy bench sync`` does not report yet).

As a test (root, namespace ``kpm-nftr-…``): 300 services x 5 endpoints, the restarted process's first sync writes
no transaction. As a tool, for the figures in the README::

    .venv/bin/python -m tests.integration.test_nftables_restart --services 10000 --endpoints 10 --repeat 3

builds the state with the bench's synthetic objects through the real cache (``kproxy.bench.synthetic``), loads it
with one process (``full_sync_s``: snapshot + sync, as ``kproxy bench sync`` times it), then ``--repeat`` times
starts a fresh process in the same namespace whose first sync adopts (``restart_sync_s``: snapshot + sync; the
cache's absorb is not part of it), and prints JSON with the runs, their median and each process's peak RSS.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from kproxy.bench import synthetic
from kproxy.cache import ServiceCache
from kproxy.config import ProxyConfig
from kproxy.model import IPFamily

from .scratch import scratch_netns

NODE = "node-1"
CFG = ProxyConfig(hostname_override=NODE, cluster_cidrs=("198.18.64.0/18",), ip_families=(IPFamily.V4,))


def _cache(services: int, endpoints: int) -> ServiceCache:
    cache = ServiceCache(node_name=NODE, ip_families=(IPFamily.V4,))
    for svc in synthetic.services(services):
        cache.upsert_service(svc)
    for eps in synthetic.endpoint_slices(services, endpoints):
        cache.upsert_slice(eps)
    cache.mark_synced("services")
    cache.mark_synced("endpointslices")
    return cache


def one_sync(netns: str, services: int, endpoints: int, partials: int = 0) -> dict[str, object]:
    """Build the state, time snapshot + the first (full) sync of a fresh proxier, report what it wrote."""
    from kproxy.backends.nftables.proxier import NftablesProxier

    cache = _cache(services, endpoints)
    p = NftablesProxier(CFG, netns=netns)
    try:
        t0 = time.perf_counter()
        state, changes = cache.snapshot()
        res = p.sync(state, changes)
        seconds = time.perf_counter() - t0
        assert res.ok, res.error
        cache.commit(changes, failed=tuple(res.failed))
        written = p.last_transaction(IPFamily.V4)
        partial = []
        for r in range(partials):  # one endpoint of one service changes, as kproxy bench sync does
            s0 = time.perf_counter()
            cache.upsert_slice(synthetic.endpoint_slice(1 + (r * 7919) % services, endpoints, variant=r + 1))
            state, changes = cache.snapshot()
            pres = p.sync(state, changes)
            assert pres.ok and not changes.full, pres.error
            cache.commit(changes, failed=tuple(pres.failed))
            partial.append(time.perf_counter() - s0)
        return {
            "seconds": seconds,
            "written_commands": written.count("\n"),
            "timings": dict(res.timings),
            "figures": dict(res.families[IPFamily.V4].figures),
            "partial_sync_runs": partial,
            "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
        }
    finally:
        p.close()


def _child(netns: str, services: int, endpoints: int, partials: int = 0) -> dict[str, object]:
    cmd = [sys.executable, "-m", "tests.integration.test_nftables_restart", "--child", netns]
    cmd += ["--services", str(services), "--endpoints", str(endpoints), "--partials", str(partials)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


@pytest.fixture
def netns() -> Iterator[str]:
    with scratch_netns("kpm-nftr-", lo_up=True) as ns:
        yield ns


@pytest.mark.root
def test_restart_with_nothing_changed_writes_nothing(netns: str) -> None:
    first = _child(netns, 300, 5)
    assert int(str(first["written_commands"])) > 300
    again = _child(netns, 300, 5)
    assert again["written_commands"] == 0, again
    # nothing changed: the restart read the digest set (one element per service port) and the hairpin set (one per
    # local endpoint), not the entry maps (service-ips: 300 more, the biggest elements)
    figures = dict(again["figures"])  # type: ignore[call-overload]
    listed = subprocess.run(
        ["ip", "netns", "exec", netns, "nft", "-j", "list", "set", "ip", "kproxy", "hairpin"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    hairpin = sum(len(o["set"].get("elem", ())) for o in json.loads(listed)["nftables"] if "set" in o)
    assert figures["adopt_elements"] == 300 + hairpin, figures


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--services", type=int, default=10000)
    ap.add_argument("--endpoints", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--child", metavar="NETNS", help=argparse.SUPPRESS)
    ap.add_argument("--partials", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(one_sync(args.child, args.services, args.endpoints, args.partials)))
        return 0
    with scratch_netns("kpm-nftr-", lo_up=True) as ns:
        full = _child(ns, args.services, args.endpoints)
        # partial syncs only in the last run: they change the table the next restart would adopt
        runs = [
            _child(ns, args.services, args.endpoints, args.repeat if i == args.repeat - 1 else 0)
            for i in range(args.repeat)
        ]
    secs = [float(str(r["seconds"])) for r in runs]
    print(
        json.dumps(
            {
                "services": args.services,
                "endpoints": args.endpoints,
                "full_sync_s": full["seconds"],
                "full_rss_mb": full["rss_mb"],
                "full_timings": full["timings"],
                "restart_sync_s": statistics.median(secs),
                "restart_sync_runs": secs,
                "restart_written_commands": [r["written_commands"] for r in runs],
                "restart_rss_mb": max(float(str(r["rss_mb"])) for r in runs),
                "restart_timings": [r["timings"] for r in runs],
                "partial_sync_after_restart_runs": runs[-1]["partial_sync_runs"],
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
