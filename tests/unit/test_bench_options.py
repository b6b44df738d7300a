"""``--backend-option KEY=VALUE`` of ``kproxy bench datapath`` and ``kproxy bench apiscale`` (kproxy.bench.options):
checked against what each requested mode declares before anything starts, handed to the lab the way ``kproxy lab up
--backend-option`` hands them (each node's kproxy gets only its own mode's), and recorded in each bench's JSON. No
lab is built here: the commands are stopped by a usage error, the benches' call of ``Lab.up`` is caught, and the
lab's own argv for a node is read from a state record as ``Lab.up`` writes it."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from kproxy.bench import apiscale, options
from kproxy.bench.cli import datapath_command, register
from kproxy.bench.dpconfig import DatapathConfig
from kproxy.bench.dplab import DatapathLab
from kproxy.lab.cluster import Lab
from kproxy.lab.echo import DEFAULT_PORTS
from kproxy.lab.plan import make_plan
from kproxy.lab.state import initial_state

BENCH = [sys.executable, "-m", "kproxy.bench", "bench"]


def _bench(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*BENCH, *argv], capture_output=True, text=True, timeout=120)


def test_each_option_goes_to_the_requested_modes_that_declare_it_typed() -> None:
    got = options.parse_for_modes(
        ["none", "bpf", "nftables", "iptables"],
        ["bpf-map-size=65536", "iptables_flavour=legacy"],
        skip=("none",),
    )
    assert got == {"bpf": {"bpf_map_size": 65536}, "nftables": {}, "iptables": {"iptables_flavour": "legacy"}}
    assert isinstance(got["bpf"]["bpf_map_size"], int)
    assert options.lab_options(got) == {"bpf_map_size": 65536, "iptables_flavour": "legacy"}
    assert options.parse_for_modes(["bpf", "bpf"], []) == {"bpf": {}}


@pytest.mark.parametrize(
    ("modes", "item", "why"),
    [
        (["nftables"], "bpf_map_size=65536", "no requested mode has such an option (nftables: none)"),
        (["bpf", "nftables"], "iptables_flavour=legacy", "bpf: bpf_allow_root_cgroup, bpf_cgroup_path"),
        (["none"], "bpf_map_size=1", "(no proxied mode)"),
        (["bpf"], "bpf_map_size=lots", "--bpf-map-size: 'lots' is not a int"),
        (["iptables"], "iptables_flavour=fast", "is not one of auto"),
        (["bpf"], "bpf_map_size", "expected NAME=VALUE"),
    ],
)
def test_an_option_no_requested_mode_declares_or_a_bad_value_is_refused(modes: list[str], item: str, why: str) -> None:
    with pytest.raises(ValueError) as err:
        options.parse_for_modes(modes, [item], skip=("none",))
    assert why in str(err.value)


def test_datapath_refuses_an_undeclared_option_before_anything_starts() -> None:
    out = _bench("datapath", "--mode", "none,nftables", "--services", "1", "--backend-option", "bpf_map_size=65536")
    assert out.returncode == 2, out.stderr
    assert "kproxy bench datapath: --backend-option bpf_map_size: no requested mode has such an option" in out.stderr
    out = _bench("datapath", "--mode", "bpf", "--services", "1", "--backend-option", "bpf_map_size=lots")
    assert out.returncode == 2 and "'lots' is not a int" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_datapath_and_apiscale_take_the_flag() -> None:
    """A declared option passes the parser: the usage error that stops each command is about something else."""
    out = _bench("datapath", "--mode", "bpf", "--rounds", "0", "--backend-option", "bpf_map_size=65536")
    assert out.returncode == 2 and "--rounds, --endpoints" in out.stderr, out.stderr
    out = _bench("apiscale", "--mode", "bpf", "--services", "0", "--backend-option", "bpf_map_size=65536")
    assert out.returncode == 2 and "--services must be" in out.stderr, out.stderr


def test_apiscale_refuses_an_option_its_mode_does_not_declare_and_an_unknown_mode() -> None:
    out = _bench("apiscale", "--mode", "nftables", "--services", "10", "--backend-option", "bpf_map_size=65536")
    assert out.returncode == 2, out.stderr
    assert "kproxy bench apiscale: --backend-option bpf_map_size: no requested mode has" in out.stderr
    out = _bench("apiscale", "--mode", "no-such-mode", "--services", "10")
    assert out.returncode == 2 and "unknown mode 'no-such-mode'" in out.stderr, out.stderr


class _LabUp(Exception):
    """Raised in place of building a lab: the test only wants what the bench asks the lab for."""


def _catch_lab_up(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    asked: dict[str, Any] = {}

    def up(cls: type[Lab], **kwargs: Any) -> Lab:
        asked.update(kwargs)
        raise _LabUp

    monkeypatch.setattr(Lab, "up", classmethod(up))
    monkeypatch.setattr(Lab, "live", classmethod(lambda cls, prefix=None: None))
    return asked


def test_both_benches_ask_the_lab_for_the_options(monkeypatch: pytest.MonkeyPatch) -> None:
    asked = _catch_lab_up(monkeypatch)
    cfg = apiscale.ScaleConfig(mode="bpf", services=10, lab_prefix="kh1u-", backend_options={"bpf_map_size": 65536})
    with pytest.raises(_LabUp):
        apiscale.run(cfg)
    assert asked["backend_options"] == {"bpf_map_size": 65536} and asked["mode"] is None
    asked.clear()
    per_mode = {"bpf": {"bpf_map_size": 65536}, "iptables": {"iptables_flavour": "legacy"}, "nftables": {}}
    with pytest.raises(_LabUp):
        DatapathLab(DatapathConfig(prefix="kh1u-", backend_options=per_mode)).up()
    assert asked["backend_options"] == {"bpf_map_size": 65536, "iptables_flavour": "legacy"}


def test_the_lab_gives_each_nodes_kproxy_only_its_own_modes_options(tmp_path: Path) -> None:
    """What Lab.up records, read back by the real Lab: ``kproxy run``'s argv on a node, per mode."""
    given = options.lab_options(
        options.parse_for_modes(["bpf", "iptables", "nftables"], ["bpf_map_size=65536", "iptables_flavour=legacy"])
    )
    state = initial_state(make_plan(2, 1, False, "kh1u-"), tmp_path, None, [], DEFAULT_PORTS, given)
    lab = Lab(json.loads(json.dumps(state)))  # as state.json holds it
    node = lab.node("node-1")
    bpf = lab.kproxy_argv(node, "bpf")
    assert bpf[bpf.index("--bpf-map-size") + 1] == "65536"
    assert "--iptables-flavour" not in bpf
    assert "--bpf-pin-path" in bpf  # the node's own pin folder still comes with it (Proxier.lab_options)
    ipt = lab.kproxy_argv(node, "iptables")
    assert ipt[ipt.index("--iptables-flavour") + 1] == "legacy" and "--bpf-map-size" not in ipt
    nft = lab.kproxy_argv(node, "nftables")
    assert not [a for a in nft if a.startswith(("--bpf-", "--iptables-"))]


def test_the_options_are_recorded_in_each_benchs_json() -> None:
    per_mode = {"bpf": {"bpf_map_size": 65536}, "nftables": {}}
    described = json.loads(json.dumps(DatapathConfig(backend_options=per_mode).describe()))
    assert described["backend_options"] == per_mode
    cfg = apiscale.ScaleConfig(mode="bpf", backend_options={"bpf_map_size": 65536})
    result = apiscale.ScaleResult(config=asdict(cfg), service_ports=1)
    doc = json.loads(json.dumps(asdict(result)))
    assert doc["config"]["backend_options"] == {"bpf_map_size": 65536}
    assert "backend options" in apiscale.table(result) and "bpf_map_size=65536" in apiscale.table(result)
    args = _parsed("datapath", "--mode", "bpf,nftables", "--backend-option", "bpf_map_size=65536")
    assert " --backend-option bpf_map_size=65536 " in datapath_command(args, ["bpf", "nftables"])


def _parsed(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kproxy")
    register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["bench", *argv])
