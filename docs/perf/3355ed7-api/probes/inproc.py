"""`kproxy run` in this process (as cmd_run builds it) fed by the API stand-in with N lab-shaped services; RSS at
each stage. usage: inproc.py N MODE   (inside a netns of its own). TM=1: tracemalloc diff list-start -> first sync."""
import gc, os, subprocess, sys, tempfile, threading, time, tracemalloc
from pathlib import Path
n, mode = int(sys.argv[1]), sys.argv[2]
TM = os.environ.get("TM")
def rss():
    s = dict(l.split(":", 1) for l in open("/proc/self/status"))
    return int(s["VmRSS"].split()[0]) / 1024, int(s["VmHWM"].split()[0]) / 1024
t0 = time.monotonic()
def say(w):
    r, p = rss(); print(f"{time.monotonic()-t0:6.1f}s {w:32s} rss {r:6.1f} peak {p:6.1f}", flush=True)
say("python")
from kproxy.cli import build_parser, config_from_args, _make_source_factory, _cleanup_other_modes
from kproxy.proxier import backend_class
from kproxy.daemon import Daemon
say("imports")
d = Path(tempfile.mkdtemp()); pf = d / "port"
api = subprocess.Popen([sys.executable, "-m", "kproxy.lab.apiserver", "--listen", "127.0.0.1:0", "--port-file", str(pf)],
                       stdout=open(d / "api.log", "wb"), stderr=subprocess.STDOUT)
try:
    for _ in range(100):
        if pf.exists() and pf.read_text().strip(): break
        time.sleep(0.1)
    url = f"http://127.0.0.1:{pf.read_text().strip()}"
    if os.fork() == 0:
        from kproxy.sources.client import make_api_client
        from kproxy.bench import apiscale
        from kproxy.lab.plan import LabPod
        pods = [LabPod(f"pod-{i}", "x", f"node-{1 + i % 2}", f"10.244.{i%2}.{10+i}", "") for i in range(12)]
        apiscale.load(make_api_client(master=url), url, apiscale.ScaleConfig(mode=mode, services=n, endpoints=10, nodes=1), pods)
        os._exit(0)
    os.wait()
    say("loaded (child)")
    args = build_parser().parse_args(["run", "--mode", mode, "--master", url, "--hostname-override", "node-1",
            "--cluster-cidr", "10.244.0.0/16", "--min-sync-period", "0", "--sync-period", "10s",
            "--healthz-bind-address", "127.0.0.1:10256", "--metrics-bind-address", "127.0.0.1:10249"])
    config = config_from_args(args)
    factory, event_sink = _make_source_factory(config)
    daemon = Daemon(config, backend_class(mode)(config), factory, event_sink=event_sink, settle_heap=True)
    say("daemon made")
    if TM: tracemalloc.start(); base = tracemalloc.take_snapshot()
    done = threading.Event()
    mid = []
    def first():
        say("first sync applied")
        if TM: mid.append(tracemalloc.take_snapshot())
        _cleanup_other_modes(config); say("others cleaned")
    daemon.start(after_first_sync=first)
    seen = set()
    while daemon.status.syncs < 1 and time.monotonic() - t0 < 900:
        for k, r in daemon.source.reflectors.items():
            if k not in seen and r.synced.is_set():
                seen.add(k); say(f"{k} listed")
        time.sleep(0.05)
    time.sleep(1)
    say("after first sync")
    gc.collect(); say("gc")
    if TM:
        end = tracemalloc.take_snapshot()
        for st in mid[0].compare_to(base, "lineno")[:25]: print(st)
        print("---- after the first sync's hook")
        for st in end.compare_to(mid[0], "lineno")[:25]: print(st)
    daemon.stop(); say("stopped")
finally:
    api.terminate(); api.wait()
