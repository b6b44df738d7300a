"""First full sync at N x 10 under nftables; prints the sync's seconds and CPU split.
usage: fullsync.py N (inside a throwaway netns)"""
import os, sys, time
from kproxy.bench.syncparts import BenchState, NODE, CLUSTER_CIDR
from kproxy.cache import ServiceCache
from kproxy.config import ProxyConfig
from kproxy.model import IPFamily
from kproxy.proxier import backend_class
n = int(sys.argv[1])
if os.environ.get("CHUNK"):
    import kproxy.backends.nftables.plan as _p
    _p.CHUNK = int(os.environ["CHUNK"])
cls = backend_class("nftables")
config = ProxyConfig(mode="nftables", hostname_override=NODE, cluster_cidrs=(CLUSTER_CIDR,))
be = cls(config); be.start()
gen = BenchState("default", 10)
cache = ServiceCache(node_name=NODE, ip_families=(IPFamily.V4,))
gen.absorb(cache, n)
state, changes = cache.snapshot()
open("/tmp/kpt-sync-start", "w").write(str(os.getpid()))
t0 = time.perf_counter(); c0 = os.times()
r = be.sync(state, changes)
t1 = time.perf_counter(); c1 = os.times()
print("timings", {k: round(v, 2) for k, v in r.timings.items()})
print(f"sync ok={r.ok} wall={t1-t0:.2f} user={c1.user-c0.user:.2f} sys={c1.system-c0.system:.2f}", flush=True)
open("/tmp/kpt-sync-end", "w").write("1")
print("figures", {k: v for k, v in be.describe_last().items()} if hasattr(be, "describe_last") else be._counts)
if os.environ.get("VERIFY"):
    t0 = time.perf_counter(); rep = be.verify(state)
    print("verify", time.perf_counter() - t0, rep.ok if hasattr(rep, "ok") else rep, str(rep)[:500])
be.cleanup(); be.close()
