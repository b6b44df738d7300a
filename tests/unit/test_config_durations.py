"""Durations from flags and the --config file: non-finite, out-of-range and inconsistent sync periods are refused
at start (exit 2, the field named), as upstream's KubeProxyConfiguration validation refuses them."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

import kproxy.cli
from kproxy.cli import build_parser, config_from_args, main
from kproxy.config import ConfigError, ProxyConfig, build_config, load_config_file, parse_duration
from kproxy.proxier import Availability

GO_MAX_SECONDS = (2**63 - 1) / 1e9  # Go's longest time.Duration
NOT_DURATIONS = ["nan", "NaN", "inf", "-inf", "Infinity", "1e999", "1e3", "1_0", "0x10", "true", "1e999s", " "]
TOO_LONG = ["9999999999999h", "2562048h", "9223372037", "9223372037s"]


@pytest.mark.parametrize("text", NOT_DURATIONS + TOO_LONG)
def test_parse_duration_refuses_with_the_field_named(text: str) -> None:
    with pytest.raises(ConfigError, match="^syncPeriod: "):
        parse_duration(text, "syncPeriod")


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 1e999, 1e10, True, None, [30]])
def test_parse_duration_refuses_non_finite_numbers_and_other_types(value: object) -> None:
    with pytest.raises(ConfigError, match="^minSyncPeriod: "):
        parse_duration(value, "minSyncPeriod")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("2562047h", 2562047 * 3600.0), ("-1s", -1.0), ("-2", -2.0), ("1.5h", 5400.0), ("250us", 250e-6), ("0", 0.0)],
)
def test_go_durations_within_range_are_read(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)
    assert abs(parse_duration(text)) <= GO_MAX_SECONDS


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"sync_period": math.nan}, "syncPeriod"),
        ({"sync_period": math.inf}, "syncPeriod"),
        ({"min_sync_period": math.nan}, "minSyncPeriod"),
        ({"min_sync_period": -math.inf}, "minSyncPeriod"),
        ({"sync_period": 0.0}, "syncPeriod"),
        ({"sync_period": -1.0}, "syncPeriod"),
        ({"min_sync_period": -0.5}, "minSyncPeriod"),
        ({"sync_period": 5.0, "min_sync_period": 10.0}, "syncPeriod"),  # upstream: syncPeriod >= minSyncPeriod
        ({"sync_period": 1e12}, "syncPeriod"),
        ({"full_sync_period": math.nan}, "full sync period"),
    ],
)
def test_validate_refuses_bad_periods(changes: dict[str, float], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        ProxyConfig(**changes).validate()  # type: ignore[arg-type]


def test_validate_keeps_sane_periods() -> None:
    cfg = ProxyConfig(sync_period=10.0, min_sync_period=10.0).validate()
    assert (cfg.sync_period, cfg.min_sync_period) == (10.0, 10.0)
    assert ProxyConfig(sync_period=0.001, min_sync_period=0.0).validate().sync_period == 0.001


@pytest.mark.parametrize("text", ["nan", "inf", "1e999", "9999999999999h"])
@pytest.mark.parametrize("flag", ["--sync-period", "--min-sync-period"])
def test_bad_duration_flags_exit_2_naming_the_flag(
    flag: str, text: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Were the flag accepted, this kproxy must still not start: no mode is available.
    monkeypatch.setattr(kproxy.cli, "availability", lambda _mode: Availability(False, "not in this test"))
    with pytest.raises(SystemExit) as exc:
        main(["run", "--mode", "iptables", f"{flag}={text}", "--manifests", "/nonexistent"])
    assert exc.value.code == 2
    assert f"argument {flag}: " in capsys.readouterr().err


def test_min_sync_period_above_sync_period_flags(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kproxy.cli, "availability", lambda _mode: Availability(False, "not in this test"))
    rc = main(["run", "--mode", "iptables", "--sync-period=5s", "--min-sync-period=10s", "--manifests", "/x"])
    assert rc == 2
    assert "must be greater than or equal to minSyncPeriod (--min-sync-period" in capsys.readouterr().err


FILE = """apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
{body}
"""


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ("iptables: {syncPeriod: .nan}", "iptables.syncPeriod"),
        ("iptables: {syncPeriod: .inf}", "iptables.syncPeriod"),
        ("iptables: {minSyncPeriod: '1e999'}", "iptables.minSyncPeriod"),
        ("syncPeriod: 1e999", "syncPeriod"),  # YAML 1.1 reads this as a string; still not a duration
        ("syncPeriod: 1.0e+999", "syncPeriod"),  # ... and this as a float: infinity
        ("syncPeriod: true", "syncPeriod"),
        ("minSyncPeriod: 99999999999h", "minSyncPeriod"),
        ("syncPeriod: 0s", "syncPeriod"),
        ("minSyncPeriod: -1s", "minSyncPeriod"),
        ("syncPeriod: 5s\nminSyncPeriod: 6s", "syncPeriod"),
    ],
)
def test_bad_periods_in_the_config_file(
    tmp_path: Path, body: str, field: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(FILE.format(body=body))
    with pytest.raises(ConfigError, match=field):
        build_config(load_config_file(f), {})
    with pytest.raises(ConfigError, match=field):
        config_from_args(build_parser().parse_args(["run", "--config", str(f)]))
    monkeypatch.setattr(kproxy.cli, "availability", lambda _mode: Availability(False, "not in this test"))
    assert main(["run", "--config", str(f), "--manifests", "/nonexistent"]) == 2
    assert field in capsys.readouterr().err
