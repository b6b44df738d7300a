"""Object sources: what feeds Services, EndpointSlices and this node's Node into the cache.

Two sources exist, both used by the daemon: `kube.KubeSource` (list + watch reflectors on the official client,
for real clusters and the lab's API stand-in) and `files.FilesSource` (a folder of manifests, for running without
an API server). Both push JSON-shaped dicts, exactly as the API returns them, into an `ObjectSink` — in production
the cache (kproxy.cache), in tests a small recorder. The sink is the only thing a source knows about the rest of
kproxy, which keeps this layer below the server and daemon and above the cache.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol

__all__ = ["ObjectSink", "SYNC_KINDS"]

# The names passed to ObjectSink.mark_synced, one per object kind a source delivers.
SYNC_KINDS = ("services", "endpointslices", "nodes")


class ObjectSink(Protocol):
    """Where sources deliver objects. Called from source threads; implementations must be thread-safe.

    `replace_*` carries a full (re)list: anything the sink holds that is not in it was deleted meanwhile.
    `upsert_*` returns True when the object changed what the sink holds (a hint for the caller; sources ignore it).
    `mark_synced(kind)` is called once per kind after the first successful full list.
    """

    def upsert_service(self, obj: Mapping[str, Any]) -> bool: ...
    def delete_service(self, namespace: str, name: str) -> None: ...
    def replace_services(self, objs: Iterable[Mapping[str, Any]]) -> None: ...
    def upsert_slice(self, obj: Mapping[str, Any]) -> bool: ...
    def delete_slice(self, namespace: str, name: str) -> None: ...
    def replace_slices(self, objs: Iterable[Mapping[str, Any]]) -> None: ...
    def set_node(self, obj: Mapping[str, Any] | None) -> None: ...
    def mark_synced(self, kind: str) -> None: ...
