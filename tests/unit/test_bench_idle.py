"""``kproxy bench idle``'s pure parts: /proc parsing, the counts read from a real /metrics exposition, the table."""

from __future__ import annotations

import os

import pytest
from prometheus_client import generate_latest

from kproxy.bench import idle
from kproxy.bench.cli import main
from kproxy.metrics import Metrics
from kproxy.model import IPFamily

# a real line's shape (kernel 6.x, 52 fields) with a comm that holds a space and a parenthesis
STAT = (
    "4242 (kproxy (run) x) S 1 4242 4242 0 -1 4194560 9000 0 0 0 "
    "150 75 12 3 20 0 9 0 123456 300000000 33000 18446744073709551615 1 1 0 0 0 0 0 16781312 0 0 0 0 17 1 0 0 0 0 0"
    " 0 0 0 0 0 0 0 0"
)


def test_parse_stat_counts_fields_after_the_last_parenthesis() -> None:
    st = idle.parse_stat(STAT)
    assert (st.comm, st.state) == ("kproxy (run) x", "S")
    assert (st.utime, st.stime, st.cutime, st.cstime) == (150, 75, 12, 3)
    assert st.ticks == 240  # children included
    assert (st.threads, st.rss_pages) == (9, 33000)


def test_parse_stat_reads_this_process() -> None:
    with open(f"/proc/{os.getpid()}/stat") as f:
        st = idle.parse_stat(f.read())
    assert st.threads >= 1 and st.rss_pages > 0 and st.state in "RS"


@pytest.mark.parametrize("bad", ["", "4242 kproxy S 1", "4242 (kproxy) S 1 2 3", STAT.replace(" 150 ", " x ")])
def test_parse_stat_refuses_what_is_not_a_stat_line(bad: str) -> None:
    with pytest.raises(ValueError):
        idle.parse_stat(bad)


def test_status_kib() -> None:
    text = "Name:\tpython3\nVmHWM:\t  204800 kB\nVmRSS:\t  102400 kB\nThreads:\t8\n"
    assert idle.status_kib(text, "VmRSS") == 102400
    assert idle.status_kib(text, "VmHWM") == 204800
    assert idle.status_kib(text, "VmSwap") is None


def _exposition(m: Metrics) -> str:
    return generate_latest(m.registry).decode()


def test_counts_from_the_daemons_own_metrics() -> None:
    """The counts are read from what kproxy's Metrics really export: a sync of both families counts once, written
    services add up over the families, the drift counters are read as they are."""
    m = Metrics((IPFamily.V4, IPFamily.V6))
    before = idle.counts(_exposition(m))
    assert before == dict.fromkeys(idle.COUNTS, 0.0)
    for _ in range(3):
        for fam in (IPFamily.V4, IPFamily.V6):
            m.observe_sync(fam, 0.01, full=False)
    m.observe_sync(IPFamily.V4, 0.5, full=True)
    m.observe_sync(IPFamily.V6, 0.5, full=True, ok=False)
    m.count_written(IPFamily.V4, 5)
    m.count_written(IPFamily.V6, 2)
    for _ in range(7):
        m.count_drift_check()
    m.count_drift_repair()
    grown = idle.increase(before, idle.counts(_exposition(m)))
    assert grown == {"syncs": 4, "full_syncs": 1, "services_written": 7, "drift_checks": 7, "drift_repairs": 1}


def test_a_count_the_daemon_does_not_export_is_none() -> None:
    text = '# TYPE kproxy_syncs counter\nkproxy_syncs_total{ip_family="IPv4",result="success"} 3.0\n'
    got = idle.counts(text)
    assert got["syncs"] == 3.0 and got["drift_checks"] is None
    assert idle.increase(got, got) == {**dict.fromkeys(idle.COUNTS, None), "syncs": 0}


def test_busiest_threads() -> None:
    before = {10: ("python3", 100), 11: ("python3", 50), 12: ("kproxy-drift", 7)}
    after = {10: ("python3", 100), 11: ("python3", 350), 12: ("kproxy-drift", 9), 13: ("new", 4)}
    got = idle.busiest(before, after)
    tick = idle.CLK_TCK
    assert [(t["tid"], t["cpu_s"]) for t in got] == [
        (11, round(300 / tick, 3)),
        (13, round(4 / tick, 3)),
        (12, round(2 / tick, 3)),
    ]


def _run(mode: str, cpu_s: float, checks: int | None) -> idle.IdleRun:
    counts = {"syncs": 2, "full_syncs": 0, "services_written": 0, "drift_checks": checks, "drift_repairs": 0}
    return idle.IdleRun(
        mode,
        10000,
        10,
        41.5,
        50.25,
        60.0,
        cpu_s,
        612.3,
        700.0,
        9,
        counts,
        [{"tid": 77, "comm": "python3", "cpu_s": 0.42}],
    )


def test_the_figures_and_the_table() -> None:
    bpf, nft = _run("bpf", 0.9, 200), _run("nftables", 0.06, None)
    assert bpf.cpu_s_per_min == pytest.approx(0.9) and bpf.core_share == pytest.approx(0.015)
    j = bpf.to_json()
    assert (j["cpu_s_per_min"], j["core_share"], j["counts"]["drift_checks"]) == (0.9, 0.015, 200)
    table = idle.format_table([bpf, nft], "2 cores; load 9")
    lines = table.splitlines()
    assert lines[0].split()[:2] == ["mode", "1st"] and len(lines) == 5
    assert lines[2].split()[:12] == [
        "bpf",
        "41.5",
        "50.2",
        "60.0",
        "0.900",
        "1.50%",
        "612.3",
        "2",
        "0",
        "0",
        "200",
        "0",
    ]
    assert lines[3].split()[10] == "-"  # a count the daemon did not export is shown as such, never as 0
    assert "python3 (tid 77) 0.42 s" in lines[2] and lines[4] == "2 cores; load 9"


@pytest.mark.parametrize(
    "argv",
    [
        ["--mode", "nosuchmode"],
        ["--mode", "nftables", "--services", "0"],
        ["--mode", "nftables", "--endpoints", "1001"],
        ["--mode", "nftables", "--seconds", "0"],
        ["--mode", "nftables", "--prefix", "bad prefix "],
    ],
)
def test_bad_arguments_are_usage_errors(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "idle", *argv]) == 2
    assert "kproxy bench idle:" in capsys.readouterr().err
