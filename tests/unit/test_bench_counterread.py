"""``kproxy bench sync --service-counters``'s counter read figures (kproxy.bench.counterread): present in the JSON
and the table when counters are on, absent when off. The fake mode's "kernel" holds no counts here, so its figures
time the collector's offered gauge and empty families: this checks the plumbing; the nftables mode's figures come
from a real kernel (the commands in docs/PERFORMANCE.md)."""

from __future__ import annotations

from kproxy.bench.sync import format_table, run_sync_bench
from kproxy.counters import ALL_MEASURES, _offered_text


def test_counter_read_figures_in_the_json_and_the_table_with_counters_on() -> None:
    doc = run_sync_bench("fake", 60, 3, repeat=2, service_counters=True).to_json()
    c = doc["counter_read"]
    assert c["repeat"] == 2 and c["read_parts_s"] == {}  # the fake says nothing of where a read goes
    assert 0 <= c["read_cpu_s"] and 0 <= c["read_s"] and 0 < c["exposition_s"] and 0 < c["first_exposition_s"]
    # the fake mode offers every measure: the offered gauge, then each measure's families (no samples: no counts)
    assert c["exposition_bytes"] > len(_offered_text(ALL_MEASURES).encode())
    assert 0 < c["made_s"] and c["background"] is False and isinstance(c["peak_reset"], bool)
    assert c["rss_peak_added_mb"] >= c["rss_added_mb"] or not c["peak_reset"]
    b = run_sync_bench("fake", 60, 3, repeat=1, service_counters=True)
    table = format_table(b)
    assert "counter read (median of 1)" in table and "a scrape waits for the counters' text" in table


def test_no_counter_read_without_counters() -> None:
    b = run_sync_bench("fake", 30, 2, repeat=1)
    assert b.to_json()["counter_read"] is None and "counter read" not in format_table(b)
