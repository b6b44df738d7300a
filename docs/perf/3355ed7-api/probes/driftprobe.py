"""RSS of a first full sync at N x 10 under nftables with and without the daemon's drift watcher running.
usage: driftprobe.py N on|off  (inside a throwaway netns; CHUNK=N in the environment sets the nftables chunk size)"""
import gc, sys, threading, time
from types import MappingProxyType
from kproxy.bench.syncparts import BenchState, NODE, CLUSTER_CIDR
from kproxy.cache import ServiceCache
from kproxy.config import ProxyConfig
from kproxy.drift import DriftWatcher
from kproxy.model import IPFamily
from kproxy.proxier import backend_class
n, on = int(sys.argv[1]), sys.argv[2] == "on"
import os
if os.environ.get("CHUNK"):
    import kproxy.backends.nftables.plan as _p
    _p.CHUNK = int(os.environ["CHUNK"])
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) / 1024
cls = backend_class("nftables")
config = ProxyConfig(mode="nftables", hostname_override=NODE, cluster_cidrs=(CLUSTER_CIDR,))
be = cls(config); be.start()
w = None
if on:
    w = DriftWatcher(be.drift(), (IPFamily.V4,), repair=lambda f, why: None, check=lambda f, why: None, netns=None)
    w.start()
gen = BenchState("default", 10)
cache = ServiceCache(node_name=NODE, ip_families=(IPFamily.V4,))
gen.absorb(cache, n)
state, changes = cache.snapshot()
gc.collect()
before = status("VmRSS")
t0 = time.perf_counter()
if w is not None:
    with w.own_writes():
        r = be.sync(state, changes)
else:
    r = be.sync(state, changes)
t1 = time.perf_counter()
time.sleep(3)  # the watcher drains what is queued
gc.collect()
print(f"drift={'on' if on else 'off'} n={n} ok={r.ok} sync_s={t1-t0:.1f} rss_before={before:.0f} rss_after={status('VmRSS'):.0f} hwm={status('VmHWM'):.0f}", flush=True)
if w is not None:
    w.stop()
be.cleanup(); be.close()
