"""The only place the nftables backend talks to the kernel: libnftables in-process (Debian's ``python3-nftables``).

One ``run(text)`` call is one ``nft_run_cmd_from_buffer``: the whole text is one atomic transaction, as ``nft -f``,
without starting a process (``nft add element`` from a shell costs ~20 ms, mostly process start). Reads use JSON
output (``libnftables-json(5)``), parsed with the standard library.

libnftables talks netlink from the calling thread's network namespace. ``Nft`` owns one worker thread that makes every
call (libnftables releases the GIL, so the proxier builds the next transaction while one is applied); with
``netns="name"`` that thread first ``setns``es into ``/run/netns/<name>`` (tests and benchmarks aim at their own
namespaces; ``setns`` affects that thread alone), else it works in the caller's namespace (the daemon runs inside the
node's).

Who uses it: ``backends.nftables.proxier`` and ``backends.nftables.cleanup``.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")
_CLONE_NEWNET = 0x40000000

_LOCATION = re.compile(r"^(?:/dev/stdin|internal|<cmdline>|[^:\s]*):(\d+):\d+", re.M)


@dataclass(frozen=True, slots=True)
class Result:
    """What one libnftables call returned: rc 0 is success; ``seconds`` is the call's wall time."""

    rc: int
    output: str
    error: str
    seconds: float

    @property
    def ok(self) -> bool:
        return self.rc == 0

    def error_lines(self) -> list[int]:
        """1-based lines of the input the error names (libnftables reports each refused command's location)."""
        return [int(m.group(1)) for m in _LOCATION.finditer(self.error)]


def import_nftables() -> Any:
    """The ``nftables`` module (Debian's python3-nftables; the venv sees it through --system-site-packages)."""
    import nftables  # type: ignore[import-not-found,unused-ignore]

    return nftables


class Nft:
    """A libnftables context in this namespace or in a named one (see the module docstring)."""

    def __init__(self, netns: str | None = None) -> None:
        self.netns = netns
        self._lock = threading.Lock()
        self._ctx: Any = None
        # one thread makes every call: libnftables releases the GIL, so Python builds the next transaction meanwhile
        self._pool: ThreadPoolExecutor | None = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nft")
        if netns is not None:
            self._pool.submit(self._enter, netns).result()

    def _enter(self, netns: str) -> None:
        # os.setns arrives in Python 3.12; this is 3.11
        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(f"/run/netns/{netns}", os.O_RDONLY)
        try:
            if libc.setns(fd, _CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"setns into {netns}: {os.strerror(err)}")
        finally:
            os.close(fd)

    def _call(self, fn: Callable[[], T]) -> T:
        return self._submit(fn).result()

    def _submit(self, fn: Callable[[], T]) -> Future[T]:
        if self._pool is None:
            raise RuntimeError("libnftables context closed")
        return self._pool.submit(fn)

    def _nft(self) -> Any:
        if self._ctx is None:  # made in the thread that uses it (its socket belongs to that namespace)
            ctx = import_nftables().Nftables()
            ctx.set_handle_output(False)
            self._ctx = ctx
        return self._ctx

    def run(self, text: str, *, json_output: bool = False) -> Result:
        return self.submit(text, json_output=json_output).result()

    def submit(self, text: str, *, json_output: bool = False) -> Future[Result]:
        """Run commands (one transaction when they change anything) in the libnftables thread. The text is handed
        over as a memfd "file", because libnftables reports a refused command's line only for file input (from a
        buffer it prints the first line), and the proxier maps that line back to the service that owns it."""

        def go() -> Result:
            nft = self._nft()
            nft.set_json_output(json_output)
            fd = os.memfd_create("kproxy-nft", os.MFD_CLOEXEC)
            try:
                data = text.encode()
                view = memoryview(data)
                while view:
                    n = os.write(fd, view)
                    view = view[n:]
                t0 = time.perf_counter()
                rc, out, err = nft.cmd_from_file(f"/proc/self/fd/{fd}")
                return Result(int(rc), out or "", err or "", time.perf_counter() - t0)
            finally:
                os.close(fd)

        return self._submit(go)

    def query(self, text: str, *, json_output: bool = True) -> Result:
        """A read (``list ...``) from a buffer: no transaction, nothing to map back."""

        def go() -> Result:
            nft = self._nft()
            nft.set_json_output(json_output)
            t0 = time.perf_counter()
            rc, out, err = nft.cmd(text)
            return Result(int(rc), out or "", err or "", time.perf_counter() - t0)

        return self._call(go)

    def read(self, command: str) -> tuple[list[dict[str, Any]] | None, str]:
        """A ``list ...`` command's JSON objects (the ``nftables`` array without metainfo), or (None, error)."""
        res = self.query(command)
        if not res.ok:
            return None, res.error.strip()
        try:
            data = json.loads(res.output) if res.output else {"nftables": []}
        except ValueError as exc:
            return None, f"unreadable JSON from libnftables: {exc}"
        return [o for o in data.get("nftables", []) if "metainfo" not in o], ""

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._ctx = None


def available() -> str | None:
    """None when libnftables can be loaded and asked for its version here, else why not."""
    try:
        nftables = import_nftables()
    except ImportError as exc:
        return f"python3-nftables is not importable ({exc}): apt-get install python3-nftables nftables"
    try:
        nft = nftables.Nftables()
        rc, _, err = nft.cmd("list tables")
    except OSError as exc:
        return f"libnftables cannot be loaded: {exc}"
    if rc != 0:
        return f"nft list tables failed: {err.strip()}"
    return None
