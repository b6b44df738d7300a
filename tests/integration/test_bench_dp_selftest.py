"""The data-path benchmark's self-test on its own lab (prefix ``kpxt-``, taken down also on failure), no proxy:

* two identical targets (the limit and its twin: the same nodes, other pods, a server each) measure within 2 % of
  each other, rate and median latencies, in the interleaved rounds a real run uses;
* each target's sockets are made by a process in that target's client pod's node cgroup: the limits' in cgroups of
  nodes that never run a proxy (no bpf socket program can see them), the pod IP's and the ClusterIP's in node-1's."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from kproxy.bench import datapath
from kproxy.lab.cluster import Lab

pytestmark = [
    pytest.mark.root,
    pytest.mark.lab,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create network namespaces"),
    pytest.mark.skipif(shutil.which("iperf3") is None, reason="iperf3 not installed"),
]

PREFIX = "kpxt-"
#: two identical paths must agree this closely (the median over rounds of the per-round ratio)
TWIN_TOLERANCE = 0.02


def _netns() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _cgroup_of(pid: int) -> str:
    """The cgroup v2 path of a process, relative to its cgroup2 mount (``0::/kpxt-n3``)."""
    return next(line for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines() if line.startswith("0::"))


def test_identical_targets_agree_and_sockets_come_from_their_nodes_cgroups() -> None:
    cfg = datapath.DatapathConfig(rounds=9, seconds=0.5, iperf_seconds=1.0, prefix=PREFIX, conntrack_limits=False)
    try:
        with datapath.DatapathLab(cfg) as dl:
            lab = dl.lab
            assert lab is not None
            for target in datapath.targets_for(datapath.NONE_MODE, cfg):
                node = dl.client_of(target).node
                # the factory's cgroup is its client node's own: what bpf's programs, attached there, would see
                assert _cgroup_of(dl.factory_pid(target)).endswith("/" + lab.cgroup_path(node).name), target
                assert (node in ("node-1", "node-2")) == (target in ("podip", "clusterip")), (target, node)
            run = datapath.measure_run(dl, datapath.NONE_MODE, 1, datapath.targets_for(datapath.NONE_MODE, cfg))
    finally:
        Lab.down(prefix=PREFIX)
    assert not run.failed_rounds, run.failed_rounds
    assert len(run.rounds) == cfg.rounds
    twin = run.ratios[datapath.TWIN]
    for metric in ("conn_rate", "conn_p50_us", "rr_p50_us", "udp_p50_us"):
        assert abs(twin[metric] - 1.0) <= TWIN_TOLERANCE, (metric, twin, run.ratio_spread[datapath.TWIN])
    # mode none measured the ClusterIP's slot at its endpoint: every target answered in every round
    for target in datapath.targets_for(datapath.NONE_MODE, cfg):
        assert run.medians[target]["conn_rate"] > 0 and run.medians[target]["udp_p50_us"] > 0, target
    assert not [ns for ns in _netns() if ns.startswith(PREFIX)]
