"""The thin exec layer between the iptables backend and the kernel: the only module that runs iptables binaries.

Every call is an argv list (never a shell) with the payload on stdin. The flavour (``nft`` or ``legacy``) picks the
binaries; ``netns`` prefixes ``ip netns exec NAME`` so tests and the floor measurement can aim the same code at a
namespace they made. The daemon uses neither: it runs in the node's namespace, as upstream does.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass

from kproxy.model import IPFamily

FLAVOURS = ("nft", "legacy")
TABLES = ("mangle", "filter", "nat")
#: wait at most 5 s for the xtables lock, as upstream's pkg/util/iptables (a held lock fails the sync, which is
#: retried, instead of blocking the proxier, /rules and /trace until the timeout): the flags of a current iptables
WAIT = ("-w", "5")
# Which versions take which wait flag, as upstream's pkg/util/iptables checks them (iptables.go: WaitMinVersion,
# WaitSecondsMinVersion, WaitRestoreMinVersion): `iptables -w` exists since 1.4.20, `-w SECONDS` since 1.4.22, and
# iptables-restore takes `-w SECONDS` since 1.6.2 (older ones fail on any -w). An unknown version counts as too old,
# as upstream assumes its minimum then: a missing lock wait is retried by the next sync, an unknown flag never works.
WAIT_MIN = (1, 4, 20)
WAIT_SECONDS_MIN = (1, 4, 22)
WAIT_RESTORE_MIN = (1, 6, 2)
_VERSION_RE = re.compile(r"v(\d+)\.(\d+)(?:\.(\d+))?")


def parse_version(text: str) -> tuple[int, int, int] | None:
    """``iptables v1.8.9 (nf_tables)`` -> (1, 8, 9); None when the text carries no version."""
    m = _VERSION_RE.search(text)
    if m is None:
        return None
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def wait_flags(version: tuple[int, int, int] | None, *, restore: bool) -> tuple[str, ...]:
    """The lock-wait flags an iptables (or, with ``restore``, iptables-restore) of ``version`` accepts."""
    if version is None:
        return ()
    if restore:
        return WAIT if version >= WAIT_RESTORE_MIN else ()
    if version >= WAIT_SECONDS_MIN:
        return WAIT
    if version >= WAIT_MIN:
        return ("-w",)
    return ()


_versions: dict[str, tuple[int, int, int] | None] = {}
_versions_lock = threading.Lock()


def tool_version(tool: str) -> tuple[int, int, int] | None:
    """``TOOL --version``, asked once per binary and process (the binaries do not change under a running kproxy;
    the namespace does not matter: it is the binary's version). None when it cannot be run or read."""
    with _versions_lock:
        if tool in _versions:
            return _versions[tool]
    try:
        proc = subprocess.run([tool, "--version"], capture_output=True, text=True, timeout=10, check=False)
        version = parse_version(proc.stdout + proc.stderr) if proc.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired):
        version = None
    with _versions_lock:
        _versions[tool] = version
    return version


_TIMEOUT = 300.0  # seconds; a 420k-line restore takes ~10 s, a wedged lock must not hang the runner forever


@dataclass(frozen=True, slots=True)
class Run:
    rc: int
    stdout: str
    stderr: str
    seconds: float

    @property
    def ok(self) -> bool:
        return self.rc == 0


def binary(tool: str, family: IPFamily, flavour: str) -> str:
    """``iptables-nft-restore``, ``ip6tables-legacy-save``, ``iptables-nft`` ... for tool in restore/save/''."""
    base = "ip6tables" if family == IPFamily.V6 else "iptables"
    return f"{base}-{flavour}-{tool}" if tool else f"{base}-{flavour}"


def missing_binaries(flavours: tuple[str, ...] = FLAVOURS) -> list[str]:
    """Binaries of the given flavours that are not on PATH."""
    out = []
    for flavour in flavours:
        for fam in (IPFamily.V4, IPFamily.V6):
            for tool in ("restore", "save", ""):
                name = binary(tool, fam, flavour)
                if shutil.which(name) is None:
                    out.append(name)
    return out


class Kernel:
    """Runs one flavour's iptables tools, optionally inside a named network namespace."""

    def __init__(self, flavour: str = "nft", netns: str | None = None) -> None:
        if flavour not in FLAVOURS:
            raise ValueError(f"iptables flavour {flavour!r}: choose one of {FLAVOURS}")
        self.flavour = flavour
        self.netns = netns

    def _argv(self, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.netns, *argv] if self.netns else argv

    def run(self, argv: list[str], stdin: str | None = None) -> Run:
        start = time.perf_counter()
        try:
            proc = subprocess.run(
                self._argv(argv), input=stdin, capture_output=True, text=True, timeout=_TIMEOUT, check=False
            )
        except FileNotFoundError as exc:
            return Run(127, "", f"{argv[0]}: {exc.strerror}", time.perf_counter() - start)
        except subprocess.TimeoutExpired:
            return Run(124, "", f"{argv[0]}: timed out after {_TIMEOUT:.0f}s", time.perf_counter() - start)
        return Run(proc.returncode, proc.stdout, proc.stderr, time.perf_counter() - start)

    def wait(self, family: IPFamily, *, restore: bool = False) -> tuple[str, ...]:
        """The lock-wait flags this flavour's iptables (or iptables-restore) takes (``wait_flags``)."""
        # iptables-restore reports the version of the iptables package it belongs to
        return wait_flags(tool_version(binary("restore" if restore else "", family, self.flavour)), restore=restore)

    def restore(self, family: IPFamily, text: str, *, noflush: bool = True) -> Run:
        """``iptables-restore -w 5 [--noflush] --counters`` with ``text`` on stdin (``-w`` as the version allows)."""
        argv = [binary("restore", family, self.flavour), *self.wait(family, restore=True)]
        if noflush:
            argv.append("--noflush")
        argv.append("--counters")
        return self.run(argv, text)

    def save(self, family: IPFamily, table: str | None = None, counters: bool = False) -> Run:
        argv = [binary("save", family, self.flavour)]
        if table:
            argv += ["-t", table]
        if counters:
            argv.append("-c")
        return self.run(argv)

    def chain_exists(self, family: IPFamily, table: str, chain: str) -> bool:
        """``iptables -t TABLE -S CHAIN`` succeeds (the nft flavour fetches only that chain)."""
        return self.run([binary("", family, self.flavour), *self.wait(family), "-t", table, "-S", chain]).ok

    def list_chain(self, family: IPFamily, table: str, chain: str) -> Run:
        """``iptables -t TABLE -S CHAIN``: one chain's rules in save syntax (cheap on both flavours)."""
        return self.run([binary("", family, self.flavour), *self.wait(family), "-t", table, "-S", chain])


def count_rules(save_text: str) -> tuple[int, bool]:
    """(rules, whether any KUBE-* chain exists) in ``iptables-save`` output."""
    rules = 0
    kube = False
    for line in save_text.splitlines():
        if line.startswith("-A "):
            rules += 1
        elif line.startswith(":KUBE-"):
            kube = True
    return rules, kube


def detect_flavour(netns: str | None = None) -> str:
    """The flavour the node already uses, as upstream's iptables-wrapper decides: legacy when legacy tables hold
    KUBE-* chains (or more rules than nft without nft having KUBE-* chains), otherwise nft."""
    stats: dict[str, tuple[int, bool]] = {}
    for flavour in FLAVOURS:
        k = Kernel(flavour, netns)
        rules, kube = 0, False
        for fam in (IPFamily.V4, IPFamily.V6):
            if shutil.which(binary("save", fam, flavour)) is None:
                continue
            r = k.save(fam)
            if r.ok:
                n, has = count_rules(r.stdout)
                rules += n
                kube = kube or has
        stats[flavour] = (rules, kube)
    if stats["legacy"][1]:
        return "legacy"
    if stats["nft"][1]:
        return "nft"
    return "legacy" if stats["legacy"][0] > stats["nft"][0] else "nft"
