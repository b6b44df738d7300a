"""The thin exec layer between the iptables backend and the kernel: the only module that runs iptables binaries.

Every call is an argv list (never a shell) with the payload on stdin. The flavour (``nft`` or ``legacy``) picks the
binaries; ``netns`` prefixes ``ip netns exec NAME`` so tests and the floor measurement can aim the same code at a
namespace they made. The daemon uses neither: it runs in the node's namespace, as upstream does.
"""

from __future__ import annotations

import functools
import logging
import re
import shutil
import subprocess
import time
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from kproxy.model import IPFamily
from kproxy.toolkit.netns import in_netns

from .adopt import Adoption, Canon, KernelRules, canonical, kernel_service_chains
from .layout import JUMP_RULES, Context, JumpRule
from .restore import Restore

log = logging.getLogger(__name__)

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


@functools.lru_cache(maxsize=16)
def tool_version(tool: str) -> tuple[int, int, int] | None:
    """``TOOL --version``, asked once per binary and process (the binaries do not change under a running kproxy;
    the namespace does not matter: it is the binary's version). None when it cannot be run or read."""
    try:
        proc = subprocess.run([tool, "--version"], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_version(proc.stdout + proc.stderr) if proc.returncode == 0 else None


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


# ------------------------------------------------------------------------------------------ reading kproxy's rules


def filter_builtin_rules(kernel: Kernel, fam: IPFamily) -> tuple[set[str], str | None]:
    """The rules of filter's INPUT, FORWARD and OUTPUT ("filter/-A CHAIN spec"), one ``iptables -S`` per chain:
    filter is small on both flavours (on legacy every -S reads the whole table, so nat is read by one save)."""
    present: set[str] = set()
    for chain in ("INPUT", "FORWARD", "OUTPUT"):
        res = kernel.list_chain(fam, "filter", chain)
        if not res.ok:
            return present, f"{binary('', fam, kernel.flavour)} -t filter -S {chain}: {res.stderr.strip()}"
        present.update(f"filter/{line}" for line in res.stdout.splitlines() if line.startswith("-A "))
    return present, None


def read_adoption(kernel: Kernel, family: IPFamily) -> Adoption:
    """The nat table's service chains (canonical, for adoption), the jumps present in the built-in chains and the nat
    table's rule count, read once per full batch. The nat jumps come with the nat table's save (on the legacy flavour
    every ``-S`` reads the whole table)."""
    jumps, err = filter_builtin_rules(kernel, family)
    if err:
        return Adoption(error=err)
    res = kernel.save(family, "nat")
    if not res.ok:
        return Adoption(error=f"{binary('save', family, kernel.flavour)} -t nat: {res.stderr.strip()}")
    builtin = ("-A PREROUTING ", "-A OUTPUT ", "-A POSTROUTING ")
    jumps.update(f"nat/{line}" for line in res.stdout.splitlines() if line.startswith(builtin))
    return Adoption(kernel_service_chains(res.stdout), jumps, res.stdout.count("\n-A "))


def read_rules(kernel: Kernel, family: IPFamily, ctx: Context) -> KernelRules:
    """Every rule of kproxy's chains in nat and filter, read now with ``iptables-save`` (canonical), for ``verify``."""
    rules: dict[str, list[Canon]] = {}
    for table in ("nat", "filter"):
        res = kernel.save(family, table)
        if not res.ok:
            return KernelRules(ctx, {}, f"{binary('save', family, kernel.flavour)} -t {table}: {res.stderr}")
        for line in res.stdout.splitlines():
            if line.startswith(":KUBE-"):
                rules.setdefault(f"{table}/{line[1:].split(' ', 1)[0]}", [])
            elif line.startswith("-A KUBE-"):
                chain, canon = canonical(line)
                rules.setdefault(f"{table}/{chain}", []).append(canon)
    return KernelRules(ctx, rules)


# ------------------------------------------------------------------------------------------ route_localnet

ROUTE_LOCALNET = "/proc/sys/net/ipv4/conf/all/route_localnet"


def ensure_route_localnet(netns: str | None) -> bool:
    """``net.ipv4.conf.all.route_localnet=1`` in the backend's namespace, as upstream's ``NewProxier`` sets it while
    it serves localhost NodePorts (a packet DNATed from 127.0.0.1 to a pod leaves the loopback device; without it
    the kernel drops it as a martian); never set back, as upstream. Checked on every full sync, so a sysctl reset by
    hand is set again; False (logged) when it cannot be set: the rules are written anyway."""

    def ensure() -> bool:
        with open(ROUTE_LOCALNET) as f:
            if f.read().strip() == "1":
                return False
        with open(ROUTE_LOCALNET, "w") as f:
            f.write("1")
        return True

    try:
        changed = in_netns(netns, ensure, name="kproxy-sysctl")
    except OSError as exc:
        log.error("cannot set %s to 1: localhost NodePorts will not answer (%s)", ROUTE_LOCALNET, exc)
        return False
    if changed:
        log.info(
            "Setting route_localnet=1 to allow node-ports on localhost; to change this either disable "
            "--iptables-localhost-nodeports or set --nodeport-addresses to filter loopback addresses"
        )
    return True


# ------------------------------------------------------------------------------------------ applying payloads

LINE = re.compile(r"line:? (\d+)")


TABLE_LINE = re.compile(r"^\*(\w+)$", re.M)


def apply_overlapped(
    kernel: Kernel, fam: IPFamily, restores: Iterable[Restore]
) -> Iterator[tuple[Restore, Run, float]]:
    """Apply payloads in order, one at a time, each in a worker thread while the next is taken from ``restores``
    (rendered, when it is a generator): yields (payload, result, seconds spent taking the next payload) as each
    one finishes. The caller stops at the first refusal; the payload rendered meanwhile is never applied.

    ``iptables-restore`` runs in its own process (the kernel's work is in its system calls), so on two cores the
    rendering of chunk N+1 in Python costs no wall time while chunk N is applied."""
    it = iter(restores)

    def take() -> tuple[Restore | None, float]:
        t0 = time.perf_counter()
        for r in it:
            if r.text:
                return r, time.perf_counter() - t0
        return None, time.perf_counter() - t0

    cur, spent = take()
    if cur is None:
        return
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="iptables-restore") as pool:
        while cur is not None:
            fut = pool.submit(kernel.restore, fam, cur.text)
            nxt, more = take()
            res = fut.result()
            yield cur, res, spent
            if not res.ok:
                return
            cur, spent = nxt, more


def deletes_at(text: str, line: int) -> bool:
    """Whether the payload's refused line (1-based) is a chain deletion (``-X``), as both flavours report a chain
    that something still jumps to."""
    lines = text.splitlines()
    return 0 < line <= len(lines) and lines[line - 1].startswith("-X ")


def timed_restores(kernel: Kernel, payloads: Mapping[IPFamily, list[str]], what: str) -> float | None:
    """Seconds ``iptables-restore`` took for every payload, in order; None (logged) when one is refused."""
    total = 0.0
    for fam, texts in payloads.items():
        for text in texts:
            res = kernel.restore(fam, text)
            if not res.ok:
                log.warning("%s failed: %s", what, res.stderr.strip())
                return None
            total += res.seconds
    return total


def replayable(text: str) -> str:
    """A restore payload without its chain deletions (``-X``, which cannot be repeated) and without the declarations
    (``:CHAIN``) that flushed those chains before, which would create them again."""
    lines = text.splitlines(keepends=True)
    gone = {f":{line[3:].strip()} " for line in lines if line.startswith("-X ")}
    return "".join(line for line in lines if not line.startswith("-X ") and line[: line.find(" ") + 1] not in gone)


def jump_text(jumps: list[JumpRule], op: str) -> str:
    """A restore payload deleting (``-D``) or inserting at the top (``-I``, in the order a full sync does) jumps."""
    lines: list[str] = []
    for table in ("filter", "nat"):
        mine = [j for j in jumps if j.table == table]
        if mine:
            pos = " 1" if op == "-I" else ""
            lines += [f"*{table}", *(f"{op} {j.chain}{pos} {j.spec}" for j in mine), "COMMIT"]
    return "\n".join(lines) + "\n" if lines else ""


def summarise(stderr: str, text: str) -> str:
    """The first line of iptables-restore's complaint plus the payload line it names."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip() and not ln.startswith("Try `")]
    summary = "; ".join(lines[:3]) or "iptables-restore failed"
    m = LINE.search(stderr)
    if m:
        n = int(m.group(1))
        payload = text.split("\n")
        if 1 <= n <= len(payload):
            summary += f" [line {n}: {payload[n - 1][:300]}]"
    return summary


# ------------------------------------------------------------------------------------------ the bench's floors


def unhooked_floor(k: Kernel, payloads: Mapping[IPFamily, list[str]]) -> tuple[float | None, list[IPFamily]]:
    """The replay of ``payloads`` with the jumps from the built-in chains into the tables they write deleted first
    and inserted again afterwards: (seconds or None, the families whose jumps could not be inserted again)."""
    tables = {fam: {m.group(1) for t in texts for m in TABLE_LINE.finditer(t)} for fam, texts in payloads.items()}
    jumps = {fam: [j for j in JUMP_RULES if j.table in tables[fam]] for fam in payloads}
    unhooked: dict[IPFamily, list[JumpRule]] = {}
    seconds: float | None = None
    lost: list[IPFamily] = []
    try:
        for fam, js in jumps.items():
            for table in ("filter", "nat"):  # one restore per table: each is deleted whole or not at all
                mine = [j for j in js if j.table == table]
                if not mine:
                    continue
                res = k.restore(fam, jump_text(mine, "-D"))
                if not res.ok:
                    log.warning("partial floor: could not unhook: %s", res.stderr.strip())
                    return None, lost
                unhooked.setdefault(fam, []).extend(mine)
        seconds = timed_restores(k, payloads, "partial floor replay without the jumps")
    finally:
        for fam, js in unhooked.items():
            res = k.restore(fam, jump_text(js, "-I"))
            if not res.ok:
                log.error("partial floor: could not insert the jumps again: %s", res.stderr.strip())
                lost.append(fam)
    return seconds, lost
