"""The data-path benchmark's diagnostic limits do what they claim on this kernel: in a network namespace with no
netfilter rule, connection tracking is off (no connection is tracked), the ``limit_ct`` table turns it on, the
``limit_nat`` table (nat base chains and one DNAT rule that never matches) turns it on too, and deleting the table
turns it off again. Nat base chains with no rule do not turn it on: it is a NAT rule that does (so ``limit_nat``
has one), a masquerade rule that never applies included (as in the bpf mode's companion table).

This is the mechanism behind the benchmark's "conntrack floor": the limit nodes pay no conntrack at all, while any
NAT-based proxy (iptables, nftables) needs it on every packet of every connection on its nodes. Namespaces are this
test's own (prefix ``kpdz-``) and are removed also on failure.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator

import pytest

from kproxy.bench.dpconfig import DIAG_RULESETS, DIAG_TABLE

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create network namespaces"),
    pytest.mark.skipif(shutil.which("nft") is None, reason="nft not installed"),
]

# listen on loopback, connect 5 times (each a new connection), exit; bounded by the socket timeouts
_CONNECT = """
import socket
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(8); srv.settimeout(5)
for _ in range(5):
    c = socket.create_connection(srv.getsockname(), timeout=5)
    s, _ = srv.accept(); s.close(); c.close()
"""


def _run(ns: str, *argv: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["ip", "netns", "exec", ns, *argv], input=stdin, capture_output=True, text=True, timeout=30, check=False
    )


@pytest.fixture
def ns() -> Iterator[str]:
    name = f"kpdz-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True, timeout=30)
    try:
        _run(name, "ip", "link", "set", "lo", "up").check_returncode()
        yield name
    finally:
        subprocess.run(["ip", "netns", "delete", name], timeout=30, check=False)


def _tracked_after_connections(ns: str) -> int:
    _run(ns, "conntrack", "-F")  # what an earlier step left is not this step's figure
    _run(ns, sys.executable, "-c", _CONNECT).check_returncode()
    res = _run(ns, "cat", "/proc/sys/net/netfilter/nf_conntrack_count")
    if res.returncode != 0:
        pytest.skip("nf_conntrack is not loaded on this machine")
    return int(res.stdout.strip())


@pytest.mark.skipif(shutil.which("conntrack") is None, reason="conntrack (the tool) not installed")
def test_conntrack_is_off_without_rules_and_on_with_each_diagnostic_table(ns: str) -> None:
    assert _tracked_after_connections(ns) == 0  # no rule in the namespace: the kernel tracks nothing
    for name in ("limit_ct", "limit_nat"):
        _run(ns, "nft", "-f", "-", stdin=DIAG_RULESETS[name]).check_returncode()
        assert _tracked_after_connections(ns) >= 5, name  # every connection is tracked now
        family = "inet" if name == "limit_ct" else "ip"
        _run(ns, "nft", "delete", "table", family, DIAG_TABLE).check_returncode()
        assert _tracked_after_connections(ns) == 0, f"{name}: deleting the table turns conntrack off again"
    empty_nat = (
        f"table ip {DIAG_TABLE} {{\n chain pre {{ type nat hook prerouting priority dstnat; policy accept; }}\n}}\n"
    )
    _run(ns, "nft", "-f", "-", stdin=empty_nat).check_returncode()
    assert _tracked_after_connections(ns) == 0  # a nat chain alone registers the nat hooks, not conntrack
    # a masquerade rule that never applies (nothing carries the label), as the bpf mode's companion table has in
    # its nat-postrouting chain: conntrack is on for every connection of the namespace
    masq = f"table ip {DIAG_TABLE} {{\n chain post {{ type nat hook postrouting priority srcnat; policy accept;"
    masq += " ct label 127 masquerade fully-random; }\n}\n"
    _run(ns, "nft", "-f", "-", stdin=masq).check_returncode()
    assert _tracked_after_connections(ns) >= 5
