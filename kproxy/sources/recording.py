"""`RecordingSink`: a first-class fake `ObjectSink` that keeps what it is given and logs every call.

Used by the source tests (tests/unit/test_reflector.py, test_files_source.py) and by anyone who wants to see what a
source delivers without a cache (for instance to check a lab's API stand-in by hand). Thread-safe; `wait_for`
blocks until a predicate over the current state holds, so tests need no sleeps.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

Key = tuple[str, str]


def _key(obj: Mapping[str, Any]) -> Key:
    meta = obj.get("metadata") or {}
    return str(meta.get("namespace") or ""), str(meta.get("name") or "")


class RecordingSink:
    def __init__(self) -> None:
        self.services: dict[Key, dict[str, Any]] = {}
        self.slices: dict[Key, dict[str, Any]] = {}
        self.node: dict[str, Any] | None = None
        self.synced: set[str] = set()
        self.calls: list[tuple[str, Any]] = []  # (method, key or count) in call order
        self._cond = threading.Condition()

    def _changed(self, call: str, arg: Any) -> None:
        self.calls.append((call, arg))
        self._cond.notify_all()

    def upsert_service(self, obj: Mapping[str, Any]) -> bool:
        with self._cond:
            key = _key(obj)
            changed = self.services.get(key) != obj
            self.services[key] = copy.deepcopy(dict(obj))
            self._changed("upsert_service", key)
            return changed

    def delete_service(self, namespace: str, name: str) -> None:
        with self._cond:
            self.services.pop((namespace, name), None)
            self._changed("delete_service", (namespace, name))

    def replace_services(self, objs: Iterable[Mapping[str, Any]]) -> None:
        with self._cond:
            self.services = {_key(o): copy.deepcopy(dict(o)) for o in objs}
            self._changed("replace_services", len(self.services))

    def upsert_slice(self, obj: Mapping[str, Any]) -> bool:
        with self._cond:
            key = _key(obj)
            changed = self.slices.get(key) != obj
            self.slices[key] = copy.deepcopy(dict(obj))
            self._changed("upsert_slice", key)
            return changed

    def delete_slice(self, namespace: str, name: str) -> None:
        with self._cond:
            self.slices.pop((namespace, name), None)
            self._changed("delete_slice", (namespace, name))

    def replace_slices(self, objs: Iterable[Mapping[str, Any]]) -> None:
        with self._cond:
            self.slices = {_key(o): copy.deepcopy(dict(o)) for o in objs}
            self._changed("replace_slices", len(self.slices))

    def set_node(self, obj: Mapping[str, Any] | None) -> None:
        with self._cond:
            self.node = copy.deepcopy(dict(obj)) if obj is not None else None
            self._changed("set_node", _key(obj)[1] if obj is not None else None)

    def mark_synced(self, kind: str) -> None:
        with self._cond:
            self.synced.add(kind)
            self._changed("mark_synced", kind)

    def count(self, call: str) -> int:
        with self._cond:
            return sum(1 for c, _ in self.calls if c == call)

    def wait_for(self, predicate: Callable[[RecordingSink], bool], timeout: float = 5.0) -> bool:
        """Wait until predicate(self) is true (evaluated under the sink's lock); False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate(self):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.1))
            return True
