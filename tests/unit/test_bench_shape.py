"""``kproxy bench sync --ports-every N --udp-every N``: the default state's shape, from the command line to the JSON,
and the conntrack reconciler's figures (its map kept from each partial sync's changes, and the walk it replaced)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kproxy.bench import synthetic
from kproxy.bench.sync import BenchError, run_sync_bench


def test_ports_every_reaches_the_cache_the_ledger_and_the_json() -> None:
    # 60 services, every 5th with three ports: 84 service ports; the second partial run moves an endpoint of service
    # 60 (1 + 7919 % 60), a three-port one: its three ports are written, and that is what the bench expects
    doc = run_sync_bench("fake", 60, 3, repeat=3, ports_every=5).to_json()
    assert doc["ports_every"] == 5 and doc["udp_every"] == synthetic.UDP_EVERY
    assert doc["service_ports"] == synthetic.service_ports(60, ports_every=5) == 84
    assert doc["counts"]["IPv4/services"] == 84  # the ledger holds every port
    assert doc["partial_writes"] == [1, 3, 1]
    assert doc["conntrack_partial_s"] is not None and doc["conntrack_walk_s"] > 0


def test_the_command_line_takes_the_shape() -> None:
    argv = [sys.executable, "-m", "kproxy.bench", "bench", "sync", "--mode", "fake", "--services", "40"]
    argv += ["--endpoints", "2", "--repeat", "2", "--ports-every", "4", "--udp-every", "1", "--format", "json"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert (doc["ports_every"], doc["udp_every"], doc["service_ports"]) == (4, 1, 40 + 10 * 2)
    table = subprocess.run([*argv[:-2], "--format", "table"], capture_output=True, text=True, timeout=120)
    assert table.returncode == 0 and "60 (every 4th service has 3)" in table.stdout, table.stderr


def test_the_shape_is_the_default_states_only() -> None:
    with pytest.raises(BenchError, match="default state only"):
        run_sync_bench("fake", 10, 1, state_name="mixed", ports_every=3)
    with pytest.raises(BenchError, match="at least 0"):
        run_sync_bench("fake", 10, 1, ports_every=-1)
