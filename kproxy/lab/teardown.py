"""Taking a lab down: every process it started, its namespaces, cgroups, state files and (unless kept) logs.

Processes are found by pid file, by the namespaces they are in, by the cgroups they are in and by a command line
naming the state folder, so even a lab whose runner was killed with SIGKILL is removed completely. What a node's
kproxy left outside its namespace (pins, cgroup attachments) is removed by its backend's ``cleanup_leftovers``.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kproxy.config import ProxyConfig
from kproxy.lab import netns
from kproxy.lab.plan import LabError, is_lab_namespace
from kproxy.lab.state import CGROUP_MOUNT, STATE_ROOT, locked, read_pidfile, reap_live
from kproxy.proxier import BackendError, KernelHooks, Proxier, backend_class

log = logging.getLogger(__name__)


def installed_backend(mode: str) -> type[Proxier] | None:
    """The installed backend of ``mode``, None when it is missing or broken (kproxy run itself says so in its log)."""
    try:
        return backend_class(mode)
    except BackendError:
        return None


def cleanup_node(ns: str, record: Mapping[str, Any]) -> None:
    """Remove what a node's kproxy left outside the node's namespace (pins, cgroup attachments: bpffs and cgroups are
    shared by the machine), with the options the node ran with; the namespace's own rules go with the namespace."""
    mode = str(record.get("mode") or "")
    hooks: KernelHooks | None = installed_backend(mode) if mode else None
    if hooks is None:
        return
    try:
        hooks.cleanup_leftovers(ProxyConfig(mode=mode, backend_options=dict(record.get("options") or {})), netns=ns)
    except Exception as exc:  # best effort: the namespace goes anyway
        log.warning("lab down: cleaning up %s of %s failed: %s", mode, ns, exc)


def remove_lab(prefix: str, state_dir: Path, keep_logs: bool = False) -> None:
    """Remove the lab under ``prefix`` (the caller holds its lock); LabError if a process or namespace stays."""
    names = lab_namespaces(prefix)
    cgroups = [d for d in CGROUP_MOUNT.glob(f"{prefix}n*") if d.is_dir()] if CGROUP_MOUNT.is_dir() else []
    left = netns.terminate(_lab_pids(state_dir, names, cgroups))
    reap_live()
    if left:
        raise LabError(f"lab processes would not die: {sorted(left)}")
    _cleanup_nodes(state_dir, names)
    netns.delete_netns(names)
    for cg in cgroups:
        netns.remove_cgroup(cg)
    # one cgroup2 mount serves every prefix's lab: unmount it only when no other lab is recorded
    other_labs = [
        p for p in [STATE_ROOT / "state.json", *STATE_ROOT.glob("prefix/*/state.json")] if p.parent != state_dir
    ]
    with locked(None):
        if netns.is_cgroup2_mount(CGROUP_MOUNT) and not [p for p in other_labs if p.exists()]:
            netns.umount(CGROUP_MOUNT)
    _remove_files(state_dir, keep_logs)
    still = lab_namespaces(prefix)
    if still:
        raise LabError(f"lab namespaces could not be removed: {still}")


def _lab_pids(state_dir: Path, names: list[str], cgroups: list[Path]) -> set[int]:
    """Every process of the lab: by pid file, namespace, cgroup and command line."""
    pids: set[int] = set()
    pid_dir = state_dir / "pids"
    if pid_dir.is_dir():
        for f in pid_dir.glob("*.pid"):
            rec = read_pidfile(f)
            if rec and netns.alive(rec[0], rec[1] or None):
                pids.add(rec[0])
    for found in netns.netns_pids(names).values():
        pids |= found
    for cg in cgroups:
        pids |= netns.cgroup_procs(cg)
    # the API stand-in lives in the machine's namespace: if its pid file was lost, find it by its --port-file
    pids |= netns.pids_with_arg(str(state_dir / "api.port"))
    if state_dir != STATE_ROOT:
        pids |= netns.pids_with_arg(str(state_dir) + "/")
    return pids


def _cleanup_nodes(state_dir: Path, names: list[str]) -> None:
    """:func:`cleanup_node` for every node whose kproxy the state records and whose namespace is still there."""
    try:
        old = json.loads((state_dir / "state.json").read_text())
    except (OSError, ValueError):
        old = {}
    node_ns = {n.get("name"): n.get("ns") for n in old.get("nodes") or [] if isinstance(n, dict)}
    for node_name, record in (old.get("kproxy") or {}).items():
        ns = node_ns.get(node_name)
        if ns in names and isinstance(record, dict):
            cleanup_node(str(ns), record)


def _remove_files(state_dir: Path, keep_logs: bool) -> None:
    for sub in ("pids", "ready"):
        d = state_dir / sub
        if d.is_dir():
            for f in d.iterdir():
                f.unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                d.rmdir()
    for fname in ("state.json", "state.json.tmp", "api.port", "kubeconfig", "kubeconfig.tmp"):
        (state_dir / fname).unlink(missing_ok=True)
    if not keep_logs and state_dir.is_dir():
        for log_file in state_dir.glob("*.log"):
            log_file.unlink(missing_ok=True)
    if state_dir != STATE_ROOT:
        # a second lab's own folder goes once empty; /run/kproxy-lab stays (locks, the cgroup2 mount point)
        with contextlib.suppress(OSError):
            state_dir.rmdir()


def lab_namespaces(prefix: str) -> list[str]:
    """The named namespaces of the lab under ``prefix`` (never another tool's that shares the prefix)."""
    return [n for n in netns.list_netns(prefix) if is_lab_namespace(prefix, n)]
