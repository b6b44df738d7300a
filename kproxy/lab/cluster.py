"""The lab: a Kubernetes-like cluster made of network namespaces, for the conformance suite of every backend.

Used by ``kproxy lab`` (kproxy.lab.cli), by the conformance runner and scenarios (kproxy.conformance), by the
benchmarks and by tests/integration/test_lab.py. One lab exists at a time per prefix; its state lives in
/run/kproxy-lab/state.json so another process can :meth:`Lab.attach` to it.

Topology (fixed names and addresses others rely on; prefix "kpl-"):

* fabric namespace ``kpl-fabric`` with bridge ``kpl-br0`` (198.18.0.1/24, fd00:198:18::1/64): the API stand-in
  listens there on port 6443;
* node i (1-based) ``kpl-n{i}``: ``eth0`` 198.18.0.{10+i}/24, fd00:198:18::{10+i}/64 on the fabric; pod bridge
  ``cbr0`` 198.18.{64+i}.1/24, fd00:198:18:{64+i}::1/64; routes to the other nodes' pod CIDRs via their fabric
  addresses; a default route via the external client (so a packet to a VIP without rules reaches the netfilter
  hooks instead of failing routing, and "no endpoints -> refused" is observable); ip forwarding, the
  bridge-nf-call sysctls, and its own cgroup ``kpl-n{i}`` in a lab-owned cgroup2 mount;
* pod j on node i: namespace ``kpl-n{i}-p{j}``, pod ``pod-{i}-{j}``, 198.18.{64+i}.{10+j}/24 and
  fd00:198:18:{64+i}::{10+j}/64, default routes via cbr0, hairpin on its bridge port, running
  ``python -m kproxy.lab.echo`` (kproxy.lab.echo) inside the node's cgroup;
* external client ``kpl-ext``: 198.18.0.2/24, fd00:198:18::2/64, routes to the service ranges via node 1.

Nothing is configured in the machine's own namespace and no lab namespace is wired to it: the only link between
the two is the API stand-in process, which opens listening sockets inside the fabric namespace and on 127.0.0.1.

Processes are recorded as pid files (pid plus start time, so a recycled pid is never signalled) as soon as they are
started; :meth:`Lab.down` ends them by pid file, by the namespaces they are in, by the cgroups they are in and by a
command line naming the state directory, so even a lab whose runner was killed with SIGKILL is removed completely.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import ipaddress
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kproxy.config import ProxyConfig
from kproxy.lab import netns
from kproxy.lab.echo import DEFAULT_PORTS
from kproxy.lab.probe import ProbeResult, build_argv
from kproxy.proxier import DEFAULT_MODE, BackendError, LabNodeSpec, Proxier, backend_class, option_arguments

log = logging.getLogger(__name__)

STATE_ROOT = Path("/run/kproxy-lab")
CGROUP_MOUNT = STATE_ROOT / "cgroup2"
CLUSTER_CIDR4 = "198.18.64.0/18"
CLUSTER_CIDR6 = "fd00:198:18:40::/58"
SERVICE_ROUTES4 = ("198.19.0.0/16",)
# fd00:198:18:ff::/64 is where the tests allocate ClusterIPs; fd00:198:18:ffff::/64 holds the API stand-in's own
# default allocation range, routed too so an automatically allocated IPv6 ClusterIP is as reachable as a chosen one.
SERVICE_ROUTES6 = ("fd00:198:18:ff::/64", "fd00:198:18:ffff::/64")
API_PORT_IN_LAB = 6443
MAX_NODES = 15  # fd00:198:18:{64+i}:: must stay inside fd00:198:18:40::/58 (hex 40..7f)
MAX_PODS_PER_NODE = 200
ZONE_LABEL = "topology.kubernetes.io/zone"


# Every process the lab starts in this interpreter, by pid: the lab outlives the objects that started it, and a
# Popen dropped while its process runs would warn (ResourceWarning) when collected; down() reaps them from here.
_LIVE: dict[int, subprocess.Popen[bytes]] = {}


def _reap_live(pids: set[int] | None = None) -> None:
    for pid, proc in list(_LIVE.items()):
        if (pids is None or pid in pids) and proc.poll() is not None:
            del _LIVE[pid]


class LabError(RuntimeError):
    """The lab could not be built, found or used; the message says what and where to look."""


@dataclass(frozen=True)
class LabNode:
    index: int
    name: str
    ns: str
    ip4: str
    ip6: str
    pod_cidr4: str
    pod_cidr6: str
    zone: str


@dataclass(frozen=True)
class LabPod:
    name: str
    ns: str
    node: str  # the LabNode's name ("node-1")
    ip4: str
    ip6: str


# --- the plan: pure, so names and addresses can be checked without root -------------------------------------------


@dataclass(frozen=True)
class Plan:
    prefix: str
    ipv6: bool
    fabric_ns: str
    bridge: str
    external_ns: str
    external_ip4: str
    external_ip6: str
    nodes: tuple[LabNode, ...]
    pods: tuple[LabPod, ...]

    def namespaces(self) -> list[str]:
        return [self.fabric_ns, self.external_ns, *(n.ns for n in self.nodes), *(p.ns for p in self.pods)]


def check_prefix(prefix: str) -> str:
    """The prefix if valid, else LabError: one word and a dash, so no lab's prefix is the start of another's and
    ``down`` of one (which removes every namespace starting with its prefix) never touches the other."""
    if not re.fullmatch(r"[a-z][a-z0-9]{1,8}-", prefix):
        raise LabError(f"invalid lab prefix {prefix!r}: want a short lower-case word and a dash, like 'kpl-'")
    return prefix


def make_plan(nodes: int, pods_per_node: int, ipv6: bool = True, prefix: str = "kpl-") -> Plan:
    if not 1 <= nodes <= MAX_NODES:
        raise LabError(f"nodes must be 1..{MAX_NODES}, not {nodes}")
    if not 0 <= pods_per_node <= MAX_PODS_PER_NODE:
        raise LabError(f"pods_per_node must be 0..{MAX_PODS_PER_NODE}, not {pods_per_node}")
    check_prefix(prefix)
    lab_nodes, lab_pods = [], []
    cluster4, cluster6 = ipaddress.IPv4Network(CLUSTER_CIDR4), ipaddress.IPv6Network(CLUSTER_CIDR6)
    for i in range(1, nodes + 1):
        cidr4, cidr6 = f"198.18.{64 + i}.0/24", f"fd00:198:18:{64 + i}::/64"
        # the pod CIDRs must fall inside --cluster-cidr, or every backend's local-traffic detection is wrong
        if not ipaddress.IPv4Network(cidr4).subnet_of(cluster4) or not ipaddress.IPv6Network(cidr6).subnet_of(cluster6):
            raise LabError(f"pod CIDRs of node {i} fall outside the cluster CIDRs")
        node = LabNode(
            index=i,
            name=f"node-{i}",
            ns=f"{prefix}n{i}",
            ip4=f"198.18.0.{10 + i}",
            ip6=f"fd00:198:18::{10 + i}" if ipv6 else "",
            pod_cidr4=cidr4,
            pod_cidr6=cidr6 if ipv6 else "",
            zone="zone-a" if i % 2 else "zone-b",
        )
        lab_nodes.append(node)
        for j in range(1, pods_per_node + 1):
            lab_pods.append(
                LabPod(
                    name=f"pod-{i}-{j}",
                    ns=f"{prefix}n{i}-p{j}",
                    node=node.name,
                    ip4=f"198.18.{64 + i}.{10 + j}",
                    ip6=f"fd00:198:18:{64 + i}::{10 + j}" if ipv6 else "",
                )
            )
    return Plan(
        prefix=prefix,
        ipv6=ipv6,
        fabric_ns=f"{prefix}fabric",
        bridge=f"{prefix}br0",
        external_ns=f"{prefix}ext",
        external_ip4="198.18.0.2",
        external_ip6="fd00:198:18::2" if ipv6 else "",
        nodes=tuple(lab_nodes),
        pods=tuple(lab_pods),
    )


def fabric_batch(plan: Plan) -> list[str]:
    br = plan.bridge
    lines = ["link set lo up", f"link add name {br} type bridge mcast_snooping 0", f"addr add 198.18.0.1/24 dev {br}"]
    if plan.ipv6:
        lines.append(f"addr add fd00:198:18::1/64 dev {br} nodad")
    lines.append(f"link set {br} up")
    for port, peer_ns in [(f"n{n.index}", n.ns) for n in plan.nodes] + [("ext", plan.external_ns)]:
        lines += [
            f"link add name {port} type veth peer name eth0 netns {peer_ns}",
            f"link set {port} master {br}",
            f"link set {port} up",
        ]
    return lines


def node_batch(plan: Plan, node: LabNode) -> list[str]:
    i = node.index
    lines = ["link set lo up", "link set eth0 up", f"addr add {node.ip4}/24 dev eth0"]
    lines += ["link add name cbr0 type bridge mcast_snooping 0", f"addr add 198.18.{64 + i}.1/24 dev cbr0"]
    if plan.ipv6:
        lines += [f"addr add {node.ip6}/64 dev eth0 nodad", f"addr add fd00:198:18:{64 + i}::1/64 dev cbr0 nodad"]
    lines.append("link set cbr0 up")
    for j, pod in enumerate(p for p in plan.pods if p.node == node.name):
        port = f"veth{j + 1}"
        lines += [
            f"link add name {port} type veth peer name eth0 netns {pod.ns}",
            f"link set {port} master cbr0",
            # as kubelet's hairpin-veth: without it a pod reaching itself through its service times out
            f"link set {port} type bridge_slave hairpin on",
            f"link set {port} up",
        ]
    for other in plan.nodes:
        if other is not node:
            lines.append(f"route add {other.pod_cidr4} via {other.ip4}")
            if plan.ipv6:
                lines.append(f"route add {other.pod_cidr6} via {other.ip6}")
    lines.append(f"route add default via {plan.external_ip4}")
    if plan.ipv6:
        lines.append(f"route add ::/0 via {plan.external_ip6}")
    return lines


def pod_batch(plan: Plan, node: LabNode, pod: LabPod) -> list[str]:
    lines = ["link set lo up", "link set eth0 up", f"addr add {pod.ip4}/24 dev eth0"]
    lines.append(f"route add default via 198.18.{64 + node.index}.1")
    if plan.ipv6:
        lines += [f"addr add {pod.ip6}/64 dev eth0 nodad", f"route add ::/0 via fd00:198:18:{64 + node.index}::1"]
    return lines


def external_batch(plan: Plan) -> list[str]:
    first = plan.nodes[0]
    lines = ["link set lo up", "link set eth0 up", f"addr add {plan.external_ip4}/24 dev eth0"]
    lines += [f"route add {r} via {first.ip4}" for r in SERVICE_ROUTES4]
    if plan.ipv6:
        lines.append(f"addr add {plan.external_ip6}/64 dev eth0 nodad")
        lines += [f"route add {r} via {first.ip6}" for r in SERVICE_ROUTES6]
    return lines


NO_DAD_SYSCTLS: dict[str, str | int] = {
    "net.ipv6.conf.all.accept_dad": 0,
    "net.ipv6.conf.default.accept_dad": 0,
}

NODE_SYSCTLS: dict[str, str | int] = {
    "net.ipv4.ip_forward": 1,
    "net.ipv6.conf.all.forwarding": 1,
    "net.ipv6.conf.all.accept_dad": 0,
    "net.ipv6.conf.default.accept_dad": 0,
    # replies between two pods on one bridge must pass conntrack to be un-DNATed (HOST.md)
    "net.bridge.bridge-nf-call-iptables": 1,
    "net.bridge.bridge-nf-call-ip6tables": 1,
    # Service traffic from the external client enters and leaves node 1 on one link; ICMP redirects for it share
    # the per-host ICMP rate limit with the port-unreachables a proxy sends, which then get rate-limited away.
    "net.ipv4.conf.all.send_redirects": 0,
    "net.ipv4.conf.default.send_redirects": 0,
}


def lab_is_live(state: dict[str, Any] | None, processes_alive: bool, owner_alive: bool) -> bool:
    """Whether a recorded lab is someone's running lab (to be left alone) rather than a leftover (to be cleaned).

    A lab is live when any process it started still runs and it is either ready or still being built by a process
    that is alive. A lab whose processes are all gone (killed, crashed) or whose build was abandoned half-way (its
    builder died) is a leftover, which the next ``up`` and ``down`` remove silently.
    """
    if state is None or not processes_alive:
        return False
    return bool(state.get("ready")) or owner_alive


# --- state on disk ----------------------------------------------------------------------------------------------


def state_dir_for(prefix: str) -> Path:
    check_prefix(prefix)  # every lookup of a lab goes through here, `down` included
    return STATE_ROOT if prefix == Lab.PREFIX else STATE_ROOT / "prefix" / prefix.rstrip("-")


@contextlib.contextmanager
def _locked(state_dir: Path | None) -> Iterator[None]:
    """Serialise up/down/state writes between processes (a conformance runner and a `kproxy lab` typed meanwhile).

    One lock per lab; ``None`` is the lock for the cgroup2 mount, which every prefix's lab shares.
    """
    STATE_ROOT.mkdir(parents=True, exist_ok=True)
    lock = STATE_ROOT / (f".lock-{state_dir.name}" if state_dir is not None else ".lock-cgroup2")
    fd = os.open(lock, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)


def _write_pidfile(state_dir: Path, key: str, pid: int) -> None:
    d = state_dir / "pids"
    d.mkdir(parents=True, exist_ok=True)
    st = netns.proc_starttime(pid)
    (d / f"{key}.pid").write_text(f"{pid} {st if st is not None else 0}\n")


def _read_pidfile(path: Path) -> tuple[int, int] | None:
    try:
        pid, st = path.read_text().split()[:2]
        return int(pid), int(st)
    except (OSError, ValueError):
        return None


def stdlib_module_argv(module: str) -> list[str]:
    """Run one of the lab's standard-library-only modules (echo, probe) as fast as Python starts: ``-S`` skips
    site-packages (a few dozen milliseconds per probe), so the package is found through PYTHONPATH (:func:`_env`)."""
    return [sys.executable, "-S", "-m", module]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    root = str(Path(__file__).parent.parent.parent)  # the folder holding the kproxy package
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _backend(mode: str) -> type[Proxier] | None:
    """The installed backend of ``mode``, None when it is missing or broken (kproxy run itself says so in its log)."""
    try:
        return backend_class(mode)
    except BackendError:
        return None


def _cleanup_node(ns: str, record: Mapping[str, Any]) -> None:
    """Remove what a node's kproxy left outside the node's namespace (pins, cgroup attachments: bpffs and cgroups are
    shared by the machine), with the options the node ran with; the namespace's own rules go with the namespace."""
    mode = str(record.get("mode") or "")
    cls = _backend(mode) if mode else None
    if cls is None:
        return
    try:
        cls.cleanup_leftovers(ProxyConfig(mode=mode, backend_options=dict(record.get("options") or {})), netns=ns)
    except Exception as exc:  # best effort: the namespace goes anyway
        log.warning("lab down: cleaning up %s of %s failed: %s", mode, ns, exc)


def _venv_bin(name: str) -> str:
    cand = Path(sys.executable).parent / name
    return str(cand)


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


# --- the lab ----------------------------------------------------------------------------------------------------


class Lab:
    """A running lab (see the module docstring). Build with :meth:`up`, find from elsewhere with :meth:`attach`."""

    PREFIX = "kpl-"
    # How kproxy is started and signalled on a node: None runs it natively (``ip netns exec``); a
    # kproxy.lab.container.ContainerLauncher runs it in the kproxy image, as its DaemonSet would (tests/integration/
    # test_image.py). It has ``argv(lab, node, kproxy_argv) -> argv`` and ``kill(lab, node, sig)``.
    launcher: Any = None

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
        # importing the kubernetes client's CoreV1Api takes seconds (pydantic models): do it while the kernel work
        # and the processes start
        prefetch = threading.Thread(
            target=importlib.import_module, args=("kubernetes.client.api.core_v1_api",), daemon=True
        )
        prefetch.start()
        cls.down(prefix=prefix)
        timings = {"stale_lab_removed": time.monotonic()}
        deadline = t0 + timeout
        with _locked(state_dir):
            state_dir.mkdir(parents=True, exist_ok=True)
            for old_log in state_dir.glob("*.log"):  # kept by down() for diagnosis, but they belong to the old lab
                old_log.unlink(missing_ok=True)
            for sub in ("pids", "ready"):
                (state_dir / sub).mkdir(exist_ok=True)
            state: dict[str, Any] = {
                "version": 1,
                "prefix": prefix,
                "state_dir": str(state_dir),
                "ipv6": ipv6,
                "mode": mode,
                "kproxy_args": list(kproxy_args),
                "fabric_ns": plan.fabric_ns,
                "bridge": plan.bridge,
                "external_ns": plan.external_ns,
                "external_ip4": plan.external_ip4,
                "external_ip6": plan.external_ip6,
                "nodes": [asdict(n) for n in plan.nodes],
                "pods": [asdict(p) for p in plan.pods],
                "api_port": 0,
                "echo_ports": list(echo_ports),
                "backend_options": dict(backend_options or {}),
                "created": time.time(),
                # the process building it: a lab not ready yet is "being built" only while this one lives
                "owner": {"pid": os.getpid(), "starttime": netns.proc_starttime(os.getpid()) or 0},
                "ready": False,
            }
            # written first, so a run killed half-way still leaves a record for `down`
            _write_json(state_dir / "state.json", state)
            lab = cls(state)
            try:
                lab._build(plan, deadline, timings)
                state["api_port"] = lab.api_port
                lab.state = state
                _write_json(state_dir / "state.json", state)
                lab._register_nodes()
                timings["nodes_registered"] = time.monotonic()
                lab._wait_pods(deadline)
                timings["pods_ready"] = time.monotonic()
                state["ready"] = True
                state["startup_seconds"] = round(time.monotonic() - t0, 3)
                state["startup_phases"] = {k: round(v - t0, 3) for k, v in timings.items()}
                _write_json(state_dir / "state.json", state)
            except BaseException as e:
                lab._children.clear()
                # keep the logs for diagnosis; everything else goes, so a failed start leaves nothing behind
                try:
                    cls._down_locked(prefix, state_dir, keep_logs=True)
                except Exception as cleanup_error:
                    e.add_note(f"and removing the half-built lab failed too: {cleanup_error}")
                if isinstance(e, netns.NetnsError):
                    raise LabError(f"building the lab failed: {e}") from e
                raise
        if mode is not None:
            try:
                lab.start_all(mode, kproxy_args)
            except BaseException:
                lab._children.clear()
                cls.down(prefix=prefix, keep_logs=True)  # a lab that could not start its kproxy is not left behind
                raise
        return lab

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
        with _locked(None):
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
        _write_pidfile(self.state_dir, key, proc.pid)
        self._children[key] = proc
        _LIVE[proc.pid] = proc
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
                    f"the API stand-in exited ({proc.returncode}):\n{_tail(self.state_dir / 'apiserver.log')}"
                )
            time.sleep(0.01)
        raise LabError(f"the API stand-in did not start in time:\n{_tail(self.state_dir / 'apiserver.log')}")

    def _start_echo(self, pod: LabPod) -> None:
        ready = self.state_dir / "ready" / pod.name
        ready.unlink(missing_ok=True)
        args = ["--name", pod.name, "--ports", ",".join(map(str, self.echo_ports)), "--ready-file", str(ready)]
        if not self.ipv6:
            args.append("--no-ipv6")
        argv = netns.exec_argv(pod.ns, [*stdlib_module_argv("kproxy.lab.echo"), *args])
        self._spawn(
            f"echo-{pod.name}", argv, self.state_dir / f"echo-{pod.name}.log", self.cgroup_path(pod.node), env=_env()
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
                    raise LabError(f"echo server of {name} exited:\n{_tail(self.state_dir / f'echo-{name}.log')}")
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
        with _locked(state_dir):
            cls._down_locked(prefix, state_dir, keep_logs=keep_logs)

    @staticmethod
    def _down_locked(prefix: str, state_dir: Path, keep_logs: bool = False) -> None:
        names = netns.list_netns(prefix)
        pids: set[int] = set()
        pid_dir = state_dir / "pids"
        if pid_dir.is_dir():
            for f in pid_dir.glob("*.pid"):
                rec = _read_pidfile(f)
                if rec and netns.alive(rec[0], rec[1] or None):
                    pids.add(rec[0])
        for found in netns.netns_pids(names).values():
            pids |= found
        cgroups = [d for d in CGROUP_MOUNT.glob(f"{prefix}n*") if d.is_dir()] if CGROUP_MOUNT.is_dir() else []
        for cg in cgroups:
            pids |= netns.cgroup_procs(cg)
        # the API stand-in lives in the machine's namespace: if its pid file was lost, find it by its --port-file
        pids |= netns.pids_with_arg(str(state_dir / "api.port"))
        if state_dir != STATE_ROOT:
            pids |= netns.pids_with_arg(str(state_dir) + "/")
        left = netns.terminate(pids)
        _reap_live()
        if left:
            raise LabError(f"lab processes would not die: {sorted(left)}")
        try:
            old = json.loads((state_dir / "state.json").read_text())
        except (OSError, ValueError):
            old = {}
        node_ns = {n.get("name"): n.get("ns") for n in old.get("nodes") or [] if isinstance(n, dict)}
        for node_name, record in (old.get("kproxy") or {}).items():
            ns = node_ns.get(node_name)
            if ns in names and isinstance(record, dict):
                _cleanup_node(str(ns), record)
        netns.delete_netns(names)
        for cg in cgroups:
            netns.remove_cgroup(cg)
        # one cgroup2 mount serves every prefix's lab: unmount it only when no other lab is recorded
        other_labs = [
            p for p in [STATE_ROOT / "state.json", *STATE_ROOT.glob("prefix/*/state.json")] if p.parent != state_dir
        ]
        with _locked(None):
            if netns.is_cgroup2_mount(CGROUP_MOUNT) and not [p for p in other_labs if p.exists()]:
                netns.umount(CGROUP_MOUNT)
        for sub in ("pids", "ready"):
            d = state_dir / sub
            if d.is_dir():
                for f in d.iterdir():
                    f.unlink(missing_ok=True)
                with contextlib.suppress(OSError):
                    d.rmdir()
        for fname in ("state.json", "state.json.tmp", "api.port", "kubeconfig", "kubeconfig.tmp"):
            (state_dir / fname).unlink(missing_ok=True)
        if not keep_logs and state_dir.is_dir():
            for log in state_dir.glob("*.log"):
                log.unlink(missing_ok=True)
        if state_dir != STATE_ROOT:
            # a second lab's own folder goes once empty; /run/kproxy-lab stays (locks, the cgroup2 mount point)
            with contextlib.suppress(OSError):
                state_dir.rmdir()
        still = netns.list_netns(prefix)
        if still:
            raise LabError(f"lab namespaces could not be removed: {still}")

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

    def status(self) -> dict[str, Any]:
        pids = self._pids()
        present = set(netns.list_netns(self.prefix))
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
            rec = _read_pidfile(f)
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
        cls = _backend(mode)
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
        cls = _backend(mode)
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
        prepare = getattr(_backend(mode), "lab_prepare", None)
        if prepare is not None:
            prepare(self.node_spec(n), self.node_options(n, mode))
        argv = self.launcher.argv(self, n, native) if self.launcher is not None else netns.exec_argv(n.ns, native)
        log = self.state_dir / f"kproxy-{n.name}.log"
        with open(log, "ab") as f:
            f.write(f"--- {time.strftime('%H:%M:%S')} start: {' '.join(argv)}\n".encode())
        self._spawn(f"kproxy-{n.name}", argv, log, self.cgroup_path(n), append=True)
        with _locked(self.state_dir):
            state = json.loads((self.state_dir / "state.json").read_text())
            state.setdefault("kproxy", {})[n.name] = {
                "mode": mode,
                "args": list(extra_args),
                "options": self.node_options(n, mode),  # for the cleanup at lab down (pins live outside the node)
            }
            state["mode"] = mode
            _write_json(self.state_dir / "state.json", state)
            self.state, self.mode = state, mode

    def stop_kproxy(self, node: LabNode | str, sig: int = signal.SIGTERM, timeout: float = 10) -> None:
        """Signal the node's kproxy and wait for it to exit (SIGKILL after ``timeout``)."""
        n = node if isinstance(node, LabNode) else self.node(node)
        pidfile = self.state_dir / "pids" / f"kproxy-{n.name}.pid"
        rec = _read_pidfile(pidfile)
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
            _reap_live({proc.pid})

    def start_all(self, mode: str, extra_args: Sequence[str] = ()) -> None:
        for n in self.nodes:
            self.start_kproxy(n, mode, extra_args)

    def stop_all(self, sig: int = signal.SIGTERM, timeout: float = 10) -> None:
        for n in self.nodes:
            self.stop_kproxy(n, sig, timeout)

    def kproxy_running(self, node: LabNode | str) -> bool:
        n = node if isinstance(node, LabNode) else self.node(node)
        self._reap(f"kproxy-{n.name}")
        rec = _read_pidfile(self.state_dir / "pids" / f"kproxy-{n.name}.pid")
        return rec is not None and netns.alive(rec[0], rec[1] or None)

    def kproxy_pid(self, node: LabNode | str) -> int | None:
        n = node if isinstance(node, LabNode) else self.node(node)
        rec = _read_pidfile(self.state_dir / "pids" / f"kproxy-{n.name}.pid")
        return rec[0] if rec and netns.alive(rec[0], rec[1] or None) else None

    def kproxy_log(self, node: LabNode | str) -> str:
        n = node if isinstance(node, LabNode) else self.node(node)
        try:
            return (self.state_dir / f"kproxy-{n.name}.log").read_text(errors="replace")
        except FileNotFoundError:
            return ""

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
            env=_env(),
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
            env=_env(),
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
            env=_env(),
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
