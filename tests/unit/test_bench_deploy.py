"""deploy/datapath: the real-cluster data-path probe renders with kustomize, every object is valid Kubernetes 1.32,
the probe Job runs on another node than the server and runs the probe module that ships in the image."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "datapath"

pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed (make setup)")


def _objects() -> list[dict[str, Any]]:
    out = subprocess.run(["kubectl", "kustomize", str(DEPLOY)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def test_objects_are_valid_and_in_their_own_namespace() -> None:
    objs = _objects()
    kinds = sorted(o["kind"] for o in objs)
    assert kinds == ["Deployment", "Job", "Namespace", "Role", "RoleBinding", "Service", "ServiceAccount"]
    for o in objs:
        kubernetes_validate.validate(o, "1.32", strict=True)
        if o["kind"] != "Namespace":
            assert o["metadata"]["namespace"] == "kproxy-datapath"


def test_job_probes_from_another_node_with_a_module_that_exists() -> None:
    objs = _objects()
    (job,) = [o for o in objs if o["kind"] == "Job"]
    spec = job["spec"]["template"]["spec"]
    term = spec["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
    assert term["topologyKey"] == "kubernetes.io/hostname" and term["labelSelector"]["matchLabels"] == {
        "app": "dp-server"
    }
    assert job["spec"]["activeDeadlineSeconds"] <= 900  # bounded
    cmd = spec["containers"][0]["command"]
    assert cmd[:3] == ["python", "-m", "kproxy.bench.k8sprobe"]
    assert importlib.util.find_spec("kproxy.bench.k8sprobe") is not None
    (dep,) = [o for o in objs if o["kind"] == "Deployment"]
    assert dep["spec"]["template"]["spec"]["containers"][0]["command"][:3] == ["python", "-m", "kproxy.lab.echo"]
    (role,) = [o for o in objs if o["kind"] == "Role"]
    verbs = {v for rule in role["rules"] for v in rule["verbs"]}
    assert verbs <= {"get", "list"}  # the probe only reads


def test_run_script_is_valid_bash() -> None:
    script = DEPLOY / "run.sh"
    assert script.stat().st_mode & 0o111
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True, timeout=30).returncode == 0
