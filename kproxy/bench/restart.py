"""The restart phase of ``kproxy bench sync`` (kproxy.bench.sync): a new kproxy adopting the kernel state the first one
left, which must write nothing.

A real mode's restart runs in a new process, as a DaemonSet's restart does: ``python -P
-m kproxy.bench.restart`` in the run's network namespace (``-P``: the working directory stays off its ``sys.path``). Run
in the same process after dropping the old instance, it carried the earlier phases' heap (~120 MB under bpf at 100,000 x
10, 30 MB under nftables: pymalloc's arenas, freed but kept), so its memory figures were not what a restarted kproxy
pays. The child reads the run's spec as JSON on stdin (mode, configuration, the synthetic state and the partial syncs'
changes: ``_spec``), builds a backend of the same class and configuration (the bpf mode finds the same pin folder and
cgroup: they follow from the options and the namespace), restarts it (``restarted``), removes the kernel state before it
exits, success or failure (the bpf mode's cgroup hook and pins live outside the namespace), and prints its figures as
one line of JSON on stdout; logs and errors go to stderr, exit code 1 when it failed. The run's process merges the
figures into its ``SyncBench``; when the child fails, dies or overruns RESTART_TIMEOUT (it is killed), the run's process
removes the kernel state itself (``restart_phase``'s ``live``) and fails with the end of the child's stderr. When the
run's process dies first (killed at the run's time limit), the child gets SIGTERM (``PR_SET_PDEATHSIG``), removes the
kernel state and exits with ``ORPHANED``: nobody else is left to remove it (``_die_with_parent``).

The fake's "kernel" (what it records as programmed) lives in the process: its restart stays in the process, the record
handed to the fresh instance as a real kernel keeps its tables when the process goes. Both run ``restarted``.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

from kproxy.bench import memory
from kproxy.bench.syncparts import (
    NODE,
    RESTART_FIELDS,
    BenchError,
    BenchState,
    SyncBench,
    bench_config,
    listed,
    no_refusals,
    remove_state,
    weigh,
    written,
)
from kproxy.cache import ServiceCache
from kproxy.config import ProxyConfig
from kproxy.gcpause import trim_heap
from kproxy.model import IPFamily
from kproxy.proxier import FAKE_MODE, BackendError, backend_class

MODULE = "kproxy.bench.restart"
#: seconds: a bound on the restart's process (at 100,000 x 10 its list, snapshot and sync take 15-30 s here)
RESTART_TIMEOUT = 1200.0
PHASES = ("restart_absorb", "restart_snapshot", "restart_sync")
#: the exit code of a restart's process whose run's process died before it ended (128 + SIGTERM, as a shell says)
ORPHANED = 128 + signal.SIGTERM
PR_SET_PDEATHSIG = 1


def restart_phase(
    out: SyncBench, live: list[Any], cls: Any, config: ProxyConfig, gen: BenchState, meter: memory.PhaseMeter
) -> None:
    """A restarted kproxy: the old process is gone (its sockets and descriptors closed, its memory freed; the kernel
    state stays), and a new one builds its cache from a list, takes the first snapshot and syncs in full, adopting
    what the kernel holds (``restarted``). ``live[-1]`` is the old instance; the caller cleans up with what ``live``
    holds after. A real mode's new kproxy is a new process (``_in_child``): while it runs, ``live`` holds an unstarted
    instance of the same configuration, whose cleanup removes the kernel state should the child fail or die, and
    nothing once the child has ended well (it removed the state itself). The fake's fresh instance is built here,
    takes the old one's record, and replaces it in ``live``."""
    backend = live[-1]
    forget = getattr(backend, "forget", None)
    if forget is not None:  # its records must not count in the new instance's memory
        forget()
    backend.close()  # the userspace mode's proxy sockets close: the new process binds them again
    if out.mode != FAKE_MODE:
        live[:] = [cls(config)]
        del backend
        _in_child(out, _spec(out, gen, config), meter)
        live.clear()
        return
    fresh = cls(config)
    fresh.programmed = backend.programmed  # the fake's "kernel" is its record of what it programmed: it stays
    live[:] = [fresh]  # the old instance goes with the old process
    del backend
    gc.collect()
    trim_heap()  # and its heap with it: what it freed goes back to the OS, as a new process would start without it
    restarted(out, fresh, gen, meter)


def restarted(out: SyncBench, fresh: Any, gen: BenchState, meter: memory.PhaseMeter) -> None:
    """What the restart measures, in whichever process runs it: ``fresh`` started, a new cache from the list (the
    partial syncs' ``gen.variants`` included: ``restart_absorb_s``, the generator's ``restart_generate_s`` apart),
    its first snapshot (``restart_snapshot_s``) and the adopting sync (``restart_sync_s``, ``restart_writes``,
    ``restart_parts``), each a phase of ``meter``; then the live objects (``restart_bytes``), the process's peak
    resident set since it started (``restart_rss_mb``: ``VmHWM`` read before the first phase resets it, and each
    phase's) and its pid."""
    fresh.start()
    before = memory.peak_mb()
    cache = ServiceCache(node_name=NODE, ip_families=(IPFamily.V4,))
    got = listed(gen, cache, out.services, meter, "restart_")
    state, changes = got.state, got.changes
    meter.start()
    t2b = time.perf_counter()
    result = fresh.sync(state, changes)
    t3 = time.perf_counter()
    meter.stop("restart_sync")
    if not result.ok:
        raise BenchError(f"restart sync failed: {result.error}")
    no_refusals(result, "restart sync")
    cache.commit(changes, failed=tuple(result.failed))
    out.restart_generate_s, out.restart_absorb_s = got.generate_s, got.absorb_s
    out.restart_snapshot_s, out.restart_sync_s = got.snapshot_s, t3 - t2b
    out.restart_total_s = out.restart_absorb_s + out.restart_snapshot_s + out.restart_sync_s
    out.restart_writes = written(result)
    out.restart_parts = {k: round(v, 4) for k, v in result.timings.items()}
    out.restart_rss_mb = max(before, *(meter.phases[k].peak_mb for k in PHASES))
    out.restart_pid = os.getpid()
    weigh(out, "restart_", cache, state, fresh)


def _spec(out: SyncBench, gen: BenchState, config: ProxyConfig) -> dict[str, Any]:
    """What the restart's process needs to build the same backend and list the same objects (``child``)."""
    return {
        "parent": os.getpid(),  # the restart's process ends when this one dies (``_die_with_parent``)
        "mode": out.mode,
        "services": out.services,
        "endpoints": out.endpoints,
        "repeat": out.repeat,
        "state": out.state,
        "ports_every": out.ports_every,
        "udp_every": out.udp_every,
        "service_counters": config.service_counters,
        "backend_options": dict(config.backend_options),
        "variants": {str(i): v for i, v in gen.variants.items()},
    }


def _in_child(out: SyncBench, spec: Mapping[str, Any], meter: memory.PhaseMeter) -> None:
    """Run the restart in a new process and merge its figures into ``out`` and ``meter``; its logs go to stderr.
    BenchError with the end of its stderr when it fails or overruns RESTART_TIMEOUT (it is killed)."""
    argv = [sys.executable, "-P", "-m", MODULE]
    try:
        res = subprocess.run(
            argv, input=json.dumps(spec), capture_output=True, text=True, timeout=RESTART_TIMEOUT, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise BenchError(
            f"the restart's process overran {RESTART_TIMEOUT:g} s and was killed: {_tail(exc.stderr)}"
        ) from None
    if res.returncode != 0:
        raise BenchError(f"the restart's process failed (exit code {res.returncode}): {_tail(res.stderr)}")
    sys.stderr.write(res.stderr)
    try:
        doc = json.loads(res.stdout.strip().splitlines()[-1])
        for k, v in doc["figures"].items():
            setattr(out, k, v)
        out.memory.update(doc["memory"])
        meter.phases.update({k: memory.PhaseMemory(**v) for k, v in doc["phases"].items()})
    except (ValueError, IndexError, KeyError, TypeError) as exc:
        raise BenchError(f"the restart's process printed no figures ({exc}): {_tail(res.stdout)}") from None


def _tail(text: str | bytes | None, n: int = 2000) -> str:
    """The end of a child's output (a timeout hands it over as bytes)."""
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return (text or "").strip()[-n:] or "(nothing on stderr)"


def child(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The restart's process: a backend of the spec's mode and configuration (its ``available()`` asked first, as
    ``kproxy run`` and the run's process ask), ``restarted`` and then cleaned up, success or failure (the namespace
    goes with the run; the bpf mode's cgroup hook and pins would stay). Its figures: the restart's ``SyncBench``
    fields, its ``memory`` and the meter's phases."""
    gen = BenchState(spec["state"], spec["endpoints"], ports_every=spec["ports_every"], udp_every=spec["udp_every"])
    gen.variants = {int(i): int(v) for i, v in spec["variants"].items()}
    config = bench_config(spec["mode"], spec["backend_options"], spec["service_counters"])
    out = SyncBench(mode=spec["mode"], services=spec["services"], endpoints=spec["endpoints"], repeat=spec["repeat"])
    out.state, out.ports_every, out.udp_every = spec["state"], spec["ports_every"], spec["udp_every"]
    meter = memory.PhaseMeter()
    cls = backend_class(spec["mode"])
    avail = cls.available()  # as ``kproxy run`` asks before it starts (the bpf mode tries bcc's import in a child)
    if not avail:
        raise BenchError(f"mode {spec['mode']} is not available here: {avail.reason}")
    fresh = cls(config)
    try:
        restarted(out, fresh, gen, meter)
    finally:
        remove_state(fresh)
    return {
        "figures": {k: getattr(out, k) for k in RESTART_FIELDS},
        "memory": out.memory,
        "phases": {k: asdict(v) for k, v in meter.phases.items()},
    }


def _die_with_parent(parent: int) -> None:
    """SIGTERM for this process when the run's process (``parent``) dies, raised here as SystemExit(ORPHANED) so that
    ``child``'s ``finally`` removes the kernel state (the run's process, killed, no longer can). The signal is asked
    of the kernel (``PR_SET_PDEATHSIG``) after the handler is in place, then the parent checked: one that died before
    the ask is seen here."""

    def stop(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: the cleanup that follows is not cut short
        raise SystemExit(ORPHANED)

    signal.signal(signal.SIGTERM, stop)
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != parent:
        raise SystemExit(ORPHANED)


def main() -> int:
    """``python -m kproxy.bench.restart``: the spec on stdin, the figures on stdout (one line of JSON)."""
    spec = json.loads(sys.stdin.read())
    try:
        _die_with_parent(int(spec["parent"]))
        figures = child(spec)
    except (BenchError, BackendError) as exc:
        print(f"kproxy bench sync: restart: {exc}", file=sys.stderr)
        return 1
    except SystemExit as exc:
        if exc.code == ORPHANED:  # wherever it stopped (before its backend was built, too): nobody else removes it
            print("kproxy bench sync: restart: the run's process died: removing its kernel state", file=sys.stderr)
            config = bench_config(spec["mode"], spec["backend_options"], spec["service_counters"])
            remove_state(backend_class(spec["mode"])(config))
        raise
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
