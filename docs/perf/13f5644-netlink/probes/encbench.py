"""After a full sync at N x 10 (nftables, in a throwaway netns), time the chunks of a fresh full batch:
planning, text() and nlwrite.encode, each apart."""
import sys, time
from types import MappingProxyType
from kproxy.bench.syncparts import BenchState, NODE, CLUSTER_CIDR
from kproxy.batch import Batch, Delta
from kproxy.cache import ServiceCache
from kproxy.config import ProxyConfig
from kproxy.model import IPFamily, NodeInfo, ProxyState
from kproxy.proxier import backend_class
from kproxy.backends.nftables import plan, nlwrite, adopt as adopt_mod
n = int(sys.argv[1])
be = backend_class("nftables")(ProxyConfig(mode="nftables", hostname_override=NODE, cluster_cidrs=(CLUSTER_CIDR,)))
be.start()
gen = BenchState("default", 10)
cache = ServiceCache(node_name=NODE, ip_families=(IPFamily.V4,))
gen.absorb(cache, n)
state, changes = cache.snapshot()
r = be.sync(state, changes)
print("sync", r.ok, {k: round(v, 2) for k, v in r.timings.items()})
context, fragments = be.applied(IPFamily.V4)
for rep in range(2):
    batch = Batch(family=IPFamily.V4, full=True, context=context,
                  deltas=tuple(Delta(name, None, None, None, frag) for name, frag in fragments.items()),
                  wanted=fragments, applied=MappingProxyType({}), state=ProxyState(services={}, node=NodeInfo("")),
                  adopted=adopt_mod.Adopted(IPFamily.V4))
    tp = tt = te = 0.0
    it = plan.full_chunks(batch, netlink=True)
    while True:
        t0 = time.perf_counter(); c = next(it, None); t1 = time.perf_counter()
        if c is None: break
        text = c.tx.text(); t2 = time.perf_counter()
        m = nlwrite.encode(c.tx); t3 = time.perf_counter()
        tp += t1 - t0; tt += t2 - t1; te += t3 - t2
    print(f"plan {tp:.2f} text {tt:.2f} encode {te:.2f}")
be.cleanup(); be.close()
