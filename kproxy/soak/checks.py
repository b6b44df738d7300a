"""The soak's checks at a checkpoint: every node against what the API holds (``/rules``) and its kernel read back
without drift (``/verify``, or the mode's ``kernel_view`` from outside), and the soak's own reference model against
real packets (``kproxy.soak.packets``) and against the kernel as ``kernel_view`` reads it. The counters they keep
(packets, kernel view) go into the report.
"""

from __future__ import annotations

import http.client
import json
import random
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kproxy.lab import netns
from kproxy.lab.cluster import Lab
from kproxy.lab.plan import LabNode
from kproxy.lab.state import module_env, stdlib_module_argv
from kproxy.model import IPFamily
from kproxy.proxier import KernelHooks, LocalProbe
from kproxy.soak.api import Api, NodeCheck, SoakError, ns_get
from kproxy.soak.churn import ANCHOR, NAMESPACE
from kproxy.soak.expect import differences, expected_services
from kproxy.soak.model import Model
from kproxy.soak.packets import Target, judge, plan

MAX_ABSENT = 4  # removed services' former addresses tried per checkpoint (each costs a timeout)


class Checks:
    """The checks of one soak run; :meth:`attach` gives them the lab and its API once they are up."""

    def __init__(self, cls: KernelHooks, mode: str, sample: int, verify: bool, problems: list[str]) -> None:
        self.cls, self.mode, self.sample = cls, mode, sample
        self.lab: Lab | None = None
        self.api: Api | None = None
        self.rng = random.Random()
        self.problems = problems  # the run's, shared: what a check could not do goes into the report
        self.verify_supported = verify
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

    def attach(self, lab: Lab, api: Api, rng: random.Random) -> None:
        self.lab, self.api, self.rng = lab, api, rng

    # -- expectations and checks -------------------------------------------------------------------------------

    def _families(self) -> tuple[IPFamily, ...]:
        assert self.lab is not None
        return (IPFamily.V4, IPFamily.V6) if self.lab.ipv6 else (IPFamily.V4,)

    def api_state(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        assert self.api is not None
        deadline = time.monotonic() + 30
        while True:
            try:
                return self.api.list("Service"), self.api.list("EndpointSlice")
            except (SoakError, OSError, http.client.HTTPException) as exc:
                if time.monotonic() > deadline:
                    raise SoakError(f"the API did not answer lists: {exc}") from exc
                time.sleep(0.3)

    def expected(self) -> dict[str, tuple[dict[str, Any], dict[str, str]]]:
        assert self.lab is not None and self.api is not None
        services, slices = self.api_state()
        out = {}
        for n in self.lab.nodes:
            out[n.name] = expected_services(n.name, services, slices, self.api.node(n.name), self._families())
        return out

    def check_node(self, node: LabNode, expected: Mapping[str, Any]) -> NodeCheck:
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
        probe = LocalProbe(node.ns, self.lab.node_options(node, self.mode))
        for fam in self._families():
            view = self.cls.kernel_view(probe, fam)
            if view is None:
                return
            for key, fams in expected.items():
                if key.startswith(NAMESPACE + "/") and fam.value in fams and key not in view:
                    chk.drift += 1
                    chk.drift_detail.append(f"{key}/{fam.value}: missing from the kernel")

    def converge(self, since: float, timeout: float) -> tuple[float | None, list[NodeCheck]]:
        """Poll every node until all match the API and read back without drift: (seconds from ``since`` to that
        moment, or None on timeout; the last checks)."""
        assert self.lab is not None
        expected = self.expected()
        deadline = time.monotonic() + timeout
        checks: list[NodeCheck] = []
        while True:
            checks = [self.check_node(n, expected[n.name][0]) for n in self.lab.nodes]
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
        chosen = sorted(self.rng.sample(valid, min(len(valid), self.sample)))
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
        picked = self.rng.sample(sorted(absent), min(len(absent), MAX_ABSENT))
        return chosen, {n: absent[n] for n in picked}

    def packets_check(
        self, model: Model, changed: set[str], final: bool, turn: int, meanwhile: Callable[[], None]
    ) -> list[str]:
        """Real packets from a pod of every node to every address of the chosen services (see
        ``kproxy.soak.packets``), judged against the model: what was lost or wrong, with what was sent and got.
        ``meanwhile`` runs while the packets are out (most of a sweep is waiting for drops to time out)."""
        assert self.lab is not None
        lab = self.lab
        chosen, absent = self._choose(model, changed, final)
        self.packets["services_probed"] += len(chosen)
        self.packets["removed_probed"] += len(absent)
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

    def kernel_check(self, model: Model) -> dict[str, list[str]]:
        """Each node's kernel, read by the mode's ``kernel_view`` (never kproxy's memory), against the model's
        service ports: node -> ``key/family: missing`` or ``extra``. Empty for a mode without a kernel view."""
        assert self.lab is not None
        out: dict[str, list[str]] = {}
        for node in self.lab.nodes:
            probe = LocalProbe(node.ns, self.lab.node_options(node, self.mode))
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
