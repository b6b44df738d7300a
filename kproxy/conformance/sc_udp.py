"""Conformance scenario udp-conntrack: UDP from a fixed source port, a stale conntrack entry in the way, and one
long-lived connected UDP socket, each following a replaced backend within UDP_FOLLOW_S.

The spec is docs/BEHAVIOUR.md's scenario table; ``kproxy.conformance.scenarios`` fixes the order.
"""

from __future__ import annotations

import random
import sys
import threading
from pathlib import Path
from typing import Any

from kproxy.conformance.checks import UDP_FOLLOW_S, UDP_SOCKET_INTERVAL, judge_udp_socket
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
# send time (time.monotonic, the same clock as the runner's) and the answering pod, or "!<error>". On an error other
# than a timeout the socket is replaced, as an application does once its socket is ended ("+reconnect").
UDP_SOCKET_SCRIPT = r"""
import errno, os, socket, sys, time
host, port, seconds, interval = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[6])
out, stop = sys.argv[4], sys.argv[5]
fam = socket.AF_INET6 if ":" in host else socket.AF_INET
end = time.monotonic() + seconds
sock = None
with open(out, "a", buffering=1) as f:
    while time.monotonic() < end and not os.path.exists(stop):
        t = time.monotonic()
        try:
            if sock is None:
                sock = socket.socket(fam, socket.SOCK_DGRAM)
                sock.settimeout(0.3)
                sock.connect((host, port))
            sock.send(b"hello\n")
            word = (sock.recv(65535).decode(errors="replace").split() or ["!empty"])[0]
        except socket.timeout:
            word = "!timeout"
        except OSError as e:
            word = "!" + errno.errorcode.get(e.errno or 0, type(e).__name__) + "+reconnect"
            if sock is not None:
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


def _udp_socket_follow(ctx: Context, client: Any, old: Any, new: Any) -> str:
    """One long-lived connected UDP socket in the client pod (its node's cgroup, like every probe), answered by
    ``old``, then the service's endpoint replaced by ``new``: within UDP_FOLLOW_S its datagrams reach ``new`` (a
    socket the mode ends may be replaced by the client, as an application does on the error; counted)."""
    import shutil
    import tempfile

    svc = ctx.service("udp-held", [ctx.port(80, 8080, name="udp", protocol="UDP")])
    ctx.apply(svc, ctx.slice_for(svc, [old]))
    ip = cip(svc)
    wait_reach(ctx, client, ip, 80, "udp", only=[old])
    work = Path(tempfile.mkdtemp(prefix="kproxy-conformance-udp-"))
    out, stop = work / "log", work / "stop"
    seconds = max(10.0, min(3 * SYNC_WAIT, ctx.remaining() - 10))
    argv = [sys.executable, "-I", "-c", UDP_SOCKET_SCRIPT, ip, "80", f"{seconds:.1f}", str(out), str(stop)]
    argv.append(str(UDP_SOCKET_INTERVAL))
    done: list[Any] = []
    runner = threading.Thread(target=lambda: done.append(_run_quietly(ctx, client, argv, seconds + 15)), daemon=True)
    runner.start()
    t_change = 0.0
    try:

        def answered_by(pod: str, after: float, times: int) -> None:
            words = [w for t, w in _socket_log(out) if t >= after]
            ctx.expect(
                words[-times:] == [pod] * times,
                f"the long-lived UDP socket has not been answered by {pod} {times} times in a row yet",
                got=" ".join(words[-6:]) or "nothing yet",
            )

        ctx.eventually(lambda: answered_by(old.name, 0.0, 2), timeout=SYNC_WAIT, what="long-lived UDP socket")
        t_change = ctx.now()
        ctx.apply(ctx.slice_for(svc, [new]))
        try:
            ctx.eventually(lambda: answered_by(new.name, t_change, 3), timeout=SYNC_WAIT, interval=0.2)
        except ScenarioFailure:
            pass  # judged below, on the whole record
    finally:
        stop.touch()
        runner.join(timeout=30)
        log = _socket_log(out)
        shutil.rmtree(work, ignore_errors=True)
    return judge_udp_socket(ctx, log, t_change, old.name, new.name, f"{client.name} -> {ip}:80", done)


def _run_quietly(ctx: Context, where: Any, argv: list[str], timeout: float) -> str:
    """Run ``argv`` in ``where``'s namespace; "" when it ended well, else what went wrong (judged by the caller)."""
    try:
        res = ctx.exec(where, argv, timeout=timeout)
    except Exception as exc:  # recorded: the judge reports it with the socket's record
        return f"{type(exc).__name__}: {exc}"
    return "" if rc_of(res) == 0 else f"exit {rc_of(res)}: {stdout_of(getattr(res, 'stderr', ''))[-300:]}"
