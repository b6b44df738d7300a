"""The command line: mode errors are explained and exit non-zero; config flags; `show` rendering."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from kproxy.cli import (
    build_parser,
    config_from_args,
    main,
    parse_trace_target,
    render_show_table,
    render_trace_table,
)


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kproxy", *args], capture_output=True, text=True, timeout=60)


def test_unknown_mode_exits_nonzero_with_reason() -> None:
    r = _run("run", "--mode", "ipvs", "--manifests", "/nonexistent")
    assert r.returncode != 0
    assert "unknown mode 'ipvs'" in r.stderr


def test_unimplemented_mode_says_so(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A mode of the table whose backend is not installed (here: bpf's entry point taken away) is refused by name."""
    from kproxy import proxier

    installed = proxier._entry_points()
    monkeypatch.setattr(proxier, "_entry_points", lambda: {k: v for k, v in installed.items() if k != "bpf"})
    try:
        code = main(["run", "--mode", "bpf", "--manifests", "/nonexistent"])
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    assert code not in (0, None)
    assert "bpf" in err and "not implemented" in err


def test_help_lists_modes_in_order() -> None:
    r = _run("run", "--help")
    assert r.returncode == 0
    text = " ".join(r.stdout.split())
    assert text.index("userspace:") < text.index("iptables:") < text.index("nftables:") < text.index("bpf:")


def test_flags_map_to_config() -> None:
    args = build_parser().parse_args(
        [
            "run",
            "--mode",
            "iptables",
            "--cluster-cidr",
            "198.18.64.0/18,fd00:198:18:40::/58",
            "--sync-period",
            "10s",
            "--min-sync-period",
            "0",
            "--hostname-override",
            "Node-2",
            "--masquerade-all",
        ]
    )
    cfg = config_from_args(args)
    assert cfg.mode == "iptables" and cfg.node_name == "node-2" and cfg.masquerade_all
    assert cfg.cluster_cidrs == ("198.18.64.0/18", "fd00:198:18:40::/58")
    assert (cfg.sync_period, cfg.min_sync_period) == (10.0, 0.0)
    # untouched flags keep their defaults rather than overriding a config file
    assert cfg.healthz_bind_address == "0.0.0.0:10256"


def test_bad_flag_value_is_a_clean_error(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["run", "--mode", "iptables", "--cluster-cidr", "not-a-cidr", "--manifests", "/x"])
    assert rc == 2
    assert "not a CIDR" in capsys.readouterr().err


def test_show_table() -> None:
    data = {
        "mode": "iptables",
        "node": "node-1",
        "ready": True,
        "sync": {"syncs": 3, "failures": 0, "lastError": None, "failedServices": {"ns/bad:p/TCP": "line 4 failed"}},
        "rejectedObjects": {"Service ns/x": "port 70000 out of range"},
        "backend": {"services": {"ns/a:http/TCP": {"IPv4": {"clusterIP": "198.19.0.1", "endpoints": ["1:2"]}}}},
    }
    text = render_show_table(json.loads(json.dumps(data)))
    assert "REFUSED BY KERNEL ns/bad:p/TCP: line 4 failed" in text
    assert "REJECTED Service ns/x: port 70000 out of range" in text
    assert "clusterIP=198.19.0.1" in text and "      1:2" in text


def test_show_without_a_running_kproxy() -> None:
    r = _run("show", "--metrics-bind-address", "127.0.0.1:1")
    assert r.returncode == 1 and "cannot read" in r.stderr


def test_trace_table() -> None:
    data = {
        "mode": "iptables",
        "packet": {"proto": "tcp", "src": "198.18.0.2", "dst": "198.18.0.11", "dport": 30101},
        "trace": {
            "outcomes": [
                {"verdict": "DNAT 198.18.65.11:8080", "probability": 0.5, "masquerade": True, "rules": ["-A X -j Y"]},
                {"verdict": "DNAT 198.18.66.11:8080", "probability": 0.5, "masquerade": True, "rules": []},
            ]
        },
    }
    text = render_trace_table(data)
    assert text.splitlines()[0] == "tcp 198.18.0.2 -> 198.18.0.11:30101 (iptables)"
    assert "0.5  DNAT 198.18.66.11:8080  (masqueraded)" in text and "    -A X -j Y" in text
    assert "REJECT" in render_trace_table({"trace": {"verdict": "REJECT"}})
    v6 = {"packet": {"proto": "udp", "src": "fd00:198:18::2", "dst": "fd00:198:18:ff::a", "dport": 53, "dstLocal": 1}}
    assert render_trace_table(v6).splitlines()[0] == "udp fd00:198:18::2 -> [fd00:198:18:ff::a]:53 (None)  to the node"


def test_trace_target() -> None:
    assert parse_trace_target("198.19.0.1:80") == ("198.19.0.1", "80", "tcp")
    assert parse_trace_target("198.19.0.1:53/UDP") == ("198.19.0.1", "53", "udp")
    assert parse_trace_target("[fd00:198:18:ff::b]:80/sctp") == ("fd00:198:18:ff::b", "80", "sctp")
    for bad, why in (
        ("198.19.0.1", "the port is needed"),
        ("fd00:198:18:ffff::b:80", "[ADDRESS]:PORT"),
        ("[fd00::1]80", "expected [IPv6]"),
        ("198.19.0.1:http", "not a number"),
    ):
        with pytest.raises(ValueError, match=re.escape(why)):
            parse_trace_target(bad)
    r = _run("show", "--metrics-bind-address", "127.0.0.1:1", "--trace", "198.18.0.2", "198.19.0.1")
    assert r.returncode == 2 and "the port is needed" in r.stderr
