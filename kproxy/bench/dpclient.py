"""The data-path benchmark's traffic generator: new TCP connections per second, request/response latency on one
established connection, and UDP request/response, against the lab's echo servers (one line in, one line out).

``kproxy.bench.datapath`` runs it inside a lab pod, pinned to one CPU (``ip netns exec POD taskset -c 0 python -m
kproxy.bench.dpclient HOST PORT``), and reads the one JSON object it prints. It exists because no packaged tool fits
those three measurements against a plain line echo (iperf3 covers bulk throughput; wrk needs an HTTP server). It is
deliberately small and single-threaded: the client's own cost per operation is the same for every target, so the
ratios the benchmark reports (ClusterIP and pod IP against the pod IP on nodes without proxy rules) stay honest.

Phases, each bounded in time (``--seconds``) and in count (``--max-ops``), each after a short warm-up whose figures
are discarded:

* ``crr``: connect, send one line, read the answer, close with RST (``SO_LINGER`` 0), so the client builds up no
  TIME_WAIT sockets (which otherwise dominate the rate); figures: connections per second, p50/p99 of each whole
  connection's time;
* ``rr``: one TCP connection (``TCP_NODELAY``), one line out and one in per request; requests per second, p50/p99;
* ``udp``: a connected UDP socket, one datagram out and one in; a lost answer counts as an error after ``--timeout``.

``--serve`` keeps one client running and takes one measurement request per line on stdin (see :func:`serve`): the
lab benchmark keeps one such client per client pod and interleaves short phases between targets.

Standard library only (``python -S`` works), so it starts quickly in every pod.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import struct
import sys
import time

TYPE_CHECKING = False  # typing is not imported at run time: the client starts in every pod
if TYPE_CHECKING:
    from typing import TextIO

MAX_OPS = 2_000_000
MAX_SECONDS = 60.0
LINE = b"x\n"
TRIM = 100  # the slowest 1 / TRIM of the operations are left out of the rate
_LINGER_RST = struct.pack("ii", 1, 0)


def percentile(sorted_values: list[float], q: float) -> float:
    """The q-quantile (0..1) of an ascending list, nearest-rank; 0.0 for an empty list."""
    if not sorted_values:
        return 0.0
    k = min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values)) - 1))
    return sorted_values[k]


def summarize(kind: str, latencies: list[float], errors: int, elapsed: float) -> dict[str, object]:
    """One phase's figures: rate (operations per second of wall time), latency percentiles in microseconds."""
    lat = sorted(latencies)
    n = len(lat)
    kept = lat[: max(1, n - n // TRIM)] if n else []
    return {
        "kind": kind,
        "ops": n,
        "errors": errors,
        "seconds": round(elapsed, 4),
        "rate_raw": round(n / elapsed, 1) if elapsed > 0 else 0.0,
        # operations per second of their own time, the slowest 1 % left out: on a shared 2-core machine those are
        # the client or server preempted for milliseconds, which would otherwise decide a target's rate
        "rate": round(len(kept) / sum(kept), 1) if kept and sum(kept) > 0 else 0.0,
        "p50_us": round(percentile(lat, 0.50) * 1e6, 1),
        "p90_us": round(percentile(lat, 0.90) * 1e6, 1),
        "p99_us": round(percentile(lat, 0.99) * 1e6, 1),
        "mean_us": round(sum(lat) / n * 1e6, 1) if n else 0.0,
    }


def _read_line(sock: socket.socket) -> bool:
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = sock.recv(512)
        if not chunk:
            return False
        buf += chunk
    return True


def _crr_once(host: str, port: int, timeout: float) -> bool:
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RST)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.settimeout(timeout)
        s.connect((host, port))
        s.sendall(LINE)
        return _read_line(s)
    except OSError:
        return False
    finally:
        s.close()


def crr(host: str, port: int, seconds: float, max_ops: int, timeout: float, warmup: float) -> dict[str, object]:
    """New connections: connect, one exchange, close with RST."""
    clock = time.perf_counter
    end_warm = clock() + warmup
    while clock() < end_warm:
        _crr_once(host, port, timeout)
    lat: list[float] = []
    errors = 0
    start = clock()
    deadline = start + seconds
    now = start
    while now < deadline and len(lat) + errors < max_ops:
        ok = _crr_once(host, port, timeout)
        t = clock()
        if ok:
            lat.append(t - now)
        else:
            errors += 1
        now = t
    return summarize("crr", lat, errors, now - start)


def rr(host: str, port: int, seconds: float, max_ops: int, timeout: float, warmup: float) -> dict[str, object]:
    """Requests on one established TCP connection."""
    clock = time.perf_counter
    lat: list[float] = []
    errors = 0
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.settimeout(timeout)
    start = now = clock()
    try:
        s.connect((host, port))
        end_warm = clock() + warmup
        while clock() < end_warm:
            s.sendall(LINE)
            if not _read_line(s):
                raise OSError("closed")
        start = now = clock()
        deadline = start + seconds
        while now < deadline and len(lat) < max_ops:
            s.sendall(LINE)
            if not _read_line(s):
                raise OSError("closed")
            t = clock()
            lat.append(t - now)
            now = t
    except OSError:
        errors += 1  # the connection broke: the figures so far stand, the error says it did not finish
        now = clock()
    finally:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RST)
        s.close()
    return summarize("rr", lat, errors, now - start)


def udp(host: str, port: int, seconds: float, max_ops: int, timeout: float, warmup: float) -> dict[str, object]:
    """Datagram request/response on one connected UDP socket (a lost answer is an error after ``timeout``)."""
    clock = time.perf_counter
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(timeout)
    lat: list[float] = []
    errors = 0
    start = now = clock()
    try:
        s.connect((host, port))
        end_warm = clock() + warmup
        while clock() < end_warm:
            try:
                s.send(LINE)
                s.recv(512)
            except OSError:
                pass
        start = now = clock()
        deadline = start + seconds
        while now < deadline and len(lat) + errors < max_ops:
            try:
                s.send(LINE)
                s.recv(512)
                t = clock()
                lat.append(t - now)
            except OSError:
                t = clock()
                errors += 1
            now = t
    finally:
        s.close()
    return summarize("udp", lat, errors, now - start)


PHASES = {"crr": crr, "rr": rr, "udp": udp}

# --- interleaved: one operation per target in turn, so a shared machine's load hits every target alike ------------

CLONE_NEWNET = 0x40000000
_NETNS_DIR = "/run/netns/"
_libc = None


def _netns_fd(name: str) -> int:
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"not a network namespace name: {name!r}")
    return os.open(_NETNS_DIR + name, os.O_RDONLY)


def _setns(fd: int) -> None:
    """Enter a network namespace (root): sockets made afterwards live there, whatever the process does next."""
    global _libc
    import ctypes

    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _open_conn(kind: str, host: str, port: int, timeout: float) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    if kind == "rr":
        s = socket.socket(family, socket.SOCK_STREAM)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    else:
        s = socket.socket(family, socket.SOCK_DGRAM)
    s.settimeout(timeout)
    try:
        s.connect((host, port))
    except OSError:
        s.close()
        raise
    return s


def _exchange(kind: str, s: socket.socket) -> bool:
    try:
        if kind == "rr":
            s.sendall(LINE)
            return _read_line(s)
        s.send(LINE)
        s.recv(512)
        return True
    except OSError:
        return False


def interleaved(
    kind: str, targets: list[dict[str, object]], seconds: float, max_ops: int, timeout: float, warmup: float
) -> list[dict[str, object]]:
    """``kind`` (crr, rr, udp) against every target in turn, one operation each, until ``seconds`` of wall time:
    each target is ``{"netns": NAME, "host": ..., "port": N}`` and its sockets are made in that network namespace.
    A target's rate is its operations over the time spent in them (what it would reach alone, one at a time), so
    drift on a shared machine, which hits neighbouring operations alike, cancels in the ratios between targets."""
    clock = time.perf_counter
    fds = [_netns_fd(str(t["netns"])) for t in targets]
    home = os.open("/proc/self/ns/net", os.O_RDONLY)
    conns: list[socket.socket | None] = [None] * len(targets)
    lat: list[list[float]] = [[] for _ in targets]
    errors = [0] * len(targets)
    busy = [0.0] * len(targets)
    try:
        if kind in ("rr", "udp"):
            for i, t in enumerate(targets):
                _setns(fds[i])
                try:
                    conns[i] = _open_conn(kind, str(t["host"]), int(str(t["port"])), timeout)
                except OSError:
                    errors[i] += 1
        for measuring, length in ((False, warmup), (True, seconds)):
            start = clock()
            deadline = start + length
            turn = 0
            while clock() < deadline and sum(len(x) for x in lat) + sum(errors) < max_ops:
                i = turn % len(targets)
                turn += 1
                if kind == "crr":
                    _setns(fds[i])
                    t0 = clock()
                    ok = _crr_once(str(targets[i]["host"]), int(str(targets[i]["port"])), timeout)
                else:
                    conn = conns[i]
                    t0 = clock()
                    ok = conn is not None and _exchange(kind, conn)
                t1 = clock()
                if not measuring:
                    continue
                busy[i] += t1 - t0
                if ok:
                    lat[i].append(t1 - t0)
                else:
                    errors[i] += 1
    finally:
        for c in conns:
            if c is not None:
                if kind == "rr":
                    c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RST)
                c.close()
        _setns(home)
        for fd in [*fds, home]:
            os.close(fd)
    return [summarize(kind, lat[i], errors[i], busy[i]) for i in range(len(targets))]


def serve(stdin: TextIO | None = None, stdout: TextIO | None = None) -> int:
    """``--serve``: one measurement per request line, one JSON answer line each, until EOF or ``quit``.

    A request is ``{"phase": "crr"|"rr"|"udp", "host": ..., "port": N, "seconds": S, "warmup": W, "timeout": T,
    "max_ops": N}``, or with ``"targets": [{"netns": NAME, "host": ..., "port": N}, ...]`` instead of host and port
    for :func:`interleaved` (answer: ``{"targets": [figures, ...]}`` in the same order). Staying alive between
    requests saves a process start per phase."""
    inp = stdin if stdin is not None else sys.stdin
    out = stdout if stdout is not None else sys.stdout
    for line in inp:
        line = line.strip()
        if not line:
            continue
        if line == "quit":
            break
        try:
            req = json.loads(line)
            seconds = min(max(float(req.get("seconds", 1.0)), 0.01), MAX_SECONDS)
            if "targets" in req:
                if req["phase"] not in PHASES:
                    raise KeyError(req["phase"])
                got = interleaved(
                    str(req["phase"]),
                    list(req["targets"]),
                    seconds,
                    min(max(int(req.get("max_ops", 200_000)), 1), MAX_OPS),
                    float(req.get("timeout", 1.0)),
                    min(float(req.get("warmup", 0.05)), seconds),
                )
                out.write(json.dumps({"targets": got}) + "\n")
                out.flush()
                continue
            fn = PHASES[req["phase"]]
            answer = fn(
                str(req["host"]),
                int(req["port"]),
                seconds,
                min(max(int(req.get("max_ops", 200_000)), 1), MAX_OPS),
                float(req.get("timeout", 1.0)),
                min(float(req.get("warmup", 0.05)), seconds),
            )
        except (ValueError, KeyError, TypeError, OSError) as exc:
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        out.write(json.dumps(answer) + "\n")
        out.flush()
    return 0


def main(argv: list[str] | None = None) -> int:
    if (sys.argv[1:] if argv is None else argv) == ["--serve"]:
        return serve()
    p = argparse.ArgumentParser(prog="kproxy.bench.dpclient", description=__doc__.splitlines()[0])
    p.add_argument("host")
    p.add_argument("port", type=int)
    p.add_argument("--udp-port", type=int, default=None, help="UDP port (default: the TCP port)")
    p.add_argument("--phases", default="crr,rr,udp", help="comma-separated: crr, rr, udp")
    p.add_argument("--seconds", type=float, default=1.0, help="measured seconds per phase")
    p.add_argument("--warmup", type=float, default=0.1, help="seconds per phase whose figures are discarded")
    p.add_argument("--max-ops", type=int, default=200_000, help="bound on operations per phase")
    p.add_argument("--timeout", type=float, default=1.0, help="per operation")
    args = p.parse_args(argv)
    seconds = min(max(args.seconds, 0.01), MAX_SECONDS)
    max_ops = min(max(args.max_ops, 1), MAX_OPS)
    out: dict[str, object] = {"host": args.host, "port": args.port}
    for name in [x.strip() for x in args.phases.split(",") if x.strip()]:
        if name not in PHASES:
            p.error(f"unknown phase {name!r}")
        port = args.udp_port or args.port if name == "udp" else args.port
        out[name] = PHASES[name](args.host, port, seconds, max_ops, args.timeout, min(args.warmup, seconds))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
