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
lab benchmark keeps one such client and interleaves short phases between targets, one operation each in turn.
``--factory FD`` makes sockets for it in a target's client pod and cgroup (see :func:`factory`).

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


def summarize(
    kind: str, latencies: list[float], errors: int, elapsed: float, error_s: float = 0.0
) -> dict[str, object]:
    """One phase's figures: rate (successful operations per second of the time spent in operations, failed ones'
    time included), latency percentiles in microseconds. ``error_s`` is the time the failed operations took."""
    lat = sorted(latencies)
    n = len(lat)
    kept = lat[: max(1, n - n // TRIM)] if n else []
    spent = sum(kept) + error_s
    return {
        "kind": kind,
        "ops": n,
        "errors": errors,
        "error_fraction": round(errors / (n + errors), 6) if n + errors else 0.0,
        "error_s": round(error_s, 6),
        "seconds": round(elapsed, 4),
        "rate_raw": round(n / elapsed, 1) if elapsed > 0 else 0.0,
        # successful operations per second of the time spent in operations, the slowest 1 % of the successful ones
        # left out: on a shared 2-core machine those are the client or server preempted for milliseconds, which
        # would otherwise decide a target's rate. A failed operation (a timeout, a refusal) is no such outlier: its
        # time counts, so a path that loses packets cannot look fast by leaving its losses out
        "rate": round(len(kept) / spent, 1) if kept and spent > 0 else 0.0,
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
    errors, error_s = 0, 0.0
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
            error_s += t - now
        now = t
    return summarize("crr", lat, errors, now - start, error_s)


def rr(host: str, port: int, seconds: float, max_ops: int, timeout: float, warmup: float) -> dict[str, object]:
    """Requests on one established TCP connection."""
    clock = time.perf_counter
    lat: list[float] = []
    errors, error_s = 0, 0.0
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
        # the connection broke: the figures so far stand, the error says it did not finish, and the time the
        # broken request took counts
        errors += 1
        t = clock()
        error_s += t - now
        now = t
    finally:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RST)
        s.close()
    return summarize("rr", lat, errors, now - start, error_s)


def udp(host: str, port: int, seconds: float, max_ops: int, timeout: float, warmup: float) -> dict[str, object]:
    """Datagram request/response on one connected UDP socket (a lost answer is an error after ``timeout``)."""
    clock = time.perf_counter
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(timeout)
    lat: list[float] = []
    errors, error_s = 0, 0.0
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
                error_s += t - now
            now = t
    finally:
        s.close()
    return summarize("udp", lat, errors, now - start, error_s)


PHASES = {"crr": crr, "rr": rr, "udp": udp}

# --- interleaved: one operation per target in turn, so a shared machine's load hits every target alike ------------

CLONE_NEWNET = 0x40000000
_NETNS_DIR = "/run/netns/"
_libc = None
#: sockets a factory sends per request (SCM_RIGHTS carries at most 253 descriptors per message)
FACTORY_BATCH = 64
_KINDS = {b"s": socket.SOCK_STREAM, b"d": socket.SOCK_DGRAM}
_FAMILIES = {b"4": socket.AF_INET, b"6": socket.AF_INET6}


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


def factory(channel: socket.socket) -> int:
    """``--factory FD``: make sockets on request and send them over ``channel`` (a SOCK_SEQPACKET unix socket).

    A socket belongs for life to the network namespace and the cgroup (v2) of the process that made it, and the
    cgroup's socket programs (a bpf proxy's connect4/sendmsg4) run for the socket's cgroup, not the caller's. So the
    interleaving client, one process in one cgroup, takes each target's sockets from a factory started in that
    target's client pod and its node's cgroup: the limit's sockets then pass no program of the loaded nodes, the pod
    IP's pass them all. A request is three bytes (kind ``s``/``d``, family ``4``/``6``, count); the answer is ``k``
    with that many descriptors, or ``e`` and a message. Ends at EOF."""
    while True:
        req = channel.recv(16)
        if len(req) != 3:
            return 0
        made: list[socket.socket] = []
        try:
            kind, family, count = _KINDS[req[0:1]], _FAMILIES[req[1:2]], min(req[2], FACTORY_BATCH)
            made = [socket.socket(family, kind) for _ in range(max(count, 1))]
            socket.send_fds(channel, [b"k"], [s.fileno() for s in made])
        except (KeyError, OSError) as exc:
            channel.send(b"e" + f"{type(exc).__name__}: {exc}".encode()[:200])
        finally:
            for s in made:
                s.close()


class _Source:
    """Where one target's sockets come from: made here after entering the target's network namespace (``netns``), or
    received from a factory (``source``: the client's descriptor of a channel to :func:`factory`). Either way the
    socket is made before an operation's clock starts, so every target's operation times the same calls."""

    def __init__(self, target: dict[str, object]) -> None:
        self.netns_fd = _netns_fd(str(target["netns"])) if "netns" in target else -1
        self.channel = socket.socket(fileno=os.dup(int(str(target["source"])))) if "source" in target else None
        if self.channel is None and self.netns_fd < 0:
            raise ValueError(f"a target needs a netns or a source: {target!r}")
        self.pool: list[socket.socket] = []

    def take(self, kind: str, family: int) -> socket.socket:
        stype = socket.SOCK_STREAM if kind in ("crr", "rr") else socket.SOCK_DGRAM
        if self.channel is None:
            _setns(self.netns_fd)
            return socket.socket(family, stype)
        if not self.pool:
            want = FACTORY_BATCH if kind == "crr" else 1
            self.channel.send(
                (b"s" if stype == socket.SOCK_STREAM else b"d")
                + (b"6" if family == socket.AF_INET6 else b"4")
                + bytes([want])
            )
            msg, fds, _flags, _addr = socket.recv_fds(self.channel, 256, FACTORY_BATCH)
            if not msg.startswith(b"k") or not fds:
                raise OSError(f"the socket factory refused: {msg[1:].decode(errors='replace')}")
            self.pool = [socket.socket(fileno=fd) for fd in reversed(fds)]
        return self.pool.pop()

    def close(self) -> None:
        for s in self.pool:
            s.close()
        self.pool.clear()
        if self.channel is not None:
            self.channel.close()
        if self.netns_fd >= 0:
            os.close(self.netns_fd)


def _prepared(src: _Source, kind: str, host: str, timeout: float) -> socket.socket:
    """A fresh socket of ``src`` with the options its operation needs (RST on close, no Nagle, the timeout)."""
    s = src.take(kind, socket.AF_INET6 if ":" in host else socket.AF_INET)
    if kind in ("crr", "rr"):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if kind == "crr":
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RST)
    s.settimeout(timeout)
    return s


def _crr_on(s: socket.socket, host: str, port: int) -> bool:
    """One new connection on a prepared socket: connect, one exchange, close (RST)."""
    try:
        s.connect((host, port))
        s.sendall(LINE)
        return _read_line(s)
    except OSError:
        return False
    finally:
        s.close()


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


def _open_conns(
    kind: str, targets: list[dict[str, object]], sources: list[_Source], timeout: float, errors: list[int]
) -> list[socket.socket | None]:
    """The one connection per target of an ``rr`` or ``udp`` phase (None where it could not be made: an error)."""
    conns: list[socket.socket | None] = []
    for src, t in zip(sources, targets, strict=True):
        host = str(t["host"])
        try:
            s = _prepared(src, kind, host, timeout)
        except OSError:
            errors[len(conns)] += 1
            conns.append(None)
            continue
        try:
            s.connect((host, int(str(t["port"]))))
            conns.append(s)
        except OSError:
            s.close()
            errors[len(conns)] += 1
            conns.append(None)
    return conns


def interleaved(
    kind: str, targets: list[dict[str, object]], seconds: float, max_ops: int, timeout: float, warmup: float
) -> list[dict[str, object]]:
    """``kind`` (crr, rr, udp) against every target in turn, one operation each, until ``seconds`` of wall time:
    each target is ``{"netns": NAME, "host": ..., "port": N}`` (its sockets made in that network namespace) or
    ``{"source": FD, ...}`` (its sockets from a :func:`factory`). A target's rate is its successful operations over
    the time spent in all its operations, failed ones included (what it would reach alone, one at a time), so drift
    on a shared machine, which hits neighbouring operations alike, cancels in the ratios between targets."""
    clock = time.perf_counter
    # the namespace to return to, when some target's sockets are made here in another one
    home = os.open("/proc/self/ns/net", os.O_RDONLY) if any("netns" in t for t in targets) else -1
    sources: list[_Source] = []
    conns: list[socket.socket | None] = []
    n = len(targets)
    lat: list[list[float]] = [[] for _ in targets]
    errors, error_s = [0] * n, [0.0] * n
    busy = [0.0] * n
    warm = [0] * n  # warm-up operations: not measured, but sent (a counting proxy counts them)
    try:
        for t in targets:
            sources.append(_Source(t))
        if kind in ("rr", "udp"):
            conns = _open_conns(kind, targets, sources, timeout, errors)
        for measuring, length in ((False, warmup), (True, seconds)):
            start = clock()
            deadline = start + length
            turn = 0
            while clock() < deadline and sum(len(x) for x in lat) + sum(errors) < max_ops:
                i = turn % n
                turn += 1
                host, port = str(targets[i]["host"]), int(str(targets[i]["port"]))
                if kind == "crr":
                    try:
                        s: socket.socket | None = _prepared(sources[i], kind, host, timeout)
                    except OSError:
                        s = None
                    t0 = clock()
                    ok = s is not None and _crr_on(s, host, port)
                else:
                    conn = conns[i]
                    t0 = clock()
                    ok = conn is not None and _exchange(kind, conn)
                t1 = clock()
                if not measuring:
                    warm[i] += 1
                    continue
                busy[i] += t1 - t0
                if ok:
                    lat[i].append(t1 - t0)
                else:
                    errors[i] += 1
                    error_s[i] += t1 - t0
    finally:
        for c in conns:
            if c is not None:
                if kind == "rr":
                    c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RST)
                c.close()
        if home >= 0:
            _setns(home)
            os.close(home)
        for src in sources:
            src.close()
    return [{**summarize(kind, lat[i], errors[i], busy[i], error_s[i]), "warmup_ops": warm[i]} for i in range(n)]


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
    args_in = sys.argv[1:] if argv is None else argv
    if args_in == ["--serve"]:
        return serve()
    if len(args_in) == 2 and args_in[0] == "--factory":
        return factory(socket.socket(fileno=int(args_in[1])))
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
