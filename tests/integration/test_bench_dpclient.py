"""The data-path benchmark's interleaved client makes each target's sockets in that target's network namespace and
measures all targets in turn: two namespaces of this test's own (prefix ``kpdz-``, removed also on failure), an echo
server listening in only one of them; the same address and port answer in that one and fail in the other."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kproxy.bench import dpclient

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create network namespaces"),
]

PORT = 18080


@pytest.fixture
def two_ns(tmp_path: Path) -> Iterator[tuple[str, str]]:
    names = (f"kpdz-a{os.getpid()}", f"kpdz-b{os.getpid()}")
    server = None
    try:
        for name in names:
            subprocess.run(["ip", "netns", "add", name], check=True, timeout=30)
            subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True, timeout=30)
        ready = tmp_path / "ready"
        argv = [sys.executable, "-m", "kproxy.lab.echo", "--name", "a", "--ports", str(PORT), "--no-ipv6"]
        server = subprocess.Popen(
            ["ip", "netns", "exec", names[0], *argv, "--ready-file", str(ready)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 20
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready.exists(), "the echo server did not come up"
        yield names
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=10)
        for name in names:
            subprocess.run(["ip", "netns", "delete", name], timeout=30, check=False)


def test_interleaved_sockets_live_in_each_targets_namespace(two_ns: tuple[str, str]) -> None:
    a, b = two_ns
    home = os.readlink("/proc/self/ns/net")
    targets: list[dict[str, object]] = [
        {"netns": a, "host": "127.0.0.1", "port": PORT},
        {"netns": b, "host": "127.0.0.1", "port": PORT},  # nothing listens there
        {"netns": a, "host": "127.0.0.1", "port": PORT},
    ]
    for kind in ("crr", "rr", "udp"):
        got = dpclient.interleaved(kind, targets, seconds=0.3, max_ops=100_000, timeout=0.2, warmup=0.02)
        first, missing, again = got
        assert first["ops"] > 20 and again["ops"] > 20, (kind, got)
        assert abs(int(str(first["ops"])) - int(str(again["ops"]))) <= 2  # one operation each, in turn
        assert missing["ops"] == 0 and int(str(missing["errors"])) > 0, (kind, missing)
        assert float(str(first["rate"])) > 0 and float(str(first["p50_us"])) > 0
    # the process is back in its own namespace afterwards
    assert os.readlink("/proc/self/ns/net") == home
