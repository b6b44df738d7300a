"""FilesSource: a folder of manifests feeding a sink, re-read on change, broken files skipped without loss."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kproxy.sources.files import FilesSource, parse_manifest, read_manifest_folder
from kproxy.sources.recording import RecordingSink

SERVICES = """\
apiVersion: v1
kind: Service
metadata: {name: web, namespace: shop}
spec:
  clusterIP: 198.19.0.10
  ports: [{name: http, port: 80, targetPort: 8080}]
---
apiVersion: v1
kind: Service
metadata: {name: nons}
spec: {clusterIP: 198.19.0.11, ports: [{port: 53, protocol: UDP}]}
---
apiVersion: v1
kind: Service
metadata:
  name: not-ours
  labels: {service.kubernetes.io/service-proxy-name: other}
spec: {clusterIP: 198.19.0.12, ports: [{port: 1}]}
---
apiVersion: v1
kind: Service
metadata:
  name: headless
  labels: {service.kubernetes.io/headless: ""}
spec: {clusterIP: None, ports: [{port: 1}]}
---
# an empty document and a comment are fine
"""

SLICES = """\
apiVersion: v1
kind: List
items:
- apiVersion: discovery.k8s.io/v1
  kind: EndpointSlice
  metadata: {name: web-1, namespace: shop, labels: {kubernetes.io/service-name: web}}
  addressType: IPv4
  endpoints: [{addresses: [198.18.3.1], conditions: {ready: true}}]
  ports: [{name: http, port: 8080}]
- apiVersion: discovery.k8s.io/v1
  kind: EndpointSlice
  metadata: {name: nons-1, labels: {kubernetes.io/service-name: nons}}
  addressType: IPv4
  endpoints: [{addresses: [198.18.3.2]}]
  ports: [{port: 53, protocol: UDP}]
"""

NODES = {
    "apiVersion": "v1",
    "kind": "List",
    "items": [
        {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-1", "labels": {"zone": "a"}}},
        {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-2"}},
    ],
}


def write(path: Path, text: str) -> None:
    """Write and move the mtime forward, so a rewrite within one clock tick is still seen as a change."""
    old = path.stat().st_mtime_ns if path.exists() else 0
    path.write_text(text)
    st = path.stat()
    if st.st_mtime_ns <= old:
        os.utime(path, ns=(st.st_atime_ns, old + 1_000_000))


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    d = tmp_path / "manifests"
    d.mkdir()
    write(d / "services.yaml", SERVICES)
    write(d / "slices.yml", SLICES)
    write(d / "nodes.json", json.dumps(NODES))
    write(d / "README.txt", "not a manifest")
    write(d / ".hidden.yaml", "kind: Service\nmetadata: {name: hidden}\n")
    return d


@pytest.fixture
def source(folder: Path) -> Iterator[tuple[FilesSource, RecordingSink]]:
    sink = RecordingSink()
    src = FilesSource(sink, folder, "node-1", poll_interval=0.05)
    try:
        yield src, sink
    finally:
        src.stop()


def test_reads_services_slices_and_own_node(source: tuple[FilesSource, RecordingSink]) -> None:
    src, sink = source
    src.start()
    assert src.synced and sink.synced == {"services", "endpointslices", "nodes"}
    assert set(sink.services) == {("shop", "web"), ("default", "nons")}  # labelled ones dropped
    assert set(sink.slices) == {("shop", "web-1"), ("default", "nons-1")}
    assert sink.node is not None and sink.node["metadata"]["labels"] == {"zone": "a"}
    assert sink.services[("shop", "web")]["spec"]["ports"][0]["targetPort"] == 8080
    assert sink.count("replace_services") == 1 and src.reads == 1


def test_change_add_and_remove_files_rereads(folder: Path, source: tuple[FilesSource, RecordingSink]) -> None:
    src, sink = source
    src.start()
    # An unchanged folder is not re-read.
    assert not sink.wait_for(lambda s: s.count("replace_services") > 1, timeout=0.3)

    write(folder / "services.yaml", SERVICES.replace("198.19.0.10", "198.19.0.20"))
    assert sink.wait_for(lambda s: s.services[("shop", "web")]["spec"]["clusterIP"] == "198.19.0.20")

    write(folder / "extra.yaml", "apiVersion: v1\nkind: Service\nmetadata: {name: extra}\nspec: {ports: [{port: 9}]}\n")
    assert sink.wait_for(lambda s: ("default", "extra") in s.services)

    (folder / "slices.yml").unlink()
    assert sink.wait_for(lambda s: not s.slices)

    nodes = json.loads(json.dumps(NODES))
    nodes["items"] = nodes["items"][1:]
    write(folder / "nodes.json", json.dumps(nodes))
    assert sink.wait_for(lambda s: s.node is None)


def test_broken_file_is_skipped_and_keeps_its_last_good_objects(
    folder: Path, source: tuple[FilesSource, RecordingSink]
) -> None:
    src, sink = source
    src.start()
    reads = src.reads
    write(folder / "slices.yml", SLICES + "\n  - : [unbalanced\n")  # half-written save
    assert sink.wait_for(lambda s: src.errors == 1)
    assert set(sink.slices) == {("shop", "web-1"), ("default", "nons-1")}  # nothing lost
    # Other files still count.
    write(folder / "services.yaml", SERVICES.split("---")[0])
    assert sink.wait_for(lambda s: set(s.services) == {("shop", "web")})
    assert set(sink.slices) == {("shop", "web-1"), ("default", "nons-1")}
    # The broken file is not parsed again until it changes.
    settled = src.reads
    assert not sink.wait_for(lambda s: src.errors > 1 or src.reads > settled, timeout=0.3)
    assert src.reads > reads
    # Fixed: its new content replaces the old.
    write(folder / "slices.yml", SLICES.split("- apiVersion")[0] + "- apiVersion" + SLICES.split("- apiVersion")[1])
    assert sink.wait_for(lambda s: set(s.slices) == {("shop", "web-1")})


def test_a_file_caught_between_truncate_and_write_loses_nothing(folder: Path) -> None:
    """``open(path, "w")`` empties the file before its write: a poll in between must not drop its services, and
    a file that stays empty is believed at the next poll."""
    sink = RecordingSink()
    src = FilesSource(sink, folder, "node-1", poll_interval=3600)  # polled by hand below
    src.start()
    fed = sink.count("replace_services")
    write(folder / "services.yaml", "")  # the truncate, seen before the write
    assert not src.poll(), "an emptied file fed the sink at once"
    assert set(sink.services) == {("shop", "web"), ("default", "nons")}
    write(folder / "services.yaml", SERVICES.split("---")[0])  # the write
    assert src.poll() and set(sink.services) == {("shop", "web")}
    write(folder / "services.yaml", "")
    assert not src.poll() and set(sink.services) == {("shop", "web")}
    assert src.poll() and sink.services == {}  # still empty at the next poll: the file is empty
    assert not src.poll() and sink.count("replace_services") == fed + 2


def test_broken_file_at_start_is_skipped(folder: Path) -> None:
    write(folder / "bad.json", "{not json")
    sink = RecordingSink()
    src = FilesSource(sink, folder, "node-1", poll_interval=10).start()
    try:
        assert src.synced and src.errors == 1
        assert ("shop", "web") in sink.services
    finally:
        src.stop()


def test_missing_folder_gives_an_empty_synced_view(tmp_path: Path) -> None:
    sink = RecordingSink()
    src = FilesSource(sink, tmp_path / "absent", "node-1", poll_interval=0.05).start()
    try:
        assert src.synced and not sink.services and sink.node is None
        (tmp_path / "absent").mkdir()
        write(tmp_path / "absent" / "s.yaml", "apiVersion: v1\nkind: Service\nmetadata: {name: s}\nspec: {}\n")
        assert sink.wait_for(lambda s: ("default", "s") in s.services)
    finally:
        src.stop()


def test_parse_helpers(folder: Path) -> None:
    objs = parse_manifest(folder / "slices.yml")
    assert [o["metadata"]["name"] for o in objs] == ["web-1", "nons-1"]
    kinds = sorted(o["kind"] for o in read_manifest_folder(folder))
    assert kinds == ["EndpointSlice"] * 2 + ["Node"] * 2 + ["Service"] * 4
