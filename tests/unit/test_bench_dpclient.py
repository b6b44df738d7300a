"""The data-path client's accounting, on loopback: a failed operation costs its time in the rate (a path that loses
packets cannot look fast), and the interleaved client takes a target's sockets from a factory process's channel as
it would from a pod's."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from kproxy.bench import dpclient


def test_summarize_counts_the_time_of_failed_operations() -> None:
    ok = [0.001] * 100
    clean = dpclient.summarize("crr", ok, 0, 0.1)
    assert clean["rate"] == pytest.approx(99 / 0.099, rel=1e-3)
    # ten failures that took 10 ms each: the rate is over all the time spent, not only the successes'
    lossy = dpclient.summarize("crr", ok, 10, 0.2, error_s=0.1)
    assert lossy["rate"] == pytest.approx(99 / (0.099 + 0.1), rel=1e-3)
    assert lossy["errors"] == 10 and lossy["error_fraction"] == pytest.approx(10 / 110, rel=1e-3)


@pytest.fixture
def half_deaf_udp() -> Iterator[int]:
    """A UDP echo on loopback that answers every second datagram only."""
    srv = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    srv.bind(("127.0.0.1", 0))
    srv.settimeout(0.1)
    stop = threading.Event()

    def run() -> None:
        n = 0
        while not stop.is_set():
            try:
                data, peer = srv.recvfrom(512)
            except TimeoutError:
                continue
            n += 1
            if n % 2 == 0:
                srv.sendto(data, peer)

    th = threading.Thread(target=run, daemon=True)
    th.start()
    yield srv.getsockname()[1]
    stop.set()
    th.join(timeout=5)
    srv.close()


def test_a_lossy_path_is_slower_by_the_time_its_losses_took(half_deaf_udp: int) -> None:
    # every second datagram times out after 20 ms; the answered ones take microseconds. Counting only the answered
    # ones' time (the old accounting) made this path look as fast as a clean one
    fig = dpclient.udp("127.0.0.1", half_deaf_udp, 0.4, 10_000, 0.02, 0.0)
    ops, errors = int(str(fig["ops"])), int(str(fig["errors"]))
    assert ops > 3 and errors > 3, fig
    assert float(str(fig["rate"])) < 1.5 * ops / float(str(fig["seconds"])), fig
    assert float(str(fig["rate"])) < 100, fig  # at most one answer per 20 ms timeout


def test_interleaved_counts_failed_time_and_takes_sockets_from_a_factory(half_deaf_udp: int) -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    th = threading.Thread(target=dpclient.factory, args=(theirs,), daemon=True)
    th.start()
    clean = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)  # a plain UDP echo beside the lossy one
    clean.bind(("127.0.0.1", 0))
    clean.settimeout(0.1)
    stop = threading.Event()

    def echo() -> None:
        while not stop.is_set():
            try:
                data, peer = clean.recvfrom(512)
            except TimeoutError:
                continue
            clean.sendto(data, peer)

    eth = threading.Thread(target=echo, daemon=True)
    eth.start()
    try:
        targets: list[dict[str, object]] = [
            {"source": ours.fileno(), "host": "127.0.0.1", "port": clean.getsockname()[1]},
            {"source": ours.fileno(), "host": "127.0.0.1", "port": half_deaf_udp},
        ]
        good, lossy = dpclient.interleaved("udp", targets, 0.4, 10_000, 0.02, 0.0)
        assert int(str(good["errors"])) == 0 and int(str(good["ops"])) > 3, good
        assert int(str(lossy["errors"])) > 3, lossy
        # the same number of turns each; the lossy target's rate pays for its timeouts
        assert float(str(lossy["rate"])) < float(str(good["rate"])) / 10, (good, lossy)
        crr = dpclient.interleaved("crr", targets[:1], 0.1, 50, 0.2, 0.0)[0]
        assert int(str(crr["errors"])) > 0 and crr["ops"] == 0  # a TCP connect to a UDP-only port: refused, counted
    finally:
        stop.set()
        ours.close()
        th.join(timeout=5)
        eth.join(timeout=5)
        theirs.close()
        clean.close()
