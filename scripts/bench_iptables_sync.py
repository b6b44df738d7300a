"""Sync benchmark of the iptables backend alone, until ``kproxy bench sync`` covers it.

Builds N services x E endpoints (198.18.0.0/15 addresses), syncs them into a throwaway network namespace
(prefix ``kpb-``, deleted at the end) and prints render time, full sync time, the kernel floor (``measure_floor``:
the same payloads restored into another fresh namespace) and the partial sync time after one endpoint of one
service changes (median of R). Usage: ``scripts/bench_iptables_sync.py [--services N] [--endpoints E]
[--repeat R] [--flavour nft|legacy]`` (root).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import time
import uuid

from kproxy.backends.iptables import render
from kproxy.backends.iptables.proxier import IptablesProxier
from kproxy.config import ProxyConfig
from kproxy.model import Changes, Endpoint, IPFamily, NodeInfo, Protocol, ProxyState, ServicePort, ServicePortName


def build(n: int, e: int) -> dict[ServicePortName, ServicePort]:
    out = {}
    for i in range(n):
        spn = ServicePortName("bench", f"svc-{i}", "http", Protocol.TCP)
        eps = tuple(Endpoint(f"198.19.{(i * e + j) // 250 % 250}.{(i * e + j) % 250 + 1}", 8080) for j in range(e))
        out[spn] = ServicePort(
            spn, IPFamily.V4, f"198.18.{i // 250}.{i % 250 + 1}", 80, cluster_endpoints=eps, has_any_endpoints=True
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--services", type=int, default=10000)
    ap.add_argument("--endpoints", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--flavour", default="nft")
    ap.add_argument("--restart", action="store_true", help="also time a new instance's adopting full sync")
    a = ap.parse_args()
    svcs = build(a.services, a.endpoints)
    cfg = ProxyConfig(
        cluster_cidrs=("198.18.0.0/16",), ip_families=(IPFamily.V4,), backend_options={"iptables_flavour": a.flavour}
    )
    node = NodeInfo("bench-node")
    ctx = render.make_context(cfg, node, IPFamily.V4, large_cluster=a.services * a.endpoints > 1000)
    t = time.perf_counter()
    frags = {k: render.render_service(v, ctx) for k, v in svcs.items()}
    text = render.build_restore(ctx, frags, write=None, top=None).text
    render_s = time.perf_counter() - t
    ns = "kpb-" + uuid.uuid4().hex[:10]
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        p = IptablesProxier(cfg, netns=ns)
        state = ProxyState({IPFamily.V4: svcs}, node)
        t = time.perf_counter()
        r = p.sync(state, Changes(full=True))
        full_s = time.perf_counter() - t
        assert r.ok, r.error
        full_timings = dict(r.timings)
        floor_s = p.measure_floor()
        partial = []
        first = next(iter(svcs))
        for k in range(a.repeat):
            sp = svcs[first]
            eps = list(sp.cluster_endpoints)
            eps[-1] = Endpoint(f"198.19.251.{k + 1}", 8080)
            svcs[first] = dataclasses.replace(sp, cluster_endpoints=tuple(eps))
            state = ProxyState({IPFamily.V4: svcs}, node)
            t = time.perf_counter()
            r = p.sync(state, Changes(full=False, services=frozenset({first})))
            partial.append(time.perf_counter() - t)
            assert r.ok, r.error
            partial_timings = dict(r.timings)
        restart = {}
        if a.restart:
            p2 = IptablesProxier(cfg, netns=ns)
            t = time.perf_counter()
            r = p2.sync(state, Changes(full=True))
            restart = {"restart_full_sync_s": round(time.perf_counter() - t, 3)}
            restart.update({f"restart_{k}": round(v, 3) for k, v in r.timings.items()})
            assert r.ok, r.error
        print(
            json.dumps(
                {
                    **restart,
                    "flavour": a.flavour,
                    "services": a.services,
                    "endpoints": a.endpoints,
                    "lines": text.count("\n"),
                    "render_s": round(render_s, 3),
                    "full_sync_s": round(full_s, 3),
                    "full_timings": {k: round(v, 3) for k, v in full_timings.items()},
                    "floor_s": round(floor_s or 0, 3),
                    "ratio": round(full_s / floor_s, 3) if floor_s else None,
                    "partial_sync_s": round(statistics.median(partial), 4),
                    "partial_all": [round(x, 4) for x in partial],
                    "partial_timings": {k: round(v, 4) for k, v in partial_timings.items()},
                }
            )
        )
    finally:
        subprocess.run(["ip", "netns", "delete", ns], check=False)


if __name__ == "__main__":
    main()
