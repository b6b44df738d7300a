"""kproxy.bench.memory: the owner walk counts a shared object once (by the first owner), the forked walk answers what
the in-process walk does, the phase meter reads the kernel's figures, and the sync bench reports all of it."""

from __future__ import annotations

import sys

import pytest

from kproxy.bench import memory
from kproxy.bench.sync import run_sync_bench


def test_a_shared_object_counts_once_by_its_first_owner() -> None:
    shared = [f"endpoint-{i}" for i in range(100)]
    first, second = {"eps": shared}, {"eps": shared, "own": ["x" * 1000]}
    got = memory.walk([memory.Owner("first", [first]), memory.Owner("second", [second])])
    shared_bytes = sys.getsizeof(shared) + sum(sys.getsizeof(s) for s in shared)
    assert got["first"]["bytes"] == sys.getsizeof(first) + shared_bytes + sys.getsizeof("eps")
    assert got["first"]["objects"] == 1 + 1 + 100 + 1
    # the second dict, its own list and string: the shared list and the key were the first's
    own = sys.getsizeof(second) + sys.getsizeof(second["own"]) + sys.getsizeof("x" * 1000) + sys.getsizeof("own")
    assert got["second"]["bytes"] == own


def test_a_stop_object_is_left_to_a_later_owner() -> None:
    inner = ["y" * 500]
    outer = {"inner": inner}
    got = memory.walk([memory.Owner("outer", [outer], stop=[inner]), memory.Owner("inner", [inner])])
    assert got["inner"]["bytes"] == sys.getsizeof(inner) + sys.getsizeof("y" * 500)
    assert got["outer"]["objects"] == 2  # the dict and its key


def test_the_forked_walk_answers_as_the_walk_in_process() -> None:
    data = {i: (str(i), [i] * 3) for i in range(1000)}
    owners = [memory.Owner("data", [data])]
    assert memory.breakdown(owners) == memory.walk(owners)
    assert memory.per_port({"a": {"bytes": 300, "objects": 1}, "b": {"bytes": 100, "objects": 1}}, 4) == {
        "a": 75.0,
        "b": 25.0,
        "total": 100.0,
    }


def test_the_phase_meter_sees_a_phase_grow() -> None:
    meter = memory.PhaseMeter()
    meter.start()
    blob = bytearray(64 * 1024 * 1024)  # touched pages: resident
    for i in range(0, len(blob), 4096):
        blob[i] = 1
    meter.stop("grow")
    del blob
    grown = meter.phases["grow"]
    assert grown.peak_mb >= grown.rss_mb > 60
    meter.start()
    meter.stop("idle")
    if meter.phases["idle"].peak_reset:  # the kernel reset the high-water mark: the big buffer is gone from it
        assert meter.phases["idle"].peak_mb < grown.peak_mb - 32


def test_the_sync_bench_reports_where_the_bytes_go() -> None:
    doc = run_sync_bench("fake", 300, 4, repeat=2).to_json()
    mem = doc["memory"]
    assert set(mem["phases"]) == {
        "absorb",
        "snapshot",
        "full_sync",
        "partial",
        "restart_absorb",
        "restart_snapshot",
        "restart_sync",
    }
    assert all(p["rss_mb"] > 0 and p["peak_mb"] >= p["rss_mb"] and p["cpu_s"] >= 0 for p in mem["phases"].values())
    for prefix in ("", "restart_"):
        per_port = mem[prefix + "bytes_per_port"]
        assert set(per_port) == {"cache", "snapshot", "fake_kernel", "ledger", "backend", "total"}
        # 4 endpoints of a service port cannot take less than their addresses' strings
        assert per_port["cache"] > 4 * sys.getsizeof("198.18.64.1")
        assert per_port["total"] == pytest.approx(sum(v for k, v in per_port.items() if k != "total"))
    # the fake's restart: a fresh cache from a list, its snapshot, and an adopting sync that wrote nothing
    assert doc["restart_writes"] == 0
    assert doc["restart_total_s"] == doc["restart_absorb_s"] + doc["restart_snapshot_s"] + doc["restart_sync_s"]
    # and where that sync's time went, as the ledger timed it: reading the kernel, rendering and comparing
    parts = doc["restart_parts"]
    assert {"adopt", "render", "total"} <= set(parts) and parts["total"] <= doc["restart_sync_s"] + 1e-4  # rounded
    assert parts["adopt"] + parts["render"] <= parts["total"] + 2e-4


def test_another_processes_memory_and_a_gone_one() -> None:
    """``process_mb``: what `bench apiscale` and the data-path lab read of each node's kproxy (``VmRSS``, ``VmHWM``)."""
    import subprocess

    from kproxy.bench.memory import process_mb

    code = "import sys; b = b'x' * (64 << 20); print('ready', flush=True); sys.stdin.read()"
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"  # its 64 MiB are written
        got = process_mb(child.pid)
        assert got is not None and 64 <= got[0] <= got[1]
    finally:
        child.communicate("", timeout=30)
    assert process_mb(child.pid) is None  # reaped: no /proc entry
