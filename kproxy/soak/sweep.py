"""The soak's packet sweep: many TCP and UDP exchanges from one lab pod, in one process, reported as JSON.

``kproxy.soak.run`` starts it as ``ip netns exec POD python -S -m kproxy.soak.sweep`` in the pod's namespace and its
node's cgroup (so a cgroup-attached backend translates its sockets as a pod's) and writes the targets to its stdin::

    {"workers": 64, "targets": [{"id": "t1", "proto": "tcp", "host": "198.19.0.5", "port": 80,
                                 "attempts": 3, "timeout": 1.0}, ...]}

Each target's attempts run one after another, each a new connection (TCP) or a new connected socket (UDP) through
``kproxy.lab.probe``, every second UDP attempt from an unconnected socket instead (``udp_unconnected``: its answer
carries ``source``), with the payload ``info`` so the echo server names its pod and its own port; targets run in
parallel on ``workers`` threads, so a target that must be dropped costs its timeout once, not once per target. The
answer is one JSON object on stdout: target id -> the list of results (``ProbeResult.to_json``). Bounded: at most
``MAX_TARGETS`` targets, ``MAX_ATTEMPTS`` attempts each, ``MAX_TIMEOUT`` s per attempt. Standard library only.
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time

from kproxy.lab.probe import ProbeResult, error_word, tcp_once, udp_once

TYPE_CHECKING = False  # typing is not imported at run time (start-up)
if TYPE_CHECKING:
    from typing import Any

MAX_TARGETS = 5000
MAX_ATTEMPTS = 10
MAX_TIMEOUT = 5.0
MAX_WORKERS = 64


def udp_unconnected(host: str, port: int, timeout: float, payload: str) -> dict[str, object]:
    """One datagram from an unconnected socket (``sendto``/``recvfrom``, as most resolvers send): the result with
    ``source``, the address the answer came from, which must be the one it was sent to (a proxy that translates the
    destination must translate the answer's source back). No ICMP error reaches such a socket: a refusal times out."""
    start = time.monotonic()
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sock.settimeout(timeout)
        sock.sendto((payload + "\n").encode(), (host, port))
        data, peer = sock.recvfrom(65535)
        result = ProbeResult(True, data.decode(errors="replace").split("\n", 1)[0], "", time.monotonic() - start)
        return {**result.to_json(), "source": f"[{peer[0]}]:{peer[1]}" if ":" in peer[0] else f"{peer[0]}:{peer[1]}"}
    except OSError as e:
        return ProbeResult(False, "", error_word(e), time.monotonic() - start).to_json()
    finally:
        sock.close()


def _one(target: dict[str, Any], out: dict[str, list[dict[str, object]]], lock: threading.Lock) -> None:
    host = str(target["host"])
    port = int(target["port"])
    timeout = min(max(float(target.get("timeout") or 1.0), 0.05), MAX_TIMEOUT)
    attempts = min(max(int(target.get("attempts") or 1), 1), MAX_ATTEMPTS)
    results: list[dict[str, object]] = []
    for i in range(attempts):
        if target.get("proto") == "tcp":
            results.append(tcp_once(host, port, timeout, "info").to_json())
        elif i % 2 == 1:  # every second UDP attempt from an unconnected socket: the sendmsg/recvmsg path
            results.append(udp_unconnected(host, port, timeout, "info"))
        else:
            results.append(udp_once(host, port, timeout, "info").to_json())
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
