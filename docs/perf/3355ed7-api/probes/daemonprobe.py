"""RSS timeline of `kproxy run --mode MODE` fed by the API stand-in with N services x 10 (lab-shaped objects).
usage: daemonprobe.py N MODE [extra kproxy args...]   (inside a netns of its own)"""
import os, subprocess, sys, tempfile, time, urllib.request
from pathlib import Path
n, mode, extra = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
from kproxy.sources.client import make_api_client
from kproxy.bench import apiscale
from kproxy.lab.plan import LabPod
d = Path(tempfile.mkdtemp()); pf = d / "port"
api = subprocess.Popen([sys.executable, "-m", "kproxy.lab.apiserver", "--listen", "127.0.0.1:0", "--port-file", str(pf)],
                       stdout=open(d / "api.log", "wb"), stderr=subprocess.STDOUT)
def status(pid):
    with open(f"/proc/{pid}/status") as f:
        s = dict(l.split(":", 1) for l in f)
    return int(s["VmRSS"].split()[0]) / 1024, int(s["VmHWM"].split()[0]) / 1024
kp = None
try:
    for _ in range(100):
        if pf.exists() and pf.read_text().strip(): break
        time.sleep(0.1)
    url = f"http://127.0.0.1:{pf.read_text().strip()}"
    pods = [LabPod(f"pod-{i}", "x", f"node-{1 + i % 2}", f"10.244.{i%2}.{10+i}", "") for i in range(12)]
    cfg = apiscale.ScaleConfig(mode=mode, services=n, endpoints=10, nodes=1)
    t = time.monotonic()
    apiscale.load(make_api_client(master=url), url, cfg, pods)
    print(f"loaded {n} in {time.monotonic()-t:.1f}s", flush=True)
    argv = [sys.executable, "-m", "kproxy", "run", "--mode", mode, "--master", url, "--hostname-override", "node-1",
            "--cluster-cidr", "10.244.0.0/16", "--min-sync-period", "0", "--sync-period", "10s",
            "--healthz-bind-address", "127.0.0.1:10256", "--metrics-bind-address", "127.0.0.1:10249", *extra]
    log = open(d / "kproxy.log", "wb")
    t0 = time.monotonic()
    kp = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    healthy = None; marks = []; last = 0
    while time.monotonic() - t0 < 900 and kp.poll() is None:
        r, p = status(kp.pid)
        now = time.monotonic() - t0
        if healthy is None:
            try:
                with urllib.request.urlopen("http://127.0.0.1:10256/healthz", timeout=1) as resp:
                    if resp.status == 200:
                        healthy = now; print(f"healthy at {now:.1f}s rss {r:.0f} peak {p:.0f}", flush=True)
            except Exception:
                pass
        if now - last >= 2:
            print(f"{now:6.1f}s rss {r:6.0f} peak {p:6.0f}", flush=True); last = now
        if healthy is not None and now - healthy > 20:
            break
        time.sleep(0.1)
    print("final rss/peak", status(kp.pid))
    print(open(d / "kproxy.log").read()[-3000:])
finally:
    if kp is not None:
        kp.terminate(); kp.wait()
    api.terminate(); api.wait()
