"""The data-path benchmark's lab (kproxy.bench.datapath says what it measures and why): four nodes (eight with the
diagnostic limits), two pods each, kproxy on node-1 and node-2 only; starting and stopping a mode there, the socket
factories and the one interleaving client, iperf3, and one judged round of every target.
"""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kproxy.bench import options as bench_options
from kproxy.bench.dpconfig import (
    CLEANUP_TIMEOUT,
    CLUSTER_IPS,
    CONNTRACK_LIMITS,
    DIAG_RULESETS,
    ECHO_PORT,
    IPERF_PORT,
    KPROXY_READY_TIMEOUT,
    PINNED_CLIENT,
    ROLES,
    SERVER_CPU,
    SERVICE_PORT,
    DatapathConfig,
    DatapathError,
    targets_for,
)
from kproxy.bench.dpobjects import ApiWriter, synthetic_objects, target_objects
from kproxy.bench.dpstats import flatten, iperf_gbps, round_failure
from kproxy.bench.memory import process_mb
from kproxy.counters import Scrape, parse
from kproxy.lab import netns
from kproxy.lab.cluster import Lab
from kproxy.lab.plan import LabPod

#: ``progress(message, advance=0)``: the step starting now ("" keeps the last), and how many measurements just ended
Progress = Callable[..., None]


def tables(lab: Lab, ns: str) -> list[str]:
    """The nftables tables in a lab namespace ("ip filter", ...)."""
    res = lab.exec(ns, ["nft", "list", "tables"], timeout=30)
    return [line.removeprefix("table ").strip() for line in res.stdout.decode().splitlines() if line.strip()]


def remove_mode(lab: Lab, nodes: Sequence[Any], mode: str) -> str:
    """Stop kproxy on ``nodes``, remove what ``mode`` wrote (its cleanup, then whatever tables are left) and the
    conntrack entries; "" or what went wrong or was left (not fatal: the caller notes it)."""
    for node in nodes:
        lab.stop_kproxy(node)
    problems = []
    for node in nodes:
        try:
            res = lab.exec(node.ns, [*Lab.kproxy_command(), "cleanup", "--mode", mode], timeout=CLEANUP_TIMEOUT)
        except subprocess.TimeoutExpired:
            problems.append(f"kproxy cleanup --mode {mode} in {node.name} took over {CLEANUP_TIMEOUT:.0f} s")
            continue
        if res.returncode != 0:
            problems.append(f"kproxy cleanup in {node.name}: {res.stderr.decode(errors='replace')[-300:]}")
    # What the mode's cleanup leaves (iptables-nft's empty built-in tables and chains: a filter chain hooked at
    # forward taxes every packet of the next mode measured here) goes too, and the conntrack entries: each mode
    # starts on nodes as bare as they were when the lab came up.
    for node in nodes:
        left = tables(lab, node.ns)
        if left:
            problems.append(f"left in {node.name} after the cleanup (removed): {', '.join(left)}")
        lab.exec(node.ns, ["nft", "flush", "ruleset"], timeout=CLEANUP_TIMEOUT)
        lab.exec(node.ns, ["conntrack", "-F"], timeout=30)
    return "; ".join(problems)


class DatapathLab:
    """The four-node lab of this benchmark; use as a context manager (the lab goes down on exit, also on error)."""

    def __init__(self, config: DatapathConfig, progress: Progress | None = None) -> None:
        self.config = config
        self.progress: Progress = progress or (lambda _msg, _advance=0: None)
        self.lab: Lab | None = None
        self.written = 0  # synthetic services in the API
        self._servers: list[subprocess.Popen[bytes]] = []
        self._clients: dict[str, subprocess.Popen[str]] = {}
        #: target -> (the socket factory in its client pod and cgroup, the client's end of its channel)
        self._factories: dict[str, tuple[subprocess.Popen[bytes], socket.socket]] = {}
        self.client_restarts = 0  # dpclients that died or hung and were started again
        self.proxied = False  # a proxy runs on the loaded nodes now (mode none: the ClusterIP has none to answer)
        #: target -> operations sent so far ("crr_ok", "crr_sent" with warm-up and failed ones, "rr_sent": one
        #: connection per rr phase), and "probes": connections start_mode's readiness checks made: what a counting
        #: node's counters must show (kproxy.bench.dpcounters)
        self.made: dict[str, dict[str, int]] = {}

    def __enter__(self) -> DatapathLab:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    # lifecycle

    def up(self) -> None:
        if Lab.live(self.config.prefix) is not None:
            raise DatapathError(
                f"a lab with prefix {self.config.prefix!r} is running: take it down first (kproxy lab --prefix"
                f" {self.config.prefix} down), or use another --lab-prefix"
            )
        nodes, pods = (8 if self.config.conntrack_limits else 4), self.config.pods_per_node
        self.progress(f"lab up ({self.config.prefix}: {nodes} nodes, {pods} pods each)")
        self.lab = Lab.up(
            nodes=nodes,
            pods_per_node=pods,
            mode=None,
            ipv6=False,
            prefix=self.config.prefix,
            timeout=120,
            backend_options=bench_options.lab_options(self.config.backend_options),
        )
        lab = self.lab
        # the limit is only a limit if nothing in its nodes hooks netfilter; the loaded nodes start as bare (and are
        # returned to that after each mode: stop_mode)
        for node in lab.nodes:
            if self.tables(node.ns):
                raise DatapathError(f"{node.name} has nftables tables before any proxy ran: {self.tables(node.ns)}")
        for target in CONNTRACK_LIMITS if self.config.conntrack_limits else ():
            for node in self.path_nodes(target):  # for the whole run: these nodes are that limit's
                self._nft(node.ns, DIAG_RULESETS[target])
        for target in self.all_targets:
            pod = self.server_of(target)
            self._pin_echo(pod)
            self._start_iperf(pod)
            self._start_factory(target)
        ApiWriter(lab.api_url).create_all(
            [obj for t in self.cluster_ip_targets for obj in target_objects(self.server_of(t), *CLUSTER_IPS[t])]
        )

    @property
    def all_targets(self) -> tuple[str, ...]:
        """Every target this lab measures (the same in every mode)."""
        return targets_for("", self.config)

    def down(self) -> None:
        for client in self._clients.values():
            if client.poll() is None and client.stdin is not None:
                try:
                    client.stdin.write("quit\n")
                    client.stdin.close()
                except OSError:
                    pass
            try:
                client.wait(timeout=5)
            except subprocess.TimeoutExpired:
                client.kill()
                client.wait(timeout=5)
            if client.stdout is not None:
                client.stdout.close()
        self._clients.clear()
        for proc, channel in self._factories.values():
            channel.close()  # the factory sees EOF and ends
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        self._factories.clear()
        for proc in self._servers:
            if proc.poll() is None:
                proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        self._servers.clear()
        if self.lab is not None:
            self.progress("lab down")
            Lab.down(prefix=self.config.prefix)
            self.lab = None

    # who is who

    @property
    def _lab(self) -> Lab:
        if self.lab is None:
            raise DatapathError("the lab is not up")
        return self.lab

    @property
    def client_pod(self) -> LabPod:
        """The ClusterIP's client pod (pod-1-1)."""
        return self.client_of("clusterip")

    @property
    def server_pod(self) -> LabPod:
        """The ClusterIP's only endpoint (pod-2-1)."""
        return self.server_of("clusterip")

    @property
    def cluster_ip_targets(self) -> list[str]:
        """The targets measured at a ClusterIP when a proxy runs (the ClusterIP, and its reverse for the counters)."""
        return [t for t in self.all_targets if t in CLUSTER_IPS]

    @property
    def loaded_nodes(self) -> list[Any]:
        return [self._lab.node("node-1"), self._lab.node("node-2")]

    def path_nodes(self, target: str) -> list[Any]:
        """The two nodes a target's traffic crosses (client's, server's)."""
        return [self._lab.node(self._lab.pod(p).node) for p in ROLES[target]]

    def client_of(self, target: str) -> LabPod:
        return self._lab.pod(ROLES[target][0])

    def server_of(self, target: str) -> LabPod:
        return self._lab.pod(ROLES[target][1])

    def _nft(self, ns: str, text: str) -> None:
        res = self._lab.exec(ns, ["nft", "-f", "-"], input=text.encode(), timeout=30)
        if res.returncode != 0:
            raise DatapathError(f"nft in {ns}: {res.stderr.decode(errors='replace')[-300:]}")

    def conntrack_count(self, ns: str) -> float | None:
        """Connections conntrack tracks in a node's namespace now (None: conntrack is not loaded at all)."""
        res = self._lab.exec(ns, ["cat", "/proc/sys/net/netfilter/nf_conntrack_count"], timeout=10)
        try:
            return float(res.stdout.decode().strip()) if res.returncode == 0 else None
        except ValueError:
            return None

    def kproxy_cpu(self) -> dict[str, float]:
        """CPU seconds (user + system) each loaded node's kproxy has used so far."""
        out = {}
        tick = os.sysconf("SC_CLK_TCK")
        for node in self.loaded_nodes:
            pid = self._lab.kproxy_pid(node)
            if pid is None:
                continue
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            out[node.name] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime (fields 14 and 15)
        return out

    def idle_cpu(self, seconds: float) -> dict[str, float]:
        """CPU seconds each loaded node's kproxy uses over ``seconds`` of quiet (no traffic, no change): a synced
        proxy should cost almost nothing. (A wall-clock interval on purpose: this is the measurement, not a wait.)"""
        if seconds <= 0:
            return {}
        before = self.kproxy_cpu()
        time.sleep(seconds)
        after = self.kproxy_cpu()
        return {k: round(after[k] - before[k], 3) for k in after if k in before}

    def _pin_echo(self, pod: LabPod) -> None:
        pid = next((p.get("echo_pid") for p in self._lab.status()["pods"] if p["name"] == pod.name), None)
        if not pid:
            raise DatapathError(f"no echo server found for {pod.name}")
        subprocess.run(["taskset", "-a", "-p", "-c", SERVER_CPU, str(pid)], check=True, capture_output=True, timeout=10)

    def _start_iperf(self, pod: LabPod) -> None:
        argv = netns.exec_argv(pod.ns, ["taskset", "-c", SERVER_CPU, "iperf3", "-s", "-p", str(IPERF_PORT)])
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=netns.cgroup_preexec(self._lab.cgroup_path(pod.node)),
        )
        self._servers.append(proc)

    # services and proxies

    def ensure_services(self, n: int) -> float:
        """Program ``n`` services in total (the target and ``n - 1`` synthetic ones); seconds the writes took."""
        want = n - 1
        if want <= self.written:
            if want < self.written:
                raise DatapathError("sizes must grow within one run (services are only ever added)")
            return 0.0
        self.progress(f"writing services {self.written + 1}..{want} to the lab API")
        t0 = time.monotonic()
        ApiWriter(self._lab.api_url).create_all(synthetic_objects(self.written + 1, want, self.config.endpoints))
        self.written = want
        return time.monotonic() - t0

    def start_mode(self, mode: str, counting: Sequence[str] = ()) -> float:
        """Start kproxy ``mode`` on both loaded nodes (with ``--service-counters`` on the nodes named in
        ``counting``); seconds until both are healthy and every ClusterIP target answers from its client pod."""
        lab = self._lab
        t0 = time.monotonic()
        self.proxied = True
        for node in self.loaded_nodes:
            lab.start_kproxy(node, mode, ["--service-counters"] if node.name in counting else [])
        for node in self.loaded_nodes:
            lab.wait_kproxy(node, timeout=KPROXY_READY_TIMEOUT)
        for target in self.cluster_ip_targets:
            self._wait_answers(mode, target)
        return time.monotonic() - t0

    def _wait_answers(self, mode: str, target: str) -> None:
        """Until a ClusterIP target answers over TCP and UDP from its client pod, from its own server (bounded)."""
        lab = self._lab
        client, server = self.client_of(target), self.server_of(target)
        ip = CLUSTER_IPS[target][1]
        probes = self.made.setdefault(target, {})
        deadline = time.monotonic() + 60
        last = ""
        while time.monotonic() < deadline:
            tcp = lab.probe(client.ns, "tcp", ip, SERVICE_PORT, timeout=1.0)[0]
            udp = lab.probe(client.ns, "udp", ip, SERVICE_PORT, timeout=1.0)[0]
            probes["probes"] = probes.get("probes", 0) + 1
            if tcp.ok and udp.ok and tcp.pod == server.name:
                return
            last = f"tcp {tcp!r}, udp {udp!r}"
            time.sleep(0.5)
        raise DatapathError(f"mode {mode}: the ClusterIP {ip} does not answer from {client.name}: {last}")

    def read_counters(self, node_name: str) -> Scrape:
        """A loaded node's service counters as its ``/metrics`` serves them (``Scrape.offered`` None: counters off)."""
        url = "http://127.0.0.1:10249/metrics"
        r = self._lab.probe_http(self._lab.node(node_name).ns, url, timeout=10.0)
        if r.status != 200:
            raise DatapathError(f"{url} on {node_name}: {r.status} {r.error}")
        return parse(r.body or "", time.monotonic())

    def stop_mode(self, mode: str) -> str:
        """Stop kproxy on both loaded nodes, remove what ``mode`` wrote and the conntrack entries (``remove_mode``);
        "" or what went wrong or was left (not fatal: noted beside the run)."""
        self.proxied = False
        return remove_mode(self._lab, self.loaded_nodes, mode)

    def tables(self, ns: str) -> list[str]:
        """The nftables tables in a namespace ("ip filter", ...)."""
        return tables(self._lab, ns)

    def kproxy_memory(self) -> tuple[dict[str, float], dict[str, float]]:
        """(resident MB, peak resident MB) of each loaded node's kproxy."""
        rss, peak = {}, {}
        for node in self.loaded_nodes:
            pid = self._lab.kproxy_pid(node)
            got = process_mb(pid) if pid is not None else None
            if got is not None:
                rss[node.name], peak[node.name] = got
        return rss, peak

    def sync_metrics(self) -> dict[str, dict[str, float]]:
        """Each loaded node's sync-duration histogram (sum, count) from its /metrics, parsed by prometheus_client."""
        from prometheus_client.parser import text_string_to_metric_families

        code = (
            "import sys, urllib.request; sys.stdout.write(urllib.request.urlopen("
            "'http://127.0.0.1:10249/metrics', timeout=10).read().decode())"
        )
        out: dict[str, dict[str, float]] = {}
        for node in self.loaded_nodes:
            res = self._lab.exec(node.ns, [sys.executable, "-c", code], timeout=30)
            if res.returncode != 0:
                continue
            figures: dict[str, float] = {}
            for fam in text_string_to_metric_families(res.stdout.decode(errors="replace")):
                if fam.name not in (
                    "kubeproxy_sync_proxy_rules_duration_seconds",
                    "kubeproxy_sync_full_proxy_rules_duration_seconds",
                ):
                    continue
                short = fam.name.removeprefix("kubeproxy_").removesuffix("_duration_seconds")
                for s in fam.samples:
                    if s.name.endswith("_sum"):
                        figures[f"{short}_sum_s"] = figures.get(f"{short}_sum_s", 0.0) + s.value
                    elif s.name.endswith("_count"):
                        figures[f"{short}_count"] = figures.get(f"{short}_count", 0.0) + s.value
            out[node.name] = figures
        return out

    # traffic

    def _iperf(self, pod: LabPod, host: str) -> dict[str, Any]:
        c = self.config
        argv = [*PINNED_CLIENT, "iperf3", "-c", host, "-p", str(IPERF_PORT)]
        argv += ["-t", str(c.iperf_seconds), "-J", "--connect-timeout", "2000"]
        last: dict[str, Any] = {}
        for _ in range(3):  # the server may still be finishing the previous test ("server is busy")
            res = self._lab.exec(pod.ns, argv, timeout=c.iperf_seconds + 60)
            try:
                last = json.loads(res.stdout.decode() or "{}")
            except ValueError:
                last = {"error": res.stdout.decode(errors="replace")[-300:]}
            if res.returncode == 0 and "end" in last:
                return {"gbps": iperf_gbps(last)}
            time.sleep(0.5)
        raise DatapathError(f"iperf3 in {pod.name} -> {host}: {str(last.get('error') or last)[:300]}")

    def endpoints_of(self, target: str) -> tuple[LabPod, str, int]:
        """(client pod, address, port) of a target. Without a proxy the ClusterIP is measured at its endpoint's pod
        IP: mode none then runs the same targets, pods and schedule as a real run (the calibration)."""
        if target in CLUSTER_IPS and self.proxied:
            return self.client_of(target), CLUSTER_IPS[target][1], SERVICE_PORT
        return self.client_of(target), self.server_of(target).ip4, ECHO_PORT

    def _start_factory(self, target: str) -> None:
        """The target's socket factory (dpclient.factory): in its client pod, its client node's cgroup and pinned to
        the client CPU, so the target's sockets pass exactly the socket programs of the node it starts from."""
        pod = self.client_of(target)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        argv = [*PINNED_CLIENT, sys.executable, "-m", "kproxy.bench.dpclient", "--factory", str(theirs.fileno())]
        try:
            proc = subprocess.Popen(
                netns.exec_argv(pod.ns, argv),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),),
                preexec_fn=netns.cgroup_preexec(self._lab.cgroup_path(pod.node)),
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._factories[target] = (proc, ours)

    def factory_pid(self, target: str) -> int:
        """The pid of the process that makes a target's sockets."""
        return self._factories[target][0].pid

    def _multi_client(self) -> subprocess.Popen[str]:
        """The one ``dpclient --serve`` that measures every target in turn (:func:`dpclient.interleaved`), pinned to
        the client CPU. It makes no socket of its own: each target's come from that target's factory, whose channel
        it inherits (the same descriptor number as here), so no target's sockets are in the wrong cgroup."""
        proc = self._clients.get("multi")
        if proc is None or proc.poll() is not None:
            argv = [*PINNED_CLIENT, sys.executable, "-m", "kproxy.bench.dpclient", "--serve"]
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
                bufsize=1,
                pass_fds=tuple(ch.fileno() for _, ch in self._factories.values()),
            )
            self._clients["multi"] = proc
        return proc

    def _multi_phase(self, phase: str, targets: Sequence[str]) -> list[dict[str, Any]]:
        c = self.config
        spec = []
        for t in targets:
            _pod, host, port = self.endpoints_of(t)
            spec.append({"source": self._factories[t][1].fileno(), "host": host, "port": port})
        seconds = c.seconds * len(targets)  # the same operations per target as a phase of its own
        req = {"phase": phase, "targets": spec, "seconds": seconds, "warmup": 0.05, "timeout": 1.0}
        line = ""
        for attempt in range(2):
            proc = self._multi_client()
            assert proc.stdin is not None and proc.stdout is not None
            try:
                proc.stdin.write(json.dumps(req) + "\n")
                proc.stdin.flush()
                ready, _, _ = select.select([proc.stdout], [], [], 3 * seconds + 30)
                line = proc.stdout.readline() if ready else ""
            except OSError:
                line = ""
            if line:
                break
            proc.kill()
            proc.wait(timeout=10)
            self._clients.pop("multi", None)
            self.client_restarts += 1
            self.progress(
                f"the interleaved dpclient gave no answer to {phase} (exit {proc.returncode}); attempt {attempt}"
            )
        if not line:
            raise DatapathError(f"the interleaved dpclient gave no answer to {req}, twice")
        answer = dict(json.loads(line))
        if "error" in answer:
            raise DatapathError(f"the interleaved dpclient, {req}: {answer['error']}")
        return list(answer["targets"])

    def _tally(self, target: str, phases: dict[str, dict[str, Any]]) -> None:
        """Add a round's operations to ``made`` (failed rounds too: their connections were made all the same)."""
        made = self.made.setdefault(target, {})
        crr, rr = phases.get("crr", {}), phases.get("rr", {})
        made["crr_ok"] = made.get("crr_ok", 0) + int(crr.get("ops", 0))
        sent = int(crr.get("ops", 0)) + int(crr.get("errors", 0)) + int(crr.get("warmup_ops", 0))
        made["crr_sent"] = made.get("crr_sent", 0) + sent
        made["rr_sent"] = made.get("rr_sent", 0) + (1 if rr else 0)

    def measure_round(self, targets: Sequence[str]) -> tuple[dict[str, dict[str, float]], dict[str, int]]:
        """:meth:`judged_round` without the verdict: (figures per target, errors per target)."""
        out, errors, _failure = self.judged_round(targets)
        return out, errors

    def judged_round(self, targets: Sequence[str]) -> tuple[dict[str, dict[str, float]], dict[str, int], str]:
        """One round over ``targets``: each request/response phase interleaved across all of them (one operation
        per target in turn), then iperf3 per target in the order given. (figures per target, errors per target,
        why the round failed: "" when it did not, see :func:`round_failure`)"""
        client: dict[str, dict[str, Any]] = {t: {} for t in targets}
        for phase in ("crr", "rr", "udp"):
            for t, figures in zip(targets, self._multi_phase(phase, targets), strict=True):
                client[t][phase] = figures
        for t in targets:
            self._tally(t, client[t])
        out, errors = {}, {}
        for t in targets:
            pod, host, _port = self.endpoints_of(t)
            errors[t] = sum(int(client[t][p].get("errors", 0)) for p in client[t])
            try:
                iperf: dict[str, Any] | None = self._iperf(pod, host)
            except DatapathError as exc:  # this round has no throughput for it (counted), the rest stands
                self.progress(f"{t}: {exc}")
                iperf, errors[t] = None, errors[t] + 1
            out[t] = flatten(client[t], iperf)
        return out, errors, round_failure(client)
