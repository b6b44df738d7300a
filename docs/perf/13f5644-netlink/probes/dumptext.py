"""Full sync at N x 10 under nftables, then write the fresh transaction text (the floor's input) to a file.
usage: dumptext.py N OUT (inside a throwaway netns)"""
import gc, sys, time
from kproxy.bench.syncparts import BenchState, NODE, CLUSTER_CIDR
from kproxy.cache import ServiceCache
from kproxy.config import ProxyConfig
from kproxy.model import IPFamily
from kproxy.proxier import backend_class
n, out = int(sys.argv[1]), sys.argv[2]
cls = backend_class("nftables")
config = ProxyConfig(mode="nftables", hostname_override=NODE, cluster_cidrs=(CLUSTER_CIDR,))
be = cls(config); be.start()
gen = BenchState("default", 10)
cache = ServiceCache(node_name=NODE, ip_families=(IPFamily.V4,))
gen.absorb(cache, n)
state, changes = cache.snapshot()
t0 = time.perf_counter()
r = be.sync(state, changes)
print(f"sync ok={r.ok} {time.perf_counter()-t0:.1f}s", flush=True)
text = be.fresh_transaction(IPFamily.V4)
open(out, "w").write(text)
print(len(text), text.count("\n"))
be.cleanup(); be.close()
