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


def _info(fd: int, size: int, info: ctypes.Array[ctypes.c_char] | None = None) -> bytes:
    """BPF_OBJ_GET_INFO_BY_FD: the first ``size`` bytes of the object's info (bpf_prog_info, bpf_map_info), filled
    into ``info`` when the caller prepared it (pointers the kernel fills too)."""
    buf = info if info is not None else ctypes.create_string_buffer(size)
    attr = ctypes.create_string_buffer(struct.pack("<IIQ", fd, size, ctypes.addressof(buf)), 120)
    bpf_call(_BPF_OBJ_GET_INFO_BY_FD, attr)
    return buf.raw


def _fd_by_id(cmd: int, obj_id: int) -> int:
    return bpf_call(cmd, ctypes.create_string_buffer(struct.pack("<I", obj_id), 120))


def _name(raw: bytes) -> str:
    return raw.split(b"\0", 1)[0].decode(errors="replace")


def prog_fd_by_id(prog_id: int) -> int:
    return _fd_by_id(_BPF_PROG_GET_FD_BY_ID, prog_id)


def prog_name(prog_fd: int) -> str:
    """The program's name (bpf_prog_info.name, offset 64; 16 bytes)."""
    return _name(_info(prog_fd, 256)[64:80])


def prog_tag(prog_fd: int) -> bytes:
    """The program's tag (bpf_prog_info.tag, offset 8: a hash of its instructions with map references zeroed)."""
    return _info(prog_fd, 256)[8:16]


def prog_map_ids(prog_fd: int, max_ids: int = 32) -> frozenset[int]:
    """The ids of the maps a program uses (bpf_prog_info.nr_map_ids/map_ids, filled by the kernel)."""
    ids = (ctypes.c_uint32 * max_ids)()
    info = ctypes.create_string_buffer(256)
    struct.pack_into("<IQ", info, 52, max_ids, ctypes.addressof(ids))
    n = struct.unpack_from("<I", _info(prog_fd, 256, info), 52)[0]
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
    return _fd_by_id(_BPF_MAP_GET_FD_BY_ID, map_id)


def map_name(map_fd: int) -> str:
    """The map's name (bpf_map_info.name, offset 24; 16 bytes)."""
    return _name(_info(map_fd, 96)[24:40])


def map_id(fd: int) -> int:
    """The kernel's id of the map (or program: bpf_prog_info.id is at the same offset) behind ``fd``
    (bpf_map_info.id, offset 4): two fds of one map share it, and a map pinned again by someone else after a flush
    has another."""
    return int(struct.unpack_from("<I", _info(fd, 96), 4)[0])
