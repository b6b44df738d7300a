"""The deploy manifests: every overlay renders with kustomize, every object is valid Kubernetes, and the overlays
differ only in the mode and in what that mode declares it needs.

Runs ``kubectl kustomize`` (Debian's kubectl, installed by the set-up step) and validates against the OpenAPI
schemas shipped with ``kubernetes_validate``; no cluster involved.
"""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
import types
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kproxy.config import build_config, load_config_file

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
OVERLAYS = ("userspace", "iptables", "nftables", "bpf")
K8S_VERSION = "1.32"
BASE_CAPS = {"NET_ADMIN", "NET_RAW"}
# What each mode declares it needs beyond the base (deploy/overlays/<mode>/kustomization.yaml says why).
EXTRA_CAPS = {
    "userspace": set(),  # proxy ports from the local port range: no NET_BIND_SERVICE unless a range below 1024
    "iptables": set(),
    "nftables": set(),
    # setns into pods' namespaces, BPF_PROG_GET_FD_BY_ID, the seccomp profile's bpf(2); /proc/PID/ns/net of pods
    # (each measured: deploy/overlays/bpf). BPF and PERFMON are implied by SYS_ADMIN.
    "bpf": {"SYS_ADMIN", "SYS_PTRACE"},
}
EXTRA_VOLUMES = {"bpf": {"bpffs", "cgroup2"}}
# the host's PID namespace: the bpf mode's UDP reaper finds the pods' network namespaces through /proc
HOST_PID = {"bpf"}
# arguments a mode needs after the base's command (the cgroup the socket programs attach to)
EXTRA_ARGS = {"bpf": ["--bpf-cgroup-path", "/run/kproxy/cgroupv2", "--bpf-allow-root-cgroup", "true"]}

pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed (make setup)")


def render(mode: str) -> list[dict[str, Any]]:
    out = subprocess.run(
        ["kubectl", "kustomize", str(DEPLOY / "overlays" / mode)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {mode: render(mode) for mode in OVERLAYS}


def one(objs: list[dict[str, Any]], kind: str, name: str = "kproxy") -> dict[str, Any]:
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def container(objs: list[dict[str, Any]]) -> dict[str, Any]:
    ds = one(objs, "DaemonSet")
    (c,) = [c for c in ds["spec"]["template"]["spec"]["containers"] if c["name"] == "kproxy"]
    return c


def config_doc(objs: list[dict[str, Any]]) -> str:
    return str(one(objs, "ConfigMap")["data"]["config.conf"])


@pytest.mark.parametrize("mode", OVERLAYS)
def test_every_object_validates_strictly(rendered: dict[str, list[dict[str, Any]]], mode: str) -> None:
    objs = rendered[mode]
    kinds = {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "ConfigMap", "DaemonSet"}
    assert {o["kind"] for o in objs} == kinds
    for obj in objs:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


@pytest.mark.parametrize("mode", OVERLAYS)
def test_configmap_parses_and_names_the_mode(
    rendered: dict[str, list[dict[str, Any]]], mode: str, tmp_path: Path
) -> None:
    path = tmp_path / "config.conf"
    # the values of the user's cluster ship as placeholders (test_deploy_cluster_inputs.py): filled in as a user does
    path.write_text(config_doc(rendered[mode]).replace("REPLACE-ME-pod-cidr", "198.18.64.0/18"))
    values = load_config_file(path)
    assert values["mode"] == mode
    cfg = build_config(values, {})
    assert cfg.healthz_bind_address == "0.0.0.0:10256"
    assert cfg.metrics_bind_address == "127.0.0.1:10249"
    assert cfg.masquerade_bit == 14
    assert cfg.sync_period == 30.0 and cfg.min_sync_period == 1.0
    assert cfg.cluster_cidrs
    ds = one(rendered[mode], "DaemonSet")
    assert ds["spec"]["template"]["metadata"]["labels"]["kproxy.io/mode"] == mode


@pytest.mark.parametrize("mode", OVERLAYS)
def test_daemonset_shape(rendered: dict[str, list[dict[str, Any]]], mode: str) -> None:
    ds = one(rendered[mode], "DaemonSet")
    assert ds["metadata"]["namespace"] == "kube-system"
    spec = ds["spec"]["template"]["spec"]
    assert spec["hostNetwork"] is True
    assert spec["priorityClassName"] == "system-node-critical"
    assert {"operator": "Exists"} in spec["tolerations"]
    assert ds["spec"]["updateStrategy"]["type"] == "RollingUpdate"
    assert spec["serviceAccountName"] == "kproxy"
    c = container(rendered[mode])
    assert c["image"] == "kproxy:0.1.0"
    assert c["command"] == [
        "python",
        "-m",
        "kproxy.preflight",  # refuses the ConfigMap's REPLACE-ME placeholders (test_deploy_cluster_inputs.py)
        "kproxy",
        "run",
        "--config",
        "/var/lib/kproxy/config.conf",
        "--hostname-override",
        "$(NODE_NAME)",
    ]
    assert not any(a.startswith("--mode") or a.startswith("--proxy-mode") for a in c["command"] + c.get("args", []))
    (env,) = [e for e in c["env"] if e["name"] == "NODE_NAME"]
    assert env["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert c["livenessProbe"]["httpGet"]["path"] == "/livez" and c["livenessProbe"]["httpGet"]["port"] == 10256
    assert c["readinessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["resources"]["requests"] and c["resources"]["limits"]
    sc = c["securityContext"]
    assert not sc.get("privileged")
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert set(sc["capabilities"]["add"]) == BASE_CAPS | EXTRA_CAPS[mode]
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["runAsUser"] == 0
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    # no_new_privs in every mode. The API server's own rule (pkg/apis/core/validation) refuses "false" beside
    # privileged or beside a capability spelled "CAP_SYS_ADMIN" (it compares that literal); capabilities here are
    # spelled as Kubernetes documents them, without the prefix.
    assert sc["allowPrivilegeEscalation"] is False
    assert not sc.get("privileged")
    assert not [c for c in sc["capabilities"]["add"] if c.startswith("CAP_")]
    assert spec.get("hostPID", False) is (mode in HOST_PID)
    assert not spec.get("hostIPC") and spec["hostNetwork"] is True
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["lib-modules"]["hostPath"]["path"] == "/lib/modules"
    assert volumes["xtables-lock"]["hostPath"] == {"path": "/run/xtables.lock", "type": "FileOrCreate"}
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert mounts["lib-modules"]["readOnly"] is True
    assert mounts["config"]["mountPath"] == "/var/lib/kproxy"
    # Only the bpf overlay's short-lived mount step is privileged.
    for init in spec.get("initContainers", []):
        assert mode == "bpf" and init["name"] == "mount-bpf-fs"


def test_bpf_mounts() -> None:
    objs = render("bpf")
    c = container(objs)
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert mounts["bpffs"]["mountPath"] == "/sys/fs/bpf"
    assert mounts["bpffs"]["mountPropagation"] == "HostToContainer"
    assert "usr-src" not in mounts  # the image carries the kernel headers bcc needs (BCC_KERNEL_SOURCE)
    assert c["args"] == EXTRA_ARGS["bpf"]
    assert mounts["cgroup2"]["mountPath"] == "/run/kproxy/cgroupv2"


def _normalised(objs: list[dict[str, Any]], mode: str) -> list[dict[str, Any]]:
    """The rendered objects with the mode and the mode's declared needs taken out."""
    out = []
    for obj in copy.deepcopy(objs):
        obj["metadata"].get("labels", {}).pop("kproxy.io/mode", None)
        if obj["kind"] == "ConfigMap":
            text = obj["data"]["config.conf"]
            assert text.endswith(f"\nmode: {mode}")
            obj["data"]["config.conf"] = text.removesuffix(mode)
        if obj["kind"] == "DaemonSet":
            tpl = obj["spec"]["template"]
            tpl["metadata"]["labels"].pop("kproxy.io/mode", None)
            spec = tpl["spec"]
            c = spec["containers"][0]
            caps = c["securityContext"]["capabilities"]
            caps["add"] = sorted(set(caps["add"]) - EXTRA_CAPS[mode])
            if mode in HOST_PID:
                spec.pop("hostPID")
            extra = EXTRA_VOLUMES.get(mode, set())
            spec["volumes"] = [v for v in spec["volumes"] if v["name"] not in extra]
            c["volumeMounts"] = [m for m in c["volumeMounts"] if m["name"] not in extra]
            spec.pop("initContainers", None)
            if mode in EXTRA_ARGS and c.get("args") == EXTRA_ARGS[mode]:
                c.pop("args")
        out.append(obj)
    return out


def test_overlays_differ_only_in_mode_and_needs(rendered: dict[str, list[dict[str, Any]]]) -> None:
    reference = _normalised(rendered["iptables"], "iptables")
    for mode in OVERLAYS:
        assert _normalised(rendered[mode], mode) == reference, mode


def test_image_tag_is_the_built_version(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """The DaemonSet runs the image `make image` builds (localhost/kproxy:<pyproject version>, which podman and
    CRI-O find under the short name)."""
    version = re.search(r'^version = "(.+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    assert version is not None
    for mode in OVERLAYS:
        assert container(rendered[mode])["image"] == f"kproxy:{version.group(1)}"


@pytest.mark.parametrize("mode", OVERLAYS)
def test_container_argv_follows_the_overlay(
    rendered: dict[str, list[dict[str, Any]]], mode: str, tmp_path: Path
) -> None:
    """The image test's podman command line grants what the rendered overlay grants, and nothing else."""
    from kproxy.lab.cluster import CGROUP_MOUNT, LabNode
    from kproxy.lab.container import ContainerLauncher, pod_spec

    spec = pod_spec(rendered[mode], mode)
    launcher = ContainerLauncher("localhost/kproxy:test", specs={mode: spec}, make_host_paths=False)
    lab = types.SimpleNamespace(prefix="kpu-", lab_api_url="http://198.18.0.1:6443")
    node = LabNode(1, "node-1", "kpu-n1", "198.18.0.11", "", "198.18.65.0/24", "", "zone-a")
    native = ["/x/kproxy", "run", "--mode", mode, "--master", "http://198.18.0.1:6443", "--hostname-override", "node-1"]
    if mode == "bpf":
        native += ["--bpf-cgroup-path", f"{CGROUP_MOUNT}/kpu-n1"]
    try:
        argv = launcher.argv(lab, node, native)  # type: ignore[arg-type]
    finally:
        launcher.remove_files()
    caps = container(rendered[mode])["securityContext"]["capabilities"]

    def values(flag: str) -> list[str]:
        return [argv[i + 1] for i, a in enumerate(argv) if a == flag]

    assert values("--cap-drop") == ["all"]
    assert sorted(values("--cap-add")) == sorted(caps["add"])
    assert "--privileged" not in argv
    assert "--read-only" in argv and "--read-only-tmpfs=false" in argv
    assert values("--user") == ["0"]
    assert "no-new-privileges" in values("--security-opt")
    assert values("--pid") == (["host"] if mode in HOST_PID else [])
    assert values("--network") == ["ns:/run/netns/kpu-n1"]
    mounted = {v.split(":")[1] for v in values("--volume")}
    assert {m["mountPath"] for m in container(rendered[mode])["volumeMounts"]} <= mounted
    i = argv.index("localhost/kproxy:test")
    assert argv[i + 1 : i + 4] == ["python", "-m", "kproxy.preflight"]
    assert argv[i + 4 : i + 9] == ["kproxy", "run", "--config", "/var/lib/kproxy/config.conf", "--hostname-override"]
    assert argv[i + 9] == "node-1"  # $(NODE_NAME), as the kubelet expands it
    if mode == "bpf":
        assert "/run/kproxy/cgroupv2/kpu-n1" in argv  # the lab's cgroup2 mount, where the overlay mounts it
