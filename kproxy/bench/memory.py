"""Where a sync bench's bytes go: resident memory per phase, and the live objects of the cache, the snapshot, the
ledger and the backend walked and summed per owner.

Two measures, for two questions:

- ``PhaseMemory``: the process's resident set after each phase (``rss_mb``, ``/proc/self/statm``) and its peak
  *during* that phase (``peak_mb``, ``VmHWM`` of ``/proc/self/status``, reset between phases by writing 5 to
  ``/proc/self/clear_refs``; where the kernel refuses the reset, ``peak_reset`` is False and the peak is the
  process's since it started). This is what the machine pays, the allocator's slack and freed-but-kept arenas
  included.
- ``breakdown``: ``sys.getsizeof`` summed over every object reachable from each owner (``gc.get_referents``), owners
  walked in order and an object counted once, by the first owner that reaches it: the cache first (its templates,
  slices, endpoints and current ServicePorts), then what the snapshot adds on top (its own dict copies: the values
  are the cache's), then the ledger's records (what they do not share with the cache), then the backend's own
  structures. Chosen over ``tracemalloc`` because the question is *which structure holds* the bytes, not which line
  allocated them (an Endpoint built in ``endpointslices`` is held by the cache, the snapshot and the ledger alike),
  and because it costs nothing until asked: ``tracemalloc`` slows every allocation of the timed phases and doubles
  the memory it measures. The walk runs in a forked child (``os.fork``): the visited-set of millions of ids and the
  pages its reference counting touches are the child's, so neither the parent's timings nor its resident figures
  see the measurement. Types, modules, functions, enum members and the interpreter's singletons are shared by
  everything and counted by nobody.
"""

from __future__ import annotations

import enum
import gc
import json
import os
import sys
import time
import types
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

_PAGE = os.sysconf("SC_PAGE_SIZE")
_MB = 1024.0 * 1024.0
_SKIP_TYPES = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType, types.CodeType)


def rss_mb() -> float:
    """The resident set now, in MiB."""
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * _PAGE / _MB


def peak_mb() -> float:
    """The resident set's high-water mark (``VmHWM``) since the last ``reset_peak`` (or the start), in MiB."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    return 0.0  # pragma: no cover - every Linux has it


def process_mb(pid: int) -> tuple[float, float] | None:
    """(resident MiB, peak resident MiB: ``VmRSS``, ``VmHWM``) of another process, None when it is gone."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return int(fields["VmRSS"].split()[0]) / 1024.0, int(fields["VmHWM"].split()[0]) / 1024.0
    except (OSError, KeyError, ValueError, IndexError):
        return None


def reset_peak() -> bool:
    """Reset ``VmHWM`` to the current resident set (Linux >= 4.0); False when the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
    except OSError:
        return False
    return True


@dataclass
class PhaseMemory:
    """Resident memory of one phase: where it ended (``rss_mb``) and its peak (``peak_mb``); and the process's CPU
    time in it (``cpu_s``: on a shared machine, wall time says as much about the neighbours as about the phase)."""

    rss_mb: float
    peak_mb: float
    peak_reset: bool
    cpu_s: float = 0.0


class PhaseMeter:
    """``start()`` before a phase, ``stop(name)`` after it: ``phases[name]`` holds its ``PhaseMemory``."""

    def __init__(self) -> None:
        self.phases: dict[str, PhaseMemory] = {}
        self._reset = False
        self._cpu = 0.0

    def start(self) -> None:
        self._reset = reset_peak()
        self._cpu = time.process_time()

    def stop(self, name: str) -> None:
        cpu = time.process_time() - self._cpu
        self.phases[name] = PhaseMemory(rss_mb=rss_mb(), peak_mb=peak_mb(), peak_reset=self._reset, cpu_s=cpu)


def _shared() -> set[int]:
    """Objects every structure refers to and none owns: the singletons and every enum member loaded."""
    ids = {id(None), id(True), id(False), id(Ellipsis), id(NotImplemented), id(()), id(""), id(frozenset())}
    for obj in gc.get_objects():
        if isinstance(obj, enum.EnumMeta):
            ids.update(id(m) for m in obj)  # type: ignore[var-annotated]
    return ids


@dataclass
class Owner:
    """One owner to walk: ``roots`` and everything they reach, except ``stop`` (walked later, by another owner)."""

    name: str
    roots: Sequence[Any]
    stop: Sequence[Any] = field(default_factory=tuple)


def walk(owners: Iterable[Owner]) -> dict[str, dict[str, int]]:
    """Bytes and objects reachable from each owner, each object counted by the first owner that reaches it."""
    seen = _shared()
    out: dict[str, dict[str, int]] = {}
    for owner in owners:
        stop = {id(o) for o in owner.stop}
        size = count = 0
        stack = [o for o in owner.roots if id(o) not in seen and id(o) not in stop]
        while stack:
            obj = stack.pop()
            oid = id(obj)
            if oid in seen or isinstance(obj, _SKIP_TYPES):
                continue
            seen.add(oid)
            try:
                size += sys.getsizeof(obj)
            except TypeError:  # an extension type without a size (a backend's kernel handle): counted, not weighed
                pass
            count += 1
            refs = gc.get_referents(obj)
            if isinstance(obj, dict):  # a dict of str keys shows its values only to the collector
                refs.extend(obj)
            for ref in refs:
                rid = id(ref)
                if rid not in seen and rid not in stop:
                    stack.append(ref)
        out[owner.name] = {"bytes": size, "objects": count}
    return out


def breakdown(owners: Sequence[Owner]) -> dict[str, dict[str, int]]:
    """``walk(owners)`` run in a forked child, so the walk's own memory never counts in this process; the child's
    answer comes back as JSON through a pipe. Raises RuntimeError when the child fails."""
    rfd, wfd = os.pipe()
    with warnings.catch_warnings():  # a helper thread may exist (none runs between the bench's phases)
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # pragma: no cover - the child; coverage does not follow a fork
        code = 1
        try:
            os.close(rfd)
            data = json.dumps(walk(owners)).encode()
            with os.fdopen(wfd, "wb") as w:
                w.write(data)
            code = 0
        finally:
            os._exit(code)
    os.close(wfd)
    with os.fdopen(rfd, "rb") as r:
        data = r.read()
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0 or not data:
        raise RuntimeError(f"the memory walk's child failed (status {status})")
    answer: dict[str, dict[str, int]] = json.loads(data)
    return answer


def per_port(figures: dict[str, dict[str, int]], service_ports: int) -> dict[str, float]:
    """Bytes per service port of each owner (and ``total``)."""
    n = max(service_ports, 1)
    out = {name: f["bytes"] / n for name, f in figures.items()}
    out["total"] = sum(f["bytes"] for f in figures.values()) / n
    return out
