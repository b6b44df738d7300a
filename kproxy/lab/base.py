"""A lab as its state record describes it: its nodes, pods and addresses, and running commands and probes in its
namespaces (``ip netns exec``, no shell; inside the node's cgroup as every process of a real node would be).

kproxy.lab.cluster.Lab builds on it (building, attaching, taking down, kproxy on the nodes); the split keeps the
read-only facts and the probes apart from the lifecycle.
"""

from __future__ import annotations

import json
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kproxy.lab import netns
from kproxy.lab.echo import DEFAULT_PORTS
from kproxy.lab.plan import API_PORT_IN_LAB, LabError, LabNode, LabPod
from kproxy.lab.probe import ProbeResult, build_argv
from kproxy.lab.state import CGROUP_MOUNT, module_env, stdlib_module_argv


class LabBase:
    """The facts and the probes of a lab, from its ``state.json`` record (see kproxy.lab.cluster.Lab)."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state
        self.prefix: str = state["prefix"]
        self.state_dir = Path(state["state_dir"])
        self.ipv6: bool = state["ipv6"]
        self.mode: str | None = state.get("mode")
        self.nodes: list[LabNode] = [LabNode(**n) for n in state["nodes"]]
        self.pods: list[LabPod] = [LabPod(**p) for p in state["pods"]]
        self.fabric_ns: str = state["fabric_ns"]
        self.external_ns: str = state["external_ns"]
        self.external_ip4: str = state["external_ip4"]
        self.external_ip6: str = state["external_ip6"]
        self.api_port: int = state["api_port"]
        self.api_url = f"http://127.0.0.1:{self.api_port}"
        self.lab_api_url = f"http://198.18.0.1:{API_PORT_IN_LAB}"
        self.echo_ports: list[int] = list(state.get("echo_ports", DEFAULT_PORTS))
        #: backend options every node's kproxy gets (``kproxy lab up --backend-option``), before ``lab_options``
        self.backend_options: dict[str, Any] = dict(state.get("backend_options") or {})
        self._children: dict[str, subprocess.Popen[bytes]] = {}

    # --- facts -------------------------------------------------------------------------------------------------

    def node(self, name: str | int) -> LabNode:
        """A node by name ("node-1"), namespace ("kpl-n1") or index (1)."""
        for n in self.nodes:
            if name in (n.name, n.ns, n.index):
                return n
        raise LabError(f"no lab node {name!r}")

    def pod(self, name: str) -> LabPod:
        """A pod by name ("pod-1-2") or namespace ("kpl-n1-p2")."""
        for p in self.pods:
            if name in (p.name, p.ns):
                return p
        raise LabError(f"no lab pod {name!r}")

    def pods_on(self, node: LabNode | str) -> list[LabPod]:
        name = node.name if isinstance(node, LabNode) else self.node(node).name
        return [p for p in self.pods if p.node == name]

    def cgroup_path(self, node: LabNode | str) -> Path:
        """The node's cgroup (cgroup v2) that every process of the node runs in."""
        n = node if isinstance(node, LabNode) else self.node(node)
        return CGROUP_MOUNT / n.ns

    def node_of_ns(self, ns: str) -> LabNode | None:
        """The node a namespace belongs to (the node's own or one of its pods'), None for fabric and external."""
        for n in self.nodes:
            if ns == n.ns:
                return n
        for p in self.pods:
            if ns == p.ns:
                return self.node(p.node)
        return None

    def api_client(self) -> Any:
        """A ``kubernetes.client.ApiClient`` for the lab's API stand-in (from the machine's namespace)."""
        from kubernetes import client

        cfg = client.Configuration()
        cfg.host = self.api_url
        return client.ApiClient(cfg)

    # --- running things inside the lab ------------------------------------------------------------------------

    def _check_ns(self, ns: str) -> str:
        if not ns.startswith(self.prefix):
            raise LabError(f"{ns!r} is not a namespace of this lab (prefix {self.prefix!r})")
        return ns

    def _cgroup_for(self, ns: str, cgroup_of: LabNode | None, no_cgroup: bool) -> Path | None:
        if no_cgroup:
            return None
        node = cgroup_of or self.node_of_ns(ns)
        return self.cgroup_path(node) if node else None

    def exec(
        self,
        ns: str,
        argv: Sequence[str],
        timeout: float = 30,
        input: bytes | None = None,
        cgroup_of: LabNode | None = None,
        *,
        no_cgroup: bool = False,
        check: bool = False,
    ) -> subprocess.CompletedProcess[bytes]:
        """Run argv in a lab namespace (``ip netns exec``, no shell) and capture its output.

        The process runs in the cgroup of ``cgroup_of``, by default the node the namespace belongs to (a node's or
        its pods' namespaces), as every process of a real node would; ``no_cgroup=True`` runs it outside them.
        """
        full = netns.exec_argv(self._check_ns(ns), list(argv))
        return subprocess.run(
            full,
            input=input,
            stdin=None if input is not None else subprocess.DEVNULL,
            capture_output=True,
            timeout=timeout,
            check=check,
            preexec_fn=netns.cgroup_preexec(self._cgroup_for(ns, cgroup_of, no_cgroup)),
        )

    def _probe_argv(self, ns: str, args: list[str]) -> list[str]:
        return netns.exec_argv(self._check_ns(ns), [*stdlib_module_argv("kproxy.lab.probe"), *args])

    def _parse(
        self, proc: subprocess.CompletedProcess[bytes] | tuple[bytes, bytes, int], what: str
    ) -> list[ProbeResult]:
        if isinstance(proc, tuple):
            out, err, rc = proc
        else:
            out, err, rc = proc.stdout, proc.stderr, proc.returncode
        lines = [ln for ln in out.decode(errors="replace").splitlines() if ln.startswith("[")]
        if rc != 0 or not lines:
            raise LabError(f"probe {what} failed (rc {rc}): {err.decode(errors='replace').strip()[-2000:]}")
        return [ProbeResult.from_json(d) for d in json.loads(lines[-1])]

    def probe(
        self,
        ns: str,
        kind: str,
        host: str,
        port: int,
        *,
        count: int = 1,
        timeout: float = 1.0,
        src_port: int | None = None,
        payload: str = "hello",
        interval: float = 0.0,
        cgroup_of: LabNode | None = None,
        no_cgroup: bool = False,
    ) -> list[ProbeResult]:
        """``count`` tcp or udp exchanges from namespace ``ns`` to host:port (see kproxy.lab.probe)."""
        args = build_argv(
            kind, host, port, count=count, timeout=timeout, src_port=src_port, payload=payload, interval=interval
        )
        budget = count * (timeout + interval) + 30
        proc = subprocess.run(
            self._probe_argv(ns, args),
            env=module_env(),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=budget,
            preexec_fn=netns.cgroup_preexec(self._cgroup_for(ns, cgroup_of, no_cgroup)),
        )
        return self._parse(proc, f"{kind} {ns} -> {host}:{port}")

    def probe_http(self, ns: str, url: str, timeout: float = 2.0, *, cgroup_of: LabNode | None = None) -> ProbeResult:
        """One HTTP GET from ``ns``; ``ok`` means a response came back (any status), see ``status``/``body``."""
        proc = subprocess.run(
            self._probe_argv(ns, build_argv("http", url=url, timeout=timeout)),
            env=module_env(),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=timeout + 30,
            preexec_fn=netns.cgroup_preexec(self._cgroup_for(ns, cgroup_of, False)),
        )
        return self._parse(proc, f"http {ns} {url}")[0]

    def hold(
        self,
        ns: str,
        host: str,
        port: int,
        seconds: float,
        interval: float = 0.2,
        *,
        timeout: float = 1.0,
        payload: str = "hello",
        cgroup_of: LabNode | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start one long-lived TCP exchange; returns once the first exchange is done. Read with finish_hold."""
        args = build_argv("hold", host, port, timeout=timeout, payload=payload, interval=interval, seconds=seconds)
        proc = subprocess.Popen(
            self._probe_argv(ns, args),
            env=module_env(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            preexec_fn=netns.cgroup_preexec(self._cgroup_for(ns, cgroup_of, False)),
        )
        assert proc.stdout is not None
        first = proc.stdout.readline()  # "ready", or the final JSON when the first exchange failed
        proc._kproxy_first = first  # type: ignore[attr-defined]
        return proc

    def finish_hold(
        self, proc: subprocess.Popen[bytes], stop: bool = False, timeout: float | None = None
    ) -> list[ProbeResult]:
        """Wait for a hold to end (or end it now with ``stop=True``) and return one result per exchange."""
        if stop and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=timeout if timeout is not None else 630)
        first: bytes = getattr(proc, "_kproxy_first", b"")
        return self._parse((first + out, err, proc.returncode or 0), "hold")
