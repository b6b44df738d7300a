"""The bpf(2) commands about programs and kernel objects (``maps``' ``bpf_call``): which programs a cgroup has
attached, attaching and detaching one, an fd from an id, a program's name, tag and maps, a map's name. The loader
checks and replaces attachments with them; ``programs`` reattaches held programs and re-pins held maps."""

from __future__ import annotations

import ctypes
import struct

from .maps import bpf_call

_BPF_PROG_ATTACH = 8
_BPF_PROG_DETACH = 9
_BPF_PROG_GET_FD_BY_ID = 13
_BPF_MAP_GET_FD_BY_ID = 14
_BPF_OBJ_GET_INFO_BY_FD = 15
_BPF_PROG_QUERY = 16


def prog_query(target_fd: int, attach_type: int, max_ids: int = 64) -> list[int]:
    """Ids of the programs attached to a cgroup (``target_fd``) for one attach type (BPF_PROG_QUERY)."""
    ids = (ctypes.c_uint32 * max_ids)()
    attr = ctypes.create_string_buffer(
        struct.pack("<IIIIQI", target_fd, attach_type, 0, 0, ctypes.addressof(ids), max_ids), 120
    )
    bpf_call(_BPF_PROG_QUERY, attr)
    count = struct.unpack_from("<I", attr.raw, 24)[0]
    return [int(ids[i]) for i in range(min(count, max_ids))]


def prog_fd_by_id(prog_id: int) -> int:
    attr = ctypes.create_string_buffer(struct.pack("<I", prog_id), 120)
    return bpf_call(_BPF_PROG_GET_FD_BY_ID, attr)


def prog_name(prog_fd: int) -> str:
    """The program's name (bpf_prog_info.name, offset 64; 16 bytes)."""
    info = ctypes.create_string_buffer(256)
    attr = ctypes.create_string_buffer(struct.pack("<IIQ", prog_fd, 256, ctypes.addressof(info)), 120)
    bpf_call(_BPF_OBJ_GET_INFO_BY_FD, attr)
    return info.raw[64:80].split(b"\0", 1)[0].decode(errors="replace")


def prog_tag(prog_fd: int) -> bytes:
    """The program's tag (bpf_prog_info.tag, offset 8: a hash of its instructions with map references zeroed)."""
    info = ctypes.create_string_buffer(256)
    attr = ctypes.create_string_buffer(struct.pack("<IIQ", prog_fd, 256, ctypes.addressof(info)), 120)
    bpf_call(_BPF_OBJ_GET_INFO_BY_FD, attr)
    return info.raw[8:16]


def prog_map_ids(prog_fd: int, max_ids: int = 32) -> frozenset[int]:
    """The ids of the maps a program uses (bpf_prog_info.nr_map_ids/map_ids, filled by the kernel)."""
    ids = (ctypes.c_uint32 * max_ids)()
    info = ctypes.create_string_buffer(256)
    struct.pack_into("<IQ", info, 52, max_ids, ctypes.addressof(ids))
    attr = ctypes.create_string_buffer(struct.pack("<IIQ", prog_fd, 256, ctypes.addressof(info)), 120)
    bpf_call(_BPF_OBJ_GET_INFO_BY_FD, attr)
    n = struct.unpack_from("<I", info.raw, 52)[0]
    return frozenset(int(ids[i]) for i in range(min(n, max_ids)))


def prog_detach(target_fd: int, prog_fd: int, attach_type: int) -> None:
    attr = ctypes.create_string_buffer(struct.pack("<IIII", target_fd, prog_fd, attach_type, 0), 120)
    bpf_call(_BPF_PROG_DETACH, attr, hold_gil=False)  # may wait for an RCU grace period


def prog_attach(target_fd: int, prog_fd: int, attach_type: int, flags: int) -> None:
    """Attach a loaded program to a cgroup (``target_fd``) for one attach type (legacy BPF_PROG_ATTACH: the attachment
    outlives the process)."""
    attr = ctypes.create_string_buffer(struct.pack("<IIIII", target_fd, prog_fd, attach_type, flags, 0), 120)
    bpf_call(_BPF_PROG_ATTACH, attr, hold_gil=False)


def map_fd_by_id(map_id: int) -> int:
    attr = ctypes.create_string_buffer(struct.pack("<I", map_id), 120)
    return bpf_call(_BPF_MAP_GET_FD_BY_ID, attr)


def map_name(map_fd: int) -> str:
    """The map's name (bpf_map_info.name, offset 24; 16 bytes)."""
    info = ctypes.create_string_buffer(96)
    attr = ctypes.create_string_buffer(struct.pack("<IIQ", map_fd, 96, ctypes.addressof(info)), 120)
    bpf_call(_BPF_OBJ_GET_INFO_BY_FD, attr)
    return info.raw[24:40].split(b"\0", 1)[0].decode(errors="replace")


def map_id(fd: int) -> int:
    """The kernel's id of the map (or program: bpf_prog_info.id is at the same offset) behind ``fd``
    (bpf_map_info.id, offset 4): two fds of one map share it, and a map pinned again by someone else after a flush
    has another."""
    info = ctypes.create_string_buffer(96)
    attr = ctypes.create_string_buffer(struct.pack("<IIQ", fd, 96, ctypes.addressof(info)), 120)
    bpf_call(_BPF_OBJ_GET_INFO_BY_FD, attr)
    return int(struct.unpack_from("<I", info.raw, 4)[0])
