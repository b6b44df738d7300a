"""Entering a network namespace: the calling thread moves into ``/run/netns/<name>`` (``setns`` changes that thread
alone), so a worker thread can talk to another namespace's kernel while the process stays where it is."""

from __future__ import annotations

import ctypes
import os
import subprocess
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

T = TypeVar("T")

CLONE_NEWNET = 0x40000000


def enter_netns(netns: str) -> None:
    """Move the calling thread into ``/run/netns/<netns>`` (os.setns arrives in Python 3.12; this is 3.11); OSError
    with the reason when the namespace does not exist or the call is refused."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{netns}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {netns}: {os.strerror(err)}")
    finally:
        os.close(fd)


def in_netns(netns: str | None, fn: Callable[[], T], *, timeout: float = 60.0, name: str = "kproxy-netns") -> T:
    """``fn()`` run by a short-lived thread of its own inside ``netns`` (in the caller's thread when None), its
    result or its exception handed back; TimeoutError when it has not finished within ``timeout`` seconds."""
    if not netns:
        return fn()
    out: list[T] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            enter_netns(netns)
            out.append(fn())
        except BaseException as exc:  # handed to the caller
            errors.append(exc)

    t = threading.Thread(target=run, name=name, daemon=True)
    t.start()
    t.join(timeout)
    if errors:
        raise errors[0]
    if not out:
        raise TimeoutError(f"work in network namespace {netns} did not finish within {timeout:g} s")
    return out[0]


@contextmanager
def scratch_netns(prefix: str) -> Iterator[str]:
    """A new, empty named network namespace ``<prefix><random>`` for the ``with`` block, deleted afterwards
    (benchmarks measure the kernel's own time there, away from the node's rules)."""
    ns = prefix + uuid.uuid4().hex[:8]
    subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True, timeout=30)
    try:
        yield ns
    finally:
        subprocess.run(["ip", "netns", "delete", ns], check=False, capture_output=True, timeout=60)
