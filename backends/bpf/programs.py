"""The loaded programs one kproxy holds, so that putting back what someone detached or unpinned needs no compiler.

Compiling the programs (bcc and LLVM in a child process, ``loader.attach_in_child``) takes seconds, tens of seconds
on a busy machine; attaching an already loaded program is one ``BPF_PROG_ATTACH``. So after the first attach kproxy
keeps the programs: it holds an fd of each (``Held``) and pins each in the node's pin folder as
``prog_<build>_<name>``, where ``<build>`` is ``digest``: a hash of the C source and headers, the compiler flags (the
map sizes and the maps' pin paths are among them) and the kernel release. The decision, per damage:

- Programs detached (someone's ``BPF_PROG_DETACH``, ``bpftool cgroup detach``): the held programs are attached again
  (ALLOW_MULTI), when they read the maps pinned now: a loaded program is bound to the maps it was loaded with, so
  reattaching it serves exactly the maps kproxy writes.
- Pins removed (the folder or single pins): kproxy's own map fds and the held programs still keep the maps alive, so
  each is pinned again at its path (a program's map found by its name, ``kp_<role><4|6>``: the socket-storage
  ``peer`` maps, which only the programs hold), contents and all, and the programs are pinned again; a path someone
  pinned another map at is left alone.
- Nothing usable left (no held programs, or they read other maps than the pinned ones: the pins were replaced, not
  removed): the caller compiles again (``loader.attach_in_child``).

A restart (a new process) adopts the pinned programs of its own build without a compile when each of them reads the
maps pinned now (``Held.from_pins``): the same source, flags and kernel give the same program, and the map check
rules out programs bound to maps of an earlier pin folder. (bcc's version is not in the digest: it would have to be
imported into kproxy's own process; a bcc upgrade without a source change keeps using the programs it compiled.)
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kproxy.model import IPFamily

from . import loader, maps, objects

log = logging.getLogger(__name__)

PIN_PREFIX = "prog_"
_PROG_PIN = re.compile(PIN_PREFIX + r"([0-9a-f]{16})_(kp_\w+)")
_MAP_NAME = re.compile(r"kp_([a-z]+)([46])")


def digest(p: loader.Places, *, peer: bool = True) -> str:
    """The build of the programs for ``p``: 16 hex digits of a SHA-256 over the C source and its headers, the
    compiler flags and the kernel release (bcc compiles against the running kernel's headers)."""
    h = hashlib.sha256()
    for f in [loader.SOURCE, *sorted(loader.SOURCE.parent.glob("*.h"))]:
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    for flag in loader.program_cflags(p, peer=peer):
        h.update(flag.encode() + b"\0")
    h.update(os.uname().release.encode())
    return h.hexdigest()[:16]


def pin_path(p: loader.Places, build: str, name: str) -> Path:
    return p.pin_real / f"{PIN_PREFIX}{build}_{name}"


def _reads(prog_fd: int, family: IPFamily, pinned: Mapping[tuple[str, IPFamily], int]) -> bool:
    """Whether the program reads the maps pinned now (``loader.programs_problem``'s rule): its family's service map,
    and no map that is not pinned."""
    svc = pinned.get(("svc", family))
    got = objects.prog_map_ids(prog_fd)
    return svc is not None and svc in got and got <= set(pinned.values())


class Held:
    """An fd of each of kproxy's programs (``loader.PROGRAMS``) of one build; the caller closes it."""

    def __init__(self, build: str, fds: Mapping[str, int]) -> None:
        self.build = build
        self.fds = dict(fds)
        self.ids = {name: objects.map_id(fd) for name, fd in self.fds.items()}
        self._map_pins: dict[Path, int] | None = None

    @classmethod
    def _opened(cls, build: str, fds: dict[str, int]) -> Held | None:
        """``Held`` when ``fds`` holds every program under its own name; else the fds are closed and None."""
        try:
            ok = set(fds) == set(loader.PROGRAMS) and all(objects.prog_name(fd) == n for n, fd in fds.items())
        except OSError:
            ok = False
        if ok:
            return cls(build, fds)
        for fd in fds.values():
            os.close(fd)
        return None

    @classmethod
    def by_ids(cls, build: str, ids: Mapping[str, int]) -> Held | None:
        """The programs with these ids (what ``loader.attach_in_child`` attached), or None when one is gone."""
        fds: dict[str, int] = {}
        for name, pid in ids.items():
            try:
                fds[name] = objects.prog_fd_by_id(pid)
            except maps.BpfError:
                break
        return cls._opened(build, fds)

    @classmethod
    def from_pins(cls, p: loader.Places, build: str, pinned: Mapping[tuple[str, IPFamily], int]) -> Held | None:
        """The programs of ``build`` pinned in ``p``'s folder, when every one is there and reads the maps pinned now
        (``pinned``: ``loader.pinned_ids``); else None (the caller compiles)."""
        fds: dict[str, int] = {}
        for name in loader.PROGRAMS:
            try:
                fds[name] = maps.obj_get(str(pin_path(p, build, name)))
            except (FileNotFoundError, maps.BpfError):
                break
        held = cls._opened(build, fds)
        if held is not None and not held.reads(pinned):
            held.close()
            return None
        return held

    def reads(self, pinned: Mapping[tuple[str, IPFamily], int]) -> bool:
        """Whether every held program reads the maps pinned now (attaching them again serves what kproxy writes)."""
        try:
            return all(_reads(fd, loader.PROGRAMS[n][0], pinned) for n, fd in self.fds.items())
        except OSError:
            return False

    def attach(self, cgroup: Path, *, detach_old: bool = False) -> tuple[list[str], list[dict[str, Any]]]:
        """Attach (ALLOW_MULTI) every held program that is not attached to ``cgroup``; (the names attached or kept,
        the other ``kp_*`` programs attached there: detached too when ``detach_old``). Milliseconds: no compile."""
        before = loader.ours(loader.attached(cgroup))
        on = {(str(d["attach_type"]), int(d["id"])) for d in before}
        mine = set(self.ids.values())
        cfd = os.open(str(cgroup), os.O_RDONLY | os.O_DIRECTORY)
        try:
            for name, fd in self.fds.items():
                at_name = attach_type(name)
                if (at_name, self.ids[name]) not in on:
                    objects.prog_attach(cfd, fd, loader.ATTACH_NUMBERS[at_name], loader.BPF_F_ALLOW_MULTI)
        finally:
            os.close(cfd)
        replaced = [d for d in before if int(d["id"]) not in mine]
        if detach_old:
            loader.detach_ids(cgroup, replaced)
        return list(self.fds), replaced

    def pin(self, p: loader.Places) -> list[str]:
        """Pin every held program at its path (a pin there of another program, an earlier load of the same build, is
        replaced); the names pinned now."""
        p.pin_real.mkdir(parents=True, exist_ok=True)
        out = []
        for name, fd in self.fds.items():
            path = pin_path(p, self.build, name)
            try:
                cur = maps.obj_get(str(path))
            except FileNotFoundError:
                cur = -1
            if cur >= 0:
                try:
                    if objects.map_id(cur) == self.ids[name]:
                        continue
                finally:
                    os.close(cur)
                path.unlink(missing_ok=True)
            maps.obj_pin(fd, str(path))
            out.append(name)
        return out

    def map_pins(self) -> dict[Path, int]:
        """Pin path -> id of every map the held programs read that has a pin of kproxy's (by the map's name)."""
        if self._map_pins is None:
            out: dict[Path, int] = {}
            for mid in sorted({i for fd in self.fds.values() for i in objects.prog_map_ids(fd)}):
                mfd = objects.map_fd_by_id(mid)
                try:
                    m = _MAP_NAME.fullmatch(objects.map_name(mfd))
                finally:
                    os.close(mfd)
                if m is not None and m.group(1) in loader.PINNED_ROLES:
                    fam = IPFamily.V4 if m.group(2) == "4" else IPFamily.V6
                    out[Path(maps.pin_name(m.group(1), fam))] = mid
            self._map_pins = out
        return self._map_pins

    def repin(self, p: loader.Places, own: Mapping[tuple[str, IPFamily], int]) -> list[str]:
        """Put back the pins someone removed: the maps kproxy holds (``own``: (role, family) -> fd; the names maps,
        which no program reads, among them) and every other map the programs read, each at its path when nothing is
        pinned there (a path holding another map is left alone: that is a replacement, not a removal), and the
        programs themselves. The names pinned again; [] (a few stat calls) when nothing was missing."""
        want: dict[Path, tuple[int, bool]] = {n: (i, False) for n, i in self.map_pins().items()}
        want.update({Path(maps.pin_name(r, f)): (fd, True) for (r, f), fd in own.items()})
        missing = [(n, v) for n, v in want.items() if not (p.pin_real / n).exists()]
        progs = [n for n in self.fds if not pin_path(p, self.build, n).exists()]
        if not missing and not progs:
            return []
        p.pin_real.mkdir(parents=True, exist_ok=True)
        out = []
        for name, (ref, is_fd) in missing:
            mfd = ref if is_fd else objects.map_fd_by_id(ref)
            try:
                maps.obj_pin(mfd, str(p.pin_real / name))
                out.append(str(name))
            except maps.BpfError as exc:
                if exc.errno != errno.EEXIST:  # pinned meanwhile by someone: theirs stays
                    raise
            finally:
                if not is_fd:
                    os.close(mfd)
        return out + [f"{PIN_PREFIX}{self.build}_{n}" for n in self.pin(p)]

    def close(self) -> None:
        for fd in self.fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds.clear()


def attach_type(name: str) -> str:
    """A program's attach type as ``loader.attached`` names it (bcc's name in lower case: ``cgroup_inet4_connect``)."""
    return loader.PROGRAMS[name][1].lower()


class Keeper:
    """A proxier's programs: attached at ``start`` (adopted from the pins or compiled), then held and pinned, and put
    back from what is held when someone detaches or unpins them. ``compiles`` and ``repairs`` count (tests, logs)."""

    def __init__(self) -> None:
        self.held: Held | None = None
        self.compiles = 0  # ``loader.attach_in_child`` calls
        self.repairs = 0  # detached programs or removed pins put back from the held programs

    def start(self, p: loader.Places) -> tuple[list[str], list[dict[str, Any]]]:
        """The pinned programs of this build when they read the maps pinned now, else a compile (the older copies
        stay attached: ``loader.load_and_attach``'s ``detach_old`` False); (the names attached, the copies
        replaced). Either way they are held and pinned."""
        build = digest(p)
        held = Held.from_pins(p, build, loader.pinned_ids(p))
        if held is not None:
            names, replaced = held.attach(p.cgroup)
            log.info("bpf: the pinned programs of this build (%s) read the pinned maps: adopted, no compile", build)
        else:
            names, replaced, ids = self._compile(p, detach_old=False)
            held = Held.by_ids(build, ids)
        self._hold(p, held)
        return names, replaced

    def compile_again(self, p: loader.Places) -> list[str]:
        """The repair when nothing held can serve: compile and attach (older copies detached), hold and pin."""
        names, _, ids = self._compile(p, detach_old=True)
        self._hold(p, Held.by_ids(digest(p), ids))
        return names

    def _compile(self, p: loader.Places, *, detach_old: bool) -> tuple[list[str], list[dict[str, Any]], dict[str, int]]:
        self.compiles += 1
        return loader.attach_in_child(p, detach_old=detach_old)

    def _hold(self, p: loader.Places, held: Held | None) -> None:
        self.close()
        self.held = held
        if held is None:
            log.warning("bpf: the attached programs could not be held: a repair of them compiles them again")
            return
        try:
            held.pin(p)
        except OSError as exc:
            log.warning("bpf: pinning the programs in %s failed (a restart compiles them): %s", p.pin_dir, exc)
        with contextlib.suppress(OSError):  # failing here, the first check of kernel state learns it (and says why)
            held.map_pins()  # learnt now, not in that first check (the one before the first partial sync)

    def put_back_pins(self, p: loader.Places, own: Mapping[tuple[str, IPFamily], int]) -> bool:
        """Pins someone removed put back from the held programs and ``own`` (the map fds kproxy holds, ``Held.repin``);
        whether any were."""
        if self.held is None:
            return False
        try:
            again = self.held.repin(p, own)
        except OSError as exc:
            log.warning("bpf: pinning the held maps and programs again in %s failed: %s", p.pin_dir, exc)
            return False
        if again:
            self.repairs += 1
            log.warning("bpf: pins gone in %s: pinned the held ones again (%s)", p.pin_dir, ", ".join(again))
        return bool(again)

    def reattach(
        self, p: loader.Places, pinned: Mapping[tuple[str, IPFamily], int], families: tuple[IPFamily, ...], why: str
    ) -> bool:
        """Programs detached (``why``): attach the held ones again when they read the maps pinned now; whether they
        serve now (False: none held, bound to other maps, or the attach failed; the caller compiles)."""
        held = self.held
        if held is None or not held.reads(pinned):
            return False
        t0 = time.perf_counter()
        try:
            held.attach(p.cgroup)
            still = loader.programs_problem(p, dict(pinned), families)
        except (OSError, RuntimeError) as exc:
            still = str(exc)
        if still is not None:
            log.warning("bpf: attaching the held programs again did not do: %s", still)
            return False
        self.repairs += 1
        log.warning("bpf: %s: attached the held programs again in %.1f ms", why, 1e3 * (time.perf_counter() - t0))
        return True

    def remove_stale(self, p: loader.Places) -> list[str]:
        return remove_stale(p, self.held.build) if self.held is not None else []

    def close(self) -> None:
        if self.held is not None:
            self.held.close()
            self.held = None


def remove_stale(p: loader.Places, build: str) -> list[str]:
    """Unlink the program pins of other builds (once no program of theirs is wanted); the names removed."""
    gone = []
    for f in p.pin_real.iterdir() if p.pin_real.is_dir() else ():
        m = _PROG_PIN.fullmatch(f.name)
        if m is not None and m.group(1) != build:
            f.unlink(missing_ok=True)
            gone.append(f.name)
    return sorted(gone)
