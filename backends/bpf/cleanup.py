"""What the bpf mode left in the kernel, read from outside a running kproxy: ``remnants`` (pins, cgroup attachments,
the companion table), ``kernel_view`` (the maps decoded per service port, like ``cilium bpf lb list``), and
``cleanup`` (detach, unpin the maps and the programs, delete the table).

Where a kproxy's pins and cgroup are is decided by its options (``loader.places``). Because another mode's start-up
(``cleanup_other_modes``) and ``kproxy cleanup`` call ``cleanup`` without the bpf options a node ran with, every
kproxy records its places in ``/run/kproxy/bpf/net-<netns inode>.json`` with the namespace's cookie (inodes are
reused, cookies are not); ``cleanup`` and ``remnants`` read that record only when the cookie is this namespace's,
and act on every place in it (a kproxy restarted with another pin folder or cgroup leaves the older ones there).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
from collections.abc import Mapping
from contextlib import closing
from pathlib import Path
from typing import Any

from kproxy.config import ProxyConfig
from kproxy.model import IPFamily
from kproxy.proxier import BackendError, KernelProbe

from . import companion, decode, loader, maps, programs

log = logging.getLogger(__name__)

RECORDS = Path("/run/kproxy/bpf")
#: what pins of any map version start with (the counters' ``cnt`` too)
_PIN_STEMS = ("svc", "be", "rev", "aff", "name", "peer", "cnt")  # the maps' pins (programs.Held's apart)


def _record_path(netns: str | None) -> Path:
    return RECORDS / f"net-{loader.netns_inode(netns)}.json"


@functools.lru_cache(maxsize=8)
def _warn_unrecorded(reason: str) -> None:
    """Once per process and reason (a container's read-only /run refuses it every time; its options name the
    places)."""
    log.warning("bpf: cannot record where the maps are (%s): cleanup by another mode may miss them", reason)


def _doc_places(doc: Mapping[str, Any], map_size: int) -> list[loader.Places]:
    out = []
    for d in doc.get("places", []):
        out.append(loader.Places(Path(d["pin_dir"]), Path(d["cgroup"]), bool(d["own_cgroup"]), map_size))
    return out


def _read_record(netns: str | None, map_size: int = loader.DEFAULT_MAP_SIZE) -> list[loader.Places]:
    """The places this namespace's record names, newest first; [] when there is none, or when it belongs to another
    namespace: a record is named by the namespace's inode, which the kernel reuses once a namespace is gone, so it
    also carries the namespace's cookie (``loader.netns_cookie``, never reused), and only a matching one counts (a
    record of the older layout, without a cookie, cannot be told apart and never counts)."""
    try:
        doc = json.loads(_record_path(netns).read_text())
        if not isinstance(doc, dict) or doc.get("netns_cookie") != loader.netns_cookie(netns):
            return []
        return _doc_places(doc, map_size)
    except (OSError, ValueError, KeyError, TypeError):
        return []


def record_places(p: loader.Places, netns: str | None) -> None:
    """Remember where this namespace's kproxy keeps its maps and programs (for cleanup by another mode). Places an
    earlier kproxy of this namespace recorded stay in the record (cleanup removes their pins too); its programs on
    another cgroup (``--bpf-cgroup-path`` changed) are detached first: they would keep translating from maps nobody
    writes any more."""
    old = _read_record(netns, p.map_size)
    for q in old:
        if q.cgroup != p.cgroup:
            try:
                loader.check_places(q)
                progs = loader.ours(loader.attached(q.cgroup))
                if progs:
                    loader.detach_ids(q.cgroup, progs)
                    log.warning(
                        "bpf: the cgroup changed (%s -> %s): detached kproxy's programs from the old one",
                        q.cgroup,
                        p.cgroup,
                    )
            except (OSError, RuntimeError, ValueError) as exc:
                log.warning("bpf: cannot detach kproxy's programs from the old cgroup %s: %s", q.cgroup, exc)
    keep = [p] + [q for q in old if (q.pin_dir, q.cgroup) != (p.pin_dir, p.cgroup)]
    try:
        RECORDS.mkdir(parents=True, exist_ok=True)
        doc = {
            "netns_cookie": loader.netns_cookie(netns),
            "places": [{"pin_dir": str(q.pin_dir), "cgroup": str(q.cgroup), "own_cgroup": q.own_cgroup} for q in keep],
        }
        path = _record_path(netns)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc))
        tmp.replace(path)
    except OSError as exc:
        _warn_unrecorded(exc.strerror or type(exc).__name__)


def _places_for(options: Mapping[str, Any], netns: str | None) -> list[loader.Places]:
    """The places the options name, plus those this namespace's record names (when they differ)."""
    out = [loader.places(options, netns)]
    for rec in _read_record(netns, out[0].map_size):
        if all((rec.pin_dir, rec.cgroup) != (q.pin_dir, q.cgroup) for q in out):
            out.append(rec)
    return out


def _probe_netns(probe: KernelProbe) -> str | None:
    ns = getattr(probe, "netns", None)
    return str(ns) if ns else None


def cleanup_leftovers(config: ProxyConfig, *, netns: str | None = None) -> None:
    """Detach kproxy's programs, remove its pins and default cgroup, delete the companion tables."""
    errors = []
    for p in _places_for(config.backend_options, netns):
        try:
            loader.check_places(p)
        except ValueError as exc:
            errors.append(str(exc))
            continue
        try:
            loader.detach_all(p.cgroup)
        except Exception as exc:
            errors.append(f"detach from {p.cgroup}: {exc}")
        pin_dir = p.pin_real
        if pin_dir.is_dir():
            for f in pin_dir.iterdir():
                if f.name in maps.all_pin_names() or f.name.startswith((*_PIN_STEMS, programs.PIN_PREFIX)):
                    f.unlink(missing_ok=True)
            try:
                pin_dir.rmdir()
            except OSError as exc:
                errors.append(f"rmdir {pin_dir}: {exc}")
        if p.own_cgroup and p.cgroup.is_dir():
            try:
                p.cgroup.rmdir()
            except OSError as exc:  # processes still in it: leave the cgroup, its programs are detached
                log.warning("bpf: cannot remove cgroup %s: %s", p.cgroup, exc)
    try:
        root = loader.host_view(loader.PIN_ROOT)
        if root.is_dir() and not any(root.iterdir()):
            root.rmdir()
    except OSError:
        pass
    # the lab's bind of the machine's bpffs (``lab_prepare``) goes with the last pins nobody uses any more
    loader.release_host_bind()
    with closing(companion.open_nft(netns)) as nft:
        for fam in (IPFamily.V4, IPFamily.V6):
            try:
                companion.delete_table(nft, fam)
            except companion.NftError as exc:
                errors.append(f"nft: {exc}")
    try:
        if _read_record(netns):  # ours: a record of another namespace with the same inode is left alone
            _record_path(netns).unlink(missing_ok=True)
    except OSError:
        pass
    if errors:
        raise BackendError("bpf cleanup: " + "; ".join(errors))


def remnants(probe: KernelProbe) -> list[str]:
    """Pins, cgroup attachments of ``kp_*`` programs and the companion tables that are left, one line each."""
    netns = _probe_netns(probe)
    out: list[str] = []
    for p in _places_for(probe.options, netns):
        if p.pin_real.is_dir():
            out += [f"pin {p.pin_dir / f.name}" for f in sorted(p.pin_real.iterdir())]
        try:
            progs = loader.ours(loader.attached(p.cgroup))
        except RuntimeError as exc:
            raise BackendError(str(exc)) from None
        out += [f"cgroup {p.cgroup} {d.get('attach_type')} {d.get('name')} id {d.get('id')}" for d in progs]
    for fam in ("ip", "ip6"):
        res = probe.run(["nft", "list", "table", fam, companion.TABLE])
        if res.returncode == 0:
            out += [f"nft {fam} {companion.TABLE}: {ln.strip()}" for ln in res.stdout.splitlines() if ln.strip()]
        elif "No such file" not in res.stderr and "does not exist" not in res.stderr:
            raise BackendError(f"nft list table {fam} {companion.TABLE}: {res.stderr.strip()}")
    # tc: the mode attaches no tc programs (see backends/bpf/__init__.py); a kp_ filter would be a remnant all the same
    res = probe.run(["tc", "-j", "filter", "show", "dev", "lo", "ingress"])
    if res.returncode == 0 and "kp_" in res.stdout:
        out.append(f"tc filter on lo: {res.stdout.strip()[:200]}")
    return out


def decode_maps(pin_dir: Path, family: IPFamily) -> dict[str, list[str]]:
    """The pinned maps of one family decoded: service key -> lines (frontend, then each slot's backend)."""
    fds = {}
    try:
        for role in ("svc", "be", "name"):
            fds[role] = maps.obj_get(str(pin_dir / maps.pin_name(role, family)))
        raw = maps.read_lb(fds["svc"], fds["be"], fds["name"], family)
    finally:
        for fd in fds.values():
            os.close(fd)
    index, _view = decode.index_from_raw(family, raw["svc"], raw["be"], raw["name"])
    out: dict[str, list[str]] = {}
    for fk in sorted(index.fronts, key=lambda k: (k[0], k[1], k[2])):
        st = index.fronts[fk]
        name = index.rev_names.get(st.master.rev_nat_id, f"(rev_nat_id {st.master.rev_nat_id}, unnamed)")
        m = st.master
        verdict = "reject" if m.flags & maps.F_REJECT else "drop" if m.flags & maps.F_DROP else "forward"
        front = f"[{fk[0]}]:{fk[1]}" if ":" in fk[0] else f"{fk[0]}:{fk[1]}"
        lines = out.setdefault(name, [])
        lines.append(
            f"{name} {front}/{maps.PROTO_NAMES.get(fk[2], fk[2])} {verdict} count={m.count} rev_nat={m.rev_nat_id}"
            + (f" affinity={m.affinity}s" if m.flags & maps.F_AFFINITY else "")
        )
        for i, bid in enumerate(st.slots, start=1):
            b = index.backends.get(bid)
            addr = "(missing)" if b is None else (f"[{b[0]}]:{b[1]}" if ":" in b[0] else f"{b[0]}:{b[1]}")
            lines.append(f"{name} {front} slot {i} -> backend {bid} {addr}")
    return out


def kernel_view(probe: KernelProbe, family: IPFamily) -> dict[str, list[str]] | None:
    """Every service port the node's pinned maps hold, with the companion table's elements of its addresses."""
    netns = _probe_netns(probe)
    p = loader.places(probe.options, netns)
    if not p.pin_real.is_dir():
        return {}
    try:
        return decode_maps(p.pin_real, family)
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise BackendError(f"reading the bpf maps in {p.pin_dir}: {exc}") from None


def remove_tree(path: Path) -> None:
    """Remove a pin folder with everything in it (tests' finalizers)."""
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
