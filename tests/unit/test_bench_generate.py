"""``kproxy bench sync`` keeps the synthetic generator's time out of the cache's: objects come a page at a time, each
page's generation timed apart (``synthetic.TimedPages``), and the run reports it as ``generate_s``."""

from __future__ import annotations

from typing import Any

import pytest

from kproxy.bench import synthetic
from kproxy.bench.sync import run_sync_bench


class _Clock:
    """A clock that moves only when an object is generated (one second each): what TimedPages sums is exactly the
    generation's time, and the consumer's work between pages counts nothing."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_timed_pages_sum_the_generation_and_hold_one_page(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = _Clock()
    monkeypatch.setattr(synthetic, "perf_counter", clock)
    made: list[int] = []

    def make(i: int) -> dict[str, Any]:
        clock.now += 1.0
        made.append(i)
        return synthetic.service(i)

    pages = synthetic.TimedPages()
    n = 2 * synthetic.PAGE + 7
    seen = 0
    for obj in pages.paged(make, n):
        seen += 1
        assert obj["metadata"]["name"] == synthetic.service_name(seen)
        # generated ahead of the consumer by less than one page: never the whole list alive at once
        assert len(made) - seen < synthetic.PAGE
        clock.now += 100.0  # the consumer's work: not the generator's
        assert pages.seconds <= len(made)
    assert seen == n and made == list(range(1, n + 1))
    assert pages.seconds == float(n)


def test_the_sync_bench_reports_the_generators_time_apart() -> None:
    doc = run_sync_bench("fake", 120, 3, repeat=1).to_json()
    assert doc["generate_s"] > 0 and doc["restart_generate_s"] > 0
    assert doc["absorb_s"] > 0 and doc["restart_absorb_s"] > 0
    assert doc["restart_total_s"] == doc["restart_absorb_s"] + doc["restart_snapshot_s"] + doc["restart_sync_s"]
