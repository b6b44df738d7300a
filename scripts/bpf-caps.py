"""Which of the bpf mode's privileged calls a container's capabilities allow: run inside the kproxy image with the
capabilities to try, the host's PID namespace and the pid of a process in another network namespace (a pod's).

    podman --runtime runc run --rm --pid host --cap-drop all --cap-add NET_ADMIN --cap-add BPF ... \\
        --ulimit nofile=20000:20000 --ulimit nproc=32768:32768 --security-opt no-new-privileges \\
        -v "$PWD/scripts/bpf-caps.py:/bpf-caps.py:ro" localhost/kproxy:0.1.0 /opt/kproxy/bin/python /bpf-caps.py PID

One line per call, "ok" or the errno: BPF_PROG_LOAD (a two-instruction socket filter), BPF_MAP_CREATE,
BPF_PROG_GET_FD_BY_ID of that program (what adoption and the pre-sync check do), open(/proc/PID/ns/net) and
setns(CLONE_NEWNET) on it (what the UDP reaper's nsenter does). deploy/overlays/bpf/kustomization.yaml has the results.
"""

from __future__ import annotations

import ctypes
import os
import struct
import sys
import threading
from collections.abc import Callable

from kproxy.backends.bpf import maps

CLONE_NEWNET = 0x40000000
BPF_PROG_LOAD = 5
BPF_OBJ_GET_INFO_BY_FD = 15
PROG_TYPE_SOCKET_FILTER = 1


def attempt(what: str, call: Callable[[], int]) -> int | None:
    try:
        out = call()
    except OSError as exc:
        print(f"{what}: errno {exc.errno} ({os.strerror(exc.errno or 0)})")
        return None
    print(f"{what}: ok")
    return out


def load_filter() -> int:
    insns = struct.pack("<BBhi", 0xB7, 0, 0, 0) + struct.pack("<BBhi", 0x95, 0, 0, 0)  # r0 = 0; exit
    code, lic = ctypes.create_string_buffer(insns, len(insns)), ctypes.create_string_buffer(b"GPL")
    attr = struct.pack("<IIQQIIQ", PROG_TYPE_SOCKET_FILTER, 2, ctypes.addressof(code), ctypes.addressof(lic), 0, 0, 0)
    return maps._bpf(BPF_PROG_LOAD, ctypes.create_string_buffer(attr, 128))


def prog_id(fd: int) -> int:
    info = ctypes.create_string_buffer(256)
    maps._bpf(
        BPF_OBJ_GET_INFO_BY_FD, ctypes.create_string_buffer(struct.pack("<IIQ", fd, 256, ctypes.addressof(info)), 120)
    )
    return int(struct.unpack_from("<I", info.raw, 4)[0])


def setns_in_thread(fd: int) -> int:
    """setns on a thread of its own (a network namespace is per thread), which then ends."""
    libc = ctypes.CDLL(None, use_errno=True)
    err: list[int] = []

    def run() -> None:
        err.append(ctypes.get_errno() if libc.setns(fd, CLONE_NEWNET) else 0)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if err[0]:
        raise OSError(err[0], os.strerror(err[0]))
    return 0


def main(pid: int) -> None:
    prog = attempt("bpf(BPF_PROG_LOAD)", load_filter)
    attempt("bpf(BPF_MAP_CREATE)", lambda: maps.create_map(maps.MAP_HASH, 4, 4, 16, 0, "kproxy_caps"))
    if prog is not None:
        attempt("bpf(BPF_PROG_GET_FD_BY_ID)", lambda: maps.prog_fd_by_id(prog_id(prog)))
    ns = attempt(f"open(/proc/{pid}/ns/net)", lambda: os.open(f"/proc/{pid}/ns/net", os.O_RDONLY))
    if ns is not None:
        attempt("setns(CLONE_NEWNET)", lambda: setns_in_thread(ns))


if __name__ == "__main__":
    main(int(sys.argv[1]))
