"""Conformance scenarios of UDP and its stale flows. udp-conntrack: UDP from a fixed source port, a stale conntrack
entry in the way, and one long-lived connected UDP socket, each following a replaced backend within UDP_FOLLOW_S.
udp-stale-flows: clients keeping their source port across a scale to zero and back, and a delete and re-create of
the Service, each reaching a live endpoint (and no stale one) within UDP_REPAIR_S.

The spec is docs/BEHAVIOUR.md's scenario table; ``kproxy.conformance.scenarios`` fixes the order.
"""

from __future__ import annotations

import dataclasses
import functools
import random
import shutil
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kproxy.conformance.checks import (
    UDP_FOLLOW_S,
    UDP_REPAIR_S,
    UDP_SOCKET_INTERVAL,
    UdpPhase,
    judge_udp_phases,
    judge_udp_socket,
    one_failure,
    reconnects,
)
from kproxy.conformance.context import Context
from kproxy.conformance.registry import scenario
from kproxy.conformance.steps import SYNC_WAIT, cip, rc_of, stdout_of, two_nodes, wait_reach
from kproxy.conformance.values import Probe, ScenarioFailure


def _udp_follow(ctx: Context, client: Any, ip: str, src_port: int, target: Any, label: str) -> str:
    """Send from the fixed port, one datagram at a time, until ``target`` answers. The change took effect between
    the last datagram that did not reach it and the first that did; fail when one sent later than UDP_FOLLOW_S
    after the change still did not (the earlier bound, so a lost datagram's timeout is not counted against it)."""
    t0 = ctx.now()
    seen: list[str] = []
    last_miss = 0.0
    sent = f"UDP datagrams from {client.name}:{src_port} to {ip}:80, one at a time (0.3 s timeout)"
    while True:
        sent_at = ctx.now() - t0
        pr = ctx.probe(client, ip, 80, "udp", count=1, timeout=0.3, src_port=src_port)
        seen.append(f"+{sent_at:.2f} s: " + (",".join(sorted(pr.pods)) if pr.ok else pr.summary()))
        if pr.pods == {target.name}:
            break
        last_miss = sent_at
        if sent_at > SYNC_WAIT:
            ctx.fail(
                f"{label}: UDP from a fixed source port never reached {target.name}",
                sent=sent,
                got=" | ".join(seen[-5:]),
                expected=f"answers from {target.name} within {UDP_FOLLOW_S:.0f} s",
            )
    ctx.expect(
        last_miss <= UDP_FOLLOW_S,
        f"{label}: UDP from a fixed source port still missed {target.name} {last_miss:.2f} s after the change "
        f"(first reached at {sent_at:.2f} s)",
        sent=sent,
        got=" | ".join(seen[-5:]),
        expected=f"answers from {target.name} within {UDP_FOLLOW_S:.0f} s (stale conntrack entries deleted)",
    )
    return f"{label}: between {last_miss:.2f} and {sent_at:.2f} s"


def _udp_conntrack_entries(ctx: Context, node: Any, dst: str, sport: int) -> list[str]:
    """The node's UDP conntrack entries to ``dst`` from source port ``sport`` (``conntrack -L``)."""
    argv = ["conntrack", "-L", "-p", "udp", "-d", dst, "--sport", str(sport)]
    res = ctx.exec(node, argv, timeout=10)
    if rc_of(res) != 0:
        ctx.fail(
            f"conntrack -L failed on {node.name}",
            sent=" ".join(argv) + f" in {node.ns}",
            got=f"exit {rc_of(res)}: {stdout_of(getattr(res, 'stderr', ''))[:200]}",
            expected="exit 0",
        )
    return [ln.strip() for ln in stdout_of(res).splitlines() if ln.startswith("udp")]


@scenario(
    "udp-conntrack",
    "UDP from a fixed source port, and one long-lived connected UDP socket, follow a replaced backend within 2 s",
    timeout_s=90,
    parts={"stale-entry"},
)
def udp_conntrack(ctx: Context) -> None:
    n1, n2 = two_nodes(ctx)
    client = ctx.pods_on(n1)[0]
    old, new = ctx.pods_on(n2)[0], ctx.pods_on(n2)[1]
    src_port = 40000 + random.randrange(1000)
    svc = ctx.service("udp", [ctx.port(80, 8080, name="udp", protocol="UDP")])
    ctx.apply(svc, ctx.slice_for(svc, [old]))
    ip = cip(svc)

    def from_(pod: Any, timeout: float) -> Probe:
        pr = ctx.probe(client, ip, 80, "udp", count=1, timeout=timeout, src_port=src_port)
        ctx.expect(
            pr.pods == {pod.name},
            f"UDP from fixed port {src_port} not answered by {pod.name}",
            sent=pr.sent + f" from source port {src_port}",
            got=pr.summary(),
            expected=f"answer from {pod.name}",
        )
        return pr

    ctx.eventually(lambda: from_(old, 0.3), timeout=SYNC_WAIT, what="initial backend")
    for _ in range(3):
        from_(old, 1.0)  # the conntrack entry to the old backend is alive and in use (steady state: no hurry)
    figures = []
    ctx.apply(ctx.slice_for(svc, [new]))
    figures.append(_udp_follow(ctx, client, ip, src_port, new, "backend replaced"))
    figures.append(_udp_stale_entry(ctx, n1, client, new, src_port + 1000))
    figures.append(_udp_socket_follow(ctx, client, old, new))
    ctx.note("; ".join(figures))


def _udp_stale_entry(ctx: Context, n1: Any, client: Any, new: Any, late_port: int) -> str:
    """A service that goes from nothing to an endpoint, with a stale entry in the way: before the Service exists, a
    datagram from the fixed port to its (future) ClusterIP leaves node-1 by its default route un-NATed, and
    conntrack confirms that entry (its original destination is that ClusterIP); the client's retries keep it alive.
    Only deleting it lets the next datagram be DNATed to the new endpoint. (A service with no endpoints would not
    do: its REJECT comes before conntrack confirms anything.) A mode that translates without conntrack declares the
    ``stale-entry`` part not applicable: the new service must still be reached from the same port at once."""
    late = ctx.service("udp-late", [ctx.port(80, 8080, name="udp", protocol="UDP")])
    ip2 = cip(late)
    pre = ctx.probe(client, ip2, 80, "udp", count=2, timeout=0.3, src_port=late_port)
    ctx.expect(not pre.ok, "a ClusterIP with no Service behind it answered", sent=pre.sent, got=pre.summary())
    if ctx.skips("stale-entry"):
        ctx.apply(late, ctx.slice_for(late, [new]))
        return _udp_follow(ctx, client, ip2, late_port, new, "service appeared (stale-entry part declared away)")
    stale = _udp_conntrack_entries(ctx, n1, ip2, late_port)
    ctx.expect(
        stale,
        f"no conntrack entry for the datagrams to {ip2}:80 before the service existed, so nothing stale to test",
        sent=pre.sent + f" from source port {late_port}; then conntrack -L -p udp -d {ip2} in {n1.ns}",
        got="no entry",
        expected="one un-NATed UDP entry",
    )
    ctx.apply(late, ctx.slice_for(late, [new]))
    follow = _udp_follow(ctx, client, ip2, late_port, new, "service appeared over a stale entry")
    return follow + f" (stale entry before: {stale[0][:160]})"


# One connected UDP socket, a datagram every UDP_SOCKET_INTERVAL s until the stop file appears: each line is the
# send time (time.monotonic, the same clock as the runner's) and the answering pod, or "!<error>". An ICMP port
# unreachable (ECONNREFUSED, reported once on a connected socket that stays usable) keeps the socket, so its source
# port is kept through a service's "no endpoints"; on any other error, or a failed connect, the socket is replaced, as
# an application does once its socket is ended ("+reconnect"). With a source port (argv[7]), a socket bound to that
# port is made for each datagram instead (a client that keeps its port but not its socket).
UDP_SOCKET_SCRIPT = r"""
import errno, os, socket, sys, time
host, port, seconds, interval = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[6])
out, stop = sys.argv[4], sys.argv[5]
src_port = int(sys.argv[7]) if len(sys.argv) > 7 else 0
fam = socket.AF_INET6 if ":" in host else socket.AF_INET
end = time.monotonic() + seconds
sock, live = None, False
with open(out, "a", buffering=1) as f:
    while time.monotonic() < end and not os.path.exists(stop):
        t = time.monotonic()
        try:
            if sock is None:
                sock, live = socket.socket(fam, socket.SOCK_DGRAM), False
                sock.settimeout(0.3)
                if src_port:
                    sock.bind(("", src_port))
                sock.connect((host, port))
                live = True
            sock.send(b"hello\n")
            word = (sock.recv(65535).decode(errors="replace").split() or ["!empty"])[0]
        except socket.timeout:
            word = "!timeout"
        except OSError as e:
            word = "!" + errno.errorcode.get(e.errno or 0, type(e).__name__)
            if not (live and e.errno == errno.ECONNREFUSED):
                word += "" if src_port else "+reconnect"
                if sock is not None:
                    sock.close()
                sock = None
        if src_port and sock is not None:
            sock.close()
            sock = None
        f.write(f"{t:.4f} {word}\n")
        time.sleep(interval)
"""


def _socket_log(path: Path) -> list[tuple[float, str]]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    out = []
    for line in text.splitlines():
        t, _, word = line.partition(" ")
        if word:
            out.append((float(t), word))
    return out


class UdpClient:
    """UDP_SOCKET_SCRIPT in ``where`` (a pod: its node's cgroup, like every probe) to ``ip:80``, run by a thread of
    the runner's for at most ``seconds`` while the ``with`` block lasts: one long-lived connected socket, or with
    ``src_port`` a socket bound to that port for each datagram. ``log()`` is its record so far; after the block,
    ``record`` is the whole of it and ``done`` how the script ended ("" when it ended well)."""

    def __init__(self, ctx: Context, where: Any, ip: str, seconds: float, src_port: int = 0) -> None:
        self.ctx, self.where, self.ip, self.seconds, self.src_port = ctx, where, ip, seconds, src_port
        self.record: list[tuple[float, str]] = []
        self.done: list[str] = []
        self.subject = f"UDP from fixed source port {src_port}" if src_port else "the long-lived UDP socket"
        if src_port:
            self.sent = f"UDP from {where.name}:{src_port} to {ip}:80, a socket bound to that port for each datagram"
        else:
            self.sent = f"one connected UDP socket {where.name} -> {ip}:80"
        self.sent += f", a datagram every {UDP_SOCKET_INTERVAL} s (0.3 s timeout)"

    def __enter__(self) -> UdpClient:
        self._work = Path(tempfile.mkdtemp(prefix="kproxy-conformance-udp-"))
        self.out, self._stop = self._work / "log", self._work / "stop"
        argv = [sys.executable, "-I", "-c", UDP_SOCKET_SCRIPT, self.ip, "80", f"{self.seconds:.1f}", str(self.out)]
        argv += [str(self._stop), str(UDP_SOCKET_INTERVAL)] + ([str(self.src_port)] if self.src_port else [])
        timeout = self.seconds + 15

        def run() -> None:
            self.done.append(_run_quietly(self.ctx, self.where, argv, timeout))

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.touch()
        self._thread.join(timeout=30)
        self.record = self.log()
        shutil.rmtree(self._work, ignore_errors=True)

    def log(self) -> list[tuple[float, str]]:
        return _socket_log(self.out)

    def answered_by(self, pod: str, after: float, times: int) -> None:
        """Fails (for ``eventually``) until the last ``times`` datagrams sent after ``after`` were answered by
        ``pod``."""
        words = [w for t, w in self.log() if t >= after]
        self.ctx.expect(
            words[-times:] == [pod] * times,
            f"{self.subject}: not answered by {pod} {times} times in a row yet",
            got=" ".join(words[-6:]) or "nothing yet",
        )

    def unanswered(self, after: float, times: int) -> None:
        """Fails (for ``eventually``) until ``times`` datagrams were sent after ``after`` and none was answered."""
        words = [w for t, w in self.log() if t >= after]
        self.ctx.expect(
            len(words) >= times and all(w.startswith("!") for w in words),
            f"{self.subject}: not {times} unanswered datagrams in a row yet",
            got=" ".join(words[-6:]) or "nothing yet",
        )


def _udp_socket_follow(ctx: Context, client: Any, old: Any, new: Any) -> str:
    """One long-lived connected UDP socket in the client pod, answered by ``old``, then the service's endpoint
    replaced by ``new``: within UDP_FOLLOW_S its datagrams reach ``new`` (a socket the mode ends may be replaced by
    the client, as an application does on the error; counted)."""
    svc = ctx.service("udp-held", [ctx.port(80, 8080, name="udp", protocol="UDP")])
    ctx.apply(svc, ctx.slice_for(svc, [old]))
    ip = cip(svc)
    wait_reach(ctx, client, ip, 80, "udp", only=[old])
    t_change = 0.0
    with UdpClient(ctx, client, ip, max(10.0, min(3 * SYNC_WAIT, ctx.remaining() - 10))) as held:
        ctx.eventually(lambda: held.answered_by(old.name, 0.0, 2), timeout=SYNC_WAIT, what="long-lived UDP socket")
        t_change = ctx.now()
        ctx.apply(ctx.slice_for(svc, [new]))
        try:
            ctx.eventually(lambda: held.answered_by(new.name, t_change, 3), timeout=SYNC_WAIT, interval=0.2)
        except ScenarioFailure:
            pass  # judged below, on the whole record
    return judge_udp_socket(ctx, held.record, t_change, old.name, new.name, f"{client.name} -> {ip}:80", held.done)


def _run_quietly(ctx: Context, where: Any, argv: list[str], timeout: float) -> str:
    """Run ``argv`` in ``where``'s namespace; "" when it ended well, else what went wrong (judged by the caller)."""
    try:
        res = ctx.exec(where, argv, timeout=timeout)
    except Exception as exc:  # recorded: the judge reports it with the socket's record
        return f"{type(exc).__name__}: {exc}"
    return "" if rc_of(res) == 0 else f"exit {rc_of(res)}: {stdout_of(getattr(res, 'stderr', ''))[-300:]}"


#: udp-stale-flows' part: the long-lived socket, connected while its Service did not exist, follows the re-creation
HELD_RE_CREATE = "held-socket-re-create"


@scenario(
    "udp-stale-flows",
    "UDP clients keeping their source port across a scale to zero and back, and a delete and re-create of the "
    "Service on the same ClusterIP, reach a live endpoint within 1 s",
    timeout_s=120,
    parts={HELD_RE_CREATE},
)
def udp_stale_flows(ctx: Context) -> None:
    """kubernetes#139628 (a flow DNATed to an endpoint kept going there after the service scaled to zero) and
    #141371 (flows left behind when a UDP Service was deleted), on two clients of node-1's first pod that keep their
    source port throughout: one long-lived connected socket, and a socket bound to one fixed port for each datagram.
    The service goes from ``first`` to no endpoints, to ``second``; then it is deleted and re-created on the same
    ClusterIP with ``third``. Within UDP_REPAIR_S of each change, every datagram is answered by the pod the change
    named, or (no endpoints, no Service) by none: not by the pod of a stale flow. The Service goes first and its
    slices with the re-creation, as the garbage collector removes them after it. Part HELD_RE_CREATE: the long-lived
    socket's re-creation phase (a socket connected while the Service did not exist follows it)."""
    n1, n2 = two_nodes(ctx)
    client = ctx.pods_on(n1)[0]
    first, second, third = ctx.pods_on(n2)[:3]
    ports = [ctx.port(80, 8080, name="udp", protocol="UDP")]
    svc = ctx.service("udp-flows", ports)
    ctx.apply(svc, ctx.slice_for(svc, [first]))
    ip = cip(svc)
    wait_reach(ctx, client, ip, 80, "udp", only=[first])
    src_port = 42000 + random.randrange(1000)  # apart from udp-conntrack's ports
    seconds = max(10.0, ctx.remaining() - 20)
    steps: list[tuple[str, Callable[[], None], Any, str]] = [
        ("the scale to zero", lambda: ctx.apply(ctx.slice_for(svc, [])), None, ""),
        ("the scale back up", lambda: ctx.apply(ctx.slice_for(svc, [second])), second, ""),
        ("the Service's deletion", lambda: ctx.delete("Service", "udp-flows"), None, ""),
        ("its re-creation on the same ClusterIP", lambda: _re_create(ctx, svc, third), third, HELD_RE_CREATE),
    ]
    phases = [UdpPhase(float("-inf"), "", first.name)]
    with UdpClient(ctx, client, ip, seconds) as held, UdpClient(ctx, client, ip, seconds, src_port) as fixed:
        clients = (held, fixed)
        for c in clients:
            ctx.eventually(functools.partial(c.answered_by, first.name, 0.0, 3), timeout=SYNC_WAIT, what="before")
        for change, write, pod, part in steps:
            t = ctx.now()
            write()
            phases.append(UdpPhase(t, change, pod.name if pod is not None else None, part))
            _settle(ctx, clients, t, pod)
    figures, failures = [], []
    for c in clients:
        mine = phases if c is held else [dataclasses.replace(ph, part="") for ph in phases]
        skip = {HELD_RE_CREATE} if ctx.skips(HELD_RE_CREATE) else set()
        try:
            found = judge_udp_phases(
                ctx, c.record, mine, subject=c.subject, sent=c.sent, bound=UDP_REPAIR_S, done=c.done, skip=skip
            )
        except ScenarioFailure as exc:
            failures.append(exc)
            continue
        n = reconnects(c.record, phases[1].at)
        figures.append(
            f"{c.subject}: "
            + ", ".join(f"{ph.change}: {f}" for ph, f in zip(phases[1:], found, strict=True))
            + (f" ({n} reconnect(s) on a socket error)" if n else "")
        )
    if failures:
        raise one_failure(failures)
    ctx.note("; ".join(figures))


def _re_create(ctx: Context, svc: dict[str, Any], pod: Any) -> None:
    """The Service again, on its ClusterIP, with ``pod`` its endpoint (the old slices removed first)."""
    ctx.delete_service(svc["metadata"]["name"])
    ctx.apply(svc, ctx.slice_for(svc, [pod]))


def _settle(ctx: Context, clients: Sequence[UdpClient], t: float, pod: Any) -> None:
    """Wait (bounded) until each client shows the change made at ``t``: answered by ``pod`` 3 times in a row, or
    with no pod, 5 datagrams sent from UDP_REPAIR_S after it on and none answered. Not reaching that is left to the
    judge, which reads the whole record."""

    def shown() -> None:
        for c in clients:
            if pod is not None:
                c.answered_by(pod.name, t, 3)
            else:
                c.unanswered(t + UDP_REPAIR_S, 5)

    try:
        ctx.eventually(shown, timeout=SYNC_WAIT, interval=0.2)
    except ScenarioFailure:
        pass  # judged on the whole record
