"""A folder of manifests as an object source: run kproxy without an API server.

Used by the daemon when kproxy is started with a manifest folder instead of a cluster, and by the API stand-in's
`--load` (through `read_manifest_folder`). Every `*.yaml`, `*.yml` and `*.json` file directly in the folder is read
(multi-document YAML, `kind: List` with items); Services, EndpointSlices and the Node named `node_name` are handed to
the sink as full replacements. The folder is polled with `stat` only (names, sizes, mtimes), so an unchanged folder
costs almost nothing; any change re-reads the changed files and re-sends the whole set.

A file that does not parse is logged and skipped, and the objects it held at its last good read stay in place:
an editor's half-written save must not make services vanish. For the same reason a file that held objects and is
seen empty is believed only at the next poll (a writer's truncate comes before its write); writing to a temporary
name and renaming it into place avoids both. Objects labelled for another proxy
(`service.kubernetes.io/service-proxy-name`) or headless (`service.kubernetes.io/headless`) are dropped here, as
the server-side selector does for the kube source, so both sources hand the sink the same view.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

from kproxy.objects import clip
from kproxy.sources import ObjectSink
from kproxy.sources.selectors import wanted_by_proxy
from kproxy.validation import printable

log = logging.getLogger(__name__)

SUFFIXES = (".yaml", ".yml", ".json")

# (name, size, mtime_ns) of every manifest file: the cheap signature that decides whether to re-read.
FileSig = tuple[str, int, int]


class ManifestError(ValueError):
    """A manifest file that cannot be parsed."""


def _expand(doc: Any, where: str) -> Iterator[dict[str, Any]]:
    if doc is None:
        return
    if not isinstance(doc, Mapping):
        log.warning("files: %s: skipping a document that is not a mapping", clip(where))
        return
    if str(doc.get("kind", "")).endswith("List") and isinstance(doc.get("items"), list):
        for item in doc["items"]:
            yield from _expand(item, where)
        return
    yield dict(doc)


def parse_manifest(path: Path) -> list[dict[str, Any]]:
    """All objects in one manifest file (raises ManifestError if any document of it does not parse)."""
    try:
        text = path.read_text(encoding="utf-8")
        docs: list[Any] = [json.loads(text)] if path.suffix == ".json" else list(yaml.safe_load_all(text))
    except (OSError, UnicodeDecodeError, ValueError, yaml.YAMLError) as exc:
        # one log line however the parser words it (YAML errors span lines) and whatever the file is called
        raise ManifestError(printable(f"{path}: {exc}"[:2000])) from exc
    out: list[dict[str, Any]] = []
    for doc in docs:
        out.extend(_expand(doc, str(path)))
    return out


def manifest_files(folder: Path) -> list[Path]:
    """The manifest files directly in `folder`, sorted by name (hidden files, such as ConfigMap ..data, skipped)."""
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return []
    return sorted(
        Path(e.path)
        for e in entries
        if not e.name.startswith(".") and e.name.endswith(SUFFIXES) and e.is_file(follow_symlinks=True)
    )


def read_manifest_folder(folder: Path) -> list[dict[str, Any]]:
    """Every object of every manifest in the folder; files that do not parse are logged and skipped."""
    objs: list[dict[str, Any]] = []
    for path in manifest_files(folder):
        try:
            objs.extend(parse_manifest(path))
        except ManifestError as exc:
            log.warning("files: skipping unparsable manifest %s", exc)
    return objs


def _name(obj: Mapping[str, Any]) -> str:
    meta = obj.get("metadata")
    return str(meta.get("name") or "") if isinstance(meta, Mapping) else ""


def _kind(kind: Any) -> str:
    """An object's kind for a log line: clipped and escaped, whatever the file put there."""
    return clip(kind) if isinstance(kind, str) else f"<{type(kind).__name__} kind>"


def _with_namespace(obj: dict[str, Any]) -> dict[str, Any]:
    meta = dict(obj.get("metadata") or {})
    meta.setdefault("namespace", "default")
    return {**obj, "metadata": meta}


class FilesSource:
    """Feeds a sink from a folder of manifests, re-reading it when it changes (polling every `poll_interval`)."""

    def __init__(
        self,
        sink: ObjectSink,
        folder: Path | str,
        node_name: str,
        poll_interval: float = 1.0,
        *,
        service_proxy_name: str = "",
    ) -> None:
        self.sink = sink
        self.folder = Path(folder)
        self.node_name = node_name
        self.poll_interval = poll_interval
        self.service_proxy_name = service_proxy_name
        self.reads = 0  # how many times the folder was (re-)read and sent to the sink
        self.errors = 0  # unparsable file reads
        self._by_file: dict[str, tuple[FileSig, list[dict[str, Any]]]] = {}
        self._sigs: tuple[FileSig, ...] | None = None
        self._emptied: set[str] = set()  # files seen empty once after holding objects (see ``poll``)
        self._synced = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def synced(self) -> bool:
        return self._synced.is_set()

    def wait_synced(self, timeout: float | None = None) -> bool:
        return self._synced.wait(timeout)

    def start(self) -> FilesSource:
        self.poll()
        self._thread = threading.Thread(target=self._run, name="files-source", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=max(5.0, 2 * self.poll_interval))
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self.poll_interval):
            try:
                self.poll()
            except Exception:  # the source thread must outlive any surprise in one poll
                log.exception("files: poll of %s failed", clip(str(self.folder)))

    def _signatures(self) -> tuple[FileSig, ...]:
        sigs: list[FileSig] = []
        for path in manifest_files(self.folder):
            try:
                st = path.stat()
            except OSError:
                continue  # removed between scandir and stat: it is gone
            sigs.append((path.name, st.st_size, st.st_mtime_ns))
        return tuple(sigs)

    def poll(self) -> bool:
        """Re-read the folder if anything changed; True if the sink was fed."""
        sigs = self._signatures()
        if sigs == self._sigs:
            return False
        by_file: dict[str, tuple[FileSig, list[dict[str, Any]]]] = {}
        for sig in sigs:
            name = sig[0]
            previous = self._by_file.get(name)
            if previous is not None and previous[0] == sig:
                by_file[name] = previous
                continue
            if sig[1] == 0 and previous is not None and previous[1] and name not in self._emptied:
                # Emptied: most likely a writer between its truncate and its write (``open(..., "w")``). Keep the
                # last good objects, and believe the empty file only if the next poll still sees it empty.
                self._emptied.add(name)
                by_file[name] = previous
                continue
            self._emptied.discard(name)
            try:
                by_file[name] = (sig, parse_manifest(self.folder / name))
            except ManifestError as exc:
                self.errors += 1
                log.warning("files: keeping the last good objects of an unparsable manifest: %s", exc)
                # Remember the broken version's signature, so it is parsed again only once it changes.
                by_file[name] = (sig, previous[1] if previous is not None else [])
        same = by_file.keys() == self._by_file.keys() and all(
            objs is self._by_file[name][1] for name, (_sig, objs) in by_file.items()
        )
        self._by_file = by_file
        # a file kept at its last good objects because it was emptied is looked at again at the next poll
        self._sigs = None if self._emptied & by_file.keys() else sigs
        self._emptied &= by_file.keys()
        if same and self.reads:
            return False  # only emptied files held back: the sink already has exactly these objects
        self._feed([obj for _sig, objs in by_file.values() for obj in objs])
        return True

    def _feed(self, objs: list[dict[str, Any]]) -> None:
        services: dict[tuple[str, str], dict[str, Any]] = {}
        slices: dict[tuple[str, str], dict[str, Any]] = {}
        node: dict[str, Any] | None = None
        for obj in objs:
            kind, api_version, name = obj.get("kind"), str(obj.get("apiVersion", "")), _name(obj)
            if not name:
                log.warning("files: skipping a %s without metadata.name", _kind(kind))
                continue
            if kind == "Service" and api_version == "v1":
                obj = _with_namespace(obj)
                if wanted_by_proxy(obj, self.service_proxy_name):
                    services[(obj["metadata"]["namespace"], name)] = obj
            elif kind == "EndpointSlice" and api_version.startswith("discovery.k8s.io/"):
                obj = _with_namespace(obj)
                if wanted_by_proxy(obj, self.service_proxy_name):
                    slices[(obj["metadata"]["namespace"], name)] = obj
            elif kind == "Node" and name == self.node_name:
                node = obj
        # A later file wins for the same namespace/name: files are read in name order.
        self.sink.replace_services(list(services.values()))
        self.sink.replace_slices(list(slices.values()))
        self.sink.set_node(node)
        self.reads += 1
        if not self._synced.is_set():
            for kind in ("services", "endpointslices", "nodes"):
                self.sink.mark_synced(kind)
            self._synced.set()
