"""``kproxy.nodeaddr.AddressWatch`` in a network namespace of the test's own: the daemon's copy of this node's
addresses is read from netlink once, not again while nothing changes, and again after an address is added (the
kernel's announcement marks it stale)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (a network namespace)"),
]

SCRIPT = """
import json, subprocess, sys, time
from kproxy.nodeaddr import AddressWatch
w = AddressWatch()
first = w.current()
again = w.current()
reads_steady = w.reads
subprocess.run(["ip", "addr", "add", "198.18.99.1/32", "dev", "lo"], check=True, timeout=10)
deadline = time.monotonic() + 10
seen = w.current()
while "198.18.99.1" not in seen and time.monotonic() < deadline:
    time.sleep(0.05)
    seen = w.current()
steady_after = w.reads
w.current()
w.close()
print(json.dumps({"first": first, "again": again, "reads_steady": reads_steady, "seen": seen,
                  "reads_after": steady_after, "reads_final": w.reads}))
"""


@pytest.fixture
def netns() -> Iterator[str]:
    name = f"kpf-aw-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True, timeout=30)
    try:
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True, timeout=30)
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


def test_addresses_are_read_again_only_after_a_change(netns: str) -> None:
    out = subprocess.run(
        ["ip", "netns", "exec", netns, sys.executable, "-c", SCRIPT],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    got = json.loads(out.stdout)
    assert "127.0.0.1" in got["first"] and got["again"] == got["first"]
    assert got["reads_steady"] == 1  # the second call made no netlink read
    assert "198.18.99.1" in got["seen"]
    assert got["reads_after"] >= 2  # read again after the kernel's announcement
    assert got["reads_final"] == got["reads_after"]  # and not again while nothing changed since
