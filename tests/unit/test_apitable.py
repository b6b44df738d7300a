"""`kubectl get` against the API stand-in: the server-side Table (kproxy.lab.apitable), read by the real kubectl.

Debian's kubectl (installed by the set-up step) talks to a stand-in on 127.0.0.1 through a throwaway kubeconfig:
`kubectl get svc` must show TYPE, CLUSTER-IP, EXTERNAL-IP and PORT(S) as on a real cluster, `-o wide` the
priority-1 columns, and `-o json` / `-w` keep working. The Table JSON itself is checked over plain HTTP.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kproxy.lab.apiserver import ApiServer, serve
from kproxy.lab.apitable import human_age, table_version

KUBECTL = shutil.which("kubectl")
needs_kubectl = pytest.mark.skipif(KUBECTL is None, reason="kubectl not installed (make setup)")
TABLE_ACCEPT = (
    "application/json;as=Table;v=v1;g=meta.k8s.io,application/json;as=Table;v=v1beta1;g=meta.k8s.io,application/json"
)


@pytest.fixture
def api() -> Iterator[ApiServer]:
    server = serve([(None, "127.0.0.1", 0)])
    try:
        store = server.store
        store.create(service("web", selector={"app": "web"}, ports=[{"port": 80, "name": "http"}]))
        store.create(
            service(
                "np",
                type="NodePort",
                ports=[
                    {"port": 80, "name": "http", "nodePort": 30080},
                    {"port": 53, "name": "dns", "protocol": "UDP", "nodePort": 30053},
                ],
            )
        )
        store.create(service("lb", type="LoadBalancer", ports=[{"port": 443, "nodePort": 30443}]))
        ingress = service("lb-up", type="LoadBalancer", ports=[{"port": 443, "nodePort": 30444}])
        ingress["status"] = {"loadBalancer": {"ingress": [{"ip": "198.18.200.1"}]}}
        store.apply(ingress)
        store.create(service("ext", externalIPs=["198.18.100.1"], ports=[{"port": 8080, "name": "alt"}]))
        store.create(
            {
                "apiVersion": "discovery.k8s.io/v1",
                "kind": "EndpointSlice",
                "metadata": {"name": "web-1", "namespace": "default", "labels": {"kubernetes.io/service-name": "web"}},
                "addressType": "IPv4",
                "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
                "endpoints": [{"addresses": [f"198.18.1.{i}"]} for i in range(1, 6)],
            }
        )
        store.create(
            {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {"name": "node-a", "labels": {"node-role.kubernetes.io/control-plane": ""}},
                "status": {
                    "conditions": [{"type": "Ready", "status": "True"}],
                    "nodeInfo": {"kubeletVersion": "v1.33.0"},
                    "addresses": [{"type": "InternalIP", "address": "198.18.0.2"}],
                },
            }
        )
        yield server
    finally:
        server.close()


def service(name: str, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": "default"}, "spec": spec}


def kubectl(api: ApiServer, tmp_path: Path, *args: str) -> str:
    assert KUBECTL is not None
    config = tmp_path / "kubeconfig"
    if not config.exists():
        config.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "standin", "cluster": {"server": api.url}}],
                    "users": [{"name": "standin", "user": {}}],
                    "contexts": [{"name": "standin", "context": {"cluster": "standin", "user": "standin"}}],
                    "current-context": "standin",
                }
            )
        )
    env = {**os.environ, "HOME": str(tmp_path)}  # kubectl's discovery cache goes to $HOME/.kube
    out = subprocess.run(
        [KUBECTL, "--kubeconfig", str(config), *args], capture_output=True, text=True, timeout=60, env=env
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def rows(text: str) -> dict[str, list[str]]:
    """kubectl's columns by header, per row name (cells are separated by 2+ spaces)."""
    lines = [line for line in text.splitlines() if line.strip()]
    header = lines[0].split()
    table: dict[str, list[str]] = {}
    for line in lines[1:]:
        cells = [c for c in line.split("  ") if c.strip()]
        cells = [c.strip() for c in cells]
        assert len(cells) == len(header), (header, line)
        table[cells[header.index("NAME")]] = cells
    return {"HEADER": header, **table}


@needs_kubectl
def test_kubectl_get_services_shows_type_cluster_ip_and_ports(api: ApiServer, tmp_path: Path) -> None:
    out = rows(kubectl(api, tmp_path, "get", "svc"))
    assert out["HEADER"] == ["NAME", "TYPE", "CLUSTER-IP", "EXTERNAL-IP", "PORT(S)", "AGE"]
    ip = {name: api.store.get("services", "default", name)["spec"]["clusterIP"] for name in ("web", "np", "lb")}
    assert out["web"][:5] == ["web", "ClusterIP", ip["web"], "<none>", "80/TCP"]
    assert out["np"][:5] == ["np", "NodePort", ip["np"], "<none>", "80:30080/TCP,53:30053/UDP"]
    assert out["lb"][:5] == ["lb", "LoadBalancer", ip["lb"], "<pending>", "443:30443/TCP"]
    assert out["lb-up"][3] == "198.18.200.1"
    assert [out["ext"][i] for i in (1, 3, 4)] == ["ClusterIP", "198.18.100.1", "8080/TCP"]
    assert all(row[5].endswith("s") for name, row in out.items() if name != "HEADER")  # AGE, seconds old

    wide = rows(kubectl(api, tmp_path, "get", "svc", "-o", "wide"))
    assert wide["HEADER"] == ["NAME", "TYPE", "CLUSTER-IP", "EXTERNAL-IP", "PORT(S)", "AGE", "SELECTOR"]
    assert wide["web"][6] == "app=web" and wide["np"][6] == "<none>"

    one = rows(kubectl(api, tmp_path, "get", "svc", "np"))
    assert list(one) == ["HEADER", "np"] and one["np"][4] == "80:30080/TCP,53:30053/UDP"

    every = rows(kubectl(api, tmp_path, "get", "svc", "-A", "--show-labels"))
    assert every["HEADER"][0] == "NAMESPACE" and every["HEADER"][-1] == "LABELS"  # read from the row's metadata

    listed = json.loads(kubectl(api, tmp_path, "get", "svc", "-o", "json"))
    assert listed["kind"] == "List" and {i["metadata"]["name"] for i in listed["items"]} >= {"web", "np", "lb"}
    np_ports = next(i for i in listed["items"] if i["metadata"]["name"] == "np")["spec"]["ports"]
    assert [p["nodePort"] for p in np_ports] == [30080, 30053]


@needs_kubectl
def test_kubectl_get_endpointslices_and_nodes(api: ApiServer, tmp_path: Path) -> None:
    out = rows(kubectl(api, tmp_path, "get", "endpointslices"))
    assert out["HEADER"] == ["NAME", "ADDRESSTYPE", "PORTS", "ENDPOINTS", "AGE"]
    assert out["web-1"][1:4] == ["IPv4", "8080", "198.18.1.1,198.18.1.2,198.18.1.3 + 2 more..."]

    nodes = rows(kubectl(api, tmp_path, "get", "nodes"))
    assert nodes["HEADER"] == ["NAME", "STATUS", "ROLES", "AGE", "VERSION"]
    assert nodes["node-a"][1:3] == ["Ready", "control-plane"] and nodes["node-a"][4] == "v1.33.0"
    wide = rows(kubectl(api, tmp_path, "get", "nodes", "-o", "wide"))
    assert wide["HEADER"][5:7] == ["INTERNAL-IP", "EXTERNAL-IP"]
    assert wide["node-a"][5:7] == ["198.18.0.2", "<none>"]


@needs_kubectl
def test_kubectl_watch_prints_rows_as_they_come(api: ApiServer, tmp_path: Path) -> None:
    kubectl(api, tmp_path, "get", "svc", "web")  # writes the kubeconfig
    env = {**os.environ, "HOME": str(tmp_path)}
    assert KUBECTL is not None
    proc = subprocess.Popen(
        [KUBECTL, "--kubeconfig", str(tmp_path / "kubeconfig"), "get", "svc", "-w"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    lines: list[list[str]] = []
    reader = threading.Thread(target=lambda: lines.extend(line.split() for line in proc.stdout or () if line.strip()))
    reader.start()

    def later_printed() -> bool:
        return any(cells[:2] == ["later", "NodePort"] and cells[4] == "81:30081/TCP" for cells in list(lines)[1:])

    try:
        deadline = time.monotonic() + 20
        while not any(r.query.get("watch") == "true" for r in list(api.requests)) and time.monotonic() < deadline:
            time.sleep(0.05)
        api.store.create(service("later", type="NodePort", ports=[{"port": 81, "nodePort": 30081}]))
        while not later_printed() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        reader.join(timeout=20)
        if proc.stdout is not None:
            proc.stdout.close()
    assert lines[0] == ["NAME", "TYPE", "CLUSTER-IP", "EXTERNAL-IP", "PORT(S)", "AGE"]
    assert later_printed(), lines


def get_json(api: ApiServer, path: str, accept: str = TABLE_ACCEPT) -> dict[str, Any]:
    req = urllib.request.Request(api.url + path, headers={"Accept": accept})
    with urllib.request.urlopen(req, timeout=10) as resp:
        body: dict[str, Any] = json.load(resp)
        return body


def test_table_json_as_the_real_server_sends_it(api: ApiServer) -> None:
    body = get_json(api, "/api/v1/namespaces/default/services?limit=2")
    assert body["kind"] == "Table" and body["apiVersion"] == "meta.k8s.io/v1"
    assert body["metadata"]["resourceVersion"] and body["metadata"]["continue"]  # pages as lists do
    assert [c["name"] for c in body["columnDefinitions"]] == [
        "Name", "Type", "Cluster-IP", "External-IP", "Port(s)", "Age", "Selector"
    ]  # fmt: skip
    assert [c["priority"] for c in body["columnDefinitions"]] == [0, 0, 0, 0, 0, 0, 1]
    assert len(body["rows"]) == 2
    meta = body["rows"][0]["object"]
    assert meta["kind"] == "PartialObjectMetadata" and meta["metadata"]["namespace"] == "default"
    assert "spec" not in meta

    full = get_json(api, "/api/v1/namespaces/default/services/np?includeObject=Object")
    (row,) = full["rows"]
    assert row["cells"][:5] == [
        "np",
        "NodePort",
        row["object"]["spec"]["clusterIP"],
        "<none>",
        "80:30080/TCP,53:30053/UDP",
    ]
    assert row["object"]["kind"] == "Service" and row["object"]["spec"]["type"] == "NodePort"
    bare = get_json(api, "/api/v1/services?includeObject=None")
    assert all("object" not in r for r in bare["rows"]) and len(bare["rows"]) == 5

    beta = get_json(api, "/api/v1/nodes", "application/json;as=Table;v=v1beta1;g=meta.k8s.io")
    assert beta["apiVersion"] == "meta.k8s.io/v1beta1" and beta["rows"][0]["cells"][0] == "node-a"
    events = get_json(api, "/apis/events.k8s.io/v1/events")
    assert [c["name"] for c in events["columnDefinitions"]] == ["Name", "Age"] and events["rows"] == []
    plain = get_json(api, "/api/v1/namespaces/default/services", "application/json")
    assert plain["kind"] == "ServiceList"  # the official client's Accept gets the list, as before

    with pytest.raises(urllib.error.HTTPError) as err:
        get_json(api, "/api/v1/services?includeObject=Everything")
    assert err.value.code == 400
    err.value.close()


def test_table_helpers() -> None:
    assert table_version(TABLE_ACCEPT) == "v1"
    assert table_version("application/json;as=Table;v=v1beta1;g=meta.k8s.io, application/json") == "v1beta1"
    assert table_version("application/json") is None and table_version(None) is None
    assert table_version("application/json;as=Table;v=v2;g=meta.k8s.io") is None
    now = 1_000_000_000.0

    def ago(seconds: float) -> str:
        return human_age(time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now - seconds)), now)

    assert [ago(s) for s in (0, 119, 120, 305, 600, 3 * 3600 + 60, 9 * 3600, 50 * 3600, 10 * 86400, 800 * 86400)] == [
        "0s", "119s", "2m", "5m5s", "10m", "3h1m", "9h", "2d2h", "10d", "2y70d"
    ]  # fmt: skip
    assert human_age(None, now) == "<unknown>" and ago(-5) == "<invalid>"


def test_kproxy_start_does_not_load_the_api_stand_in() -> None:
    code = (
        "import sys, kproxy.cli, kproxy.daemon\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('kproxy.lab.api'))\n"
        "assert loaded == ['kproxy.lab.apicli'], loaded\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_command_line_help_states_the_stores_defaults() -> None:
    from kproxy.lab.apistore import DEFAULT_HISTORY, DEFAULT_SERVICE_CIDRS

    out = subprocess.run(
        [sys.executable, "-m", "kproxy", "apiserver", "--help"], capture_output=True, text=True, timeout=60
    )
    text = " ".join(out.stdout.split())
    assert f"(default {DEFAULT_HISTORY})" in text
    assert f"(default {' and '.join(DEFAULT_SERVICE_CIDRS)})" in text
