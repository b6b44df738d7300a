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
each one is needed (the tests must then fail). ``KPROXY_IMAGE_MODES=iptables`` restricts the modes.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kproxy.conformance.report import FAIL, NOT_APPLICABLE
from kproxy.conformance.runner import Session
from kproxy.conformance.scenarios import BY_ID
from kproxy.lab.cluster import Lab
from kproxy.lab.container import OVERLAYS, ContainerLauncher
from kproxy.proxier import availability, backend_class, installed_backends

pytestmark = [pytest.mark.root, pytest.mark.lab]

ROOT = Path(__file__).resolve().parents[2]
PREFIX = os.environ.get("KPROXY_IMAGE_LAB_PREFIX") or "kpi-"
DROP_CAPS = tuple(c.strip().upper() for c in os.environ.get("KPROXY_IMAGE_DROP_CAPS", "").split(",") if c.strip())
SCENARIOS = ("clusterip-tcp", "nodeport", "servers", "restart")
CHECKS = (*SCENARIOS, "privileges", "legacy-node")
LEGACY_NODE = "node-2"
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


CASES = [(m, c) for m in MODES for c in CHECKS if c not in _declared_not_applicable(m)]


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
                session.prepare()
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
    launcher = ContainerLauncher(image, drop_caps=DROP_CAPS)
    launcher.close(PREFIX)  # containers of a killed earlier run
    lab = Lab.up(nodes=2, pods_per_node=3, mode=None, ipv6=True, prefix=PREFIX)
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
