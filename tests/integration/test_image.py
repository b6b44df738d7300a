"""The container image, built here and run the way the DaemonSet runs it (issue 14).

The image is built with ``scripts/image.sh`` (what ``make image`` runs; quick when it is up to date). A lab under
its own prefix (``kpi-``, or ``KPROXY_IMAGE_LAB_PREFIX``) then runs each node's kproxy as a container of that image
(kproxy.lab.container.ContainerLauncher through ``Lab.launcher``): in the node's network namespace, with exactly
the capabilities, mounts, user, read-only root filesystem and security settings of the mode's rendered overlay
(``kubectl kustomize deploy/overlays/<mode>``). For every installed and available mode that has an overlay, the
conformance scenarios ``clusterip-tcp``, ``nodeport``, ``servers`` and ``restart`` must pass with kproxy inside the
image (``restart`` SIGKILLs the container's kproxy and starts a new container), then the running containers are
checked against the overlay, and node-2, which is set up as a node on legacy iptables (kubelet's canary chain in
the legacy tables, as on such nodes), must be programmed in the node's own flavour (iptables mode) or be cleared
of a leftover in it (other modes): that is what needs NET_RAW.

``KPROXY_IMAGE_DROP_CAPS=NET_RAW`` runs the same with a capability fewer than the overlay grants, to show that
each one is needed (the tests must then fail); ``KPROXY_IMAGE_ADD_CAPS=BPF,PERFMON`` adds some, to try a narrower
set in place of a dropped one (deploy/README.md has what each try gave). ``KPROXY_IMAGE_MODES=iptables`` restricts
the modes.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from kproxy.conformance.context import Context
from kproxy.conformance.registry import Scenario
from kproxy.conformance.report import FAIL, NOT_APPLICABLE, PASS
from kproxy.conformance.runner import Session
from kproxy.conformance.scenarios import BY_ID
from kproxy.lab import netns
from kproxy.lab.cluster import CLUSTER_CIDR4, CLUSTER_CIDR6, Lab, LabNode
from kproxy.lab.container import CREDENTIALS_DIR, OVERLAYS, ContainerLauncher, PodSpec, pod_spec, render_overlay
from kproxy.proxier import availability, backend_class, installed_backends

pytestmark = [pytest.mark.root, pytest.mark.lab]

ROOT = Path(__file__).resolve().parents[2]
PREFIX = os.environ.get("KPROXY_IMAGE_LAB_PREFIX") or "kpi-"
DROP_CAPS = tuple(c.strip().upper() for c in os.environ.get("KPROXY_IMAGE_DROP_CAPS", "").split(",") if c.strip())
ADD_CAPS = tuple(c.strip().upper() for c in os.environ.get("KPROXY_IMAGE_ADD_CAPS", "").split(",") if c.strip())
SCENARIOS = ("clusterip-tcp", "nodeport", "servers", "restart")
CHECKS = (*SCENARIOS, "privileges", "legacy-node", "connected-udp")
# Modes that translate at the socket (connect4): a connected UDP socket keeps the backend it was translated to, so
# kproxy must end it when that backend goes (backends/bpf/sockets.py). The netfilter modes re-translate every
# datagram once the stale conntrack entry is deleted; the userspace proxy relays each datagram itself.
CONNECTED_UDP_MODES = ("bpf",)
LAB_API_URL = "http://198.18.0.1:6443"  # the API stand-in as the lab's nodes reach it (Lab.lab_api_url)
LEGACY_NODE = "node-2"
READY_TIMEOUT_S = 150.0
# Linux capability numbers (uapi/linux/capability.h) of the names overlays use.
CAP_BITS = {
    "CHOWN": 0,
    "DAC_OVERRIDE": 1,
    "FOWNER": 3,
    "KILL": 5,
    "SETGID": 6,
    "SETUID": 7,
    "NET_BIND_SERVICE": 10,
    "NET_BROADCAST": 11,
    "NET_ADMIN": 12,
    "NET_RAW": 13,
    "IPC_LOCK": 14,
    "SYS_MODULE": 16,
    "SYS_PTRACE": 19,
    "SYS_ADMIN": 21,
    "SYS_RESOURCE": 24,
    "PERFMON": 38,
    "BPF": 39,
}


def _modes() -> list[str]:
    wanted = [m.strip() for m in os.environ.get("KPROXY_IMAGE_MODES", "").split(",") if m.strip()]
    modes = [m for m in installed_backends() if (OVERLAYS / m).is_dir()]
    return [m for m in modes if m in wanted] if wanted else modes


MODES = _modes()


def _declared_not_applicable(mode: str) -> set[str]:
    """Scenarios the mode itself declares impossible (a relaying proxy's restart): judged by the mode's own
    conformance run as not applicable, never run in the image."""
    try:
        cls = backend_class(mode)
        return set(cls.not_applicable(cls.option_values({})))
    except Exception:  # a mode that cannot load is skipped with its reason in the test
        return set()


CASES = [
    (m, c)
    for m in MODES
    for c in CHECKS
    if c not in _declared_not_applicable(m) and (c != "connected-udp" or m in CONNECTED_UDP_MODES)
]


def _tools_missing() -> list[str]:
    return [t for t in ("podman", "buildah", "mmdebstrap", "runc", "kubectl") if shutil.which(t) is None]


@pytest.fixture(scope="module")
def image() -> str:
    if os.geteuid() != 0:
        pytest.skip("building and running the image needs root")
    missing = _tools_missing()
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed (make setup)")
    out = subprocess.run(
        ["bash", str(ROOT / "scripts" / "image.sh")], capture_output=True, text=True, timeout=1500, check=False
    )
    assert out.returncode == 0, f"scripts/image.sh failed:\n{out.stderr[-3000:]}"
    return out.stdout.strip().splitlines()[-1]


def _ipt(lab: Lab, node: Any, tool: str, *args: str) -> subprocess.CompletedProcess[bytes]:
    wait = [] if tool.endswith("-save") else ["-w", "5"]
    return lab.exec(node.ns, [tool, *wait, *args], timeout=30, no_cgroup=True)


class ImageLab:
    """One lab for the module; the mode's kproxy containers and conformance session, switched per mode."""

    def __init__(self, lab: Lab, launcher: ContainerLauncher) -> None:
        self.lab = lab
        self.launcher = launcher
        self.mode: str | None = None
        self.session: Session | None = None
        self.error: str | None = None

    def get(self, mode: str) -> Session:
        if mode != self.mode:
            self.lab.stop_all()
            self.mode, self.session, self.error = mode, None, None
            try:
                if mode != "iptables":
                    # what an iptables kproxy (or kube-proxy) left on a legacy node: the mode must remove it
                    legacy = self.lab.node(LEGACY_NODE)
                    _ipt(self.lab, legacy, "iptables-legacy", "-t", "nat", "-N", "KUBE-SERVICES")
                    _ipt(self.lab, legacy, "iptables-legacy", "-t", "nat", "-I", "PREROUTING", "-j", "KUBE-SERVICES")
                session = Session(mode, self.lab)
                # prepare() with a longer wait: bcc compiles the bpf mode's programs at start, which took over the
                # session's 40 s on this 2-core machine under other work
                for node in self.lab.nodes:
                    self.lab.start_kproxy(node, mode, session.kproxy_args)
                session.wait_ready(timeout=READY_TIMEOUT_S)
                self.session = session
            except Exception as exc:  # every check of the mode reports it
                self.error = f"kproxy --mode {mode} in the image did not come up: {type(exc).__name__}: {exc}"
                self.error += "\n" + "\n".join(f"{n.name}: {self.lab.kproxy_log(n)[-1500:]}" for n in self.lab.nodes)
        if self.error is not None:
            pytest.fail(self.error, pytrace=False)
        assert self.session is not None
        return self.session


@pytest.fixture(scope="module")
def image_lab(image: str) -> Iterator[ImageLab]:
    # the overlays with the values of the user's cluster filled in (kproxy refuses the shipped placeholders); the
    # lab's own flags (--master, --kubeconfig, --cluster-cidr) name the same values again
    specs = {m: _user_spec(m, LAB_API_URL) for m in MODES}
    launcher = ContainerLauncher(image, drop_caps=DROP_CAPS, specs=specs)
    launcher.close(PREFIX)  # containers of a killed earlier run
    lab = Lab.up(nodes=2, pods_per_node=3, mode=None, ipv6=True, prefix=PREFIX)
    assert lab.lab_api_url == LAB_API_URL, lab.lab_api_url
    lab.launcher = launcher
    try:
        # node-2 is a node on legacy iptables: kubelet's canary in the legacy tables is what tells the flavour
        legacy = lab.node(LEGACY_NODE)
        for tool in ("iptables-legacy", "ip6tables-legacy"):
            res = _ipt(lab, legacy, tool, "-t", "mangle", "-N", "KUBE-KUBELET-CANARY")
            assert res.returncode == 0, res.stderr.decode(errors="replace")
        yield ImageLab(lab, launcher)
    finally:
        try:
            lab.stop_all(timeout=10)
        finally:
            launcher.close(PREFIX)
            Lab.down(prefix=PREFIX)


def test_image_is_built_and_labelled(image: str) -> None:
    """The image exists, says what it is (OCI labels and annotations) and which user it runs as."""
    out = subprocess.run(
        ["podman", "image", "inspect", "--format", "json", image], capture_output=True, text=True, check=True
    )
    import json

    (doc,) = json.loads(out.stdout)
    labels = doc.get("Labels") or {}
    annotations = doc.get("Annotations") or {}
    version = re.search(r'^version = "(.+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    assert version is not None
    for where in (labels, annotations):
        assert where.get("org.opencontainers.image.version") == version.group(1)
        assert re.fullmatch(r"[0-9a-f]{40}(-dirty)?", where.get("org.opencontainers.image.revision", "")), where
        assert where.get("org.opencontainers.image.source"), where
    assert doc["Config"].get("User") == "0:0"
    # Debian 12 + python3 + bcc/LLVM (the bpf mode, ~220 MB of it) + the kubernetes client: about 490 MB
    assert doc["Size"] < 600_000_000, f"the image grew to {doc['Size'] / 1e6:.0f} MB"


# The kubernetes Service's ClusterIP as the kubelet hands it to every pod (KUBERNETES_SERVICE_HOST): nothing in the
# lab programs it, as nothing does on a node that has just rebooted, before kproxy has listed.
KUBERNETES_CLUSTER_IP = "198.19.0.1"
FIRST_BOOT_MODE = os.environ.get("KPROXY_IMAGE_FIRST_BOOT_MODE") or (
    "nftables" if "nftables" in MODES else (MODES[0] if MODES else "")
)
FIRST_BOOT_IP, FIRST_BOOT_SERVICE = "198.19.63.201", "first-boot"


def _user_spec(mode: str, api_url: str) -> PodSpec:
    """The rendered overlay with the ConfigMap's REPLACE-ME values filled in with the lab's, as deploy/README.md
    tells a user to: the API stand-in's real address (plain HTTP) and the lab's pod CIDRs."""
    spec = pod_spec(render_overlay(mode), mode)
    values = {
        "https://REPLACE-ME-control-plane-address:6443": api_url,
        "REPLACE-ME-pod-cidr": f"{CLUSTER_CIDR4},{CLUSTER_CIDR6}",
    }

    def filled(text: str) -> str:
        for placeholder, value in values.items():
            text = text.replace(placeholder, value)
        return text

    mounts = tuple(dataclasses.replace(m, files={k: filled(v) for k, v in m.files.items()}) for m in spec.mounts)
    caps = tuple(dict.fromkeys([*spec.cap_add, *ADD_CAPS]))  # KPROXY_IMAGE_ADD_CAPS: a narrower set to try
    return dataclasses.replace(spec, mounts=mounts, cap_add=caps)


class FirstBootLauncher(ContainerLauncher):
    """The DaemonSet exactly as a user deploys it on a node that has just rebooted: the rendered ConfigMap with its
    REPLACE-ME values filled in with the lab's (the API stand-in's real address, the lab's pod CIDRs), or left as
    shipped with ``fill=False``; credentials as the kubelet gives every pod (a service-account token and CA under
    /var/run/secrets/kubernetes.io/serviceaccount, ``KUBERNETES_SERVICE_HOST`` naming a ClusterIP nobody programs).
    The lab's own ``--master``, ``--kubeconfig``, ``--cluster-cidr`` and ``--mode`` flags are taken out: what
    kproxy knows of the cluster comes from the ConfigMap alone."""

    def __init__(self, image: str, lab: Lab, mode: str, *, fill: bool = True) -> None:
        spec = _user_spec(mode, lab.lab_api_url) if fill else pod_spec(render_overlay(mode), mode)
        super().__init__(image, specs={mode: spec}, drop_caps=DROP_CAPS)
        self.service_account = Path(tempfile.mkdtemp(prefix="kproxy-image-sa-"))
        # as the kubelet writes it: no newline (the kubernetes client sends a tokenFile as it is, newline included)
        (self.service_account / "token").write_text("lab-service-account-token")
        (self.service_account / "ca.crt").write_text("(unused: the lab's API stand-in speaks plain HTTP)\n")
        (self.service_account / "namespace").write_text("kube-system\n")

    def argv(self, lab: Lab, node: LabNode, kproxy_argv: Sequence[str]) -> list[str]:
        out = super().argv(lab, node, kproxy_argv)
        i = out.index(self.image)
        head, command = out[:i], out[i + 1 :]
        assert command[-2:] == ["--kubeconfig", f"{CREDENTIALS_DIR}/kubeconfig"], command
        command = command[:-2]
        for name in ("--master", "--cluster-cidr", "--mode"):
            while name in command:
                j = command.index(name)
                del command[j : j + 2]
        head += ["--env", f"KUBERNETES_SERVICE_HOST={KUBERNETES_CLUSTER_IP}", "--env", "KUBERNETES_SERVICE_PORT=443"]
        head += ["--volume", f"{self.service_account}:/var/run/secrets/kubernetes.io/serviceaccount:ro"]
        return [*head, self.image, *command]

    def remove_files(self) -> None:
        super().remove_files()
        shutil.rmtree(self.service_account, ignore_errors=True)


def _first_boot_objects(lab: Lab, node: LabNode) -> tuple[dict[str, Any], dict[str, Any]]:
    pods = lab.pods_on(node)
    svc = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": FIRST_BOOT_SERVICE, "namespace": "default"},
        "spec": {
            "type": "ClusterIP",
            "clusterIP": FIRST_BOOT_IP,
            "clusterIPs": [FIRST_BOOT_IP],
            "ipFamilies": ["IPv4"],
            "ports": [{"name": "tcp", "port": 80, "targetPort": 8080, "protocol": "TCP"}],
        },
    }
    eps = {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": f"{FIRST_BOOT_SERVICE}-v4",
            "namespace": "default",
            "labels": {"kubernetes.io/service-name": FIRST_BOOT_SERVICE},
        },
        "addressType": "IPv4",
        "ports": [{"name": "tcp", "port": 8080, "protocol": "TCP"}],
        "endpoints": [
            {
                "addresses": [p.ip4],
                "conditions": {"ready": True, "serving": True, "terminating": False},
                "nodeName": node.name,
            }
            for p in pods
        ],
    }
    return svc, eps


def _reaches_service(lab: Lab, node: LabNode) -> bool:
    client = lab.pods_on(node)[0]
    (res,) = lab.probe(client.ns, "tcp", FIRST_BOOT_IP, 80, timeout=1.0)
    return res.ok


def _run_first_boot(lab: Lab, launcher: FirstBootLauncher, node: LabNode, mode: str) -> None:
    lab.launcher = launcher
    lab.start_kproxy(node, mode)
    # bounded by a deadline: each round is a real connection attempt through the node's rules
    deadline = time.monotonic() + 60
    while not _reaches_service(lab, node):
        if not lab.kproxy_running(node) or time.monotonic() > deadline:
            pytest.fail(
                f"kproxy ({mode}) in the image, started as the DaemonSet on a node with no rules, did not program "
                f"{FIRST_BOOT_IP}:80 from the API at {lab.lab_api_url}:\n{lab.kproxy_log(node)[-2500:]}",
                pytrace=False,
            )
    lab.wait_kproxy(node, timeout=30)


@pytest.mark.skipif(not FIRST_BOOT_MODE, reason="no mode with an overlay is installed")
def test_first_boot_with_the_shipped_configmap(image_lab: ImageLab) -> None:
    """After a reboot the node has no rules, so the ``kubernetes`` ClusterIP leads nowhere: kproxy, deployed with the
    shipped ConfigMap filled in as deploy/README.md says, must reach the API at the control plane's own address,
    list, and program the node (a pod reaches a Service through it). Left as shipped, it must refuse to start and
    name the REPLACE-ME fields (kproxy.preflight)."""
    mode, lab = FIRST_BOOT_MODE, image_lab.lab
    avail = availability(mode)
    if not avail:
        pytest.skip(f"mode {mode} is not available here: {avail.reason}")
    lab.stop_all()
    image_lab.mode = image_lab.session = None  # the next check prepares its mode afresh
    node = lab.node("node-1")
    api = lab.api_client()
    from kubernetes import client as k8s

    svc, eps = _first_boot_objects(lab, node)
    k8s.CoreV1Api(api).create_namespaced_service("default", svc)
    k8s.DiscoveryV1Api(api).create_namespaced_endpoint_slice("default", eps)
    assert not _reaches_service(lab, node), "the node must start without rules for the Service (a fresh boot)"
    launchers = [
        FirstBootLauncher(image_lab.launcher.image, lab, mode),
        FirstBootLauncher(image_lab.launcher.image, lab, mode, fill=False),
    ]
    try:
        _run_first_boot(lab, launchers[0], node, mode)
        lab.stop_kproxy(node)
        # as shipped: the container exits at once, saying which values are still placeholders
        mark = len(lab.kproxy_log(node))
        lab.launcher = launchers[1]
        lab.start_kproxy(node, mode)
        deadline = time.monotonic() + 60
        while lab.kproxy_running(node) and time.monotonic() < deadline:
            time.sleep(0.1)
        log = lab.kproxy_log(node)[mark:]
        assert not lab.kproxy_running(node), f"kproxy started with the placeholders in its ConfigMap:\n{log[-2000:]}"
        assert "kproxy: cannot start: clusterCIDR" in log and "REPLACE-ME-control-plane-address" in log, log[-2000:]
    finally:
        lab.stop_all()
        lab.launcher = image_lab.launcher
        for launcher in launchers:
            launcher.close(lab.prefix)
        k8s.CoreV1Api(api).delete_namespaced_service(FIRST_BOOT_SERVICE, "default")
        k8s.DiscoveryV1Api(api).delete_namespaced_endpoint_slice(f"{FIRST_BOOT_SERVICE}-v4", "default")


@pytest.mark.parametrize(("mode", "check"), CASES, ids=[f"{m}-{c}" for m, c in CASES])
def test_image(image_lab: ImageLab, mode: str, check: str) -> None:
    avail = availability(mode)
    if not avail:
        pytest.skip(f"mode {mode} is not available here: {avail.reason}")
    session = image_lab.get(mode)
    if check in SCENARIOS:
        result = session.run_scenario(BY_ID[check])
        if result.status == NOT_APPLICABLE:
            pytest.fail(f"{mode} {check} must run in the image, but: {result.detail}", pytrace=False)
        if result.status == FAIL:
            pytest.fail(f"{mode} {check} with kproxy in the image: {result.detail}", pytrace=False)
        print(f"{mode} {check}: pass in {result.seconds:.1f} s; {result.detail}")
    elif check == "connected-udp":
        result = session.run_scenario(CONNECTED_UDP)
        if result.status != PASS:
            pytest.fail(f"{mode} connected-udp with kproxy in the image: {result.detail}", pytrace=False)
        print(f"{mode} connected-udp: pass in {result.seconds:.1f} s; {result.detail}")
    elif check == "privileges":
        _check_privileges(image_lab, mode)
    else:
        _check_legacy_node(image_lab, mode)


def _status(pid: int) -> dict[str, str]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        k, _, v = line.partition(":")
        out[k] = v.strip()
    return out


def _resolve_in(root: str, path: str) -> str:
    """``path`` with the links in the container's file system followed (through /proc/PID/root)."""
    cur = ""
    for part in path.strip("/").split("/"):
        cand = f"{cur}/{part}"
        if os.path.islink(root + cand):
            target = os.readlink(root + cand)
            cur = os.path.normpath(target if target.startswith("/") else f"{cur}/{target}")
        else:
            cur = cand
    return cur or "/"


def _check_privileges(image_lab: ImageLab, mode: str) -> None:
    """Each node's container runs kproxy with the overlay's capabilities and nothing more, as root, without a way
    to gain privileges, under seccomp, on a read-only root filesystem with the overlay's mounts."""
    spec = image_lab.launcher.spec(mode)
    want_caps = {c.upper() for c in spec.cap_add} - set(DROP_CAPS)
    want = sum(1 << CAP_BITS[c] for c in want_caps)
    for node in image_lab.lab.nodes:
        info = image_lab.launcher.inspect(node)
        pid = int(info["State"]["Pid"])
        assert info["State"]["Running"] and pid > 0, f"{node.name}: container not running: {info['State']}"
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        assert b"run" in cmdline and any(b"kproxy" in a for a in cmdline), cmdline
        st = _status(pid)
        for field in ("CapEff", "CapPrm", "CapBnd"):
            assert int(st[field], 16) == want, f"{node.name} {field} {st[field]}, want {want:#x} ({sorted(want_caps)})"
        assert int(st["CapAmb"], 16) == 0 and int(st["CapInh"], 16) == 0
        assert st["Uid"].split()[:2] == ["0", "0"], st["Uid"]
        assert st["NoNewPrivs"] == ("1" if spec.allow_privilege_escalation is False else "0")
        assert st["Seccomp"] == ("2" if spec.seccomp == "RuntimeDefault" else "0")
        mounts = {}
        for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines():
            parts = line.split()
            mounts[parts[4]] = parts[5].split(",")
        assert ("ro" in mounts["/"]) == spec.read_only_root, mounts["/"]
        for m in spec.mounts:
            path = _resolve_in(f"/proc/{pid}/root", m.path)  # /lib is a link to /usr/lib in the image
            assert path in mounts, f"{node.name}: {m.path} ({m.name}) not mounted"
            assert ("ro" in mounts[path]) == m.read_only, f"{node.name}: {m.path} {mounts[path]}"
        netns = Path(f"/proc/{pid}/ns/net").stat().st_ino
        assert netns == Path(f"/run/netns/{node.ns}").stat().st_ino, f"{node.name}: not in the node's namespace"
        host_pid = Path(f"/proc/{pid}/ns/pid").stat().st_ino == Path("/proc/self/ns/pid").stat().st_ino
        assert host_pid is spec.host_pid, f"{node.name}: host PID namespace {host_pid}, hostPID {spec.host_pid}"


def _check_legacy_node(image_lab: ImageLab, mode: str) -> None:
    lab = image_lab.lab
    node = lab.node(LEGACY_NODE)
    legacy = _ipt(lab, node, "iptables-legacy-save", "-t", "nat")
    assert legacy.returncode == 0, legacy.stderr
    legacy_text = legacy.stdout.decode()
    if mode == "iptables":
        nft = _ipt(lab, node, "iptables-nft-save", "-t", "nat")
        assert ":KUBE-SERVICES" in legacy_text, (
            f"kproxy on {node.name}, a legacy-iptables node, did not program the legacy tables:\n{legacy_text}"
        )
        assert ":KUBE-SERVICES" not in nft.stdout.decode(), f"kproxy on {node.name} programmed nf_tables as well"
    else:
        assert "KUBE-SERVICES" not in legacy_text, f"{mode} left the legacy iptables leftover:\n{legacy_text}"


# A resolver as glibc's: one connect() to the service, then send()/recv() on that socket; when the socket is ended
# under it (sock_diag SOCK_DESTROY: ECONNABORTED, then EDESTADDRREQ), a new socket and a new connect(). Prints one line
# per event; reads a line from stdin between the first answer and the loop (the test changes the endpoint then).
RESOLVER = r"""
import socket, sys, time
ip, port, want, seconds = sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
def connected():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(0.5); s.connect((ip, port)); return s
def ask(s):
    s.send(b"who"); return s.recv(200).decode().split()[0]
s = connected()
print("first", ask(s), "from", s.getpeername()[0], flush=True)
sys.stdin.readline()
t0, who, ended = time.monotonic(), "", 0
while time.monotonic() - t0 < seconds:
    try:
        who = ask(s)
    except socket.timeout:
        who = "(timeout)"
        continue
    except OSError as e:
        ended += 1
        print("ended", e.errno, f"{time.monotonic() - t0:.2f}", flush=True)
        s.close(); s = connected()
        continue
    if who == want:
        print("reached", who, f"{time.monotonic() - t0:.2f}", "ended", ended, flush=True)
        break
    time.sleep(0.05)
else:
    print("pinned", who, "ended", ended, flush=True)
"""
CONNECTED_UDP_FOLLOW_S = 10.0


def _connected_udp(ctx: Context) -> None:
    """A resolver in a pod of node-1 keeps one connected UDP socket to a ClusterIP whose only endpoint is then
    replaced: its next sends must reach the new endpoint, directly or after its socket was ended and it
    reconnected (as glibc's resolver does), within a few seconds. kproxy runs in the image on node-1, so it must
    find the pod's network namespace from inside its container (hostPID, backends/bpf/sockets.py)."""
    n1, n2 = ctx.lab.node("node-1"), ctx.lab.node("node-2")
    client, old, new = ctx.pods_on(n1)[1], ctx.pods_on(n2)[0], ctx.pods_on(n2)[1]
    svc = ctx.service("resolver", [ctx.port(53, 8080, name="dns", protocol="UDP")])
    ctx.apply(svc, ctx.slice_for(svc, [old]))
    ip = next(a for a in svc["spec"]["clusterIPs"] if ":" not in a)
    ctx.eventually(
        lambda: ctx.reach(client, ip, 53, "udp", count=1, timeout=0.5, only=[old]), timeout=30.0, what="programmed"
    )
    argv = netns.exec_argv(client.ns, [sys.executable, "-c", RESOLVER, ip, "53", new.name, str(CONNECTED_UDP_FOLLOW_S)])
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=netns.cgroup_preexec(ctx.lab.cgroup_path(n1)),  # a process of node-1, as a pod's would be
    )
    try:
        assert proc.stdin is not None and proc.stdout is not None
        first = proc.stdout.readline().split()
        ctx.expect(first[:2] == ["first", old.name], "the resolver's first answer", got=" ".join(first))
        mark = len(ctx.lab.kproxy_log(n1))
        ctx.apply(ctx.slice_for(svc, [new]))
        proc.stdin.write("go\n")
        proc.stdin.flush()
        out, err = proc.communicate(timeout=CONNECTED_UDP_FOLLOW_S + 20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)
    lines = out.strip().splitlines()
    # what node-1's kproxy said about it (the reaper logs what it ended and what it could not look at)
    said = [ln.strip()[-400:] for ln in ctx.lab.kproxy_log(n1)[mark:].splitlines() if "UDP" in ln or "ss -K" in ln]
    ctx.expect(
        bool(lines) and lines[-1].startswith("reached"),
        f"a connected UDP socket stayed pinned to {old.name} after the service's only endpoint became {new.name}",
        sent=f"send() on one socket connect()ed to {ip}:53 from {client.name}, reconnecting when it is ended",
        got="; ".join(lines)
        + (f" (stderr: {err.strip()[-300:]})" if err.strip() else "")
        + f"; node-1's kproxy: {' | '.join(said) or 'nothing about UDP sockets'}",
        expected=f"answers from {new.name} within {CONNECTED_UDP_FOLLOW_S:.0f} s",
    )
    ctx.note("; ".join(lines))


CONNECTED_UDP = Scenario(
    "connected-udp", "a connected UDP client follows an endpoint change", _connected_udp, timeout_s=60.0
)
