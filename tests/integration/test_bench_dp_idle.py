"""Why an idle iptables node burned minutes of CPU at 10,000 services (issue 21), pinned down: the hook after kproxy's
first sync probes every other mode's availability through ``kproxy.nftkernel.available``, and a probe that made
libnftables fetch the ruleset (``list tables`` in nft 1.0.6 dumps every rule of every table: iptables-nft's 430,000
lines there) costs the node minutes. The probe, run under strace in a namespace of this test's own (prefix ``kpxs-``,
removed also on failure) that holds a table with a chain and a rule, asks the kernel for tables and for nothing else.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create network namespaces"),
    pytest.mark.skipif(shutil.which("strace") is None, reason="strace not installed"),
    pytest.mark.skipif(shutil.which("nft") is None, reason="nft not installed"),
]

RULESET = (
    "table ip kpxs {\n chain c {\n  type filter hook input priority 0; policy accept;\n  tcp dport 1 accept\n }\n}\n"
)


@pytest.fixture
def ns() -> Iterator[str]:
    name = f"kpxs-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True, timeout=30)
    try:
        argv = ["ip", "netns", "exec", name, "nft", "-f", "-"]
        subprocess.run(argv, input=RULESET, text=True, check=True, timeout=30)
        yield name
    finally:
        subprocess.run(["ip", "netns", "delete", name], timeout=30, check=False)


def test_the_availability_probe_fetches_no_rules(ns: str, tmp_path: Path) -> None:
    trace = tmp_path / "strace.txt"
    code = "from kproxy.nftkernel import available; print(repr(available()))"
    argv = ["strace", "-f", "-e", "trace=sendto,sendmsg", "-o", str(trace), sys.executable, "-c", code]
    res = subprocess.run(["ip", "netns", "exec", ns, *argv], capture_output=True, text=True, timeout=60, check=False)
    assert res.returncode == 0 and res.stdout.strip() == "None", (res.stdout, res.stderr[-2000:])
    sent = trace.read_text()
    assert "NFT_MSG_GETTABLE" in sent, sent[-2000:]  # it did ask the kernel: a real probe
    for what in ("NFT_MSG_GETRULE", "NFT_MSG_GETCHAIN", "NFT_MSG_GETSET", "NFT_MSG_GETSETELEM"):
        assert what not in sent, f"the availability probe asked for {what}: it would dump a whole ruleset"
