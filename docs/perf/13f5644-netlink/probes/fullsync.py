"""First full sync at N x 10 under nftables; prints the sync's seconds, CPU split, timings and figures.
usage: fullsync.py N [OUT]   (inside a throwaway netns)
- OUT: also write the transaction that builds the table from nothing (the old `nft -f` floor's input) to OUT;
- CHUNK=N in the environment sets the libnftables chunk size; VERIFY=1 reads the table back;
- /tmp/kpt-sync-start holds the pid while the sync runs (for `perf record -p`), /tmp/kpt-sync-end marks its end."""
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
print("figures", be._counts)
if len(sys.argv) > 2:
    text = be.fresh_transaction(IPFamily.V4)
    open(sys.argv[2], "w").write(text)
    print("fresh text", len(text), "characters", text.count("\n"), "lines")
if os.environ.get("VERIFY"):
    t0 = time.perf_counter(); rep = be.verify(state)
    print("verify", round(time.perf_counter() - t0, 2), rep)
be.cleanup(); be.close()
