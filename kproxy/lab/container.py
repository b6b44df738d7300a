"""Run a lab node's kproxy inside the kproxy image, the way the DaemonSet of its mode runs it on a real node.

The image test (tests/integration/test_image.py) plugs it in through ``Lab.launcher``: with a
:class:`ContainerLauncher` set there, :meth:`Lab.start_kproxy` starts ``podman run`` instead of
``ip netns exec NODE kproxy run``, and :meth:`Lab.stop_kproxy` signals the container's kproxy. Everything else the
lab and the conformance scenarios do (probes, ``/rules``, logs, ``restart``'s SIGKILL) stays as it is.

What the container gets comes from the rendered overlay (``kubectl kustomize deploy/overlays/<mode>``), never from
a copy: the DaemonSet's command and environment, ``hostPID``, the kproxy container's capabilities, privilege, user,
seccomp profile, read-only root filesystem, memory limit and volume mounts (hostPath volumes from the machine,
the ConfigMap written to files and mounted read-only). The lab adds only what a real node has and the lab lacks:

* ``hostNetwork: true`` becomes the node's network namespace (``--network ns:/run/netns/NODE``);
* credentials: a kubeconfig for the lab's API stand-in (``http://198.18.0.1:6443``, as seen from the node),
  mounted read-only the way a pod's service-account secret is (a folder under /var/run/secrets), and
  ``--kubeconfig`` naming it. Not the in-cluster files themselves: the stand-in speaks plain HTTP, which only
  ``--master`` can select, and the kubernetes client's in-cluster token refresh resets the server to
  ``https://KUBERNETES_SERVICE_HOST:PORT`` before every request, so ``--master`` does not stick there;
* the lab's own flags after the DaemonSet's command (``--mode``, ``--cluster-cidr``, sync periods; flags override
  the ``--config`` file, as for kube-proxy), with the lab's cgroup2 mount standing in for the bpf overlay's;
* ``--ulimit`` within this machine's limits (root here cannot raise them), ``--runtime runc``.

The bpf overlay's privileged init container (it mounts bpffs and cgroup2 on the host) is not run: the lab's set-up
has mounted both already, and it would change the machine's own mounts.
"""

from __future__ import annotations

import contextlib
import json
import re
import resource
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kproxy.lab.cluster import Lab
from kproxy.lab.plan import LabError, LabNode
from kproxy.lab.state import CGROUP_MOUNT

ROOT = Path(__file__).resolve().parents[2]
OVERLAYS = ROOT / "deploy" / "overlays"
CREDENTIALS_DIR = "/var/run/secrets/kproxy.io/lab"
PODMAN = ("podman", "--runtime", "runc")  # crun refuses this machine's hybrid cgroup layout (HOST.md)
LAB_LABEL = "io.kproxy.lab"
# hostPath volumes the lab provides somewhere else than a real node: the bpf overlay's cgroup2 mount point
HOST_PATHS_IN_LAB = {"/run/kproxy/cgroupv2": str(CGROUP_MOUNT)}
_SIGNALS = {signal.SIGTERM: "TERM", signal.SIGKILL: "KILL", signal.SIGINT: "INT", signal.SIGHUP: "HUP"}
_CAP = re.compile(r"^[A-Z_]+$")


class ContainerError(LabError):
    """The overlay cannot be run as a container here (an unknown volume type, kustomize failed); says what."""


@dataclass(frozen=True)
class Mount:
    """One volume mount of the kproxy container: ``source`` is a path on this machine (a hostPath volume) or, for a
    ConfigMap volume, the volume's files by name (written out by the launcher)."""

    name: str
    path: str
    read_only: bool
    propagation: str | None = None
    host_path: str | None = None
    host_type: str = ""
    files: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class PodSpec:
    """What the rendered overlay of a mode grants its kproxy container."""

    mode: str
    image: str
    command: tuple[str, ...]
    env: dict[str, str]  # fieldRef values are given as "fieldRef:<path>"
    cap_add: tuple[str, ...]
    cap_drop: tuple[str, ...]
    privileged: bool
    allow_privilege_escalation: bool | None
    read_only_root: bool
    run_as_user: int | None
    run_as_group: int | None
    seccomp: str | None
    memory_limit: str | None
    host_network: bool
    mounts: tuple[Mount, ...]
    host_pid: bool = False


def render_overlay(mode: str, overlays: Path = OVERLAYS) -> list[dict[str, Any]]:
    """``kubectl kustomize deploy/overlays/<mode>``, parsed."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        raise ContainerError("kubectl is not installed (scripts/setup.sh installs it)")
    out = subprocess.run(
        [kubectl, "kustomize", str(overlays / mode)], capture_output=True, text=True, timeout=60, check=False
    )
    if out.returncode != 0:
        raise ContainerError(f"kubectl kustomize {overlays / mode} failed: {out.stderr.strip()[-500:]}")
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def pod_spec(docs: Sequence[dict[str, Any]], mode: str) -> PodSpec:
    """The kproxy container of the rendered DaemonSet, with its volumes resolved."""
    ds = _one(docs, "DaemonSet", "kproxy")
    spec = ds["spec"]["template"]["spec"]
    (c,) = [c for c in spec["containers"] if c["name"] == "kproxy"]
    sc = c.get("securityContext") or {}
    psc = spec.get("securityContext") or {}
    caps = sc.get("capabilities") or {}
    volumes = {v["name"]: v for v in spec.get("volumes") or []}
    mounts = []
    for m in c.get("volumeMounts") or []:
        vol = volumes[m["name"]]
        ro = bool(m.get("readOnly", False))
        if "hostPath" in vol:
            mounts.append(
                Mount(
                    m["name"],
                    m["mountPath"],
                    ro,
                    m.get("mountPropagation"),
                    host_path=vol["hostPath"]["path"],
                    host_type=vol["hostPath"].get("type", ""),
                )
            )
        elif "configMap" in vol:
            cm = _one(docs, "ConfigMap", vol["configMap"]["name"])
            mounts.append(Mount(m["name"], m["mountPath"], True, files=dict(cm.get("data") or {})))
        else:
            raise ContainerError(f"volume {m['name']} of mode {mode}: only hostPath and configMap are supported")
    env = {}
    for e in c.get("env") or []:
        if "value" in e:
            env[e["name"]] = str(e["value"])
        elif "fieldRef" in (e.get("valueFrom") or {}):
            env[e["name"]] = "fieldRef:" + e["valueFrom"]["fieldRef"]["fieldPath"]
        else:
            raise ContainerError(f"env {e['name']} of mode {mode}: only values and fieldRefs are supported")
    seccomp = (sc.get("seccompProfile") or psc.get("seccompProfile") or {}).get("type")
    return PodSpec(
        mode=mode,
        image=str(c["image"]),
        command=tuple(str(a) for a in (c.get("command") or []) + (c.get("args") or [])),
        env=env,
        cap_add=tuple(caps.get("add") or ()),
        cap_drop=tuple(caps.get("drop") or ()),
        privileged=bool(sc.get("privileged", False)),
        allow_privilege_escalation=sc.get("allowPrivilegeEscalation"),
        read_only_root=bool(sc.get("readOnlyRootFilesystem", False)),
        run_as_user=sc.get("runAsUser", psc.get("runAsUser")),
        run_as_group=sc.get("runAsGroup", psc.get("runAsGroup")),
        seccomp=seccomp,
        memory_limit=((c.get("resources") or {}).get("limits") or {}).get("memory"),
        host_network=bool(spec.get("hostNetwork", False)),
        mounts=tuple(mounts),
        host_pid=bool(spec.get("hostPID", False)),
    )


def _one(docs: Sequence[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [d for d in docs if d.get("kind") == kind and d.get("metadata", {}).get("name") == name]
    if len(found) != 1:
        raise ContainerError(f"expected one {kind}/{name} in the rendered overlay, found {len(found)}")
    return found[0]


def _memory(quantity: str) -> str:
    """A Kubernetes memory quantity as podman's --memory (bytes)."""
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "K": 10**3, "M": 10**6, "G": 10**9}
    m = re.fullmatch(r"(\d+)([KMG]i?)?", quantity)
    if not m:
        raise ContainerError(f"memory limit {quantity!r} not understood")
    return str(int(m.group(1)) * units.get(m.group(2) or "", 1))


def _ulimits() -> list[str]:
    """Soft = hard, no higher than this process's hard limit: podman would raise them, which root here lacks the
    capability for. nproc is capped lower still: runc's init could not set 65536 (32768 worked) although the shell's
    hard limit was 96364."""
    out = []
    for name, res, cap in (("nofile", resource.RLIMIT_NOFILE, 1 << 20), ("nproc", resource.RLIMIT_NPROC, 32768)):
        _soft, hard = resource.getrlimit(res)
        n = min(hard if hard != resource.RLIM_INFINITY else cap, cap)
        out += ["--ulimit", f"{name}={n}:{n}"]
    return out


def _expand(arg: str, env: dict[str, str]) -> str:
    """``$(VAR)`` in a container's command, as the kubelet expands it (unknown names stay as they are)."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), arg)


def mode_of(kproxy_argv: Sequence[str]) -> str:
    argv = list(kproxy_argv)
    for i, a in enumerate(argv):
        if a == "--mode" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--mode="):
            return a.split("=", 1)[1]
    raise ContainerError(f"no --mode in {argv}")


class ContainerLauncher:
    """Starts and signals each lab node's kproxy as a container of ``image`` (see the module docstring).

    ``drop_caps`` removes capabilities from what the overlay grants (to show each one is needed); ``specs`` gives
    a PodSpec per mode instead of rendering the overlay, and ``make_host_paths=False`` leaves hostPath volumes
    unchecked and uncreated (both for tests that only look at the command line).
    """

    def __init__(
        self,
        image: str,
        *,
        drop_caps: Sequence[str] = (),
        specs: dict[str, PodSpec] | None = None,
        podman: Sequence[str] = PODMAN,
        make_host_paths: bool = True,
    ) -> None:
        self.image = image
        self.make_host_paths = make_host_paths
        self.drop_caps = tuple(c.upper() for c in drop_caps)
        self.podman = list(podman)
        self._specs: dict[str, PodSpec] = dict(specs or {})
        self._dir: Path | None = None
        self.names: set[str] = set()

    def spec(self, mode: str) -> PodSpec:
        if mode not in self._specs:
            self._specs[mode] = pod_spec(render_overlay(mode), mode)
        return self._specs[mode]

    @staticmethod
    def container_name(node: LabNode) -> str:
        return f"{node.ns}-kproxy"

    def _files_dir(self) -> Path:
        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix="kproxy-image-"))
        return self._dir

    def _write_credentials(self, lab: Lab) -> Path:
        """A kubeconfig for the lab's API as a node sees it (Lab.kubeconfig is for this machine's namespace)."""
        d = self._files_dir() / f"{lab.prefix}credentials"
        d.mkdir(exist_ok=True)
        doc = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "lab", "cluster": {"server": lab.lab_api_url}}],
            "users": [{"name": "kproxy", "user": {"token": "lab-service-account-token"}}],
            "contexts": [{"name": "lab", "context": {"cluster": "lab", "user": "kproxy", "namespace": "kube-system"}}],
            "current-context": "lab",
        }
        (d / "kubeconfig").write_text(json.dumps(doc, indent=2) + "\n")
        return d

    def _write_config_map(self, mount: Mount, mode: str) -> Path:
        d = self._files_dir() / f"{mode}-{mount.name}"
        d.mkdir(exist_ok=True)
        for key, text in mount.files.items():
            if "/" in key or key.startswith("."):
                raise ContainerError(f"ConfigMap key {key!r} is not a file name")
            (d / key).write_text(text)
        return d

    def argv(self, lab: Lab, node: LabNode, kproxy_argv: Sequence[str]) -> list[str]:
        """The ``podman run`` command line that runs ``kproxy_argv`` (the lab's native command) for ``node``."""
        mode = mode_of(kproxy_argv)
        spec = self.spec(mode)
        if not spec.host_network:
            raise ContainerError(f"the {mode} overlay's DaemonSet is not on the host network")
        name = self.container_name(node)
        self.names.add(name)
        env = {k: (node.name if v == "fieldRef:spec.nodeName" else v) for k, v in spec.env.items()}
        unknown = [k for k, v in env.items() if v.startswith("fieldRef:")]
        if unknown:
            raise ContainerError(f"env {unknown} of mode {mode}: fieldRef not known to the lab")
        out = [*self.podman, "run", "--rm", "--replace", "--pull", "never", "--name", name]
        out += ["--label", f"{LAB_LABEL}={lab.prefix}", "--hostname", node.name]
        out += ["--network", f"ns:/run/netns/{node.ns}"]
        if spec.host_pid:
            out += ["--pid", "host"]  # the machine's PID namespace stands in for the node's
        out += _ulimits()
        if spec.privileged:
            out.append("--privileged")
        caps = [c for c in spec.cap_add if c.upper() not in self.drop_caps]
        for c in [*spec.cap_drop, *caps]:
            if not _CAP.match(c.upper()):
                raise ContainerError(f"capability {c!r} of mode {mode} is not a capability name")
        out += [a for c in spec.cap_drop for a in ("--cap-drop", c.lower())]
        out += [a for c in caps for a in ("--cap-add", c.upper())]
        if spec.allow_privilege_escalation is False:
            out += ["--security-opt", "no-new-privileges"]
        # Kubernetes runs a container without a seccomp profile unless one is set; podman's default is the
        # runtime's default profile, what RuntimeDefault asks for.
        if spec.seccomp in (None, "Unconfined"):
            out += ["--security-opt", "seccomp=unconfined"]
        elif spec.seccomp != "RuntimeDefault":
            raise ContainerError(f"seccomp profile {spec.seccomp} of mode {mode} is not supported here")
        if spec.read_only_root:
            out += ["--read-only", "--read-only-tmpfs=false"]  # Kubernetes adds no writable /tmp or /run
        if spec.run_as_user is not None:
            user = str(spec.run_as_user)
            out += ["--user", user + (f":{spec.run_as_group}" if spec.run_as_group is not None else "")]
        if spec.memory_limit:
            out += ["--memory", _memory(spec.memory_limit)]
        for k, v in env.items():
            out += ["--env", f"{k}={v}"]
        rewrites: dict[str, str] = {}
        for m in spec.mounts:
            out += ["--volume", self._volume(m, mode, rewrites)]
        out += ["--volume", f"{self._write_credentials(lab)}:{CREDENTIALS_DIR}:ro"]
        command = [_expand(a, env) for a in spec.command]
        out += [self.image, *command, *self._lab_flags(kproxy_argv, rewrites)]
        out += ["--kubeconfig", f"{CREDENTIALS_DIR}/kubeconfig"]
        return out

    def _volume(self, m: Mount, mode: str, rewrites: dict[str, str]) -> str:
        if m.host_path is None:
            source = str(self._write_config_map(m, mode))
        else:
            source = HOST_PATHS_IN_LAB.get(m.host_path, m.host_path)
            if source != m.host_path:
                rewrites[source] = m.path
            p = Path(source)
            if not self.make_host_paths:
                pass
            elif m.host_type == "FileOrCreate" and not p.exists():
                p.parent.mkdir(parents=True, exist_ok=True)
                p.touch()
            elif m.host_type == "DirectoryOrCreate" and not p.exists():
                p.mkdir(parents=True)
            elif m.host_type in ("Directory", "File") and not p.exists():
                raise ContainerError(f"hostPath {source} ({m.host_type}) of volume {m.name} does not exist")
        opts = ["ro" if m.read_only else "rw"]
        if m.propagation == "HostToContainer":
            opts.append("rslave")
        elif m.propagation == "Bidirectional":
            opts.append("rshared")
        return f"{source}:{m.path}:{','.join(opts)}"

    @staticmethod
    def _lab_flags(kproxy_argv: Sequence[str], rewrites: dict[str, str]) -> list[str]:
        """The lab's flags (after ``run``), with lab paths rewritten to where the container sees them."""
        argv = list(kproxy_argv)
        try:
            flags = argv[argv.index("run") + 1 :]
        except ValueError:
            raise ContainerError(f"not a `kproxy run` command: {argv}") from None
        out = []
        for a in flags:
            for src, dst in rewrites.items():
                if a == src or a.startswith(src + "/"):
                    a = dst + a[len(src) :]
            out.append(a)
        return out

    def kill(self, lab: Lab, node: LabNode, sig: int) -> None:
        """Send ``sig`` to the node's containerised kproxy (the ``podman run`` client exits when it has)."""
        name = _SIGNALS.get(signal.Signals(sig), str(int(sig)))
        subprocess.run(
            [*self.podman, "kill", "--signal", name, self.container_name(node)],
            capture_output=True,
            timeout=30,
            check=False,
        )

    def containers(self, prefix: str) -> list[str]:
        """Names of the containers this machine runs for the lab with ``prefix``."""
        out = subprocess.run(
            [*self.podman, "ps", "-a", "--filter", f"label={LAB_LABEL}={prefix}", "--format", "{{.Names}}"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        return [n for n in out.stdout.split() if n]

    def inspect(self, node: LabNode) -> dict[str, Any]:
        out = subprocess.run(
            [*self.podman, "inspect", "--type", "container", self.container_name(node)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        if out.returncode != 0:
            raise ContainerError(f"podman inspect {self.container_name(node)}: {out.stderr.strip()}")
        doc = json.loads(out.stdout)
        return doc[0] if isinstance(doc, list) else doc

    def close(self, prefix: str) -> None:
        """Remove every container of the lab with ``prefix`` (running or not) and the files written for them."""
        names = set(self.containers(prefix)) | self.names
        if names:
            subprocess.run(
                [*self.podman, "rm", "--force", "--ignore", "--time", "0", *sorted(names)],
                capture_output=True,
                timeout=120,
                check=False,
            )
        self.names.clear()
        self.remove_files()

    def remove_files(self) -> None:
        """Remove the ConfigMap and credential files written for the containers."""
        if self._dir is not None:
            with contextlib.suppress(OSError):
                shutil.rmtree(self._dir)
            self._dir = None
