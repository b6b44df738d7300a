"""The soak run: a lab, churn through the API stand-in, faults on a schedule, traffic throughout, checkpoints.

One ``Soak`` is one bounded run (``minutes`` of churn rounded up to whole cycles of the fault kinds, or ``cycles``
of them, then a final convergence): see ``kproxy.soak`` for what it proves. The schedule is a cycle of fault kinds,
run whole so that every kind runs; each turn is

1. a *window* (``fault_window`` s) of churn at ``rate`` changes/s while the fault is on;
2. the fault cleared and the churn paused: from then (or from the last write, if later) the time until every node
   programs exactly what the API holds (``/rules`` against ``kproxy.soak.expect``) and reads its kernel back without
   drift (``/verify``) is that fault's *convergence time*, bounded by ``converge_timeout``;
3. a checkpoint: the differences left (lost changes if any), the drift, and two checks that do not take kproxy's
   word: the expectation of the soak's own reference model (``kproxy.soak.model``, computed from the API's objects,
   not by kproxy's cache) against real packets (``kproxy.soak.packets``: TCP and UDP from a pod of every node to
   every port, family and address, NodePorts too, of the services changed since the last checkpoint, a seeded
   sample of at most ``sample``; lost or wrong answers with what was sent and what came back) and against the kernel
   as the mode's ``kernel_view`` reads it (every service port there, none extra); the held connection's state.

Faults (``FAULT_KINDS``): ``none`` (the baseline), ``watch_drop`` (every watch cut, twice), ``http_5xx`` (half the
API requests answered 503 for the window, the soak's own writes retried), ``gone_410`` (history compacted and the
watches cut: every reflector must relist), ``api_restart`` (the stand-in process stopped and started again from a
dump of what it held, on the same addresses: the reflectors meet a server behind their resourceVersion; timed
from the moment it holds everything again), ``kproxy_kill`` (SIGKILL of the traffic node's kproxy mid-window,
changes for a second while it is down, then the restart, timed from the new process's start), ``flush`` (the mode's
``cleanup_leftovers`` run on another node after the window, as someone deleting our state, and its repair timed
from that moment: kproxy's own check that its state is there, at the latest the periodic sync) and
``apply_fail`` (a failed kernel apply, through a fault switch the core does not have yet: see ``FAULT_SWITCH``;
reported as not injected when the switch is not honoured).

Traffic: ``kproxy.soak.traffic`` in a pod of node 1 to the anchor service's IPv4 ClusterIP (every pod behind it):
its held connection must survive everything, and its new connections (every 0.3 s) must all be answered; failures
inside a kproxy-restart window of that node are counted apart.

Root only (the lab).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kproxy.config import ProxyConfig
from kproxy.lab import netns
from kproxy.lab.cluster import Lab
from kproxy.lab.plan import API_PORT_IN_LAB, CLUSTER_CIDR4, CLUSTER_CIDR6, LabNode
from kproxy.lab.state import module_env, stdlib_module_argv
from kproxy.model import IPFamily
from kproxy.proxier import LocalProbe, backend_class
from kproxy.soak.churn import ANCHOR, NAMESPACE, Churn, PodRef, Write, api_differences
from kproxy.soak.expect import differences, expected_services
from kproxy.soak.model import Model, build
from kproxy.soak.packets import Target, judge, plan
from kproxy.soak.report import fault_summary, table

log = logging.getLogger(__name__)

FAULT_KINDS = ("none", "watch_drop", "http_5xx", "gone_410", "kproxy_kill", "flush", "api_restart", "apply_fail")
DEFAULT_PREFIX = "kps-"
METRICS_PORT = 10249
HEALTHZ_PORT = 10256
#: The fault switch for "a failed kernel apply" (kproxy.ledger.FAULT_SWITCH): with this variable set in kproxy's
#: environment, the ledger looks for ``$KPROXY_TEST_FAULTS_DIR/<node name>/fail-apply`` before each ``apply``;
#: a positive integer N there answers the next N applies as failed (as a refused restore) and counts down. The soak
#: sets it for the kproxy processes it starts and writes the file; a file nobody consumed means "not supported".
FAULT_SWITCH = "KPROXY_TEST_FAULTS_DIR"
SOAK_ROOT = Path("/run/kproxy-soak")
MAX_MINUTES = 120.0
MAX_CYCLES = 100
MAX_ABSENT = 4  # removed services' former addresses tried per checkpoint (each costs a timeout)


class SoakError(RuntimeError):
    """The soak could not run (lab, API, traffic client); the message says where."""


# ------------------------------------------------------------------------------------------------------------ API


class Api:
    """The lab's API stand-in over plain HTTP (JSON), with bounded retries for the 5xx the soak itself injects."""

    def __init__(self, url: str, timeout: float = 5.0) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout

    def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        req.add_header("Accept", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return resp.status, json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as exc:
            try:
                payload = json.loads(exc.read() or b"null")
            except ValueError:
                payload = None
            return exc.code, payload

    @staticmethod
    def path(kind: str, name: str | None = None, namespace: str | None = NAMESPACE) -> str:
        if kind == "Service":
            base = "/api/v1" + (f"/namespaces/{namespace}" if namespace else "") + "/services"
        elif kind == "EndpointSlice":
            base = "/apis/discovery.k8s.io/v1" + (f"/namespaces/{namespace}" if namespace else "") + "/endpointslices"
        elif kind == "Node":
            base = "/api/v1/nodes"
        else:
            raise ValueError(kind)
        return base + (f"/{name}" if name else "")

    def write(self, w: Write, deadline: float) -> tuple[bool, int]:
        """Send one write, retrying 5xx and connection errors until ``deadline``: (the API took it, retries).
        A 4xx is final (the API refused the object): False."""
        retries = 0
        while True:
            try:
                if w.verb == "delete":
                    code, _ = self.call("DELETE", self.path(w.kind, w.name))
                    if code in (200, 202, 404):
                        return code != 404, retries
                else:
                    code, _ = self.call("PUT", self.path(w.kind, w.name), w.obj)
                    if code == 404:
                        code, _ = self.call("POST", self.path(w.kind), w.obj)
                    if code in (200, 201):
                        return True, retries
                if 400 <= code < 500 and code not in (404, 409, 429):
                    return False, retries
            except (OSError, http.client.HTTPException):
                pass
            if time.monotonic() >= deadline:
                return False, retries
            retries += 1
            time.sleep(min(0.2 * retries, 1.0))

    def list(self, kind: str) -> list[dict[str, Any]]:
        code, body = self.call("GET", self.path(kind, namespace=None))
        if code != 200 or not isinstance(body, dict):
            raise SoakError(f"listing {kind} failed: HTTP {code}")
        return list(body.get("items") or [])

    def node(self, name: str) -> dict[str, Any] | None:
        code, body = self.call("GET", self.path("Node", name))
        return body if code == 200 and isinstance(body, dict) else None

    def faults(self, **body: Any) -> None:
        code, answer = self.call("POST", "/_faults", body)
        if code != 200:
            raise SoakError(f"POST /_faults {body} failed: HTTP {code} {answer}")


# ------------------------------------------------------------------------------------------------- node access


def ns_get(ns: str, path: str, port: int = METRICS_PORT, timeout: float = 5.0) -> tuple[int, bytes]:
    """GET http://127.0.0.1:PORT/PATH inside network namespace ``ns``: the socket is made there (setns of this
    thread only, then back), the exchange runs here. Cheaper than a probe process per poll. Main thread only."""
    from pyroute2 import netns as pr_netns

    pr_netns.pushns(ns)
    try:
        sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    finally:
        pr_netns.popns()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.sock = sock
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


@dataclass
class NodeCheck:
    """One node's state against the expectation at one moment."""

    node: str
    diffs: dict[str, str] = field(default_factory=dict)  # from /rules
    drift: int = 0  # from /verify (or the kernel_view fallback)
    drift_detail: list[str] = field(default_factory=list)
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.diffs and self.drift == 0 and not self.error


# ------------------------------------------------------------------------------------------------------- the run


@dataclass
class SoakOptions:
    mode: str
    minutes: float = 1.0
    rate: float = 5.0
    prefix: str = DEFAULT_PREFIX
    reuse_lab: bool = False
    keep_lab: bool = False
    nodes: int = 2
    pods_per_node: int = 3
    ipv6: bool = True
    seed: int = 1
    faults: tuple[str, ...] = FAULT_KINDS
    fault_window: float = 4.0
    converge_timeout: float = 40.0
    initial_services: int = 12
    #: at most this many of the services changed since the last checkpoint are tried with packets at a checkpoint
    #: (a sample, drawn with the seed, when more changed); every port, family and address of each
    sample: int = 16
    #: whole cycles of ``faults`` to run instead of ``minutes`` (0: as many as begin within ``minutes``, at least one)
    cycles: int = 0
    #: how the kernel is read back: "verify" (the node's /verify, the default) or "kernel-view" (the mode's
    #: kernel_view hook from outside: every expected service port present; coarser, for modes or builds whose
    #: /verify is missing or wrong)
    drift_check: str = "verify"


class Churner(threading.Thread):
    """Writes the churn's steps at ``rate`` per second until stopped; ``pause()`` waits for the write in flight."""

    def __init__(self, api: Api, churn: Churn, rate: float) -> None:
        super().__init__(name="soak-churn", daemon=True)
        self.api, self.churn, self.rate = api, churn, max(0.1, rate)
        self.stop_event = threading.Event()
        self.run_event = threading.Event()
        self.idle = threading.Event()
        self.idle.set()
        self.lock = threading.Lock()
        self.applied = 0
        self.api_refused = 0
        self.retries = 0
        self.by_step: dict[str, int] = {}
        self.last_write = 0.0  # monotonic time of the last write the API took
        self.failures: list[str] = []
        self.written: dict[tuple[str, str], Write] = {}  # (kind, name) -> the last write of it the API took
        self.unsure: set[tuple[str, str]] = set()  # objects whose last write the API refused
        self.changed: set[str] = set()  # names of the services written since the last take_changed()

    def record(self, w: Write, took: bool) -> None:
        key = (w.kind, w.name)
        with self.lock:
            self.changed.add(w.service)  # a refused write may still have landed: its service is checked too
            if took:
                self.written[key] = w
                self.unsure.discard(key)
            else:
                self.unsure.add(key)

    def take_changed(self) -> set[str]:
        """The services written since the last call."""
        with self.lock:
            changed, self.changed = self.changed, set()
        return changed

    def resume(self) -> None:
        self.run_event.set()

    def pause(self, timeout: float = 30.0) -> None:
        self.run_event.clear()
        self.idle.wait(timeout)

    def stop(self) -> None:
        self.stop_event.set()
        self.run_event.set()

    MAX_WRITES = 200_000  # a bound in count besides the soak's in time (10 minutes at 5/s is about 4,000)

    def run(self) -> None:
        interval = 1.0 / self.rate
        nxt = time.monotonic()
        while not self.stop_event.is_set() and self.applied + self.api_refused < self.MAX_WRITES:
            self.run_event.wait()
            if self.stop_event.is_set():
                break
            self.idle.clear()
            try:
                if not self.run_event.is_set():
                    continue
                for w in self.churn.step():
                    took, retries = self.api.write(w, time.monotonic() + 20.0)
                    self.record(w, took)
                    with self.lock:
                        self.retries += retries
                        if took:
                            self.applied += 1
                            self.by_step[w.step] = self.by_step.get(w.step, 0) + 1
                            self.last_write = time.monotonic()
                        else:
                            self.api_refused += 1
                            if len(self.failures) < 20:
                                self.failures.append(f"{w.verb} {w.kind} {w.name} ({w.step})")
            finally:
                self.idle.set()
            nxt = max(nxt + interval, time.monotonic() - interval)
            self.stop_event.wait(max(0.0, nxt - time.monotonic()))


class Traffic:
    """``kproxy.soak.traffic`` in a pod's namespace, read line by line into ``events``."""

    def __init__(self, lab: Lab, pod_ns: str, node: LabNode, host: str, port: int, seconds: float) -> None:
        argv = netns.exec_argv(pod_ns, [*stdlib_module_argv("kproxy.soak.traffic")])
        argv += ["--host", host, "--port", str(port), "--seconds", str(int(seconds))]
        self.proc = subprocess.Popen(
            argv,
            env=module_env(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            preexec_fn=netns.cgroup_preexec(lab.cgroup_path(node)),
        )
        self.events: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.reader = threading.Thread(target=self._read, name="soak-traffic", daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            try:
                ev = json.loads(raw)
            except ValueError:
                continue
            with self.lock:
                self.events.append(ev)

    def snapshot(self) -> list[dict[str, Any]]:
        with self.lock:
            return list(self.events)

    def held_alive(self) -> bool:
        holds = [e for e in self.snapshot() if e.get("kind") == "hold"]
        return bool(holds) and all(e.get("ok") for e in holds) and time.time() - float(holds[-1]["t"]) < 3.0

    def finish(self) -> str:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            _, err = self.proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        self.reader.join(timeout=5)
        return (err or b"").decode(errors="replace")[-2000:]


class Soak:
    """One soak run (see the module docstring): ``run()`` returns the report."""

    def __init__(self, opts: SoakOptions, progress: Callable[[str], None] | None = None) -> None:
        if opts.mode not in _modes():
            raise SoakError(f"mode {opts.mode!r} is not available here")
        if not 0 < opts.minutes <= MAX_MINUTES:
            raise SoakError(f"--minutes must be in (0, {MAX_MINUTES:g}]")
        if not 0 <= opts.cycles <= MAX_CYCLES:
            raise SoakError(f"--cycles must be in [0, {MAX_CYCLES}]")
        if opts.sample < 1:
            raise SoakError("--sample must be at least 1")
        unknown = [k for k in opts.faults if k not in FAULT_KINDS]
        if unknown:
            raise SoakError(f"unknown fault kinds {unknown}: choose from {', '.join(FAULT_KINDS)}")
        self.opts = opts
        self.progress = progress or (lambda text: log.info("%s", text))
        self.cls = backend_class(opts.mode)
        self.lab: Lab | None = None
        self.api: Api | None = None
        self.owned_lab = False
        self.convergence: dict[str, list[float]] = {}
        self.unconverged: dict[str, int] = {}
        self.not_injected: dict[str, str] = {}
        self.checkpoints: list[dict[str, Any]] = []
        self.restart_windows: list[tuple[float, float]] = []  # wall-clock spans of the traffic node's restarts
        self.turns: list[tuple[str, float, float]] = []  # (fault kind, wall-clock start, end of its convergence)
        self.turn_counts: dict[str, int] = {}  # fault kind -> turns it had (injected or not)
        # real packets at checkpoints: exchanges sent, targets tried, verdicts (failed = lost + wrong), services
        self.packets = {
            "sent": 0,
            "targets": 0,
            "lost": 0,
            "wrong": 0,
            "failed": 0,
            "services_changed": 0,
            "services_probed": 0,
            "removed_probed": 0,
        }
        self.kernel_view = {"checked": 0, "missing": 0, "extra": 0, "unsupported": 0}
        self.known_ips: dict[str, list[str]] = {}  # "ns/name" -> the ClusterIPs the model last saw it with
        self.problems: list[str] = []
        self.verify_supported = opts.drift_check == "verify"
        self.churner: Churner | None = None
        self.churn_started = 0.0
        self.churn_s = 0.0
        if opts.drift_check not in ("verify", "kernel-view"):
            raise SoakError(f"drift check {opts.drift_check!r}: choose verify or kernel-view")
        self.faults_dir = SOAK_ROOT / opts.prefix.rstrip("-") / "faults"

    # -- lab --------------------------------------------------------------------------------------------------

    def _lab(self) -> Lab:
        o = self.opts
        if o.reuse_lab:
            lab = Lab.live(o.prefix)
            if lab is not None:
                for n in lab.nodes:
                    if not lab.kproxy_running(n) or lab.state.get("kproxy", {}).get(n.name, {}).get("mode") != o.mode:
                        with contextlib.suppress(Exception):
                            lab.stop_kproxy(n)
                        lab.start_kproxy(n, o.mode)
                lab.wait_all(60)
                return lab
        self.owned_lab = True
        lab = Lab.up(
            nodes=o.nodes, pods_per_node=o.pods_per_node, mode=o.mode, ipv6=o.ipv6, prefix=o.prefix, timeout=90
        )
        try:
            lab.wait_all(90)
        except BaseException:
            Lab.down(prefix=o.prefix, keep_logs=True)  # a lab whose kproxy never became healthy is not left behind
            raise
        return lab

    #: per-namespace sysctls the soak sets on its nodes: a checkpoint sends up to hundreds of connections that must
    #: be rejected from one pod within a second, and the node's kernel limits the ICMP errors a reject sends per
    #: peer (about one a second after a burst of six) and in all (1,000 a second after a burst of 50); limited, a
    #: reject would look like a drop. Only the node namespaces of the lab the soak runs on are touched.
    ICMP_UNLIMITED = (
        "net.ipv4.icmp_ratelimit=0",
        "net.ipv4.icmp_msgs_per_sec=100000",
        "net.ipv4.icmp_msgs_burst=100000",
        "net.ipv6.icmp.ratelimit=0",
    )

    def _lift_icmp_limits(self, lab: Lab) -> None:
        for node in lab.nodes:
            res = lab.exec(node.ns, ["sysctl", "-q", "-w", *self.ICMP_UNLIMITED], timeout=10)
            if res.returncode != 0:
                raise SoakError(f"sysctl in {node.ns} failed: {res.stderr.decode(errors='replace').strip()}")

    # -- expectations and checks -------------------------------------------------------------------------------

    def _families(self) -> tuple[IPFamily, ...]:
        assert self.lab is not None
        return (IPFamily.V4, IPFamily.V6) if self.lab.ipv6 else (IPFamily.V4,)

    def _api_state(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        assert self.api is not None
        deadline = time.monotonic() + 30
        while True:
            try:
                return self.api.list("Service"), self.api.list("EndpointSlice")
            except (SoakError, OSError, http.client.HTTPException) as exc:
                if time.monotonic() > deadline:
                    raise SoakError(f"the API did not answer lists: {exc}") from exc
                time.sleep(0.3)

    def _expected(self) -> dict[str, tuple[dict[str, Any], dict[str, str]]]:
        assert self.lab is not None and self.api is not None
        services, slices = self._api_state()
        out = {}
        for n in self.lab.nodes:
            out[n.name] = expected_services(n.name, services, slices, self.api.node(n.name), self._families())
        return out

    def _check_node(self, node: LabNode, expected: Mapping[str, Any]) -> NodeCheck:
        chk = NodeCheck(node.name)
        try:
            code, body = ns_get(node.ns, "/rules")
            if code != 200:
                chk.error = f"/rules answered {code}"
                return chk
            chk.diffs = differences(expected, json.loads(body), namespaces=[NAMESPACE])
        except (OSError, ValueError, http.client.HTTPException) as exc:
            chk.error = f"/rules: {type(exc).__name__}: {exc}"
            return chk
        if chk.diffs:
            return chk  # the kernel is read only once the ledger agrees (a sync is still on its way)
        self._drift(node, expected, chk)
        return chk

    def _drift(self, node: LabNode, expected: Mapping[str, Any], chk: NodeCheck) -> None:
        if self.verify_supported:
            try:
                code, body = ns_get(node.ns, "/verify", timeout=30)
            except (OSError, http.client.HTTPException) as exc:
                chk.error = f"/verify: {type(exc).__name__}: {exc}"
                return
            if code == 200:
                report = json.loads(body)
                chk.drift = int(report.get("drift", 0))
                for key, fams in (report.get("services") or {}).items():
                    chk.drift_detail += [f"{key}/{f}: {why}" for f, why in fams.items()]
                chk.drift_detail += [str(x) for x in (report.get("extra") or [])]
                chk.drift_detail += [str(x) for x in (report.get("errors") or [])]
                return
            if code == 404 and b"cannot read" in body:
                self.verify_supported = False
                self.problems.append(f"/verify: {body.decode(errors='replace')[:200]}; kernel_view is used instead")
            else:
                chk.error = f"/verify answered {code}: {body.decode(errors='replace')[:200]}"
                return
        # The fallback reads the kernel through the mode's kernel_view: every expected service port is there.
        assert self.lab is not None
        probe = LocalProbe(node.ns, self.lab.node_options(node, self.opts.mode))
        for fam in self._families():
            view = self.cls.kernel_view(probe, fam)
            if view is None:
                return
            for key, fams in expected.items():
                if key.startswith(NAMESPACE + "/") and fam.value in fams and key not in view:
                    chk.drift += 1
                    chk.drift_detail.append(f"{key}/{fam.value}: missing from the kernel")

    def _converge(self, since: float, timeout: float) -> tuple[float | None, list[NodeCheck]]:
        """Poll every node until all match the API and read back without drift: (seconds from ``since`` to that
        moment, or None on timeout; the last checks)."""
        assert self.lab is not None
        expected = self._expected()
        deadline = time.monotonic() + timeout
        checks: list[NodeCheck] = []
        while True:
            checks = [self._check_node(n, expected[n.name][0]) for n in self.lab.nodes]
            now = time.monotonic()
            if all(c.ok for c in checks):
                return max(0.0, now - since), checks
            if now > deadline:
                return None, checks
            time.sleep(0.1)

    # -- the reference model against the kernel ----------------------------------------------------------------

    def _choose(self, model: Model, changed: set[str], final: bool) -> tuple[list[str], dict[str, list[str]]]:
        """The services to try (``ns/name``, a seeded sample of at most ``sample``) and the removed or rejected ones
        whose former ClusterIPs are tried (at most ``MAX_ABSENT``; never an address another service holds now)."""
        names = {f"{NAMESPACE}/{name}" for name in changed if name != ANCHOR}
        self.packets["services_changed"] += len(names)
        if final:  # the end: every service is a candidate
            names |= {s for s in model.cluster_ips if s != f"{NAMESPACE}/{ANCHOR}"}
        valid = sorted(n for n in names if model.of(n))
        chosen = sorted(self._rng_packets.sample(valid, min(len(valid), self.opts.sample)))
        held = {ip for n, ips in model.cluster_ips.items() if n not in model.rejected for ip in ips}
        absent: dict[str, list[str]] = {}
        for n in sorted(names - set(valid)):
            if n in model.rejected:  # in the API, with an address, and nothing may answer there
                ips = model.cluster_ips[n]
            elif n not in model.cluster_ips:  # deleted: its former address, unless another service holds it now
                ips = self.known_ips.get(n, [])
            else:  # outside the model
                continue
            ips = [ip for ip in ips if ip not in held]
            if ips:
                absent[n] = ips
        picked = self._rng_packets.sample(sorted(absent), min(len(absent), MAX_ABSENT))
        return chosen, {n: absent[n] for n in picked}

    def _packets(self, model: Model, changed: set[str], final: bool, meanwhile: Callable[[], None]) -> list[str]:
        """Real packets from a pod of every node to every address of the chosen services (see
        ``kproxy.soak.packets``), judged against the model: what was lost or wrong, with what was sent and got.
        ``meanwhile`` runs while the packets are out (most of a sweep is waiting for drops to time out)."""
        assert self.lab is not None
        lab = self.lab
        chosen, absent = self._choose(model, changed, final)
        self.packets["services_probed"] += len(chosen)
        self.packets["removed_probed"] += len(absent)
        turn = len(self.checkpoints)
        clients = {n.name: lab.pods_on(n)[turn % len(lab.pods_on(n))].name for n in lab.nodes if lab.pods_on(n)}
        node_ips = {n.name: {"IPv4": n.ip4, "IPv6": n.ip6} for n in lab.nodes}
        targets = plan(model, chosen, clients, node_ips, absent=absent)
        pod_of = {p.ip4: p.name for p in lab.pods} | {p.ip6: p.name for p in lab.pods if p.ip6}
        results = self._sweep(targets, meanwhile)
        failures: list[str] = []
        self.packets["targets"] += len(targets)
        for t in targets:
            got = results.get(t.id)
            self.packets["sent"] += len(got or ())
            verdict = judge(t, got, pod_of)
            if verdict is not None:
                self.packets[verdict[0]] += 1
                self.packets["failed"] += 1
                failures.append(f"{verdict[0]}: {verdict[1]}")
        for n in model.cluster_ips:
            self.known_ips[n] = list(model.cluster_ips[n])
        return failures

    def _sweep(self, targets: Sequence[Target], meanwhile: Callable[[], None]) -> dict[str, list[dict[str, Any]]]:
        """``kproxy.soak.sweep`` in each client pod at once (its node's cgroup), ``meanwhile()`` while they run:
        target id -> results."""
        assert self.lab is not None
        lab = self.lab
        procs = []
        for client in sorted({t.client for t in targets}):
            pod = lab.pod(client)
            mine = [t.request() for t in targets if t.client == client]
            argv = netns.exec_argv(pod.ns, stdlib_module_argv("kproxy.soak.sweep"))
            # the request from a file: the sweep starts at once and nothing here waits on a pipe before meanwhile()
            request = tempfile.TemporaryFile()
            request.write(json.dumps({"workers": 64, "targets": mine}).encode())
            request.seek(0)
            proc = subprocess.Popen(
                argv,
                env=module_env(),
                stdin=request,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                preexec_fn=netns.cgroup_preexec(lab.cgroup_path(pod.node)),
            )
            request.close()  # the child has its own descriptor
            procs.append((client, proc))
        meanwhile()
        out: dict[str, list[dict[str, Any]]] = {}
        for client, proc in procs:
            try:
                stdout, stderr = proc.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
                self.problems.append(f"the packet sweep from {client} did not finish in 120 s")
                continue
            try:
                out.update(json.loads(stdout.decode(errors="replace").strip().splitlines()[-1]))
            except (ValueError, IndexError):
                self.problems.append(f"the packet sweep from {client} failed: {stderr.decode(errors='replace')[-300:]}")
        return out

    def _kernel_check(self, model: Model) -> dict[str, list[str]]:
        """Each node's kernel, read by the mode's ``kernel_view`` (never kproxy's memory), against the model's
        service ports: node -> ``key/family: missing`` or ``extra``. Empty for a mode without a kernel view."""
        assert self.lab is not None
        out: dict[str, list[str]] = {}
        for node in self.lab.nodes:
            probe = LocalProbe(node.ns, self.lab.node_options(node, self.opts.mode))
            for fam in self._families():
                try:
                    view = self.cls.kernel_view(probe, fam)
                except Exception as exc:  # a read that fails is reported, never taken for agreement
                    out.setdefault(node.name, []).append(f"{fam.value}: kernel_view failed: {exc}")
                    continue
                if view is None:
                    self.kernel_view["unsupported"] += 1
                    return out
                have = {k for k in view if k.startswith(NAMESPACE + "/")}
                want = model.keys(fam.value)
                self.kernel_view["checked"] += len(want)
                bad = [f"{k}/{fam.value}: missing" for k in sorted(want - have)]
                bad += [f"{k}/{fam.value}: extra" for k in sorted(have - want)]
                self.kernel_view["missing"] += len(want - have)
                self.kernel_view["extra"] += len(have - want)
                if bad:
                    out.setdefault(node.name, []).extend(bad)
        return out

    # -- faults ------------------------------------------------------------------------------------------------

    def _window(self, seconds: float) -> None:
        time.sleep(max(0.0, seconds))

    def _fault(self, kind: str) -> float:
        """Inject ``kind`` during one window; returns the monotonic time it was cleared."""
        assert self.lab is not None and self.api is not None
        w = self.opts.fault_window
        node1, other = self.lab.nodes[0], self.lab.nodes[-1]
        if kind == "none":
            self._window(w)
        elif kind == "watch_drop":
            self.api.faults(drop_watches=True)
            self._window(w / 2)
            self.api.faults(drop_watches=True)
            self._window(w / 2)
        elif kind == "http_5xx":
            self.api.faults(error_rate=0.5, error_code=503)
            try:
                self._window(w)
            finally:
                self.api.faults(error_rate=0.0)
        elif kind == "gone_410":
            self._window(w / 2)
            self.api.faults(compact=True, drop_watches=True)
            self._window(w / 2)
        elif kind == "api_restart":
            # churn, then the restart with the writers waiting (the server is down for them too; the stand-in also
            # listens a moment before its --load is in, and a create then could take a ClusterIP a loaded service
            # holds): convergence is timed from the moment the new server holds everything again
            self._window(w)
            assert self.churner is not None
            self.churner.pause()
            self._restart_api()
        elif kind == "kproxy_kill":
            # churn, SIGKILL mid-way, a second of changes while it is down, then the restart with the churn paused:
            # convergence is timed from the new process's start (start-up, relist, adoption, first sync)
            assert self.churner is not None
            self._window(w / 2)
            t_kill = time.time()
            self.lab.stop_kproxy(node1, signal.SIGKILL)
            self._window(1.0)
            self.churner.pause()
            restarted = time.monotonic()
            self.lab.start_kproxy(node1, self.opts.mode)
            self.lab.wait_kproxy(node1, 60)
            self.restart_windows.append((t_kill, time.time() + 1.0))
            return restarted
        elif kind == "flush":
            # churn first, then the flush with the churn paused: what follows is kproxy's own repair (its check
            # that the state is still there, or the periodic sync), measured from the flush itself
            self._window(w)
            assert self.churner is not None
            self.churner.pause()
            config = ProxyConfig(
                mode=self.opts.mode,
                hostname_override=other.name,
                cluster_cidrs=(CLUSTER_CIDR4, CLUSTER_CIDR6) if self.lab.ipv6 else (CLUSTER_CIDR4,),
                backend_options=self.lab.node_options(other, self.opts.mode),
            )
            self.cls.cleanup_leftovers(config, netns=other.ns)
        elif kind == "apply_fail":
            switch = self.faults_dir / other.name / "fail-apply"
            switch.parent.mkdir(parents=True, exist_ok=True)
            switch.write_text("2\n")
            deadline = time.monotonic() + max(w, 5.0)  # a partial sync follows the churn within a second
            while time.monotonic() < deadline and _pending(switch) > 0:
                time.sleep(0.2)
            left = _pending(switch)
            switch.unlink(missing_ok=True)
            if left > 0:
                raise _NotInjected(f"the build does not honour the fault switch ({FAULT_SWITCH}; see the report)")
        return time.monotonic()

    def _restart_api(self) -> None:
        """Stop the stand-in and start it again from a dump of what it held, on the same addresses."""
        assert self.lab is not None and self.api is not None
        lab = self.lab
        dump = lab.state_dir / "soak-api-dump"
        dump.mkdir(exist_ok=True)
        for old in dump.glob("*.json"):
            old.unlink()
        objs = []
        for kind, api_version in (("Node", "v1"), ("Service", "v1"), ("EndpointSlice", "discovery.k8s.io/v1")):
            # a list's items carry neither (as the real API's); --load needs both to know the resource
            objs += [{**obj, "apiVersion": api_version, "kind": kind} for obj in self.api.list(kind)]
        for i, obj in enumerate(objs):
            meta = obj.get("metadata", {})
            for key in ("resourceVersion", "uid", "creationTimestamp", "managedFields"):
                meta.pop(key, None)
            (dump / f"{i:05d}.json").write_text(json.dumps(obj))
        pid = lab._pids().get("apiserver")
        if pid is None:
            raise SoakError("the API stand-in is not running")
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        while netns.alive(pid) and time.monotonic() < deadline:
            lab._reap("apiserver")
            time.sleep(0.05)
        if netns.alive(pid):
            os.kill(pid, signal.SIGKILL)
        port_file = lab.state_dir / "api.port"
        port_file.unlink(missing_ok=True)
        argv = [*stdlib_module_argv("kproxy.lab.apiserver")[:1], "-m", "kproxy.lab.apiserver"]
        argv += ["--listen", f"127.0.0.1:{lab.api_port}", "--port-file", str(port_file), "--load", str(dump)]
        argv += ["--listen", f"{lab.fabric_ns}/198.18.0.1:{API_PORT_IN_LAB}"]
        if lab.ipv6:
            argv += ["--listen", f"{lab.fabric_ns}/[fd00:198:18::1]:{API_PORT_IN_LAB}"]
        with open(lab.state_dir / "apiserver.log", "ab") as f:
            f.write(f"--- {time.strftime('%H:%M:%S')} soak: restart from {len(objs)} objects\n".encode())
        proc = lab._spawn("apiserver", argv, lab.state_dir / "apiserver.log", None, append=True)
        deadline = time.monotonic() + 30
        while not port_file.exists():  # written once the dump is loaded
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SoakError("the restarted API stand-in did not come up; see apiserver.log")
            time.sleep(0.05)
        held = sum(len(self.api.list(kind)) for kind in ("Node", "Service", "EndpointSlice"))
        if held != len(objs):
            raise SoakError(f"the restarted API stand-in holds {held} objects of the {len(objs)} dumped")

    # -- the run -----------------------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        import random

        o = self.opts
        self._rng_packets = random.Random(o.seed + 1)
        # kproxy processes started from here inherit the (proposed) fault switch's location
        os.environ[FAULT_SWITCH] = str(self.faults_dir)
        self.faults_dir.mkdir(parents=True, exist_ok=True)
        t_start = time.monotonic()
        self.progress(f"soak: bringing up the lab ({o.prefix}, mode {o.mode})")
        self.lab = lab = self._lab()
        traffic: Traffic | None = None
        churner: Churner | None = None
        failed = True
        try:
            self._lift_icmp_limits(lab)
            self.api = api = Api(lab.api_url)
            pods = [PodRef(p.name, p.node, p.ip4, p.ip6) for p in lab.pods]
            churn = Churn(pods, ipv6=lab.ipv6, seed=o.seed)
            self.churner = churner = Churner(api, churn, o.rate)
            setup = churn.anchor() + churn.initial(o.initial_services)
            for w in setup:
                took, _ = api.write(w, time.monotonic() + 30)
                churner.record(w, took)
                if not took:
                    raise SoakError(f"the API refused the soak's setup object {w.kind} {w.name}")
            anchor_ip = self._anchor_ip()
            secs, checks = self._converge(time.monotonic(), 60)
            if secs is None:
                raise SoakError(f"the lab did not converge on the initial objects: {_describe(checks)}")
            self.progress(f"soak: {len(setup)} initial objects programmed in {secs:.2f}s; traffic to {anchor_ip}:80")
            node1 = lab.nodes[0]
            # the traffic outlives the run: whole cycles may go past --minutes by up to one cycle (ended by SIGTERM)
            turn_bound = o.fault_window + o.converge_timeout + 90
            total = (0 if o.cycles else o.minutes * 60) + len(o.faults) * turn_bound * max(1, o.cycles) + 120
            traffic = Traffic(lab, lab.pods_on(node1)[0].ns, node1, anchor_ip, 80, total)
            self._wait_traffic(traffic)
            churner.start()
            self.churn_started = time.monotonic()
            end = time.monotonic() + o.minutes * 60
            nothing_left = lambda: all(k in self.not_injected for k in o.faults)  # noqa: E731
            for kind in fault_schedule(o.faults, lambda: time.monotonic() >= end, o.cycles, nothing_left):
                self._turn(kind, churner, traffic)
            churner.pause()
            self.churn_s = time.monotonic() - self.churn_started
            # the end: everything the soak wrote must be programmed, and read back without drift
            secs, checks = self._converge(max(time.monotonic(), churner.last_write), max(o.converge_timeout, 60))
            final = self._checkpoint("final", secs, checks, traffic)
            churner.stop()
            report = self._report(churner, traffic, final, time.monotonic() - t_start)
            failed = False
            return report
        finally:
            if churner is not None and churner.is_alive():
                churner.stop()
            if traffic is not None:
                err = traffic.finish()
                if err.strip():
                    self.problems.append(f"traffic client stderr: {err.strip()[-300:]}")
            with contextlib.suppress(Exception):
                if self.api is not None:
                    self.api.faults(reset=True)
            os.environ.pop(FAULT_SWITCH, None)
            if self.owned_lab and not o.keep_lab:
                self.progress("soak: taking the lab down" + (" (logs kept in the state folder)" if failed else ""))
                # the api_restart fault's dump is the soak's own: Lab.down removes only what the lab made
                shutil.rmtree(lab.state_dir / "soak-api-dump", ignore_errors=True)
                Lab.down(prefix=o.prefix, keep_logs=failed)

    def _anchor_ip(self) -> str:
        assert self.api is not None
        code, body = self.api.call("GET", Api.path("Service", ANCHOR))
        if code != 200:
            raise SoakError(f"the anchor service is not in the API (HTTP {code})")
        ips = [ip for ip in body["spec"].get("clusterIPs") or [] if ":" not in ip]
        return str(ips[0])

    def _wait_traffic(self, traffic: Traffic) -> None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            evs = traffic.snapshot()
            if any(e.get("kind") == "hold" and e.get("ok") for e in evs):
                return
            if any(e.get("kind") == "hold" and not e.get("ok") for e in evs) or traffic.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise SoakError(f"the held connection did not come up: {traffic.snapshot()[-3:]} {traffic.finish()}")

    def _turn(self, kind: str, churner: Churner, traffic: Traffic) -> None:
        o = self.opts
        self.turn_counts[kind] = self.turn_counts.get(kind, 0) + 1
        if kind in self.not_injected:
            return
        self.progress(f"soak: fault {kind}")
        t_wall = time.time()
        churner.resume()
        try:
            cleared = self._fault(kind)
        except _NotInjected as why:
            self.not_injected[kind] = str(why)
            churner.pause()
            return
        except Exception as exc:
            churner.pause()
            self.problems.append(f"injecting {kind} failed: {type(exc).__name__}: {exc}")
            self.unconverged[kind] = self.unconverged.get(kind, 0) + 1
            return
        churner.pause()
        since = max(cleared, churner.last_write)
        secs, checks = self._converge(since, o.converge_timeout)
        if secs is None:
            self.unconverged[kind] = self.unconverged.get(kind, 0) + 1
        else:
            self.convergence.setdefault(kind, []).append(secs)
        self.turns.append((kind, t_wall, time.time()))
        self._checkpoint(kind, secs, checks, traffic)

    def _checkpoint(
        self, after: str, secs: float | None, checks: Sequence[NodeCheck], traffic: Traffic
    ) -> dict[str, Any]:
        assert self.churner is not None
        t0 = time.monotonic()
        services, slices = self._api_state()
        model = build(services, slices, namespace=NAMESPACE)
        kernel: dict[str, list[str]] = {}
        before = dict(self.packets)
        changed = self.churner.take_changed()
        failures = self._packets(model, changed, after == "final", lambda: kernel.update(self._kernel_check(model)))
        api_diffs = self._api_differences()
        cp = {
            "after": after,
            "t": round(time.time(), 3),
            "converged_s": None if secs is None else round(secs, 3),
            # a change lost by the API (a restart that dropped objects) counts as much as one lost by a node
            "lost": sum(len(c.diffs) for c in checks) + len(api_diffs),
            "api_differences": dict(list(api_diffs.items())[:10]),
            "drift": sum(c.drift for c in checks),
            "errors": [c.error for c in checks if c.error],
            "differences": {c.node: dict(list(c.diffs.items())[:10]) for c in checks if c.diffs},
            "drift_detail": {c.node: c.drift_detail[:10] for c in checks if c.drift_detail},
            "packets_failed": failures[:20],
            **{f"packets_{k}": self.packets[k] - before[k] for k in ("lost", "wrong", "sent", "targets")},
            "services_changed": self.packets["services_changed"] - before["services_changed"],
            "services_probed": self.packets["services_probed"] - before["services_probed"],
            "checked_s": round(time.monotonic() - t0, 3),  # the model, the kernel view and the packets
            "kernel_view": {node: bad[:10] for node, bad in kernel.items()},
            "kernel_view_differences": sum(len(bad) for bad in kernel.values()),
            "held_alive": traffic.held_alive(),
        }
        self.checkpoints.append(cp)
        if secs is None:
            self.problems.append(f"after {after}: not converged in time: {_describe(checks)}")
        self.problems.extend(f"after {after}: packets: {f}" for f in failures[:10])
        self.problems.extend(f"after {after}: kernel view of {n}: {b}" for n, bad in kernel.items() for b in bad[:5])
        self.progress(
            f"soak:   {after}: converged in {cp['converged_s']}s, lost {cp['lost']}, drift {cp['drift']},"
            f" packets lost {cp['packets_lost']} wrong {cp['packets_wrong']}, kernel view"
            f" {cp['kernel_view_differences']}, held {'open' if cp['held_alive'] else 'BROKEN'}"
        )
        return cp

    def _api_differences(self) -> dict[str, str]:
        """What the API holds in the soak's namespace against the last write of each object it took."""
        assert self.churner is not None
        services, slices = self._api_state()
        held = {
            (obj.get("kind") or kind, obj["metadata"]["name"]): {**obj, "kind": kind}
            for kind, objs in (("Service", services), ("EndpointSlice", slices))
            for obj in objs
            if obj.get("metadata", {}).get("namespace") == NAMESPACE
        }
        with self.churner.lock:
            written, unsure = dict(self.churner.written), set(self.churner.unsure)
        return api_differences(written, unsure, held)

    def _report(self, churner: Churner, traffic: Traffic, final: dict[str, Any], duration: float) -> dict[str, Any]:
        o = self.opts
        evs = traffic.snapshot()
        conns = [e for e in evs if e.get("kind") == "conn"]
        failed = [e for e in conns if not e.get("ok")]
        in_restart = [e for e in failed if any(a <= float(e["t"]) <= b for a, b in self.restart_windows)]
        holds = [e for e in evs if e.get("kind") == "hold"]
        hold_errors = [e for e in holds if not e.get("ok")]
        held_alive = bool(holds) and not hold_errors
        report: dict[str, Any] = {
            "mode": o.mode,
            "minutes": o.minutes,
            "rate": o.rate,
            "seed": o.seed,
            "nodes": len(self.lab.nodes) if self.lab else 0,
            "duration_s": round(duration, 1),
            "churn_s": round(self.churn_s, 1),
            "drift_check": "/verify" if self.verify_supported else "kernel_view",
            "changes": {
                "applied": churner.applied,
                "api_refused": churner.api_refused,
                "retries": churner.retries,
                "by_step": dict(sorted(churner.by_step.items())),
            },
            "faults": fault_summary(self.convergence, self.unconverged),
            "faults_not_injected": self.not_injected,
            # whole cycles of the fault schedule that ran, and every kind's turns (injected or not)
            "cycles": min((self.turn_counts.get(k, 0) for k in o.faults), default=0),
            "turns": dict(self.turn_counts),
            "lost_changes": final["lost"],
            "drift_final": final["drift"],
            "drift_checkpoints": max((int(c["drift"]) for c in self.checkpoints), default=0),
            "packets": dict(self.packets),
            "kernel_view": dict(self.kernel_view),
            "new_connections": {
                "total": len(conns),
                "failed": len(failed),
                "failed_in_kproxy_restarts": len(in_restart),
                "failed_outside": len(failed) - len(in_restart),
                "errors": sorted({str(e.get("error")) for e in failed}),
                "failed_by_fault": self._by_turn(failed),
            },
            "held_connection": {
                "alive": held_alive,
                "exchanges": sum(1 for e in holds if e.get("ok")),
                "age_s": holds[-1].get("age") if holds and holds[-1].get("ok") else None,
                "error": hold_errors[0].get("error") if hold_errors else None,
            },
            "checkpoints": self.checkpoints,
            "api_refused_writes": churner.failures,
            "problems": self.problems,
        }
        # A mode whose datapath is the kproxy process itself (a userspace proxy) cannot keep a connection through
        # its own SIGKILL: the contract's ``survives_restart`` says so.
        in_process = not self.cls.survives_restart
        report["held_connection"]["required"] = not in_process
        report["ok"] = (
            report["lost_changes"] == 0
            and report["drift_final"] == 0
            and report["drift_checkpoints"] == 0
            and final["converged_s"] is not None
            and (held_alive or in_process)
            and report["new_connections"]["failed_outside"] == 0
            and self.packets["failed"] == 0
            and self.kernel_view["missing"] + self.kernel_view["extra"] == 0
            and not any(v["unconverged"] for v in report["faults"].values())
        )
        return report

    def _by_turn(self, events: Sequence[Mapping[str, Any]]) -> dict[str, int]:
        """How many of ``events`` fell in each fault kind's turn (window and convergence), else ``between``."""
        out: dict[str, int] = {}
        for e in events:
            t = float(e["t"])
            kind = next((k for k, a, b in self.turns if a <= t <= b), "between")
            out[kind] = out.get(kind, 0) + 1
        return out


class _NotInjected(Exception):
    """This build cannot take the fault (the message says why)."""


def fault_schedule(
    faults: Sequence[str], time_up: Callable[[], bool], cycles: int = 0, stop: Callable[[], bool] = lambda: False
) -> Iterator[str]:
    """The fault kinds in turn, in whole cycles only: ``cycles`` of them when positive, else as many as begin before
    ``time_up()`` (at least one, so every kind runs). ``stop()`` ends it after a cycle (nothing left to inject)."""
    for n in range(1, MAX_CYCLES * 100 + 1):
        yield from faults
        if stop() or (cycles > 0 and n >= cycles) or (cycles <= 0 and time_up()):
            return


def _pending(switch: Path) -> int:
    try:
        return int(switch.read_text().strip() or 0)
    except (OSError, ValueError):
        return 0


def _describe(checks: Sequence[NodeCheck]) -> str:
    parts = []
    for c in checks:
        if c.ok:
            continue
        bits = [c.error] if c.error else []
        bits += [f"{k}: {v}" for k, v in list(c.diffs.items())[:3]]
        bits += c.drift_detail[:3]
        parts.append(f"{c.node}: " + "; ".join(bits))
    return " | ".join(parts) or "no difference"


def _modes() -> list[str]:
    from kproxy.proxier import available_backends

    return list(available_backends())


def render(report: Mapping[str, Any]) -> str:
    return table(report)
