"""The results of ``kproxy compare`` and ``kproxy bench datapath`` as the report and the plots read them: the data
path's metrics (name, where dpclient or iperf3 gives it, whether higher is better, unit), the machine's facts, and
the results document (a compare run's, or a bench datapath document wrapped as one).

Below kproxy.bench.compare, kproxy.bench.report and kproxy.bench.plots, which all read it: none of them imports
another for these.
"""

from __future__ import annotations

import datetime as dt
import os
import platform
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kproxy import __version__

#: (metric, where it comes from, higher is better, unit)
METRICS: tuple[tuple[str, str, bool, str], ...] = (
    ("conn_rate", "crr.rate", True, "conn/s"),
    ("conn_p50_us", "crr.p50_us", False, "us"),
    ("conn_p99_us", "crr.p99_us", False, "us"),
    ("rr_rate", "rr.rate", True, "req/s"),
    ("rr_p50_us", "rr.p50_us", False, "us"),
    ("rr_p99_us", "rr.p99_us", False, "us"),
    ("udp_rate", "udp.rate", True, "req/s"),
    ("udp_p50_us", "udp.p50_us", False, "us"),
    ("udp_p99_us", "udp.p99_us", False, "us"),
    ("tcp_gbps", "iperf.gbps", True, "Gbit/s"),
)
HIGHER_IS_BETTER = {m: hib for m, _, hib, _ in METRICS}
UNITS = {m: unit for m, _, _, unit in METRICS}


# --- facts about the machine ---------------------------------------------------------------------------------------


def _first_line(argv: Sequence[str]) -> str:
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "(not found)"
    text = (proc.stdout or proc.stderr).strip()
    return text.splitlines()[0] if text else "(no output)"


def machine_facts() -> dict[str, Any]:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = 0.0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gib = int(line.split()[1]) / 1024 / 1024
    except OSError:
        pass
    os_name = ""
    try:
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                os_name = line.split("=", 1)[1].strip('"')
    except OSError:
        pass
    repo = Path(__file__).resolve().parent.parent.parent
    commit = _first_line(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"])
    dirty = subprocess.run(
        ["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
    ).stdout.strip()
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(mem_gib, 1),
        "os": os_name,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "kproxy": __version__,
        "commit": commit + (" (with uncommitted changes)" if dirty else ""),
        "iptables": _first_line(["iptables", "--version"]),
        "nft": _first_line(["nft", "--version"]),
        "iperf3": _first_line(["iperf3", "--version"]),
        "date_utc": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


# --- the results document -----------------------------------------------------------------------------------------


def compare_results(
    command: str,
    modes: list[str],
    skipped: dict[str, str],
    sizes: list[int],
    datapath_sizes: list[int],
    endpoints: int,
) -> dict[str, Any]:
    """A ``kproxy compare`` results document before anything is measured: the command, this machine's facts, what
    runs, and empty lists the benchmarks fill (``sync``, ``reference``, ``cache_alone``, ``datapath``, ``fairness``,
    ``notes``)."""
    return {
        "command": command,
        "machine": machine_facts(),
        "modes": modes,
        "skipped_modes": skipped,
        "sizes": sizes,
        "datapath_sizes": datapath_sizes,
        "endpoints": endpoints,
        "sync": [],
        "reference": [],
        "cache_alone": [],
        "datapath": None,
        "fairness": None,
        "notes": [],
    }


def as_results(doc: dict[str, Any], command: str = "") -> dict[str, Any]:
    """A ``kproxy compare`` results document as is; a ``kproxy bench datapath --format json`` document wrapped as one
    (its data-path part only, with this machine's facts and the command given), so both render the same way."""
    if "datapath" in doc or "runs" not in doc:
        return doc
    command = command or doc.get("command") or "kproxy bench datapath"
    notes = list(doc.get("notes") or [])
    if not doc.get("machine"):  # a document from before runs recorded their machine
        notes.append("The machine's facts (commit, date) are the report's: the run's document did not record its own.")
    return {
        "command": command,
        "machine": doc.get("machine") or machine_facts(),
        "datapath": doc,
        "notes": notes,
        "modes": list(dict.fromkeys(r["mode"] for r in doc.get("runs") or [])),
    }
