"""The pieces of ``kproxy bench datapath`` and ``kproxy compare`` that need no root: the traffic generator against a
loopback echo server, ratios and medians, the objects written to the lab's API, upstream's nftables layout as text
(chain names checked against upstream's own documented examples), the report and the plots."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import kubernetes_validate
import pytest

from kproxy.bench import datapath, dpclient, dpconfig, dpobjects, dpstats, plots, reference_nft, report, synthetic
from kproxy.bench.reference_nft import Counts, hash_and_truncate, render_full, render_partial
from kproxy.cache import ServiceCache
from kproxy.cli import build_parser
from kproxy.lab.cluster import LabPod
from kproxy.lab.echo import EchoServer
from kproxy.model import IPFamily

# --- the traffic generator ---------------------------------------------------------------------------------------


@pytest.fixture
def echo_port() -> Iterator[int]:
    """The lab's echo server on a free loopback port, served from a thread for the test's duration."""
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    server = EchoServer("pod-t", [port], ipv6=False)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    yield port
    for key in list(server.sel.get_map().values()):
        key.fileobj.close()  # type: ignore[union-attr]


def test_dpclient_measures_every_phase_on_loopback(echo_port: int, capsys: pytest.CaptureFixture[str]) -> None:
    rc = dpclient.main(["127.0.0.1", str(echo_port), "--seconds", "0.2", "--warmup", "0.02"])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    for phase in ("crr", "rr", "udp"):
        fig = doc[phase]
        assert fig["ops"] > 10 and fig["errors"] == 0, fig
        assert 0 < fig["p50_us"] <= fig["p99_us"] and fig["rate"] > 0
        assert fig["seconds"] == pytest.approx(0.2, abs=0.15)


def test_dpclient_counts_failures_instead_of_crashing() -> None:
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens: every connection is refused
    fig = dpclient.crr("127.0.0.1", port, 0.05, 50, 0.2, 0.0)
    assert fig["ops"] == 0 and 0 < int(fig["errors"]) <= 50  # type: ignore[call-overload]
    assert dpclient.rr("127.0.0.1", port, 0.05, 50, 0.2, 0.0)["errors"] == 1


def test_dpclient_serves_one_answer_per_request(echo_port: int) -> None:
    import io

    reqs = [
        {"phase": "rr", "host": "127.0.0.1", "port": echo_port, "seconds": 0.05, "warmup": 0.0},
        {"phase": "nope", "host": "127.0.0.1", "port": echo_port},
        {"phase": "udp", "host": "127.0.0.1", "port": echo_port, "seconds": 0.05, "warmup": 0.0},
    ]
    out = io.StringIO()
    text = "".join(json.dumps(r) + "\n" for r in reqs) + "quit\n" + json.dumps(reqs[0]) + "\n"
    assert dpclient.serve(io.StringIO(text), out) == 0
    answers = [json.loads(line) for line in out.getvalue().splitlines()]
    assert len(answers) == 3  # nothing after quit
    assert answers[0]["kind"] == "rr" and answers[0]["ops"] > 0
    assert "error" in answers[1] and answers[2]["kind"] == "udp" and answers[2]["ops"] > 0


def test_percentile_is_nearest_rank() -> None:
    values = [float(i) for i in range(1, 101)]
    assert dpclient.percentile(values, 0.5) == 50.0
    assert dpclient.percentile(values, 0.99) == 99.0
    assert dpclient.percentile([7.0], 0.99) == 7.0
    assert dpclient.percentile([], 0.5) == 0.0


# --- figures -----------------------------------------------------------------------------------------------------


def test_ratios_are_oriented_so_one_means_no_cost() -> None:
    assert dpstats.ratio("conn_rate", 900.0, 1000.0) == pytest.approx(0.9)  # a rate: target / limit
    assert dpstats.ratio("rr_p99_us", 200.0, 100.0) == pytest.approx(0.5)  # a latency: limit / target
    assert dpstats.ratio("tcp_gbps", 10.0, 10.0) == 1.0
    assert dpstats.ratio("conn_rate", 0.0, 1000.0) is None


def test_flatten_and_medians() -> None:
    client = {
        "crr": {"ops": 10, "rate": 5000.0, "p50_us": 150.0, "p99_us": 400.0},
        "rr": {"ops": 10, "rate": 20000.0, "p50_us": 45.0, "p99_us": 90.0},
        "udp": {"ops": 0, "rate": 0.0, "p50_us": 0.0, "p99_us": 0.0},  # no answers: no figure rather than zero
    }
    flat = dpstats.flatten(client, {"gbps": 12.5})
    assert flat["conn_rate"] == 5000.0 and flat["rr_p99_us"] == 90.0 and flat["tcp_gbps"] == 12.5
    assert "udp_p50_us" not in flat
    assert dpstats.medians([{"a": 1.0}, {"a": 3.0}, {"a": 2.0, "b": 5.0}]) == {"a": 2.0, "b": 5.0}
    assert dpstats.iperf_gbps({"end": {"sum_received": {"bits_per_second": 2.5e9}}}) == 2.5
    with pytest.raises(datapath.DatapathError):
        dpstats.iperf_gbps({"error": "unable to connect"})


def test_ratios_are_paired_within_rounds() -> None:
    # the machine slows down by half in round 2: both targets see it, so the paired ratio stays 0.8
    rounds = [
        {"limit": {"conn_rate": 1000.0}, "clusterip": {"conn_rate": 800.0}},
        {"limit": {"conn_rate": 500.0}, "clusterip": {"conn_rate": 400.0}},
        {"limit": {"conn_rate": 1000.0}, "clusterip": {"conn_rate": 800.0}},
    ]
    assert dpstats.paired_ratios(rounds, ("limit", "clusterip")) == {"clusterip": {"conn_rate": pytest.approx(0.8)}}


def test_ratios_against_a_diagnostic_limit_and_their_spread() -> None:
    rounds = [
        {"limit": {"conn_rate": 1000.0}, "limit_nat": {"conn_rate": 900.0}, "podip": {"conn_rate": 880.0}},
        {"limit": {"conn_rate": 1000.0}, "limit_nat": {"conn_rate": 800.0}, "podip": {"conn_rate": 800.0}},
        {"limit": {"conn_rate": 1000.0}, "limit_nat": {"conn_rate": 900.0}, "podip": {"conn_rate": 900.0}},
    ]
    vs_nat = dpstats.paired_ratios(rounds, ("limit_nat", "podip"), base="limit_nat")
    assert vs_nat == {"podip": {"conn_rate": pytest.approx(1.0)}}  # all of the pod IP's cost is the NAT floor
    spread = dpstats.ratio_spread(rounds, ("limit", "podip"))
    assert spread["podip"]["conn_rate"] == pytest.approx([0.84, 0.89])  # quartiles of 0.88, 0.80, 0.90
    assert dpstats.quartiles([0.5]) == [0.5, 0.5] and dpstats.quartiles([]) == []


def test_diagnostic_limits_are_measured_by_default_and_can_be_left_out() -> None:
    cfg = datapath.DatapathConfig()
    both = ("limit", "podip", "clusterip", "limit_twin", "limit_ct", "limit_nat")
    assert datapath.targets_for("nftables", cfg) == both
    assert datapath.targets_for("none", cfg) == both  # the calibration: a real run's targets and schedule
    off = datapath.DatapathConfig(conntrack_limits=False, twin=False)
    assert datapath.targets_for("iptables", off) == dpconfig.TARGETS and not off.describe()["conntrack_limits_detail"]
    # the diagnostic tables: conntrack via a ct expression; conntrack and nat via nat base chains and a DNAT rule
    # whose address nothing uses (so it never translates anything)
    assert "ct state established" in dpconfig.DIAG_RULESETS["limit_ct"]
    nat = dpconfig.DIAG_RULESETS["limit_nat"]
    assert nat.count("type nat hook") == 3 and "ip daddr 198.19.255.254 tcp dport 1 dnat" in nat


def test_parse_sizes() -> None:
    assert datapath.parse_sizes("1000,1, 10000,1000") == [1, 1000, 10000]
    for bad in ("", "0", "200000", "x"):
        with pytest.raises(ValueError):
            datapath.parse_sizes(bad)


def test_objects_written_to_the_lab_api_are_valid() -> None:
    pod = LabPod(name="pod-2-1", ns="kpd-n2-p1", node="node-2", ip4="198.18.66.11", ip6="")
    svc, eps = dpobjects.target_objects(pod)
    for obj in (svc, eps):
        kubernetes_validate.validate(obj, "1.32", strict=True)
    assert eps["endpoints"][0]["addresses"] == ["198.18.66.11"]
    assert {(p["protocol"], p["port"]) for p in svc["spec"]["ports"]} == {("TCP", 80), ("UDP", 80), ("TCP", 5201)}
    objs = list(dpobjects.synthetic_objects(3, 4, 2))
    assert [o["kind"] for o in objs] == ["Service", "EndpointSlice"] * 2
    for o in objs:  # what the API server assigns on create is not sent
        assert not {"uid", "resourceVersion", "generateName"} & set(o["metadata"])
        kubernetes_validate.validate(o, "1.32", strict=True)
    assert objs[0]["spec"]["clusterIP"] == synthetic.cluster_ip(3)


def _result() -> dpconfig.DatapathResult:
    res = dpconfig.DatapathResult(config=datapath.DatapathConfig(rounds=1).describe())
    lim = {"conn_rate": 5000.0, "rr_p99_us": 100.0, "tcp_gbps": 10.0}
    for n, slow in ((1, 1.0), (1000, 0.8)):
        run = datapath.DatapathRun(mode="iptables", services=n, ready_s=2.0, kproxy_rss_mb={"node-1": 80.0})
        cip = {"conn_rate": 5000.0 * slow, "rr_p99_us": 100.0 / slow, "tcp_gbps": 10.0}
        run.medians = {"limit": lim, "podip": dict(cip), "clusterip": cip}
        run.ratios = {
            t: {m: dpstats.ratio(m, v, lim[m]) or 0.0 for m, v in cip.items()} for t in ("podip", "clusterip")
        }
        res.runs.append(run)
    return res


def test_datapath_table() -> None:
    text = datapath.format_table(_result())
    assert "mode iptables, 1000 services" in text
    assert "conn_rate (conn/s)" in text and "0.80" in text and "pinning: clients taskset -c 0" in text


def _compare_results() -> dict[str, object]:
    dp = _result().to_json()
    dp["commands"] = {"iptables": "kproxy bench datapath --mode iptables --services 1,1000"}
    sync = [
        {
            "mode": "iptables",
            "services": n,
            "endpoints": 10,
            "runs": 3,
            "full_sync_s": 0.1 * n / 100,
            "partial_sync_s": 0.02,
            "floor_s": 0.09 * n / 100,
            "partial_floor_s": 0.02,
            "ratio": 1.1,
            "rss_mb": 40.0 + n / 100,
            "command": f"kproxy bench sync --mode iptables --services {n}",
        }
        for n in (100, 1000)
    ]
    refs = [
        {"services": 100, "endpoints": 10, "full_s": 0.07, "partial_s": 0.015, "chains": 1116, "command": "kproxy x"},
        {"services": 1000, "endpoints": 10, "note": "not run: too big", "command": "kproxy y"},
    ]
    return {
        "command": "kproxy compare --services 100,1000",
        "machine": {"cpu": "test cpu", "cores": 2, "kernel": "6.18", "nft": "nftables v1.0.6"},
        "modes": ["iptables"],
        "skipped_modes": {"bpf": "not installed in this build"},
        "endpoints": 10,
        "sync": sync,
        "reference": refs,
        "cache_alone": [],
        "datapath": dp,
        "notes": [],
    }


def test_report_names_machine_commands_and_plots() -> None:
    text = report.render(_compare_results(), ["sync.png", "datapath.png"])
    assert "test cpu" in text and "6.18" in text and "nftables v1.0.6" in text
    assert "not compared: bpf" in text
    assert "`kproxy bench sync --mode iptables --services 1000`" in text
    assert "kproxy bench datapath --mode iptables --services 1,1000" in text
    assert "![sync.png](sync.png)" in text and "not run: too big" in text
    assert "| iptables | 1,000 | ClusterIP | 0.80 |" in text


def test_report_shows_the_noise_and_the_conntrack_floor() -> None:
    results = _compare_results()
    run = results["datapath"]["runs"][1]  # type: ignore[index]
    run["ratio_spread"] = {"clusterip": {"conn_rate": [0.75, 0.85]}}
    run["ratios"]["limit_nat"] = {"conn_rate": 0.8}
    run["ratios_vs"] = {"limit_nat": {"clusterip": {"conn_rate": 1.0}, "podip": {"conn_rate": 0.98}}}
    run["conntrack_entries"] = {"limit": {"client_node": 0, "server_node": 0}, "limit_nat": {"client_node": 1500}}
    text = report.render(results, [])
    assert "| iptables | 1,000 | ClusterIP | 0.80 (0.75-0.85) |" in text
    assert "### The conntrack floor" in text and "| iptables | 1,000 | NAT floor / limit | 0.80 |" in text
    assert "| iptables | 1,000 | ClusterIP / NAT floor | 1.00 |" in text and "| 0 / 0 | - | 1,500 / 0 |" in text
    readme = report.readme_section(results, "docs/compare")
    assert "ClusterIP conn/s vs NAT floor" in readme and "| 1.00 | 0.98 |" in readme and "conntrack floor" in readme


def test_readme_section_summarises_each_mode_and_size() -> None:
    text = report.readme_section(_compare_results(), "docs/compare")
    assert "[docs/compare/report.md](docs/compare/report.md)" in text and "![sync.png](docs/compare/sync.png)" in text
    assert "| iptables | 1,000 | 1.000 | 0.0200 | - | 0.80 |" in text  # the reference was not run at 1,000
    assert "| iptables | 100 | 0.100 | 0.0200 | 0.070 |" in text


def test_plots_are_pngs(tmp_path: Path) -> None:
    files = plots.write_all(_compare_results(), tmp_path)
    assert files == ["sync.png", "datapath.png", "datapath_conn.png", "memory.png"]
    for f in files:
        data = (tmp_path / f).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


# --- upstream's nftables layout ------------------------------------------------------------------------------------


def test_chain_names_match_upstreams_documented_examples() -> None:
    # pkg/proxy/nftables/proxier.go documents these two names in its comments
    assert hash_and_truncate("ns1/svc1/tcp/p80") == "ULMVA6XW-ns1/svc1/tcp/p80"
    assert hash_and_truncate("ns1/svc1/tcp/p80__10.180.0.1/80") == "5OJB2KTY-ns1/svc1/tcp/p80__10.180.0.1/80"
    assert len(hash_and_truncate("x" * 300)) == 240


def _state(n: int, e: int, variant_of: int = 0) -> tuple[ServiceCache, object]:
    cache = ServiceCache(node_name="node-1", ip_families=(IPFamily.V4,))
    for svc in synthetic.services(n):
        cache.upsert_service(svc)
    for eps in synthetic.endpoint_slices(n, e):
        cache.upsert_slice(eps)
    cache.mark_synced("services")
    cache.mark_synced("endpointslices")
    state, changes = cache.snapshot()
    cache.commit(changes)
    return cache, state


def test_reference_renders_a_chain_per_service_and_per_endpoint() -> None:
    _, state = _state(20, 3)
    counts = Counts()
    lines = render_full(state, counts)  # type: ignore[arg-type]
    assert counts.chains == 16 + 20 * (1 + 3) and counts.elements == 40 and counts.skipped == 0
    svc_rules = [ln for ln in lines if "numgen random mod 3 vmap" in ln]
    assert len(svc_rules) == 20 and " : goto endpoint-" in svc_rules[0]
    assert sum("dnat to 198.18." in ln for ln in lines) == 60
    assert any("services ip daddr . meta l4proto . th dport vmap @service-ips" in ln for ln in lines)
    assert "add element ip kube-proxy service-ips { 198.19.0.1 . tcp . 80 : goto service-" in "\n".join(lines)
    assert "198.19.0.10 . udp . 53" in "\n".join(lines)  # every tenth synthetic service is UDP


def test_reference_partial_rewrites_one_service_and_retires_the_stale_endpoint_chain() -> None:
    cache, state = _state(5, 3)
    old = {sp.name: sp for sp in state}  # type: ignore[attr-defined]
    cache.upsert_slice(synthetic.endpoint_slice(2, 3, variant=1))
    new_state, changes = cache.snapshot()
    (spn,) = changes.services
    tx, later = render_partial(old[spn], new_state.get(spn, IPFamily.V4))  # type: ignore[arg-type]
    assert sum(ln.startswith("flush chain") for ln in tx) == 1 + 3 + 1  # service, its 3 chains, the stale one
    assert len(later) == 1 and later[0].startswith("delete chain ip kube-proxy endpoint-")
    assert reference_nft.REFERENCES == ("upstream-nftables",)


def test_reference_refuses_unsafe_words() -> None:
    with pytest.raises(reference_nft.ReferenceError_):
        reference_nft._check("1.2.3.4; flush ruleset")


# --- the command line ----------------------------------------------------------------------------------------------


def test_compare_and_datapath_are_registered() -> None:
    parser = build_parser()
    args = parser.parse_args(["compare", "--services", "100,1000", "--out", "/tmp/x"])
    assert args.func.__module__ == "kproxy.bench.compare" and args.services == "100,1000"
    args = parser.parse_args(["bench", "datapath", "--mode", "iptables", "--services", "1"])
    assert args.func.__name__ == "cmd_datapath"
    args = parser.parse_args(["bench", "sync", "--mode", "fake", "--reference", "upstream-nftables"])
    assert args.reference == "upstream-nftables"


def test_compare_writes_its_command_from_the_parsed_options_not_from_sys_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    """results.json's command reruns the same comparison whoever started it: it is built from the options, and
    parsing it again gives the same options (every one spelled out), whatever the process's own argv says."""
    import shlex

    from kproxy.bench.compare import compare_command

    monkeypatch.setattr("sys.argv", ["pytest", "-k", "something else"])
    parser = build_parser()
    for given in (
        ["compare"],
        ["compare", "--modes", "iptables,nftables", "--services", "10,100", "--endpoints", "3", "--out", "/tmp/o x"],
        ["compare", "--datapath-services", "5", "--rounds", "2", "--seconds", "0.25", "--no-sync", "--no-baseline"],
        ["compare", "--no-reference", "--no-datapath", "--conntrack-limits", "--lab-prefix", "kpz-", "--repeat", "1"],
    ):
        args = parser.parse_args(given)
        command = compare_command(args)
        assert command.startswith("kproxy compare ") and "pytest" not in command and "something" not in command
        again = parser.parse_args(shlex.split(command)[1:])
        assert vars(again) == vars(args), command


def test_compare_takes_modes_from_the_installed_backends() -> None:
    from kproxy.bench.compare import selected_modes
    from kproxy.proxier import MODE_NAMES, availability, installed_backends

    run, skipped = selected_modes(None)
    assert set(run) | set(skipped) == set(MODE_NAMES)
    assert run == [m for m in installed_backends() if availability(m)]
    run, skipped = selected_modes("no-such-mode")
    assert run == [] and "no-such-mode" in skipped


def test_rulecost_reads_a_chain_back_and_rewrites_base_chains() -> None:
    from kproxy.bench import rulecost

    listing = (
        "table ip kproxy {\n\tchain nat-postrouting {\n\t\ttype nat hook postrouting priority srcnat; policy accept;\n"
        "\t\tct label 127 masquerade fully-random # handle 7\n\t}\n}\n"
    )
    assert rulecost.chain_rules(listing) == ("ct label 127 masquerade fully-random",)
    text = rulecost.variant_commands(rulecost.VARIANTS["bare"])
    assert "flush chain ip kproxy nat-prerouting\nadd rule ip kproxy nat-prerouting ip daddr" in text
    assert "nodeport" not in text and "hairpin" not in text  # bare: the map lookup and the masquerade only


def test_readme_takes_the_floor_table_from_a_bench_datapath_run() -> None:
    doc = _result().to_json()
    doc["command"] = "kproxy bench datapath --mode iptables --services 1,1000"
    doc["machine"] = {"date_utc": "today"}
    run = doc["runs"][1]
    run["ratios"]["limit_nat"] = {"conn_rate": 0.85}
    run["ratios_vs"] = {"limit_nat": {"clusterip": {"conn_rate": 0.94}, "podip": {"conn_rate": 0.97}}}
    run["conntrack_entries"] = {"podip": {"client_node": 3000, "server_node": 2990}}
    text = report.readme_section(_compare_results(), "docs/compare", doc, "docs/compare/datapath")
    assert "`kproxy bench datapath --mode iptables --services 1,1000`" in text
    assert "| iptables | 1,000 | 0.80 | 0.80 | - | 0.80 | 0.85 | 0.94 | 0.97 | yes |" in text
    assert "[docs/compare/datapath/report.md](docs/compare/datapath/report.md)" in text
    assert report.as_results(doc)["datapath"] is doc  # a bench document renders like a compare one
    assert report.as_results(doc)["machine"] == {"date_utc": "today"}  # the run's machine, not the report's
    old = {k: v for k, v in doc.items() if k != "machine"}  # a document from before runs recorded their machine
    assert any("the report's" in n for n in report.as_results(old)["notes"])


def test_datapath_conntrack_limits_can_be_left_out_and_compare_records_its_own_choice() -> None:
    """``kproxy bench datapath`` measures the diagnostic limits unless ``--no-conntrack-limits``; the command
    ``kproxy compare`` records for each mode's data-path run repeats the comparison's choice, so that running it
    measures what the comparison measured."""
    from kproxy.bench.compare import _datapath_argv

    parser = build_parser()
    dp = ["bench", "datapath", "--mode", "none"]
    assert parser.parse_args(dp).conntrack_limits is True
    assert parser.parse_args([*dp, "--no-conntrack-limits"]).conntrack_limits is False
    for flags, measured in (([], False), (["--conntrack-limits"], True)):
        cmp_args = parser.parse_args(["compare", *flags])
        argv = _datapath_argv("bpf", [1, 1000], cmp_args)
        assert ("--no-conntrack-limits" in argv) is not measured
        again = parser.parse_args(argv)
        assert again.bench_command == "datapath" and again.conntrack_limits is measured
        assert again.mode == ["bpf"] and again.services == "1,1000"


def test_report_shows_idle_cpu_the_twin_and_left_out_rounds() -> None:
    results = _compare_results()
    run = results["datapath"]["runs"][1]  # type: ignore[index]
    run["idle_cpu_s"], run["idle_seconds"] = {"node-1": 0.05, "node-2": 0.04}, 10.0
    run["ratios"]["limit_twin"] = {"conn_rate": 1.01}
    run["failed_rounds"] = ["round 3: podip crr: 30 of 1030 operations failed"]
    text = report.render(results, [])
    assert "| iptables | 1,000 | twin (self-test) | 1.01 |" in text
    assert "| node-1 0.05 s, node-2 0.04 s in 10 s |" in text and "kproxy idle CPU" in text
    row = next(line for line in text.splitlines() if line.startswith("| iptables | 1,000 | 2.0 |"))
    assert row.endswith("| none | 1 |")  # no errors counted in this run's figures, one round left out
    table = datapath.format_table(dpconfig.DatapathResult(config=results["datapath"]["config"]))  # type: ignore[index]
    assert "twin" in table
