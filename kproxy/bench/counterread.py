"""``kproxy bench sync --service-counters``: what reading the traffic counters costs at the bench's scale, as a
``/metrics`` scrape pays it (the budget: a scrape at 10,000 services x 10 endpoints under 200 ms, adding at most
50 MB to the resident set; docs/PERFORMANCE.md).

Figures (``SyncBench.counter_read``):

- ``read_s``: median over ``repeat`` reads of ``backend.counters(family)`` for every family, the dump a scrape
  asks for (``read_cpu_s``: the process's CPU time in it, kernel time included: on a shared machine the wall time
  also says how busy the neighbours were); ``read_parts_s``: medians of what the backend says the read spent
  where, when it says (``counter_read_seconds``; the nftables mode: ``dump``, the kernel and the socket,
  ``parse``, ``map``);
- ``exposition_s``: median of what a scrape waits for the counters' text (``CounterCollector.exposition``, what
  ``/metrics`` appends), ``exposition_bytes`` its size; ``made_s``: median of what making that text took (the read
  and its formatting), in the scrape itself or, once it took ``SCRAPE_BUDGET_S`` or more, in the background after
  the scrape (``background``), which then served the last text made; ``first_exposition_s`` the first one (every
  port's format strings made, and the read's plans);
- ``rss_added_mb``: the resident set the first exposition leaves behind (the reader's plans, the collector's
  format strings and encoded lines, the last text kept to be served), ``rss_peak_added_mb`` its high-water mark
  above the resident set before it (``peak_reset``: whether the kernel let the mark be reset first; when not, the
  peak is the process's).
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Mapping, Sequence
from typing import Any

from kproxy.bench import memory
from kproxy.counters import SCRAPE_BUDGET_S, CounterCollector, CounterSource
from kproxy.model import IPFamily


def _read(backend: CounterSource, families: Sequence[IPFamily]) -> tuple[float, float, dict[str, float]]:
    """One read of every family: seconds, the process's CPU seconds, and the backend's own split of the seconds
    summed over the families."""
    parts: dict[str, float] = {}
    t0, c0 = time.perf_counter(), time.process_time()
    for family in families:
        backend.counters(family)
        for k, v in (getattr(backend, "counter_read_seconds", None) or {}).items():
            parts[k] = parts.get(k, 0.0) + v
    return time.perf_counter() - t0, time.process_time() - c0, parts


def measure(backend: CounterSource, families: Sequence[IPFamily], repeat: int = 5) -> dict[str, Any]:
    """The figures of the module docstring, in the calling thread (the backend's kernel state as it is)."""
    collector = CounterCollector(backend, families)
    gc.collect()
    before = memory.rss_mb()
    reset = memory.reset_peak()
    t0 = time.perf_counter()
    size = len(collector.exposition())  # the text goes once served: what stays is the reader's and collector's
    first = time.perf_counter() - t0
    peak, after = memory.peak_mb(), memory.rss_mb()
    reads, cpu, parts, expositions, made = [], [], [], [], []
    for _ in range(max(1, repeat)):
        seconds, cpu_s, split = _read(backend, families)
        reads.append(seconds)
        cpu.append(cpu_s)
        parts.append(split)
        t0 = time.perf_counter()
        collector.exposition()  # what a scrape waits for
        expositions.append(time.perf_counter() - t0)
        collector.settle()  # a text made in the background meanwhile is not timed with the next read
        made.append(collector.made_s)
    read_s = statistics.median(reads)
    made_s = statistics.median(made)
    return {
        "read_s": read_s,
        "read_cpu_s": statistics.median(cpu),
        "read_parts_s": {k: statistics.median(p.get(k, 0.0) for p in parts) for k in parts[0]},
        "exposition_s": statistics.median(expositions),
        "made_s": made_s,
        "first_exposition_s": first,
        "exposition_bytes": size,
        "rss_added_mb": round(after - before, 1),
        "rss_peak_added_mb": round(peak - before, 1),
        "peak_reset": reset,
        "background": made_s >= SCRAPE_BUDGET_S,
        "repeat": len(reads),
    }


def table_rows(c: Mapping[str, Any] | None) -> list[tuple[str, str]]:
    """``bench sync``'s table rows of ``measure``'s figures (none without counters)."""
    if not c:
        return []
    parts = ", ".join(f"{k} {v * 1000:.1f} ms" for k, v in c["read_parts_s"].items())
    return [
        (f"counter read (median of {c['repeat']})", f"{c['read_s'] * 1000:.1f} ms" + (f" ({parts})" if parts else "")),
        ("  its CPU time", f"{c['read_cpu_s'] * 1000:.1f} ms"),
        (
            "  a scrape waits for the counters' text",
            f"{c['exposition_s'] * 1000:.1f} ms, {c['exposition_bytes'] / 1e6:.1f} MB"
            + (" (made in the background)" if c["background"] else ""),
        ),
        ("  making it (read and formatting)", f"{c['made_s'] * 1000:.1f} ms"),
        ("  RSS the first read adds (its peak)", f"{c['rss_added_mb']:.1f} MB ({c['rss_peak_added_mb']:.1f} MB)"),
    ]
