"""Upstream's nftables layout really loads with ``nft -f`` (and is timed) in a namespace of its own that is gone
afterwards; ``kproxy bench sync --reference`` puts it beside a backend's figures; ``kproxy compare`` without the lab
writes its report, results and plots; and a smoke ``kproxy bench datapath`` at one service in a lab of its own
(prefix ``kpdt-``) measures all five targets (the limit, the diagnostic limits, the pod IP and the ClusterIP) with
short phases."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kproxy.bench.reference_nft import NETNS_PREFIX, run_reference
from kproxy.proxier import availability, installed_backends

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create network namespaces"),
    pytest.mark.skipif(shutil.which("nft") is None, reason="nft not installed"),
]

AVAILABLE = [m for m in installed_backends() if availability(m)]


def _kproxy(*argv: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kproxy", *argv], capture_output=True, text=True, timeout=timeout, check=False
    )


def _netns() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def test_reference_loads_and_is_timed() -> None:
    ref = run_reference(30, 4, repeat=2)
    assert ref.chains == 16 + 30 * 5 and ref.rules > 0 and ref.elements == 60
    assert ref.full_s > 0 and len(ref.partial_runs) == 2 and ref.partial_cleanup_s > 0
    assert "nftables" in ref.nft_version
    assert f"{NETNS_PREFIX}{os.getpid()}" not in _netns()


@pytest.mark.skipif(not AVAILABLE, reason="no backend available")
def test_sync_bench_with_reference_reports_both() -> None:
    mode = AVAILABLE[0]
    argv = ["bench", "sync", "--mode", mode, "--services", "40", "--endpoints", "3", "--repeat", "2"]
    res = _kproxy(*argv, "--reference", "upstream-nftables", "--format", "json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["mode"] == mode and doc["reference"]["layout"] == "upstream-nftables"
    assert doc["reference"]["full_s"] > 0 and doc["reference_ratio"] == pytest.approx(
        doc["reference"]["full_s"] / doc["full_sync_s"]
    )
    # over the size limit the reference is skipped, and the output says so
    res = _kproxy(*argv, "--reference", "upstream-nftables", "--reference-max-endpoints", "10", "--format", "json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["reference"] is None and "--reference-max-endpoints" in doc["reference_note"]


@pytest.mark.skipif(not AVAILABLE, reason="no backend available")
def test_compare_without_the_lab_writes_report_and_plots(tmp_path: Path) -> None:
    out = tmp_path / "cmp"
    res = _kproxy(
        "compare",
        "--services",
        "10,30",
        "--endpoints",
        "2",
        "--sync-runs",
        "1",
        "--repeat",
        "1",
        "--no-datapath",
        "--modes",
        AVAILABLE[0],
        "--out",
        str(out),
    )
    assert res.returncode == 0, res.stderr
    doc = json.loads((out / "results.json").read_text())
    assert [r["services"] for r in doc["sync"]] == [10, 30]
    assert all(r["full_sync_s"] > 0 and r["command"].startswith("kproxy bench sync") for r in doc["sync"])
    assert [r["services"] for r in doc["reference"]] == [10, 30] and all(r["full_s"] > 0 for r in doc["reference"])
    text = (out / "report.md").read_text()
    assert doc["machine"]["kernel"] in text and "![sync.png](sync.png)" in text
    assert (out / "sync.png").read_bytes()[:4] == b"\x89PNG" and (out / "memory.png").exists()


@pytest.mark.lab
@pytest.mark.skipif(not AVAILABLE, reason="no backend available")
@pytest.mark.skipif(shutil.which("iperf3") is None, reason="iperf3 not installed")
def test_datapath_smoke_at_one_service() -> None:
    mode = AVAILABLE[0]
    res = _kproxy(
        "bench",
        "datapath",
        "--mode",
        mode,
        "--services",
        "1",
        "--rounds",
        "1",
        "--seconds",
        "0.2",
        "--iperf-seconds",
        "1",
        "--lab-prefix",
        "kpdt-",
        "--format",
        "json",
        timeout=280,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    doc = json.loads(res.stdout)
    (run,) = doc["runs"]
    assert run["mode"] == mode and run["services"] == 1 and run["ready_s"] > 0
    for target in ("limit", "podip", "clusterip", "limit_ct", "limit_nat"):
        med = run["medians"][target]
        assert med["conn_rate"] > 0 and med["rr_p50_us"] > 0 and med["udp_p50_us"] > 0 and med["tcp_gbps"] > 0
        # an operation times out after 1 s: on a loaded 2-core machine a SYN retransmit now and then is not a defect
        assert run["errors"].get(target, 0) <= 3, run["errors"]
    assert set(run["ratios"]) == {"podip", "clusterip", "limit_twin", "limit_ct", "limit_nat"}
    assert run["ratios"]["clusterip"]["conn_rate"] > 0 and run["ratios_vs"]["limit_nat"]["clusterip"]["conn_rate"] > 0
    # the limit's nodes track nothing; the diagnostic limits' nodes do (that is what they are for)
    ct = run["conntrack_entries"]
    assert ct["limit"] == {"client_node": 0, "server_node": 0}, ct
    assert ct["limit_ct"]["client_node"] > 0 and ct["limit_nat"]["client_node"] > 0, ct
    assert run["kproxy_rss_mb"].get("node-1", 0) > 0
    assert not [ns for ns in _netns() if ns.startswith("kpdt-")]  # the lab is gone
