"""Compiling, loading and attaching the bpf mode's socket programs, and where they live: the pin folder and the
cgroup (v2) they serve, chosen per network namespace unless the options name them.

bpffs and cgroups belong to the whole machine, not to a network namespace, so every kproxy (a lab node, a benchmark,
a test) needs a pin folder and a cgroup of its own: ``--bpf-pin-path`` and ``--bpf-cgroup-path`` name them; without
them the defaults are keyed by the network namespace's inode (``/sys/fs/bpf/kproxy/net-<inode>`` and a child cgroup
``kproxy-net-<inode>`` in a cgroup2 mount of kproxy's own at ``/run/kproxy/cgroup2``), so two namespaces never share
maps and a restart in the same namespace finds its own. The default cgroup holds no process until someone puts them
there: a real node passes the cgroup its pods run in (never the machine's root cgroup).

Programs are loaded by bcc with their expected attach types and attached with BPF_F_ALLOW_MULTI (legacy
``BPF_PROG_ATTACH``, so they stay attached when kproxy exits: a restart keeps serving). A new process loads its own
copies; where a ``kp_*`` program with the same tag (instructions) reading the same maps is attached already (a
restart of the same build), it is kept and nothing is swapped; otherwise the new copy is attached, then the older
one detached: there is no moment without a program, and while both are attached the older one translates first and
the newer one sees a backend address, which no frontend matches. When the older copies read other maps than the
pinned ones (an upgrade that changed the map layout pins new, empty maps; pins lost while kproxy was down), ``start``
leaves them attached until its first sync has filled the new maps: detached at once, every new connection would go
out untranslated until then.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kproxy.model import IPFamily

from . import maps, objects

log = logging.getLogger(__name__)

BPF_FS = Path("/sys/fs/bpf")
PIN_ROOT = BPF_FS / "kproxy"
CGROUP_ROOT = Path("/run/kproxy/cgroup2")
SOURCE = Path(__file__).resolve().parent.parent.parent / "bpf" / "kproxy_sock.c"
BPF_F_ALLOW_MULTI = 2
DEFAULT_MAP_SIZE = 1 << 20  # 10,000 services x 50 endpoints need 510,000 service entries and 500,000 backends
LRU_SIZE = 65536
#: the largest --bpf-map-size: a map's max_entries is 32 bits, and ids are the backend array's indexes
MAX_MAP_SIZE = 0xFFFFFFFF
PROG_PREFIX = "kp_"
#: the socket-storage maps (``peer4_v3``, ``peer6_v3``, made and pinned by bcc: ``compile_programs``) and the counters
#: (``maps.COUNTER_ROLE``, with ``--service-counters`` only): not in ``maps.ROLES`` (neither adopted nor verified), but
#: pinned like the others, so ``pinned_ids``, ``programs_problem`` and cleanup know them
PEER_ROLE = "peer"
PINNED_ROLES = (*maps.ROLES, PEER_ROLE, maps.COUNTER_ROLE)

#: program name -> (family, attach type name in bcc's BPFAttachType, bpftool's name for it)
PROGRAMS: dict[str, tuple[IPFamily, str, str]] = {
    "kp_connect4": (IPFamily.V4, "CGROUP_INET4_CONNECT", "connect4"),
    "kp_sendmsg4": (IPFamily.V4, "CGROUP_UDP4_SENDMSG", "sendmsg4"),
    "kp_recvmsg4": (IPFamily.V4, "CGROUP_UDP4_RECVMSG", "recvmsg4"),
    "kp_getpeername4": (IPFamily.V4, "CGROUP_INET4_GETPEERNAME", "getpeername4"),
    "kp_connect6": (IPFamily.V6, "CGROUP_INET6_CONNECT", "connect6"),
    "kp_sendmsg6": (IPFamily.V6, "CGROUP_UDP6_SENDMSG", "sendmsg6"),
    "kp_recvmsg6": (IPFamily.V6, "CGROUP_UDP6_RECVMSG", "recvmsg6"),
    "kp_getpeername6": (IPFamily.V6, "CGROUP_INET6_GETPEERNAME", "getpeername6"),
}
ATTACH_TYPES = tuple(sorted({v[2] for v in PROGRAMS.values()}))


#: a bind mount of the machine's bpffs outside /sys (see ``host_view``), made from the machine's mount namespace
HOST_BPFFS = Path("/run/kproxy/bpffs")


def _bpf_mounted(at: Path = BPF_FS) -> bool:
    try:
        with open("/proc/self/mounts") as f:
            return any(ln.split()[1:3] == [str(at), "bpf"] for ln in f)
    except OSError:
        return False


def ensure_host_bind() -> None:
    """From a process that sees the machine's bpffs at /sys/fs/bpf (the lab, a test): bind it at ``HOST_BPFFS`` so
    that processes started with ``ip netns exec`` (a fresh /sys without bpffs) reach the same bpffs there."""
    if not _bpf_mounted(BPF_FS) or _bpf_mounted(HOST_BPFFS):
        return
    HOST_BPFFS.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "--bind", str(BPF_FS), str(HOST_BPFFS)], check=True, timeout=30)


def _bind_in_use() -> bool:
    """Whether a process in another mount namespace (a lab node's kproxy or pod under ``ip netns exec``, of any lab)
    still sees the bind at ``HOST_BPFFS``: unmounting it would propagate into theirs and cut them off the pins."""
    try:
        ours = os.readlink("/proc/self/ns/mnt")
    except OSError:
        return True
    want = str(HOST_BPFFS)
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if os.readlink(d / "ns" / "mnt") == ours:
                continue
            with open(d / "mountinfo") as f:
                if any(ln.split()[4:5] == [want] for ln in f):
                    return True
        except OSError:  # gone meanwhile, or a kernel thread
            continue
    return False


def release_host_bind() -> None:
    """Undo ``ensure_host_bind`` (lab down and ``cleanup`` call it, from the machine's mount namespace) once no
    kproxy keeps pins under ``PIN_ROOT`` and no process of another mount namespace sees the bind; else leave it."""
    if not _bpf_mounted(BPF_FS) or not _bpf_mounted(HOST_BPFFS):
        return
    if PIN_ROOT.is_dir() and any(PIN_ROOT.iterdir()):
        return
    if _bind_in_use():
        return
    for _ in range(4):  # a bind made twice (two labs racing) is two mounts
        if not _bpf_mounted(HOST_BPFFS):
            break
        res = subprocess.run(["umount", str(HOST_BPFFS)], capture_output=True, text=True, timeout=30, check=False)
        if res.returncode != 0:
            log.warning("bpf: cannot unmount %s: %s", HOST_BPFFS, res.stderr.strip())
            return
    try:
        HOST_BPFFS.rmdir()
    except OSError:
        pass


def host_view(path: Path) -> Path:
    """``path`` (under /sys/fs/bpf) as this process reaches the machine's bpffs. ``ip netns exec`` gives its command a
    mount namespace with a fresh /sys, where /sys/fs/bpf is not the machine's bpffs (a bpffs mounted there would be a
    private instance whose pins vanish with the process); the bind mount at ``HOST_BPFFS``, when someone made it in
    the machine's mount namespace (``ensure_host_bind``: the lab does), is the same bpffs."""
    if not path.is_relative_to(BPF_FS) or _bpf_mounted(BPF_FS):
        return path
    if _bpf_mounted(HOST_BPFFS):
        return HOST_BPFFS / path.relative_to(BPF_FS)
    return path


def netns_inode(netns: str | None) -> int:
    path = f"/run/netns/{netns}" if netns else "/proc/self/ns/net"
    return os.stat(path).st_ino


SO_NETNS_COOKIE = 71  # asm-generic/socket.h (Linux 5.14+)
_CLONE_NEWNET = 0x40000000


def netns_cookie(netns: str | None) -> int:
    """The network namespace's cookie (SO_NETNS_COOKIE of a socket made in it): unlike its inode, which the kernel
    gives to a later namespace once this one is gone, a cookie is never reused while the machine runs. A named
    namespace is entered by a short-lived thread of its own (setns changes the calling thread only)."""
    import socket
    import struct
    import threading

    def cookie() -> int:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as so:
            return int(struct.unpack("<Q", so.getsockopt(socket.SOL_SOCKET, SO_NETNS_COOKIE, 8))[0])

    if not netns:
        return cookie()
    out: list[int] = []
    errors: list[BaseException] = []

    def run() -> None:
        import ctypes

        try:
            fd = os.open(f"/run/netns/{netns}", os.O_RDONLY)
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                if libc.setns(fd, _CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns into {netns}")
            finally:
                os.close(fd)
            out.append(cookie())
        except BaseException as exc:  # handed to the caller
            errors.append(exc)

    t = threading.Thread(target=run, name="bpf-netns-cookie", daemon=True)
    t.start()
    t.join(10)
    if errors:
        raise errors[0]
    if not out:
        raise OSError(f"reading the cookie of network namespace {netns} timed out")
    return out[0]


@dataclass(frozen=True, slots=True)
class Places:
    """Where one kproxy's maps are pinned and which cgroup its programs serve; ``own_cgroup``: the default child
    cgroup kproxy made itself (removed by cleanup)."""

    pin_dir: Path
    cgroup: Path
    own_cgroup: bool
    map_size: int
    # --bpf-allow-root-cgroup: the cgroup may be the root of the machine's cgroup v2 hierarchy (see check_places)
    root_ok: bool = False
    # --service-counters: the programs are compiled with the counter maps (``compile_programs``)
    counters: bool = False

    @property
    def pin_real(self) -> Path:
        """The pin folder as this process reaches it (see ``host_view``; decided once per Places value)."""
        return _host_view(self.pin_dir)

    def pin(self, role: str, family: IPFamily) -> Path:
        return self.pin_real / maps.pin_name(role, family)


_host_view = functools.lru_cache(maxsize=64)(host_view)  # a pin folder's host view does not change


def places(options: Mapping[str, Any], netns: str | None = None) -> Places:
    """The pin folder and cgroup for these options (or the per-namespace defaults)."""
    size = int(options.get("bpf_map_size") or DEFAULT_MAP_SIZE)
    if not 2 <= size <= MAX_MAP_SIZE:
        raise ValueError(f"--bpf-map-size {size}: between 2 and {MAX_MAP_SIZE:,} entries")
    pin = str(options.get("bpf_pin_path") or "")
    cg = str(options.get("bpf_cgroup_path") or "")
    ino = None
    if not pin or not cg:
        ino = netns_inode(netns)
    pin_dir = Path(pin) if pin else PIN_ROOT / f"net-{ino}"
    if cg:
        return Places(pin_dir, Path(cg), False, size, bool(options.get("bpf_allow_root_cgroup")))
    return Places(pin_dir, CGROUP_ROOT / f"kproxy-net-{ino}", True, size)


def is_root_cgroup(path: Path) -> bool:
    """Whether ``path`` is the root of the machine's cgroup hierarchy, wherever it is mounted (a container's
    hostPath mount of the host's cgroup2 at /run/kproxy/cgroupv2 as much as /sys/fs/cgroup): cgroup v2 gives every
    cgroup but the root a ``cgroup.type`` file (a cgroup namespace's root, a non-root cgroup, has one too)."""
    if path.resolve() in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified"), CGROUP_ROOT, Path("/")):
        return True
    return (path / "cgroup.controllers").exists() and not (path / "cgroup.type").exists()


def check_places(p: Places) -> None:
    """Refuse the machine's shared places: bpffs itself; the root cgroup unless chosen (``root_ok``): programs
    there load-balance the sockets of every process of the machine, not only the node's pods, so that is a choice
    the operator makes with --bpf-allow-root-cgroup, never where a path happens to lead."""
    if p.pin_dir.resolve() in (BPF_FS, Path("/")):
        raise ValueError(f"--bpf-pin-path {p.pin_dir}: a folder of kproxy's own is needed, not bpffs itself")
    if not p.root_ok and is_root_cgroup(p.cgroup):
        raise ValueError(
            f"--bpf-cgroup-path {p.cgroup}: the machine's root cgroup (every process's sockets would be "
            "load-balanced); name the pods' cgroup, or choose the root explicitly with --bpf-allow-root-cgroup true"
        )


def _is_cgroup2(path: Path) -> bool:
    try:
        with open("/proc/self/mounts") as f:
            return any(ln.split()[1] == str(path) and ln.split()[2] == "cgroup2" for ln in f)
    except OSError:
        return False


def ensure_places(p: Places) -> None:
    """Make the pin folder (mount bpffs when absent) and, for the default, kproxy's cgroup2 mount and child cgroup."""
    check_places(p)
    if p.pin_dir.is_relative_to(BPF_FS) and p.pin_real == p.pin_dir and not _bpf_mounted(BPF_FS):
        # no way to the machine's bpffs from here (a benchmark under ip netns exec): a private bpffs, whose pins go
        # away with this process's mount namespace
        subprocess.run(["mount", "-t", "bpf", "bpf", str(BPF_FS)], check=True, timeout=30)
    p.pin_real.mkdir(parents=True, exist_ok=True)
    if p.own_cgroup:
        CGROUP_ROOT.mkdir(parents=True, exist_ok=True)
        if not _is_cgroup2(CGROUP_ROOT):
            subprocess.run(["mount", "-t", "cgroup2", "none", str(CGROUP_ROOT)], check=True, timeout=30)
        p.cgroup.mkdir(exist_ok=True)
    elif not p.cgroup.is_dir():
        raise FileNotFoundError(f"--bpf-cgroup-path {p.cgroup}: no such cgroup")


def pins_present(p: Places) -> bool:
    return all(p.pin(r, f).exists() for f in (IPFamily.V4, IPFamily.V6) for r in maps.ROLES)


def open_or_create(p: Places, role: str, family: IPFamily) -> int:
    """An fd for one pinned map: the existing pin, or a map created with the programs' exact spec and pinned (so a
    sync needs no compiler: bcc reopens these pins when the programs are compiled in ``start``)."""
    path = str(p.pin(role, family))
    try:
        return maps.obj_get(path)
    except FileNotFoundError:
        pass
    spec = maps.map_spec(role, family, p.map_size, LRU_SIZE)
    fd = maps.create_map(*spec, name=f"kp_{role}{4 if family == IPFamily.V4 else 6}")
    maps.obj_pin(fd, path)
    return fd


def program_cflags(p: Places, *, peer: bool = True) -> list[str]:
    """The compiler flags of the programs for ``p`` (``compile_programs``; ``programs.digest`` hashes them)."""
    cflags = [
        f"-I{SOURCE.parent}",
        f"-DKP_SVC_MAX={p.map_size}",
        f"-DKP_BE_MAX={p.map_size}",
        f"-DKP_NAME_MAX={p.map_size}",
        f"-DKP_LRU_MAX={LRU_SIZE}",
    ]
    roles = (*maps.ROLES, *((PEER_ROLE,) if peer else ()), *((maps.COUNTER_ROLE,) if p.counters else ()))
    for fam in (IPFamily.V4, IPFamily.V6):
        for role in roles:
            macro = f"KP_PIN_{role.upper()}{4 if fam == IPFamily.V4 else 6}"
            cflags.append(f'-D{macro}="{p.pin(role, fam)}"')
    return cflags


def compile_programs(p: Places, *, peer: bool = True) -> Any:
    """bcc-compile bpf/kproxy_sock.c against the pin folder (creating or reopening the pinned maps); the BPF object.
    The peer maps (``PEER_ROLE``: socket storage of connected TCP sockets, which keeps them out of the reverse-NAT
    LRU) are created and pinned by bcc itself: kproxy's own map creation cannot make SK_STORAGE maps (they need
    BTF), and userspace cannot list them, so no sync, adoption or ``pins_present`` ever opens them. ``peer=False``
    builds without them (connected TCP sockets then use the reverse-NAT LRU: tests of that path). ``p.counters``
    adds the counter maps (``KP_PIN_CNT4/6``: backends/bpf/counters.py); without them the programs have none."""
    from bcc import BPF  # type: ignore[import-not-found,unused-ignore]

    t0 = time.perf_counter()
    b = BPF(text=SOURCE.read_bytes(), cflags=program_cflags(p, peer=peer))
    log.info("bpf: compiled %s in %.2f s (maps pinned in %s)", SOURCE.name, time.perf_counter() - t0, p.pin_dir)
    return b


#: bpftool's names of the attach types kproxy uses, by their numbers in the kernel's enum bpf_attach_type
ATTACH_NUMBERS = {
    "cgroup_inet4_connect": 10,
    "cgroup_inet6_connect": 11,
    "cgroup_udp4_sendmsg": 14,
    "cgroup_udp6_sendmsg": 15,
    "cgroup_udp4_recvmsg": 19,
    "cgroup_udp6_recvmsg": 20,
    "cgroup_inet4_getpeername": 29,
    "cgroup_inet6_getpeername": 30,
}


def attached(cgroup: Path) -> list[dict[str, Any]]:
    """Programs attached to ``cgroup`` itself for the attach types kproxy uses, each ``{"id", "attach_type",
    "name"}`` (BPF_PROG_QUERY in-process: another mode's start-up removes kproxy's programs in a few milliseconds)."""
    try:
        cfd = os.open(str(cgroup), os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        return []
    out: list[dict[str, Any]] = []
    try:
        for at_name, at in ATTACH_NUMBERS.items():
            try:
                ids = objects.prog_query(cfd, at)
            except maps.BpfError as exc:
                raise RuntimeError(f"BPF_PROG_QUERY on {cgroup} ({at_name}): {exc}") from None
            for pid in ids:
                try:
                    pfd = objects.prog_fd_by_id(pid)
                except maps.BpfError:
                    continue  # gone meanwhile
                try:
                    name = objects.prog_name(pfd)
                finally:
                    os.close(pfd)
                out.append({"id": pid, "attach_type": at_name, "name": name})
    finally:
        os.close(cfd)
    return out


def detach_ids(cgroup: Path, progs: list[dict[str, Any]]) -> None:
    """Detach these programs (from ``attached``) from ``cgroup`` (BPF_PROG_DETACH; one already gone is fine)."""
    if not progs:
        return
    cfd = os.open(str(cgroup), os.O_RDONLY | os.O_DIRECTORY)
    try:
        for d in progs:
            try:
                pfd = objects.prog_fd_by_id(int(d["id"]))
            except maps.BpfError:
                continue
            try:
                objects.prog_detach(cfd, pfd, ATTACH_NUMBERS[str(d["attach_type"])])
            except maps.BpfError as exc:
                log.warning("bpf: detaching %s from %s: %s", d.get("name"), cgroup, exc)
            finally:
                os.close(pfd)
    finally:
        os.close(cfd)


def ours(progs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in progs if str(d.get("name", "")).startswith(PROG_PREFIX) and d.get("name") in PROGRAMS]


def load_and_attach(
    b: Any, cgroup: Path, *, detach_old: bool = True
) -> tuple[list[str], list[dict[str, Any]], dict[str, int]]:
    """Load every program with its expected attach type; a ``kp_*`` program of the same name and tag (the same
    instructions: a restarted kproxy of the same version) already attached to ``cgroup`` is kept as it is, else the
    new one is attached (ALLOW_MULTI) and then the older copies are detached. (The names of programs attached now,
    the older copies replaced, the id of the program serving each name.) ``detach_old`` False leaves the older copies
    attached, for the caller to detach once the maps the new ones read are filled: they run first and keep
    translating meanwhile."""
    from bcc import BPF, BPFAttachType, BPFProgType  # type: ignore[import-not-found,unused-ignore]

    before = ours(attached(cgroup))
    # a program is the same when its instructions (tag) and the maps it reads (ids: the pinned ones, not maps of a
    # pin folder someone removed) are
    tags: dict[int, tuple[bytes, frozenset[int]]] = {}
    for d in before:
        try:
            pfd = objects.prog_fd_by_id(int(d["id"]))
        except maps.BpfError:
            continue
        try:
            tags[int(d["id"])] = (objects.prog_tag(pfd), objects.prog_map_ids(pfd))
        finally:
            os.close(pfd)
    fd = os.open(str(cgroup), os.O_RDONLY | os.O_DIRECTORY)
    done, kept, serving = [], [], {}
    try:
        for name, (_fam, at_name, _short) in PROGRAMS.items():
            at = getattr(BPFAttachType, at_name)
            fn = b.load_func(name.encode(), BPFProgType.CGROUP_SOCK_ADDR, attach_type=at)
            tag = (objects.prog_tag(fn.fd), objects.prog_map_ids(fn.fd))
            same = [d for d in before if d["name"] == name and tags.get(int(d["id"])) == tag]
            if same:
                kept.append(same[0])  # adopted: it keeps serving, nothing is swapped
                done.append(name)
                serving[name] = int(same[0]["id"])
                continue
            BPF.attach_func(fn, fd, at, BPF_F_ALLOW_MULTI)
            done.append(name)
            serving[name] = objects.map_id(fn.fd)
    finally:
        os.close(fd)
    kept_ids = {int(d["id"]) for d in kept}
    replaced = [d for d in before if int(d["id"]) not in kept_ids]
    if detach_old:
        detach_ids(cgroup, replaced)
    if kept:
        log.info("bpf: %d programs of the same build were attached already: kept", len(kept))
    return done, replaced, serving


_VERSIONED_PIN = re.compile(r"(?:svc|be|rev|aff|name|peer|cnt)[46]_v[0-9]+")


def remove_stale_pins(p: Places) -> list[str]:
    """Unlink the pins of other map versions (``maps.MAPS_VERSION``) in the pin folder, once the programs of this
    version are attached (nothing of ours reads the old maps any more: an upgrade leaves no old maps behind); the
    names removed."""
    current = {maps.pin_name(r, f) for r in PINNED_ROLES for f in (IPFamily.V4, IPFamily.V6)}
    gone = []
    for f in p.pin_real.iterdir() if p.pin_real.is_dir() else ():
        if _VERSIONED_PIN.fullmatch(f.name) and f.name not in current:
            f.unlink(missing_ok=True)
            gone.append(f.name)
    return sorted(gone)


def attach_in_child(
    p: Places, timeout: float = 120.0, *, detach_old: bool = True
) -> tuple[list[str], list[dict[str, Any]], dict[str, int]]:
    """Compile, load and attach the programs in a child process (``python -m kproxy.backends.bpf.loader``), which
    reopens the pinned maps; (the names attached, the older copies replaced: still attached unless ``detach_old``,
    the id serving each name: the caller holds them, ``programs.Held``; see ``load_and_attach``). RuntimeError with
    the child's message when it fails."""
    import sys

    argv = [
        sys.executable,
        "-m",
        "kproxy.backends.bpf.loader",
        "--pin-path",
        str(p.pin_dir),
        "--cgroup",
        str(p.cgroup),
        "--map-size",
        str(p.map_size),
        *(["--allow-root-cgroup"] if p.root_ok else []),
        *(["--counters"] if p.counters else []),
        *([] if detach_old else ["--keep-old"]),
    ]
    res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"bpf: loading the programs failed: {res.stderr.strip()[-800:]}")
    doc = json.loads(res.stdout.strip().splitlines()[-1])
    ids = {str(k): int(v) for k, v in doc.get("programs", {}).items()}
    return [str(x) for x in doc["attached"]], [dict(d) for d in doc.get("replaced", [])], ids


def main(argv: list[str] | None = None) -> int:
    """The child of ``attach_in_child``: compile, attach, print ``{"attached": [...], "programs": {name: id}}``."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m kproxy.backends.bpf.loader")
    ap.add_argument("--pin-path", required=True)
    ap.add_argument("--cgroup", required=True)
    ap.add_argument("--map-size", type=int, default=DEFAULT_MAP_SIZE)
    ap.add_argument("--allow-root-cgroup", action="store_true")
    ap.add_argument("--counters", action="store_true", help="compile with the counter maps (--service-counters)")
    ap.add_argument("--keep-old", action="store_true", help="leave the older copies attached (the caller detaches)")
    args = ap.parse_args(argv)
    p = Places(Path(args.pin_path), Path(args.cgroup), False, args.map_size, args.allow_root_cgroup, args.counters)
    check_places(p)
    b = compile_programs(p)
    names, replaced, serving = load_and_attach(b, p.cgroup, detach_old=not args.keep_old)
    if not args.keep_old:
        stale = remove_stale_pins(p)
        if stale:
            log.info("bpf: removed the pins of an older map version: %s", ", ".join(stale))
    print(json.dumps({"attached": names, "replaced": replaced, "programs": serving}))
    return 0


def pinned_ids(p: Places, roles: tuple[str, ...] = PINNED_ROLES) -> dict[tuple[str, IPFamily], int]:
    """(role, family) -> id of the map pinned in the pin folder now (what is absent is left out). Read through the
    pins themselves, never through a kproxy's own fds: those keep a map alive after someone unpinned it."""
    out: dict[tuple[str, IPFamily], int] = {}
    for fam in (IPFamily.V4, IPFamily.V6):
        for role in roles:
            try:
                fd = maps.obj_get(str(p.pin(role, fam)))
            except FileNotFoundError:
                continue
            try:
                out[(role, fam)] = objects.map_id(fd)
            finally:
                os.close(fd)
    return out


def programs_problem(p: Places, pinned: dict[tuple[str, IPFamily], int], families: tuple[IPFamily, ...]) -> str | None:
    """None when every program of ``families`` is attached to the cgroup and reads the maps pinned now; else what is
    wrong, in one line (a program detached by someone, or one still reading maps that were unpinned: it serves
    state kproxy no longer writes). A few BPF_PROG_QUERY/GET_INFO calls: cheap enough for a check every second."""
    try:
        progs = ours(attached(p.cgroup))
    except RuntimeError as exc:
        return str(exc)
    by_name: dict[str, list[int]] = {}
    for d in progs:
        by_name.setdefault(str(d["name"]), []).append(int(d["id"]))
    ids = set(pinned.values())
    for name, (fam, _at, short) in PROGRAMS.items():
        if fam not in families:
            continue
        got = by_name.get(name)
        if not got:
            return f"program {name} is not attached to {p.cgroup} ({short})"
        svc = pinned.get(("svc", fam))
        reading = []
        for pid in got:
            try:
                pfd = objects.prog_fd_by_id(pid)
            except maps.BpfError:
                continue
            try:
                reading.append(objects.prog_map_ids(pfd))
            finally:
                os.close(pfd)
        # a program of the old maps alone is attached: it translates from state nobody writes any more
        if not any(svc is not None and svc in m and m <= ids for m in reading):
            return f"program {name} attached to {p.cgroup} does not read the pinned maps in {p.pin_dir}"
    return None


def detach_all(cgroup: Path) -> None:
    """Detach every ``kp_*`` program from ``cgroup``."""
    if cgroup.is_dir():
        detach_ids(cgroup, ours(attached(cgroup)))


if __name__ == "__main__":
    raise SystemExit(main())
