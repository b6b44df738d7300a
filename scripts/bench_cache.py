"""Time the shared cache alone: feed N Services + N EndpointSlices of E endpoints one by one, snapshot, then change
one endpoint and snapshot again. Prints the three figures the cache is held to and the peak resident memory
(which includes the synthetic input objects this script keeps alive, ~60 MB at 10k x 10). CPU seconds are
printed next to wall seconds because the machines are shared and noisy.

Used by the cache's author to check PERFORMANCE.md's budget; ``kproxy bench sync --mode fake`` covers the same
path through the runner. Run: ``.venv/bin/python scripts/bench_cache.py --services 10000 --endpoints 10``.
"""

from __future__ import annotations

import argparse
import copy
import json
import resource
import statistics
import time
from typing import Any

from kproxy.cache import ServiceCache
from kproxy.model import IPFamily


def service(i: int) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"namespace": "bench", "name": f"svc-{i}", "labels": {"app": f"a{i}"}},
        "spec": {
            "type": "ClusterIP",
            "clusterIP": f"198.18.{i // 256}.{i % 256}",
            "clusterIPs": [f"198.18.{i // 256}.{i % 256}"],
            "ipFamilies": ["IPv4"],
            "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080}],
            "sessionAffinity": "None",
        },
    }


def endpoint_slice(i: int, endpoints: int, node: str) -> dict[str, Any]:
    base = (1 << 14) + i * endpoints  # 198.18.64.0 onwards: above the cluster IPs, inside 198.18.0.0/15
    eps = []
    for j in range(endpoints):
        n = base + j
        eps.append(
            {
                "addresses": [f"198.{18 + (n >> 16)}.{(n >> 8) & 255}.{n & 255}"],
                "conditions": {"ready": True, "serving": True, "terminating": False},
                "nodeName": node if j % 3 == 0 else f"other-{j}",
                "zone": "z1",
            }
        )
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "namespace": "bench",
            "name": f"svc-{i}-abcde",
            "labels": {"kubernetes.io/service-name": f"svc-{i}", "endpointslice.kubernetes.io/managed-by": "bench"},
        },
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
        "endpoints": eps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--services", type=int, default=10000)
    parser.add_argument("--endpoints", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--format", choices=("text", "json"), default="text")
    args = parser.parse_args()

    services = [service(i) for i in range(args.services)]
    slices = [endpoint_slice(i, args.endpoints, "node-a") for i in range(args.services)]

    cache = ServiceCache("node-a", ip_families=(IPFamily.V4,))
    c0 = time.process_time()
    t0 = time.perf_counter()
    for obj in services:
        cache.upsert_service(obj)
    for obj in slices:
        cache.upsert_slice(obj)
    cache.mark_synced("services")
    cache.mark_synced("endpointslices")
    t_feed = time.perf_counter() - t0
    state, changes = cache.snapshot()
    t_first = time.perf_counter() - t0
    cpu_first = time.process_time() - c0
    cache.commit(changes)
    assert len(state) == args.services and len(changes.services) == args.services

    partial = []
    for r in range(args.repeat):
        changed = copy.deepcopy(slices[r])
        changed["endpoints"][0]["conditions"]["ready"] = False
        t1 = time.perf_counter()
        cache.upsert_slice(changed)
        state, changes = cache.snapshot()
        partial.append(time.perf_counter() - t1)
        cache.commit(changes)
        assert len(changes.services) == 1, changes
    t2 = time.perf_counter()
    for _ in range(args.repeat):
        cache.snapshot()
    empty_snapshot = (time.perf_counter() - t2) / args.repeat

    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    # The same absorption as one relist (replace_*), as a reconnecting API source does it.
    relisted = ServiceCache("node-a", ip_families=(IPFamily.V4,))
    t3 = time.perf_counter()
    relisted.replace_services(services)
    relisted.replace_slices(slices)
    relisted.snapshot()
    t_relist = time.perf_counter() - t3
    del relisted
    figures = {
        "services": args.services,
        "endpoints_per_service": args.endpoints,
        "feed_s": round(t_feed, 3),
        "first_snapshot_total_s": round(t_first, 3),
        "first_snapshot_total_cpu_s": round(cpu_first, 3),
        "relist_and_first_snapshot_s": round(t_relist, 3),
        "partial_change_and_snapshot_s_median": round(statistics.median(partial), 5),
        "partial_change_and_snapshot_s_max": round(max(partial), 5),
        "snapshot_no_change_s": round(empty_snapshot, 5),
        "ru_maxrss_mb": round(rss_mb, 1),
        "stats": cache.stats(),
    }
    if args.format == "json":
        print(json.dumps(figures))
    else:
        for k, val in figures.items():
            print(f"{k:40} {val}")


if __name__ == "__main__":
    main()
