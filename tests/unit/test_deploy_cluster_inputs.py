"""The values of the user's cluster in the deploy manifests (issue 19): the control plane's address and the cluster
CIDR are explicit inputs that refuse to start when left unset, never a lab's values, and the API server is reached
through a kubeconfig with the control plane's own address (as kubeadm sets up kube-proxy), not through the
``kubernetes`` ClusterIP kproxy programs itself.

Renders every overlay with ``kubectl kustomize``, runs ``kproxy.preflight`` (the DaemonSet's command) on the rendered
command line and ConfigMap written to files, and once as a real ``python -m kproxy.preflight`` process.
"""

from __future__ import annotations

import ipaddress
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from kproxy.config import build_config, load_config_file

ROOT = Path(__file__).resolve().parents[2]
OVERLAYS = ("userspace", "iptables", "nftables", "bpf")
CONFIG_DIR = "/var/lib/kproxy"
# what a kubelet puts into every pod's environment, hostNetwork pods included
SERVICE_ENV = {"KUBERNETES_SERVICE_HOST": "198.19.0.1", "KUBERNETES_SERVICE_PORT": "443"}

pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed (make setup)")


def render(mode: str) -> list[dict[str, Any]]:
    out = subprocess.run(
        ["kubectl", "kustomize", str(ROOT / "deploy" / "overlays" / mode)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {mode: render(mode) for mode in OVERLAYS}


def _one(objs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (found,) = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == "kproxy"]
    return found


def _container(objs: list[dict[str, Any]]) -> dict[str, Any]:
    (c,) = [c for c in _one(objs, "DaemonSet")["spec"]["template"]["spec"]["containers"] if c["name"] == "kproxy"]
    return c


def _materialise(objs: list[dict[str, Any]], tmp: Path, **fill: str) -> list[str]:
    """Write the ConfigMap's files into ``tmp`` (placeholders replaced by ``fill``: {placeholder: value}) and return
    the container's command line with the ConfigMap's mount path pointing there, $(NODE_NAME) expanded."""
    for key, text in _one(objs, "ConfigMap")["data"].items():
        for placeholder, value in fill.items():
            text = text.replace(placeholder, value)
        (tmp / key).write_text(text.replace(CONFIG_DIR, str(tmp)))
    c = _container(objs)
    argv = [*c["command"], *c.get("args", [])]
    return [a.replace(CONFIG_DIR, str(tmp)).replace("$(NODE_NAME)", "node-1") for a in argv]


@pytest.mark.parametrize("mode", OVERLAYS)
def test_cluster_values_are_placeholders_not_lab_values(rendered: dict[str, list[dict[str, Any]]], mode: str) -> None:
    cm = _one(rendered[mode], "ConfigMap")["data"]
    conf = yaml.safe_load(cm["config.conf"])
    assert conf["clusterCIDR"].startswith("REPLACE-ME"), conf["clusterCIDR"]
    # no address of the lab (198.18.0.0/15) or of any other network poses as a default
    lab = ipaddress.ip_network("198.18.0.0/15")
    for text in cm.values():
        for word in text.replace(",", " ").replace("/", " ").replace(":", " ").split():
            try:
                assert ipaddress.ip_address(word) not in lab, f"the ConfigMap ships the lab's address {word}"
            except ValueError:
                continue
    # the kubeconfig lives in the same ConfigMap, mounted where config.conf says
    path = conf["clientConnection"]["kubeconfig"]
    assert path == f"{CONFIG_DIR}/kubeconfig.conf"
    mounts = {m["mountPath"]: m["name"] for m in _container(rendered[mode])["volumeMounts"]}
    assert mounts[CONFIG_DIR] == "config"
    kubeconfig = yaml.safe_load(cm["kubeconfig.conf"])
    (cluster,) = kubeconfig["clusters"]
    assert cluster["cluster"]["server"] == "https://REPLACE-ME-control-plane-address:6443"
    (user,) = kubeconfig["users"]
    assert user["user"]["tokenFile"] == "/var/run/secrets/kubernetes.io/serviceaccount/token"


@pytest.mark.parametrize("mode", OVERLAYS)
def test_the_daemonset_refuses_the_placeholders(
    rendered: dict[str, list[dict[str, Any]]], mode: str, tmp_path: Path
) -> None:
    """The rendered command line, as shipped, does not start: each placeholder is named; filled in, it does."""
    from kproxy.preflight import problems

    argv = _materialise(rendered[mode], tmp_path)
    assert argv[:3] == ["python", "-m", "kproxy.preflight"] and argv[3:5] == ["kproxy", "run"]
    found = problems(argv[3:], SERVICE_ENV)
    assert len(found) == 2, found
    assert "clusterCIDR" in found[0] and "REPLACE-ME-pod-cidr" in found[0]
    assert "REPLACE-ME-control-plane-address" in found[1] and "ClusterIP" in found[1]
    with pytest.raises(Exception, match="clusterCIDR"):  # kproxy itself refuses the placeholder CIDR as well
        build_config(load_config_file(tmp_path / "config.conf"), {})

    filled = _materialise(
        rendered[mode],
        tmp_path,
        **{"REPLACE-ME-pod-cidr": "198.18.64.0/18", "REPLACE-ME-control-plane-address": "198.18.0.1"},
    )
    assert problems(filled[3:], SERVICE_ENV) == []
    cfg = build_config(load_config_file(tmp_path / "config.conf"), {})
    assert cfg.cluster_cidrs == ("198.18.64.0/18",)
    assert cfg.kubeconfig == str(tmp_path / "kubeconfig.conf")


def test_the_kubernetes_clusterip_is_refused(rendered: dict[str, list[dict[str, Any]]], tmp_path: Path) -> None:
    """The first-boot trap in every spelling: in-cluster settings (no kubeconfig, no --master), a kubeconfig or a
    --master naming the kubernetes Service's ClusterIP. Flags win over the file, as in kproxy."""
    from kproxy.preflight import problems

    argv = _materialise(rendered["iptables"], tmp_path, **{"REPLACE-ME-pod-cidr": "198.18.64.0/18"})[3:]
    conf = tmp_path / "config.conf"
    text = conf.read_text()
    conf.write_text(text.replace(f"kubeconfig: {tmp_path}/kubeconfig.conf", 'kubeconfig: ""'))
    (found,) = problems(argv, SERVICE_ENV)
    assert "in-cluster" in found and "198.19.0.1" in found
    assert problems(argv, {}) == []  # no kubelet environment: nothing points at a ClusterIP
    (found,) = problems([*argv, "--master", "https://198.19.0.1:443"], SERVICE_ENV)
    assert "--master" in found and "ClusterIP" in found
    assert problems([*argv, "--master=https://198.18.0.1:6443"], SERVICE_ENV) == []
    kc = tmp_path / "kubeconfig.conf"
    kc.write_text(kc.read_text().replace("REPLACE-ME-control-plane-address", "198.19.0.1"))
    (found,) = problems([*argv, "--kubeconfig", str(kc)], SERVICE_ENV)
    assert "'default'" in found and "ClusterIP" in found
    # --cluster-cidr on the command line wins over the file's placeholder
    conf.write_text(text.replace("198.18.64.0/18", "REPLACE-ME-pod-cidr"))
    assert any("clusterCIDR" in p for p in problems(argv, SERVICE_ENV))
    assert not any("clusterCIDR" in p for p in problems([*argv, "--cluster-cidr", "198.18.64.0/18"], SERVICE_ENV))


def test_preflight_process_refuses_or_execs(rendered: dict[str, list[dict[str, Any]]], tmp_path: Path) -> None:
    """As the container runs it: exit 2 with the fields named on stderr, else the command that follows runs."""
    argv = _materialise(rendered["nftables"], tmp_path)
    res = subprocess.run(
        [sys.executable, "-m", "kproxy.preflight", *argv[3:]],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), **SERVICE_ENV},
        check=False,
    )
    assert res.returncode == 2, res
    lines = res.stderr.splitlines()
    assert len(lines) == 2 and all(ln.startswith("kproxy: cannot start: ") for ln in lines), lines
    ok = subprocess.run(
        [sys.executable, "-m", "kproxy.preflight", "/bin/echo", "run", "--master", "https://198.18.0.1:6443"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), **SERVICE_ENV},
        check=False,
    )
    assert (ok.returncode, ok.stdout) == (0, "run --master https://198.18.0.1:6443\n"), ok
