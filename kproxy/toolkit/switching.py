"""The interpreter's thread switch interval, lowered for a block.

CPython hands the GIL to a waiting thread only every ``sys.getswitchinterval()`` seconds (5 ms by default). A thread
that makes a system call per datagram or per map write (a netlink dump, ``bpf(2)`` writes) beside a thread that is
computing waits that long for each turn, and those waits can add up to more than the work. ``switch_interval`` lowers
the interval for a block and puts it back after it whatever happens.

The interval is the interpreter's (CPython has no per-thread one), so the blocks are counted by one process-wide
``Blocks`` that mirrors that setting: the first block to enter records the interval it found, the lowest interval
asked for by any open block is in force, and the last to leave restores the recorded value. Two blocks that overlap
in different threads therefore cannot leave the interval lowered for good, which saving and restoring in each block
separately could.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator


class Blocks:
    """The open blocks of one interpreter (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: list[float] = []  # the intervals asked for by the blocks now open
        self._found = 0.0  # the interval before the first open block

    @contextlib.contextmanager
    def lowered(self, seconds: float) -> Iterator[None]:
        if seconds <= 0:
            raise ValueError(f"switch interval must be positive, got {seconds!r}")
        with self._lock:
            if not self._open:
                self._found = sys.getswitchinterval()
            self._open.append(seconds)
            sys.setswitchinterval(min(self._found, *self._open))
        try:
            yield
        finally:
            with self._lock:
                self._open.remove(seconds)
                sys.setswitchinterval(min(self._found, *self._open) if self._open else self._found)


#: the one per interpreter, as the setting it guards
BLOCKS = Blocks()


def switch_interval(seconds: float) -> contextlib.AbstractContextManager[None]:
    """The block runs with the switch interval at most ``seconds`` (never raised by it); see the module docstring."""
    return BLOCKS.lowered(seconds)
