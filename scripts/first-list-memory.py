"""The API source's first list at scale, in a process of its own: the lab's API stand-in (a child process) loaded
with N services and their EndpointSlices (`bench apiscale`'s objects), and a KubeSource feeding a real ServiceCache,
as `kproxy run` wires them. Prints one JSON line: the time to the sync, the time in list requests (HTTP + JSON) and
in json.loads alone, each sink's replace_* (with a streamed list: its pages' requests included), the process's RSS
before, at its peak and after the sync, and each heap trim (seconds, RSS before and after). No root, loopback only.

    nice -n 19 .venv/bin/python scripts/first-list-memory.py --services 100000 [--no-trim] [--tracemalloc]

``--tracemalloc``: also the largest allocations alive when the slices' replace returns (slow: minutes at 20,000).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from typing import Any

SERVER = r"""
import sys
from kproxy.bench import apiscale
from kproxy.lab.apihttp import serve
from kproxy.lab.plan import LabPod
n, e = int(sys.argv[1]), int(sys.argv[2])
cfg = apiscale.ScaleConfig(mode="bpf", services=n, endpoints=e, nodes=2)
pods = [LabPod(f"pod-{j}", "bench", f"node-{1 + j % 2}", f"10.200.{j // 250}.{1 + j % 250}", "") for j in range(40)]
api = serve([(None, "127.0.0.1", 0)], history=1000)
api.store.create({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-1", "labels": {}}, "spec": {}})
api.store.create_many(apiscale.objects(cfg, pods), chunk=4000)
print(api.ports[0], flush=True)
sys.stdin.read()
api.close()
"""


def status() -> dict[str, int]:
    """VmRSS and VmHWM in MB."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) // 1024
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--services", type=int, default=20000)
    ap.add_argument("--endpoints", type=int, default=10)
    ap.add_argument("--tracemalloc", action="store_true")
    ap.add_argument("--no-trim", action="store_true", help="no heap trim after the lists")
    args = ap.parse_args()
    started = time.monotonic()
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER, str(args.services), str(args.endpoints)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert server.stdin is not None and server.stdout is not None
    try:
        port = int(server.stdout.readline())
        print(json.dumps(run(args, port, time.monotonic() - started)))
    finally:
        server.stdin.close()
        server.wait(60)


def instrument(acc: dict[str, Any], args: argparse.Namespace) -> None:
    """Time json.loads and the list requests inside kproxy.sources.kube; time (or disable) the heap trims."""
    from kproxy.sources import kube

    lock = threading.Lock()
    real_loads, real_page = json.loads, kube.Reflector._page

    class TimedJson:
        def __getattr__(self, name: str) -> Any:
            return getattr(json, name)

        def loads(self, s: Any, **kw: Any) -> Any:
            t = time.perf_counter()
            try:
                return real_loads(s, **kw)
            finally:
                with lock:
                    acc["decode_s"] += time.perf_counter() - t

    def timed_page(self: Any, **kw: Any) -> Any:
        t = time.perf_counter()
        try:
            return real_page(self, **kw)
        finally:
            with lock:
                acc["page_s"] += time.perf_counter() - t
                acc["pages"] += 1

    kube.json = TimedJson()  # type: ignore[assignment]
    kube.Reflector._page = timed_page  # type: ignore[method-assign]
    real_trim = getattr(kube, "trim_heap", None)
    if real_trim is None:
        return  # a tree from before the heap trim

    def timed_trim() -> bool:
        t, before = time.perf_counter(), status()["VmRSS"]
        released = real_trim()
        acc["trims"].append((round(time.perf_counter() - t, 3), before, status()["VmRSS"], released))
        return bool(released)

    kube.trim_heap = timed_trim
    if args.no_trim:
        kube.TRIM_AFTER = 10**12


def run(args: argparse.Namespace, port: int, load_s: float) -> dict[str, Any]:
    from kproxy.cache import ServiceCache
    from kproxy.sources.kube import KubeSource, make_api_client

    if args.tracemalloc:
        import tracemalloc

        tracemalloc.start(3)
    acc: dict[str, Any] = {"page_s": 0.0, "decode_s": 0.0, "pages": 0, "trims": [], "top": []}
    instrument(acc, args)
    cache = ServiceCache("node-1")
    for kind, name in (("services", "replace_services"), ("endpointslices", "replace_slices")):
        real = getattr(cache, name)

        def timed(objs: Any, _real: Any = real, _kind: str = kind) -> None:
            t = time.perf_counter()
            try:
                _real(objs)
            finally:
                acc[f"replace_{_kind}_s"] = round(time.perf_counter() - t, 2)
                if args.tracemalloc and _kind == "endpointslices":
                    stats = tracemalloc.take_snapshot().statistics("lineno")[:12]
                    acc["top"] = [f"{s.size / 2**20:.1f} MB {s.count} {s.traceback}" for s in stats]

        setattr(cache, name, timed)
    before = status()
    client = make_api_client(master=f"http://127.0.0.1:{port}")
    t = time.monotonic()
    source = KubeSource(cache, client, "node-1").start()
    try:
        assert source.wait_synced(1800), "not synced within 30 minutes"
        synced_s = time.monotonic() - t
        after = status()
        return {
            "services": args.services,
            "endpoints": args.endpoints,
            "load_s": round(load_s, 1),
            "synced_s": round(synced_s, 2),
            "page_s": round(acc["page_s"], 2),
            "decode_s": round(acc["decode_s"], 2),
            "pages": acc["pages"],
            "replace_services_s": acc.get("replace_services_s"),
            "replace_endpointslices_s": acc.get("replace_endpointslices_s"),
            "rss_before_mb": before["VmRSS"],
            "rss_peak_mb": after["VmHWM"],
            "rss_synced_mb": after["VmRSS"],
            "trims": acc["trims"],
            "traced_peak_mb": tracemalloc.get_traced_memory()[1] // 2**20 if args.tracemalloc else None,
            "top": acc["top"],
            "lists": {k: v["lists"] for k, v in source.stats().items()},
        }
    finally:
        source.stop()
        client.close()


if __name__ == "__main__":
    main()
