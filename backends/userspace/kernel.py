"""Where the userspace backend talks to the kernel: libnftables in-process, and the network namespace it works in.

One ``Kernel.nft(text)`` call is one ``nft_run_cmd_from_buffer``-like call of Debian's python3-nftables: the whole
text is one atomic transaction (as ``nft -f``), without a process per change. The text is handed over as a memfd
"file", because libnftables names a refused command's line only for file input, and the proxier maps that line back
to the service that owns it.

libnftables (1.0.6) waits for netlink answers with ``select()``, which aborts the process ("bit out of range 0 -
FD_SETSIZE") when its socket's descriptor is 1024 or above, and this mode holds thousands of descriptors. So a
context's socket must be opened early or on a low number: the contexts of the process's own namespace are one,
shared and made before any proxy socket (``Kernel.call`` in ``start``), and a new context takes one of a few low
descriptors reserved at import.

``Kernel(netns=None)`` works in the caller's namespace (the daemon runs inside the node's). ``Kernel("name")`` owns
one worker thread that ``setns``es into ``/run/netns/<name>`` once; libnftables calls and the creation of proxy
sockets run there (a socket belongs to the namespace of the thread that made it; tests and benchmarks aim at
namespaces of their own). ``enter_netns`` is also what the data-path thread calls first.

Who uses it: ``backends.userspace.proxier`` and ``backends.userspace.datapath``.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")
_CLONE_NEWNET = 0x40000000
_LOCATION = re.compile(r"^(?:/dev/stdin|internal|<cmdline>|[^:\s]*):(\d+):\d+", re.M)


def enter_netns(netns: str) -> None:
    """Move the calling thread into ``/run/netns/<netns>`` (os.setns arrives in Python 3.12; this is 3.11)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{netns}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {netns}: {os.strerror(err)}")
    finally:
        os.close(fd)


@dataclass(frozen=True, slots=True)
class Result:
    rc: int
    output: str
    error: str
    seconds: float

    @property
    def ok(self) -> bool:
        return self.rc == 0

    def error_lines(self) -> list[int]:
        """1-based lines of the input that the error names."""
        return [int(m.group(1)) for m in _LOCATION.finditer(self.error)]


def import_nftables() -> Any:
    import nftables  # type: ignore[import-not-found,unused-ignore]

    return nftables


def available() -> str | None:
    """None when libnftables loads and lists tables here, else why not."""
    try:
        nftables = import_nftables()
    except ImportError as exc:
        return f"python3-nftables is not importable ({exc}): apt-get install python3-nftables nftables"
    try:
        rc, _, err = nftables.Nftables().cmd("list tables")
    except OSError as exc:
        return f"libnftables cannot be loaded: {exc}"
    if rc != 0:
        return f"nft list tables failed: {str(err).strip()}"
    return None


_RESERVE = 8
_reserved: list[int] = []
_reserve_lock = threading.Lock()
_shared: list[Any] = []  # the one context of this process's own namespace
_shared_lock = threading.Lock()


def _refill() -> None:
    with _reserve_lock:
        while len(_reserved) < _RESERVE:
            fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
            if fd >= 1000:
                os.close(fd)
                break
            _reserved.append(fd)


def new_context() -> Any:
    """A libnftables context whose netlink socket (opened right away) takes a low descriptor freed for it."""
    with _reserve_lock:
        if _reserved:
            os.close(_reserved.pop(0))
        ctx = import_nftables().Nftables()
    ctx.set_handle_output(False)
    return ctx


_refill()


class Kernel:
    """libnftables and socket creation in this namespace or a named one (see the module docstring)."""

    def __init__(self, netns: str | None = None) -> None:
        self.netns = netns
        self._pool: ThreadPoolExecutor | None = None
        self._ctx: Any = None
        if netns is not None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"kpu-kernel-{netns}")
            self._pool.submit(enter_netns, netns).result()

    def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` in the backend's namespace (this thread when none was named)."""
        if self._pool is None:
            with _shared_lock:  # the process namespace's context is shared by every Kernel(None)
                return fn()
        return self._pool.submit(fn).result()

    def ready(self) -> None:
        """Open the libnftables context now (``start`` calls it before any proxy socket exists)."""
        self.call(self._nftables)

    def _nftables(self) -> Any:
        if self._pool is None:
            if not _shared:
                _shared.append(new_context())
            return _shared[0]
        if self._ctx is None:  # made in the thread that uses it: its netlink socket belongs to that namespace
            self._ctx = new_context()
        return self._ctx

    def nft(self, text: str) -> Result:
        """Run commands as one transaction (see the module docstring)."""

        def go() -> Result:
            ctx = self._nftables()
            ctx.set_json_output(False)
            fd = os.memfd_create("kproxy-userspace-nft", os.MFD_CLOEXEC)
            try:
                view = memoryview(text.encode())
                while view:
                    view = view[os.write(fd, view) :]
                t0 = time.perf_counter()
                rc, out, err = ctx.cmd_from_file(f"/proc/self/fd/{fd}")
                return Result(int(rc), out or "", err or "", time.perf_counter() - t0)
            finally:
                os.close(fd)

        return self.call(go)

    def read(self, command: str, *, terse: bool = False) -> tuple[list[dict[str, Any]] | None, str]:
        """A ``list ...`` command's JSON objects (without metainfo), or (None, the error). ``terse``: without set
        and map elements (libnftables then does not fetch them either)."""

        def go() -> tuple[int, str, str]:
            ctx = self._nftables()
            ctx.set_json_output(True)
            ctx.set_terse_output(terse)
            try:
                rc, out, err = ctx.cmd(command)
            finally:
                ctx.set_terse_output(False)
            return int(rc), out or "", err or ""

        rc, out, err = self.call(go)
        if rc != 0:
            return None, err.strip()
        try:
            data = json.loads(out) if out else {"nftables": []}
        except ValueError as exc:
            return None, f"unreadable JSON from libnftables: {exc}"
        return [o for o in data.get("nftables", []) if "metainfo" not in o], ""

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._ctx is not None:
            self._ctx = None  # its socket closes with it: the low descriptor goes back to the reserve
            _refill()


def elements(objs: list[dict[str, Any]]) -> list[tuple[str, str, str, str]]:
    """(map or set name, key text, value text, comment) of every element in ``list map/set`` JSON objects, in the
    text form ``render`` writes (``198.18.0.1 . tcp . 80``, ``goto redirect-svc``, ``41000``)."""
    out: list[tuple[str, str, str, str]] = []
    for obj in objs:
        body = obj.get("map") or obj.get("set")
        if not body:
            continue
        for item in body.get("elem") or []:
            value = ""
            if isinstance(item, list):  # a map element: [key, value]
                key_obj, val = item
                value = _value_text(val)
            else:
                key_obj = item
            comment = ""
            if isinstance(key_obj, dict) and "elem" in key_obj:
                comment = str(key_obj["elem"].get("comment") or "")
                key_obj = key_obj["elem"].get("val")
            out.append((str(body["name"]), _key_text(key_obj), value, comment))
    return out


def _key_text(obj: Any) -> str:
    if isinstance(obj, dict):
        if "concat" in obj:
            return " . ".join(_key_text(x) for x in obj["concat"])
        if "prefix" in obj:
            return f"{obj['prefix']['addr']}/{obj['prefix']['len']}"
        if "range" in obj:
            lo, hi = obj["range"]
            return f"{_key_text(lo)}-{_key_text(hi)}"
    return str(obj)


def _value_text(obj: Any) -> str:
    if isinstance(obj, dict):
        for verdict in ("goto", "jump"):
            if verdict in obj:
                return f"{verdict} {obj[verdict]['target']}"
        if "drop" in obj:
            return "drop"
        if "accept" in obj:
            return "accept"
    return str(obj)
