"""The lab: a Kubernetes-like cluster made of network namespaces, for the conformance suite of every backend.

Used by ``kproxy lab`` (kproxy.lab.cli), by the conformance runner and scenarios (kproxy.conformance), by the
benchmarks and by tests/integration/test_lab.py. One lab exists at a time per prefix; its state lives in
/run/kproxy-lab/state.json (kproxy.lab.state) so another process can :meth:`Lab.attach` to it. What it is made of
(namespaces, links, addresses, routes) is its plan, kproxy.lab.plan; the facts and probes of a built lab are
kproxy.lab.base; taking it down is kproxy.lab.teardown.

Nothing is configured in the machine's own namespace and no lab namespace is wired to it: the only link between
the two is the API stand-in process, which opens listening sockets inside the fabric namespace and on 127.0.0.1.

Processes are recorded as pid files (pid plus start time, so a recycled pid is never signalled) as soon as they are
started; :meth:`Lab.down` ends them by pid file, by the namespaces they are in, by the cgroups they are in and by a
command line naming the state directory, so even a lab whose runner was killed with SIGKILL is removed completely.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kproxy.lab import netns
from kproxy.lab.base import LabBase
from kproxy.lab.echo import DEFAULT_PORTS
from kproxy.lab.plan import (
    API_PORT_IN_LAB,
    CLUSTER_CIDR4,
    CLUSTER_CIDR6,
    DEFAULT_PREFIX,
    NO_DAD_SYSCTLS,
    NODE_SYSCTLS,
    ZONE_LABEL,
    LabError,
    LabNode,
    LabPod,
    Plan,
    check_prefix,
    external_batch,
    fabric_batch,
    make_plan,
    node_batch,
    pod_batch,
)
from kproxy.lab.probe import ProbeResult
from kproxy.lab.state import (
    CGROUP_MOUNT,
    LIVE,
    STATE_ROOT,
    initial_state,
    lab_is_live,
    locked,
    module_env,
    read_pidfile,
    reap_live,
    state_dir_for,
    stdlib_module_argv,
    tail,
    write_json,
    write_pidfile,
)
from kproxy.lab.teardown import installed_backend, lab_namespaces, remove_lab
from kproxy.proxier import DEFAULT_MODE, LabNodeSpec, option_arguments

# the names other modules have always imported from here
__all__ = [
    "API_PORT_IN_LAB",
    "CGROUP_MOUNT",
    "CLUSTER_CIDR4",
    "CLUSTER_CIDR6",
    "STATE_ROOT",
    "Lab",
    "LabError",
    "LabNode",
    "LabPod",
    "Plan",
    "check_prefix",
    "lab_is_live",
    "make_plan",
    "state_dir_for",
]


def _venv_bin(name: str) -> str:
    cand = Path(sys.executable).parent / name
    return str(cand)


def _prefetch_kubernetes_client() -> None:
    """Import the kubernetes client's CoreV1Api in a thread: it takes seconds (pydantic models), spent while the
    kernel work and the processes start."""
    prefetch = threading.Thread(
        target=importlib.import_module, args=("kubernetes.client.api.core_v1_api",), daemon=True
    )
    prefetch.start()


def _fresh_state_dir(state_dir: Path) -> None:
    state_dir.mkdir(parents=True, exist_ok=True)
    for old_log in state_dir.glob("*.log"):  # kept by down() for diagnosis, but they belong to the old lab
        old_log.unlink(missing_ok=True)
    for sub in ("pids", "ready"):
        (state_dir / sub).mkdir(exist_ok=True)


class Lab(LabBase):
    """A running lab (see the module docstring). Build with :meth:`up`, find from elsewhere with :meth:`attach`."""

    PREFIX = DEFAULT_PREFIX
    PREFIX = "kpl-"
    # How kproxy is started and signalled on a node: None runs it natively (``ip netns exec``); a
    # kproxy.lab.container.ContainerLauncher runs it in the kproxy image, as its DaemonSet would (tests/integration/
    # test_image.py). It has ``argv(lab, node, kproxy_argv) -> argv`` and ``kill(lab, node, sig)``.
    launcher: Any = None

    # --- lifecycle ---------------------------------------------------------------------------------------------

    @classmethod
    def up(
        cls,
        nodes: int = 2,
        pods_per_node: int = 3,
        mode: str | None = DEFAULT_MODE,
        ipv6: bool = True,
        kproxy_args: Sequence[str] = (),
        *,
        prefix: str | None = None,
        echo_ports: Sequence[int] = DEFAULT_PORTS,
        timeout: float = 30.0,
        backend_options: Mapping[str, Any] | None = None,
    ) -> Lab:
        """Build a fresh lab and return it once pods answer and nodes are registered.

        Whatever lab is under the prefix goes first, running or not: a command that must not take down someone's
        lab checks :meth:`live` before. ``mode=None`` starts no kproxy. kproxy processes are started but not waited
        for; if starting them fails, the lab is taken down again (logs kept).
        """
        prefix = prefix or cls.PREFIX
        plan = make_plan(nodes, pods_per_node, ipv6, prefix)
        state_dir = state_dir_for(prefix)
        t0 = time.monotonic()
        _prefetch_kubernetes_client()
        cls.down(prefix=prefix)
        timings = {"stale_lab_removed": time.monotonic()}
        with locked(state_dir):
            _fresh_state_dir(state_dir)
            state = initial_state(plan, state_dir, mode, kproxy_args, echo_ports, backend_options)
            # written first, so a run killed half-way still leaves a record for `down`
            write_json(state_dir / "state.json", state)
            lab = cls(state)
            lab._bring_up(plan, t0, t0 + timeout, timings)
        if mode is not None:
            lab._start_or_remove(mode, kproxy_args)
        return lab

    def _bring_up(self, plan: Plan, t0: float, deadline: float, timings: dict[str, float]) -> None:
        """Build, register the nodes, wait for the pods and record the lab ready; a failure removes the half-built
        lab again (logs kept for diagnosis), so a failed start leaves nothing behind."""
        state = self.state
        try:
            self._build(plan, deadline, timings)
            state["api_port"] = self.api_port
            write_json(self.state_dir / "state.json", state)
            self._register_nodes()
            timings["nodes_registered"] = time.monotonic()
            self._wait_pods(deadline)
            timings["pods_ready"] = time.monotonic()
            state["ready"] = True
            state["startup_seconds"] = round(time.monotonic() - t0, 3)
            state["startup_phases"] = {k: round(v - t0, 3) for k, v in timings.items()}
            write_json(self.state_dir / "state.json", state)
        except BaseException as e:
            self._children.clear()
            try:
                remove_lab(self.prefix, self.state_dir, keep_logs=True)
            except Exception as cleanup_error:
                e.add_note(f"and removing the half-built lab failed too: {cleanup_error}")
            if isinstance(e, netns.NetnsError):
                raise LabError(f"building the lab failed: {e}") from e
            raise

    def _start_or_remove(self, mode: str, kproxy_args: Sequence[str]) -> None:
        try:
            self.start_all(mode, kproxy_args)
        except BaseException:
            self._children.clear()
            self.down(prefix=self.prefix, keep_logs=True)  # a lab that could not start its kproxy is not left behind
            raise

    def _build(self, plan: Plan, deadline: float, timings: dict[str, float]) -> None:
        netns.add_netns(plan.namespaces())
        timings["namespaces_added"] = time.monotonic()
        if plan.ipv6:
            # Before any link exists: a veth peer is created straight into its namespace and takes that
            # namespace's defaults then; with DAD on, its link-local address stays tentative for a second or two
            # and the first IPv6 packets across the lab are lost (a flaky first probe).
            netns.run_parallel({ns: netns.sysctl_argv(ns, NO_DAD_SYSCTLS) for ns in plan.namespaces()})
        # node sysctls and the fabric are independent; then nodes and the external client; then pods
        sysctls = {n.ns: netns.sysctl_argv(n.ns, NODE_SYSCTLS) for n in plan.nodes}
        fabric = netns.start_batch(plan.fabric_ns, fabric_batch(plan))
        try:
            netns.run_parallel(sysctls)
        except netns.NetnsError:
            # the bridge-nf-call sysctls appear only once br_netfilter is loaded
            subprocess.run(["modprobe", "br_netfilter"], capture_output=True, timeout=30)
            try:
                netns.run_parallel(sysctls)
            except netns.NetnsError as e:
                raise LabError(f"node sysctls failed (is br_netfilter available?): {e}") from e
        netns.wait_batch(fabric, f"netns {plan.fabric_ns}")
        timings["fabric_ready"] = time.monotonic()
        self._mount_cgroups()
        api = self._start_api()
        batches = {n.ns: node_batch(plan, n) for n in plan.nodes}
        batches[plan.external_ns] = external_batch(plan)
        netns.run_batches(batches)
        by_name = {n.name: n for n in plan.nodes}
        netns.run_batches({p.ns: pod_batch(plan, by_name[p.node], p) for p in plan.pods})
        timings["links_ready"] = time.monotonic()
        for pod in plan.pods:
            self._start_echo(pod)
        self.api_port = self._wait_api(api, deadline)
        timings["api_listening"] = time.monotonic()
        self.api_url = f"http://127.0.0.1:{self.api_port}"
        self._write_kubeconfig()

    @property
    def kubeconfig(self) -> Path:
        """A kubeconfig for the lab's API from this machine (``kubectl --kubeconfig``), written by :meth:`up`."""
        return self.state_dir / "kubeconfig"

    def _write_kubeconfig(self) -> None:
        doc = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "kproxy-lab", "cluster": {"server": self.api_url}}],
            "users": [{"name": "kproxy-lab", "user": {}}],
            "contexts": [{"name": "kproxy-lab", "context": {"cluster": "kproxy-lab", "user": "kproxy-lab"}}],
            "current-context": "kproxy-lab",
        }
        tmp = self.kubeconfig.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, indent=2) + "\n")  # JSON is YAML: kubectl and the client read it
        tmp.replace(self.kubeconfig)

    def _mount_cgroups(self) -> None:
        with locked(None):
            netns.mount_cgroup2(CGROUP_MOUNT)
            for node in self.nodes:
                self.cgroup_path(node).mkdir(exist_ok=True)

    def _spawn(
        self,
        key: str,
        argv: list[str],
        log: Path,
        cgroup: Path | None,
        append: bool = False,
        env: dict[str, str] | None = None,
    ) -> subprocess.Popen[bytes]:
        with open(log, "ab" if append else "wb") as out:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                preexec_fn=netns.cgroup_preexec(cgroup),
                start_new_session=True,  # the lab outlives the command that built it
                cwd=str(self.state_dir),
                env=env,
            )
        write_pidfile(self.state_dir, key, proc.pid)
        self._children[key] = proc
        LIVE[proc.pid] = proc
        return proc

    def _start_api(self) -> subprocess.Popen[bytes]:
        port_file = self.state_dir / "api.port"
        port_file.unlink(missing_ok=True)
        argv = [sys.executable, "-m", "kproxy.lab.apiserver", "--listen", "127.0.0.1:0", "--port-file", str(port_file)]
        argv += ["--listen", f"{self.fabric_ns}/198.18.0.1:{API_PORT_IN_LAB}"]
        if self.ipv6:
            argv += ["--listen", f"{self.fabric_ns}/[fd00:198:18::1]:{API_PORT_IN_LAB}"]
        return self._spawn("apiserver", argv, self.state_dir / "apiserver.log", None)

    def _wait_api(self, proc: subprocess.Popen[bytes], deadline: float) -> int:
        port_file = self.state_dir / "api.port"
        while time.monotonic() < deadline:
            if port_file.exists():
                text = port_file.read_text().strip()
                if text.isdigit():
                    return int(text)
            if proc.poll() is not None:
                raise LabError(
                    f"the API stand-in exited ({proc.returncode}):\n{tail(self.state_dir / 'apiserver.log')}"
                )
            time.sleep(0.01)
        raise LabError(f"the API stand-in did not start in time:\n{tail(self.state_dir / 'apiserver.log')}")

    def _start_echo(self, pod: LabPod) -> None:
        ready = self.state_dir / "ready" / pod.name
        ready.unlink(missing_ok=True)
        args = ["--name", pod.name, "--ports", ",".join(map(str, self.echo_ports)), "--ready-file", str(ready)]
        if not self.ipv6:
            args.append("--no-ipv6")
        argv = netns.exec_argv(pod.ns, [*stdlib_module_argv("kproxy.lab.echo"), *args])
        self._spawn(
            f"echo-{pod.name}",
            argv,
            self.state_dir / f"echo-{pod.name}.log",
            self.cgroup_path(pod.node),
            env=module_env(),
        )

    def _wait_pods(self, deadline: float) -> None:
        pending = {p.name for p in self.pods}
        while pending and time.monotonic() < deadline:
            for name in list(pending):
                if (self.state_dir / "ready" / name).exists():
                    pending.discard(name)
                    continue
                proc = self._children.get(f"echo-{name}")
                if proc is not None and proc.poll() is not None:
                    raise LabError(f"echo server of {name} exited:\n{tail(self.state_dir / f'echo-{name}.log')}")
            if pending:
                time.sleep(0.01)
        if pending:
            raise LabError(f"echo servers not ready in time: {sorted(pending)}")

    def _register_nodes(self) -> None:
        from kubernetes import client

        with self.api_client() as api_client:
            core = client.CoreV1Api(api_client)
            for node in self.nodes:
                cidrs = [node.pod_cidr4] + ([node.pod_cidr6] if node.pod_cidr6 else [])
                addresses = [{"type": "InternalIP", "address": node.ip4}]
                if node.ip6:
                    addresses.append({"type": "InternalIP", "address": node.ip6})
                addresses.append({"type": "Hostname", "address": node.name})
                status = {
                    "addresses": addresses,
                    "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}],
                }
                body: dict[str, Any] = {
                    "apiVersion": "v1",
                    "kind": "Node",
                    "metadata": {
                        "name": node.name,
                        "labels": {
                            "kubernetes.io/hostname": node.name,
                            "kubernetes.io/os": "linux",
                            ZONE_LABEL: node.zone,
                            "kproxy.io/lab-namespace": node.ns,
                        },
                    },
                    "spec": {"podCIDR": node.pod_cidr4, "podCIDRs": cidrs},
                    "status": status,
                }
                core.create_node(body=body, _request_timeout=10)  # type: ignore[arg-type]
                # like a real API server the stand-in may ignore status on create: set it through /status as well
                core.patch_node_status(node.name, {"status": status}, _request_timeout=10)

    @classmethod
    def attach(cls, prefix: str | None = None) -> Lab:
        """The running lab, from its state file; LabError if there is none."""
        state_dir = state_dir_for(prefix or cls.PREFIX)
        try:
            state = json.loads((state_dir / "state.json").read_text())
        except FileNotFoundError:
            raise LabError(
                f"no lab is running (no {state_dir / 'state.json'}); start one with `kproxy lab up`"
            ) from None
        except (OSError, ValueError) as e:
            raise LabError(f"unreadable lab state {state_dir / 'state.json'}: {e}") from e
        if not state.get("ready"):
            raise LabError(f"the lab in {state_dir} is not ready (being built, or its build failed)")
        return cls(state)

    @classmethod
    def live(cls, prefix: str | None = None) -> Lab | None:
        """The lab under this prefix if it is someone's running lab (see :func:`lab_is_live`), else None.

        For the commands that would replace a lab (``kproxy lab up``, ``kproxy demo``): they refuse a live one and
        clean up a leftover silently. :meth:`up` itself always replaces whatever is there.
        """
        state_dir = state_dir_for(prefix or cls.PREFIX)
        try:
            state = json.loads((state_dir / "state.json").read_text())
            lab = cls(state)
        except (OSError, ValueError, KeyError, TypeError):
            return None  # no lab, or a record too broken to be anyone's working lab
        owner = state.get("owner") or {}
        owner_alive = bool(owner.get("pid")) and netns.alive(
            int(owner["pid"]), int(owner.get("starttime") or 0) or None
        )
        return lab if lab_is_live(state, bool(lab._pids()), owner_alive) else None

    @classmethod
    def down(cls, prefix: str | None = None, *, keep_logs: bool = False) -> None:
        """Remove everything of the lab with this prefix: processes, namespaces, cgroups, state files and logs
        (``keep_logs`` keeps the ``*.log`` files, for diagnosis; the next :meth:`up` removes them). Idempotent."""
        prefix = prefix or cls.PREFIX
        state_dir = state_dir_for(prefix)
        with locked(state_dir):
            remove_lab(prefix, state_dir, keep_logs=keep_logs)

    def status(self) -> dict[str, Any]:
        pids = self._pids()
        present = set(lab_namespaces(self.prefix))
        return {
            "prefix": self.prefix,
            "state_dir": str(self.state_dir),
            "mode": self.mode,
            "ipv6": self.ipv6,
            "api_url": self.api_url,
            "lab_api_url": self.lab_api_url,
            "api_running": "apiserver" in pids,
            "startup_seconds": self.state.get("startup_seconds"),
            "startup_phases": self.state.get("startup_phases"),
            "external": {"ns": self.external_ns, "ip4": self.external_ip4, "ip6": self.external_ip6},
            "nodes": [
                {
                    **asdict(n),
                    "netns": n.ns in present,
                    "cgroup": str(self.cgroup_path(n)),
                    "kproxy_pid": pids.get(f"kproxy-{n.name}"),
                    "kproxy_mode": self.state.get("kproxy", {}).get(n.name, {}).get("mode"),
                }
                for n in self.nodes
            ],
            "pods": [
                {**asdict(p), "netns": p.ns in present, "echo_pid": pids.get(f"echo-{p.name}")} for p in self.pods
            ],
        }

    def _pids(self) -> dict[str, int]:
        out = {}
        for f in (self.state_dir / "pids").glob("*.pid"):
            rec = read_pidfile(f)
            if rec:
                key = f.name[: -len(".pid")]
                proc = self._children.get(key)
                if proc is not None:
                    proc.poll()  # reap our own dead children, so they do not look alive as zombies
                if netns.alive(rec[0], rec[1] or None):
                    out[key] = rec[0]
        return out

    # --- kproxy ------------------------------------------------------------------------------------------------

    @staticmethod
    def kproxy_command() -> list[str]:
        """How to invoke kproxy (the venv's ``kproxy`` script), e.g. for ``lab.exec(ns, [*cmd, "cleanup"])``."""
        kproxy = _venv_bin("kproxy")
        return [kproxy] if os.access(kproxy, os.X_OK) else [sys.executable, "-m", "kproxy"]

    def node_spec(self, node: LabNode | str) -> LabNodeSpec:
        """What a backend's ``lab_options`` learns about a node: name, namespace, cgroup and a folder of its own."""
        n = node if isinstance(node, LabNode) else self.node(node)
        return LabNodeSpec(n.name, n.ns, self.cgroup_path(n), self.state_dir / "nodes" / n.name)

    def node_options(self, node: LabNode | str, mode: str) -> dict[str, Any]:
        """The backend options a node's kproxy runs with: the lab's (``backend_options``) plus the backend's per-node
        values (``Proxier.lab_options``: e.g. the node's own cgroup and pin folder)."""
        cls = installed_backend(mode)
        if cls is None:
            return {}
        given = {k: v for k, v in self.backend_options.items() if k in {o.name for o in cls.options}}
        return {**given, **cls.lab_options(self.node_spec(node), given)}

    def kproxy_argv(self, node: LabNode, mode: str, extra_args: Sequence[str] = ()) -> list[str]:
        """The full ``kproxy run`` command line for a node (without ``ip netns exec``), with the node's backend
        options (``node_options``) as the backend's flags."""
        cidrs = CLUSTER_CIDR4 + (f",{CLUSTER_CIDR6}" if self.ipv6 else "")
        argv = self.kproxy_command()
        argv += ["run", "--mode", mode, "--master", self.lab_api_url, "--hostname-override", node.name]
        argv += ["--cluster-cidr", cidrs, "--min-sync-period", "0", "--sync-period", "10s"]
        argv += ["--healthz-bind-address", "0.0.0.0:10256", "--metrics-bind-address", "127.0.0.1:10249"]
        cls = installed_backend(mode)
        if cls is not None:
            argv += option_arguments(cls, self.node_options(node, mode))
        return argv + list(extra_args)

    def start_kproxy(self, node: LabNode | str, mode: str, extra_args: Sequence[str] = ()) -> None:
        """Start kproxy in the node's namespace and cgroup (log: <state>/kproxy-node-{i}.log); does not wait."""
        n = node if isinstance(node, LabNode) else self.node(node)
        if self.kproxy_running(n):
            raise LabError(f"kproxy already runs on {n.name}; stop it first")
        native = self.kproxy_argv(n, mode, extra_args)
        # what the node's kproxy needs prepared on the machine (the bpf mode: a bind of bpffs outside /sys)
        cls = installed_backend(mode)
        if cls is not None:
            cls.lab_prepare(self.node_spec(n), self.node_options(n, mode))
        argv = self.launcher.argv(self, n, native) if self.launcher is not None else netns.exec_argv(n.ns, native)
        log = self.state_dir / f"kproxy-{n.name}.log"
        with open(log, "ab") as f:
            f.write(f"--- {time.strftime('%H:%M:%S')} start: {' '.join(argv)}\n".encode())
        self._spawn(f"kproxy-{n.name}", argv, log, self.cgroup_path(n), append=True)
        with locked(self.state_dir):
            state = json.loads((self.state_dir / "state.json").read_text())
            state.setdefault("kproxy", {})[n.name] = {
                "mode": mode,
                "args": list(extra_args),
                "options": self.node_options(n, mode),  # for the cleanup at lab down (pins live outside the node)
            }
            state["mode"] = mode
            write_json(self.state_dir / "state.json", state)
            self.state, self.mode = state, mode

    def stop_kproxy(self, node: LabNode | str, sig: int = signal.SIGTERM, timeout: float = 10) -> None:
        """Signal the node's kproxy and wait for it to exit (SIGKILL after ``timeout``)."""
        n = node if isinstance(node, LabNode) else self.node(node)
        pidfile = self.state_dir / "pids" / f"kproxy-{n.name}.pid"
        rec = read_pidfile(pidfile)
        if rec is None or not netns.alive(rec[0], rec[1] or None):
            pidfile.unlink(missing_ok=True)
            return
        pid = rec[0]
        if self.launcher is not None:  # the signal is for kproxy in its container; the recorded pid is its client's
            self.launcher.kill(self, n, sig)
        else:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._reap(f"kproxy-{n.name}")
            if not netns.alive(pid, rec[1] or None):
                break
            time.sleep(0.02)
        else:
            netns.terminate([pid], grace=0)
        self._reap(f"kproxy-{n.name}")
        pidfile.unlink(missing_ok=True)

    def wait_kproxy(self, node: LabNode | str, timeout: float = 30.0) -> None:
        """Wait until the node's kproxy answers 200 on :10256/healthz (it has synced); LabError with its log if it
        exits or does not get there within ``timeout`` seconds."""
        n = node if isinstance(node, LabNode) else self.node(node)
        deadline = time.monotonic() + timeout
        last: ProbeResult | None = None
        while time.monotonic() < deadline:
            if not self.kproxy_running(n):
                tail = "\n".join(self.kproxy_log(n).splitlines()[-15:])
                raise LabError(f"kproxy on {n.name} is not running; its log ends with:\n{tail}")
            last = self.probe_http(n.ns, "http://127.0.0.1:10256/healthz", timeout=1.0)
            if last.status == 200:
                return
            time.sleep(0.1)
        raise LabError(f"kproxy on {n.name} not healthy after {timeout}s (last: {last})")

    def wait_all(self, timeout: float = 30.0) -> None:
        """:meth:`wait_kproxy` for every node (one shared deadline)."""
        deadline = time.monotonic() + timeout
        for n in self.nodes:
            self.wait_kproxy(n, max(0.1, deadline - time.monotonic()))

    def _reap(self, key: str) -> None:
        proc = self._children.get(key)
        if proc is not None and proc.poll() is not None:
            del self._children[key]
            reap_live({proc.pid})

    def start_all(self, mode: str, extra_args: Sequence[str] = ()) -> None:
        for n in self.nodes:
            self.start_kproxy(n, mode, extra_args)

    def stop_all(self, sig: int = signal.SIGTERM, timeout: float = 10) -> None:
        for n in self.nodes:
            self.stop_kproxy(n, sig, timeout)

    def kproxy_running(self, node: LabNode | str) -> bool:
        n = node if isinstance(node, LabNode) else self.node(node)
        self._reap(f"kproxy-{n.name}")
        rec = read_pidfile(self.state_dir / "pids" / f"kproxy-{n.name}.pid")
        return rec is not None and netns.alive(rec[0], rec[1] or None)

    def kproxy_pid(self, node: LabNode | str) -> int | None:
        n = node if isinstance(node, LabNode) else self.node(node)
        rec = read_pidfile(self.state_dir / "pids" / f"kproxy-{n.name}.pid")
        return rec[0] if rec and netns.alive(rec[0], rec[1] or None) else None

    def kproxy_log(self, node: LabNode | str) -> str:
        n = node if isinstance(node, LabNode) else self.node(node)
        try:
            return (self.state_dir / f"kproxy-{n.name}.log").read_text(errors="replace")
        except FileNotFoundError:
            return ""
