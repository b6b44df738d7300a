"""RSS of the API -> cache path in one process, stage by stage, vs the bench's absorb.
usage: apiprobe.py N api|gen [fake]   (run inside a netns of its own; starts the stand-in on loopback)"""
import gc, os, subprocess, sys, tempfile, time, threading
from pathlib import Path
n, how = int(sys.argv[1]), sys.argv[2]
sync = len(sys.argv) > 3
def rss():
    with open("/proc/self/status") as f:
        d = dict(l.split(":", 1) for l in f)
    return int(d["VmRSS"].split()[0]) / 1024, int(d["VmHWM"].split()[0]) / 1024
t0 = time.monotonic()
import tracemalloc
TM = os.environ.get("TM")
if TM:
    tracemalloc.start(int(TM))
def say(what):
    r, p = rss()
    if TM:
        cur, pk = tracemalloc.get_traced_memory()
        what += f" traced {cur/2**20:.1f}/{pk/2**20:.1f}"
    print(f"{time.monotonic()-t0:7.1f}s {what:40s} rss {r:7.1f} peak {p:7.1f}", flush=True)
from kproxy.cache import ServiceCache
from kproxy.model import IPFamily
from kproxy.bench.syncparts import NODE
say("imports")
if how == "api":
    import kproxy.sources.kube  # noqa
    from kproxy.sources.kube import KubeSource
    from kproxy.sources.client import make_api_client
    from kproxy.bench import apiscale
    from kproxy.lab.plan import LabPod
    d = tempfile.mkdtemp()
    pf = Path(d) / "port"
    api = subprocess.Popen([sys.executable, "-m", "kproxy.lab.apiserver", "--listen", "127.0.0.1:0", "--port-file", str(pf)],
                           stdout=open(Path(d)/"api.log","wb"), stderr=subprocess.STDOUT)
    try:
        for _ in range(100):
            if pf.exists() and pf.read_text().strip():
                break
            time.sleep(0.1)
        url = f"http://127.0.0.1:{pf.read_text().strip()}"
        pods = [LabPod(f"pod-{i}", "x", f"node-{1 + i % 2}", f"10.244.{i%2}.{10+i}", "") for i in range(12)]
        cfg = apiscale.ScaleConfig(mode="fake", services=n, endpoints=10, nodes=1)
        c = make_api_client(master=url)
        # the loader's objects go in a child process so this one's heap is only kproxy's
        if os.fork() == 0:
            apiscale.load(c, url, cfg, pods); os._exit(0)
        os.wait()
        say("loaded (in a child)")
        cache = ServiceCache(NODE, ip_families=(IPFamily.V4,))
        src = KubeSource(cache, make_api_client(master=url), NODE)
        say("source made")
        base = tracemalloc.take_snapshot() if TM else None
        src.start()
        peak = [0.0]; stop = threading.Event()
        def sample():
            while not stop.is_set():
                peak[0] = max(peak[0], rss()[0]); time.sleep(0.05)
        threading.Thread(target=sample, daemon=True).start()
        src.wait_synced(600)
        say("synced")
        src.stop()
        say("source stopped")
        if TM:
            gc.collect()
            for st in tracemalloc.take_snapshot().compare_to(base, "lineno")[:30]:
                print(st)
    finally:
        api.terminate(); api.wait()
elif how.startswith("lab"):
    import json
    from kproxy.bench import apiscale
    from kproxy.lab.plan import LabPod
    pods = [LabPod(f"pod-{i}", "x", f"node-{1 + i % 2}", f"10.244.{i%2}.{10+i}", "") for i in range(12)]
    cfg = apiscale.ScaleConfig(mode="fake", services=n, endpoints=10, nodes=1)
    def paged(make):
        for start in range(1, n + 1, 500):
            page = [make(i) for i in range(start, min(start + 500, n + 1))]
            if how == "labjson":
                page = json.loads(json.dumps(page))
            yield from page
    cache = ServiceCache(NODE, ip_families=(IPFamily.V4,))
    say("before")
    cache.replace_services(paged(lambda i: apiscale.service(i, cfg)))
    say("services")
    cache.replace_slices(paged(lambda i: apiscale.endpoint_slice(i, cfg, pods)))
    say("absorbed")
else:
    from kproxy.bench.syncparts import BenchState
    gen = BenchState("default", 10)
    cache = ServiceCache(NODE, ip_families=(IPFamily.V4,))
    gen.absorb(cache, n)
    say("absorbed")
gc.collect()
say("gc")
state, changes = cache.snapshot()
say("snapshot")
print("services", len(state.services))
if TM:
    snap = tracemalloc.take_snapshot()
    for st in snap.statistics("lineno")[:25]:
        print(st)
