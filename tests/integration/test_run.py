"""`kproxy run` as a user runs it: a real process in a network namespace of the test's own (prefix kpr-), fed by a
manifest folder. It must program the kernel, answer `kproxy show`, stop on SIGTERM leaving its rules in place (so
connections survive a restart), and `kproxy cleanup` / `kproxy run --cleanup` must then remove them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.root

KPROXY = [sys.executable, "-m", "kproxy"]


def sh(ns: str, *argv: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["ip", "netns", "exec", ns, *argv], capture_output=True, text=True, check=check, timeout=timeout
    )


@pytest.fixture
def netns() -> Iterator[str]:
    name = f"kpr-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        sh(name, "ip", "link", "set", "lo", "up")
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


def manifests(folder: Path) -> None:
    objs = [
        {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-1"}, "spec": {"podCIDRs": ["198.18.65.0/24"]}},
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"namespace": "demo", "name": "web"},
            "spec": {"clusterIP": "198.19.0.10", "ports": [{"name": "http", "port": 80, "protocol": "TCP"}]},
        },
        {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {"namespace": "demo", "name": "web-1", "labels": {"kubernetes.io/service-name": "web"}},
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
            "endpoints": [{"addresses": ["198.18.65.11"], "conditions": {"ready": True}, "nodeName": "node-1"}],
        },
    ]
    (folder / "objects.yaml").write_text(yaml.safe_dump_all(objs))


def kube_chains(ns: str) -> list[str]:
    out = sh(ns, "iptables-save", "-t", "nat").stdout
    return [ln.split()[0][1:] for ln in out.splitlines() if ln.startswith(":KUBE-")]


def wait_for(check: object, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return
        time.sleep(0.2)
    raise AssertionError(f"not within {timeout}s: {check}")


def test_run_show_sigterm_keeps_rules_then_cleanup(netns: str, tmp_path: Path) -> None:
    manifests(tmp_path)
    argv = [
        *KPROXY,
        "run",
        "--mode",
        "iptables",
        "--manifests",
        str(tmp_path),
        "--hostname-override",
        "node-1",
        "--cluster-cidr",
        "198.18.64.0/18",
        "--healthz-bind-address",
        "127.0.0.1:10256",
        "--metrics-bind-address",
        "127.0.0.1:10249",
        "--sync-period",
        "5s",
        "--min-sync-period",
        "0",
    ]
    log = (tmp_path / "kproxy.log").open("wb")
    proc = subprocess.Popen(["ip", "netns", "exec", netns, *argv], stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: any(c.startswith("KUBE-SVC-") for c in kube_chains(netns)))
        shown = json.loads(sh(netns, *KPROXY, "show", "--format", "json").stdout)
        assert shown["mode"] == "iptables" and shown["ready"] is True
        assert "demo/web:http/TCP" in shown["backend"]["services"]
        text = sh(netns, *KPROXY, "show", "--service", "demo/web:http").stdout
        assert "198.18.65.11:8080" in text
        before = kube_chains(netns)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0, (tmp_path / "kproxy.log").read_text()
        assert kube_chains(netns) == before  # never flushed on exit
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        log.close()
    r = sh(netns, *KPROXY, "cleanup", "--mode", "iptables")
    assert r.returncode == 0, r.stderr
    assert kube_chains(netns) == []
    saved = sh(netns, "iptables-save").stdout + sh(netns, "ip6tables-save").stdout
    # KUBE-FIREWALL (the localnet drop that comes with localhost NodePorts) is kubelet's chain too, as upstream's: it
    # stays, so cleanup never takes a node's CVE-2020-8558 protection away; nothing else of kproxy's may
    assert not [ln for ln in saved.splitlines() if "KUBE-" in ln and "KUBE-FIREWALL" not in ln], saved


def test_run_cleanup_flag_removes_everything(netns: str, tmp_path: Path) -> None:
    sh(netns, "iptables", "-t", "nat", "-N", "KUBE-SERVICES")
    sh(netns, "iptables", "-t", "nat", "-A", "OUTPUT", "-j", "KUBE-SERVICES")
    sh(netns, "iptables", "-t", "nat", "-N", "SOMEONE-ELSE")
    r = sh(netns, *KPROXY, "run", "--cleanup", "--manifests", str(tmp_path))
    assert r.returncode == 0, r.stderr
    save = sh(netns, "iptables-save", "-t", "nat").stdout
    assert "KUBE-" not in save and ":SOMEONE-ELSE" in save  # only ours goes


def test_a_changed_config_file_ends_the_process(netns: str, tmp_path: Path) -> None:
    """As upstream: kproxy exits (non-zero, so the DaemonSet restarts it with the new file) when its --config
    changes, and leaves its rules in place while doing so."""
    manifests(tmp_path)
    conf = tmp_path / "config.conf"
    doc = {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "mode": "iptables",
        "clusterCIDR": "198.18.64.0/18",
        "metricsBindAddress": "127.0.0.1:10249",
    }
    conf.write_text(yaml.safe_dump(doc))
    argv = [*KPROXY, "run", "--config", str(conf), "--manifests", str(tmp_path), "--hostname-override", "node-1"]
    proc = subprocess.Popen(
        ["ip", "netns", "exec", netns, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # synced: the service's rules are in
            if "198.19.0.10" in sh(netns, "iptables-save", "-t", "nat", check=False).stdout:
                break
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.2)
        else:
            raise AssertionError("kproxy never programmed the service")
        assert proc.poll() is None
        conf.write_text(yaml.safe_dump({**doc, "metricsBindAddress": "127.0.0.1:10250"}))
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 1 and "changed" in err, err[-2000:]
        assert "198.19.0.10" in sh(netns, "iptables-save", "-t", "nat").stdout  # rules left for the restart
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
