"""A small Kubernetes Event recorder: what upstream kube-proxy reports about its node (for example "Starting").

Used by the daemon once at start-up (and for rare notable conditions), through the official client's
events.k8s.io/v1 API, as upstream's recorder does: `Recorder.Eventf(nodeRef, nil, Normal, "Starting",
"StartKubeProxy", "")` with a node reference whose UID is the node name. Recording is best effort: a failure is
logged and reported as False, never raised, because an API server that refuses Events must not stop the proxy.
"""

from __future__ import annotations

import logging
import time
from datetime import datetime, timezone
from typing import Any

import kubernetes
from kubernetes.client import ApiClient

log = logging.getLogger(__name__)


class EventRecorder:
    def __init__(
        self,
        api_client: ApiClient,
        node_name: str,
        *,
        controller: str = "kproxy",
        namespace: str = "default",
        timeout: float = 5.0,
    ) -> None:
        # Typed as Any: plain dict bodies and raw responses (_preload_content=False) are not in the client's stubs.
        self._api: Any = kubernetes.client.EventsV1Api(api_client)
        self.node_name = node_name
        self.controller = controller
        self.namespace = namespace  # events about cluster-scoped objects (a Node) live in "default"
        self.timeout = timeout
        self.recorded = 0
        self.failed = 0

    def node_event(self, reason: str, action: str, note: str = "", type_: str = "Normal") -> bool:
        """Record an event about this node; True if the server accepted it."""
        now = datetime.now(timezone.utc)
        body: dict[str, Any] = {
            "apiVersion": "events.k8s.io/v1",
            "kind": "Event",
            # Upstream names events <object>.<hex nanoseconds>, unique per object and moment.
            "metadata": {"name": f"{self.node_name}.{time.time_ns():x}", "namespace": self.namespace},
            "eventTime": now.strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
            "reportingController": self.controller,
            "reportingInstance": f"{self.controller}-{self.node_name}",
            "action": action,
            "reason": reason,
            "type": type_,
            "regarding": {"kind": "Node", "apiVersion": "v1", "name": self.node_name, "uid": self.node_name},
        }
        if note:
            body["note"] = note[:1024]
        try:
            resp = self._api.create_namespaced_event(
                self.namespace, body, _preload_content=False, _request_timeout=(self.timeout, self.timeout)
            )
            resp.release_conn()
        except Exception as exc:  # noqa: BLE001 - best effort by design
            self.failed += 1
            log.warning("events: could not record %s/%s for node %s: %s", reason, action, self.node_name, exc)
            return False
        self.recorded += 1
        return True

    def starting(self) -> bool:
        """Upstream's start-up event."""
        return self.node_event("Starting", "StartKubeProxy")
