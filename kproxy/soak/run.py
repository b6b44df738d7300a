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
import logging
import os
import shutil
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kproxy.config import ProxyConfig
from kproxy.lab.cluster import Lab
from kproxy.lab.plan import CLUSTER_CIDR4, CLUSTER_CIDR6
from kproxy.proxier import backend_class
from kproxy.soak.api import Api, NodeCheck, SoakError, describe_checks
from kproxy.soak.checks import Checks
from kproxy.soak.churn import ANCHOR, NAMESPACE, Churn, PodRef, api_differences
from kproxy.soak.faults import FAULT_KINDS, FAULT_SWITCH, MAX_CYCLES, NotInjected, fault_schedule, pending, restart_api
from kproxy.soak.model import build
from kproxy.soak.report import fault_summary, table
from kproxy.soak.workers import Churner, Traffic

log = logging.getLogger(__name__)

DEFAULT_PREFIX = "kps-"
SOAK_ROOT = Path("/run/kproxy-soak")
MAX_MINUTES = 120.0


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
        self.problems: list[str] = []
        self.checks = Checks(self.cls, opts.mode, opts.sample, opts.drift_check == "verify", self.problems)
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
            restart_api(self.lab, self.api)
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
            while time.monotonic() < deadline and pending(switch) > 0:
                time.sleep(0.2)
            left = pending(switch)
            switch.unlink(missing_ok=True)
            if left > 0:
                raise NotInjected(f"the build does not honour the fault switch ({FAULT_SWITCH}; see the report)")
        return time.monotonic()

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
            self.checks.attach(lab, api, self._rng_packets)
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
            secs, checks = self.checks.converge(time.monotonic(), 60)
            if secs is None:
                raise SoakError(f"the lab did not converge on the initial objects: {describe_checks(checks)}")
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
            secs, checks = self.checks.converge(max(time.monotonic(), churner.last_write), max(o.converge_timeout, 60))
            final = self._checkpoint("final", secs, checks, traffic)
            churner.stop()
            report = self._report(churner, traffic, final, time.monotonic() - t_start)
            failed = not report.get("ok", False)  # a failed verdict keeps the nodes' logs too, to find out why
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
        except NotInjected as why:
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
        secs, checks = self.checks.converge(since, o.converge_timeout)
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
        services, slices = self.checks.api_state()
        model = build(services, slices, namespace=NAMESPACE)
        kernel: dict[str, list[str]] = {}
        before = dict(self.checks.packets)
        changed = self.churner.take_changed()
        failures = self.checks.packets_check(
            model,
            changed,
            after == "final",
            len(self.checkpoints),
            lambda: kernel.update(self.checks.kernel_check(model)),
        )
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
            **{f"packets_{k}": self.checks.packets[k] - before[k] for k in ("lost", "wrong", "sent", "targets")},
            "services_changed": self.checks.packets["services_changed"] - before["services_changed"],
            "services_probed": self.checks.packets["services_probed"] - before["services_probed"],
            "checked_s": round(time.monotonic() - t0, 3),  # the model, the kernel view and the packets
            "kernel_view": {node: bad[:10] for node, bad in kernel.items()},
            "kernel_view_differences": sum(len(bad) for bad in kernel.values()),
            "held_alive": traffic.held_alive(),
        }
        self.checkpoints.append(cp)
        if secs is None:
            self.problems.append(f"after {after}: not converged in time: {describe_checks(checks)}")
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
        services, slices = self.checks.api_state()
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
            "drift_check": "/verify" if self.checks.verify_supported else "kernel_view",
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
            "packets": dict(self.checks.packets),
            "kernel_view": dict(self.checks.kernel_view),
            "new_connections": {
                "total": len(conns),
                "failed": len(failed),
                "failed_in_kproxy_restarts": len(in_restart),
                "failed_outside": len(failed) - len(in_restart),
                "errors": sorted({str(e.get("error")) for e in failed}),
                "failed_by_fault": self._by_turn(failed),
                # each failure outside a restart (they fail the run): when, how, and during which fault's turn
                "failed_outside_events": [
                    {"t": e["t"], "error": str(e.get("error")), "turn": self._turn_of(float(e["t"]))}
                    for e in failed
                    if e not in in_restart
                ][:20],
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
            and self.checks.packets["failed"] == 0
            and self.checks.kernel_view["missing"] + self.checks.kernel_view["extra"] == 0
            and not any(v["unconverged"] for v in report["faults"].values())
        )
        return report

    def _by_turn(self, events: Sequence[Mapping[str, Any]]) -> dict[str, int]:
        """How many of ``events`` fell in each fault kind's turn (window and convergence), else ``between``."""
        out: dict[str, int] = {}
        for e in events:
            kind = self._turn_of(float(e["t"]))
            out[kind] = out.get(kind, 0) + 1
        return out

    def _turn_of(self, t: float) -> str:
        return next((k for k, a, b in self.turns if a <= t <= b), "between")


def _modes() -> list[str]:
    from kproxy.proxier import available_backends

    return list(available_backends())


def render(report: Mapping[str, Any]) -> str:
    return table(report)


# the soak's interface (kproxy.soak.cli and the tests take these names from here)
__all__ = ["FAULT_KINDS", "MAX_CYCLES", "Soak", "SoakError", "SoakOptions", "fault_schedule", "render"]
