"""The soak's packet sweep: many TCP and UDP exchanges from one lab pod, in one process, reported as JSON.

``kproxy.soak.run`` starts it as ``ip netns exec POD python -S -m kproxy.soak.sweep`` in the pod's namespace and its
node's cgroup (so a cgroup-attached backend translates its sockets as a pod's) and writes the targets to its stdin::

    {"workers": 64, "targets": [{"id": "t1", "proto": "tcp", "host": "198.19.0.5", "port": 80,
                                 "attempts": 3, "timeout": 1.0}, ...]}

Each target's attempts run one after another, each a new connection (TCP) or a new connected socket (UDP) through
``kproxy.lab.probe``, with the payload ``info`` so the echo server names its pod and its own port; targets run in
parallel on ``workers`` threads, so a target that must be dropped costs its timeout once, not once per target. The
answer is one JSON object on stdout: target id -> the list of results (``ProbeResult.to_json``). Bounded: at most
``MAX_TARGETS`` targets, ``MAX_ATTEMPTS`` attempts each, ``MAX_TIMEOUT`` s per attempt. Standard library only.
"""

from __future__ import annotations

import json
import sys
import threading

from kproxy.lab.probe import tcp_once, udp_once

TYPE_CHECKING = False  # typing is not imported at run time (start-up)
if TYPE_CHECKING:
    from typing import Any

MAX_TARGETS = 5000
MAX_ATTEMPTS = 10
MAX_TIMEOUT = 5.0
MAX_WORKERS = 64


def _one(target: dict[str, Any], out: dict[str, list[dict[str, object]]], lock: threading.Lock) -> None:
    once = tcp_once if target.get("proto") == "tcp" else udp_once
    host = str(target["host"])
    port = int(target["port"])
    timeout = min(max(float(target.get("timeout") or 1.0), 0.05), MAX_TIMEOUT)
    attempts = min(max(int(target.get("attempts") or 1), 1), MAX_ATTEMPTS)
    results = [once(host, port, timeout, "info").to_json() for _ in range(attempts)]
    with lock:
        out[str(target["id"])] = results


def sweep(targets: list[dict[str, Any]], workers: int) -> dict[str, list[dict[str, object]]]:
    """Run every target (see the module docstring); id -> results."""
    out: dict[str, list[dict[str, object]]] = {}
    lock = threading.Lock()
    todo = list(targets[:MAX_TARGETS])
    todo_lock = threading.Lock()

    def worker() -> None:
        while True:
            with todo_lock:
                if not todo:
                    return
                target = todo.pop()
            _one(target, out, lock)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(min(max(workers, 1), MAX_WORKERS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def main() -> int:
    request = json.loads(sys.stdin.read() or "{}")
    targets = [t for t in request.get("targets") or [] if isinstance(t, dict)]
    print(json.dumps(sweep(targets, int(request.get("workers") or 64))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
