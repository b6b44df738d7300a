"""``kproxy bench sync`` in its throwaway network namespace: the re-executed run reports its figures, and the
namespace ``kpb-<pid>`` is gone afterwards. Real backends run at a small scale, each one that is installed."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from modes import all_modes, require_mode, run_mode_cli

from kproxy.bench.sync import NETNS_PREFIX, run_in_namespace

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create network namespaces"),
]


def _namespaces_of(pid: int) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    return [line.split()[0] for line in out.splitlines() if line.split()[0] == f"{NETNS_PREFIX}{pid}"]


def test_namespace_round_trip(capfd: pytest.CaptureFixture[str]) -> None:
    """The machinery alone, with the fake backend run inside the namespace."""
    argv = ["bench", "sync", "--mode", "fake", "--services", "50", "--endpoints", "3", "--repeat", "2"]
    rc = run_in_namespace([*argv, "--format", "json"])
    out, err = capfd.readouterr()
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["services"] == 50 and doc["full_sync_s"] > doc["partial_sync_s"] > 0
    assert not _namespaces_of(os.getpid())


@pytest.mark.parametrize("state", ["default", "mixed"])
@pytest.mark.parametrize("mode", all_modes())
def test_real_backend_small(mode: str, state: str) -> None:
    """Every mode at 100 x 3, in both synthetic states: each partial sync wrote exactly its service, the restarted
    backend (the first one closed: userspace binds its sockets again) wrote nothing, and the counts are the
    state's."""
    require_mode(mode)
    args = ["bench", "sync", "--mode", mode, "--services", "100", "--endpoints", "3", "--repeat", "3"]
    pid, stdout = run_mode_cli(mode, [*args, "--format", "json", "--state", state])
    assert not _namespaces_of(pid)
    doc = json.loads(stdout)
    assert doc["mode"] == mode and doc["state"] == state and doc["full_sync_s"] > 0 and doc["partial_sync_s"] > 0
    counts = doc["counts"]
    assert counts["IPv4/services"] == 100 and counts["IPv4/deltas"] == 100 and counts["IPv4/full"] == 1
    assert counts["IPv6/services"] == 0 and counts["IPv6/deltas"] == 0
    assert doc["partial_writes"] == [1, 1, 1]
    assert doc["restart_writes"] == 0
    restart = doc["restart_absorb_s"] + doc["restart_snapshot_s"] + doc["restart_sync_s"]
    assert doc["restart_total_s"] == pytest.approx(restart) and min(doc["restart_absorb_s"], restart) > 0
    if mode == "iptables":  # a fresh namespace: the nf_tables flavour, which also reports the unhooked replay
        assert doc["partial_floor_s"] > 0 and doc["partial_floor_detail"]["unhooked_s"] > 0
    if doc["floor_s"] is not None:
        assert doc["ratio"] == pytest.approx(doc["full_sync_s"] / doc["floor_s"])
    if mode in ("iptables", "userspace"):  # a tool in a child process takes the floor's transaction
        assert doc["floor_user_s"] + doc["floor_sys_s"] > 0, doc
    if mode == "nftables":  # kproxy's own transactions sent in-process (``kernel.netlink_floor``): no tool
        assert doc["floor_s"] > 0 and doc["floor_user_s"] is None, doc
