"""The interpreter's thread switch interval, lowered for a block.

CPython hands the GIL to a waiting thread only every ``sys.getswitchinterval()`` seconds (5 ms by default). A thread
that makes a system call per datagram or per map write (a netlink dump, ``bpf(2)`` writes) beside a thread that is
computing waits that long for each turn, and those waits can add up to more than the work. ``switch_interval`` lowers
the interval for a block and puts it back after it whatever happens.

The interval is the interpreter's (CPython has no per-thread one), so the blocks are counted process-wide: the first
to enter records the interval it found, the lowest interval asked for by any open block is in force, and the last to
leave restores the recorded value. Two blocks that overlap in different threads therefore cannot leave the interval
lowered for good, which saving and restoring in each block separately could.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_open: list[float] = []  # the intervals asked for by the blocks now open
_found: float | None = None  # the interval before the first open block


@contextlib.contextmanager
def switch_interval(seconds: float) -> Iterator[None]:
    """The block runs with the switch interval at most ``seconds`` (never raised by it); see the module text."""
    global _found
    if seconds <= 0:
        raise ValueError(f"switch interval must be positive, got {seconds!r}")
    with _lock:
        if not _open:
            _found = sys.getswitchinterval()
        _open.append(seconds)
        sys.setswitchinterval(min(_found or seconds, *_open))
    try:
        yield
    finally:
        with _lock:
            _open.remove(seconds)
            if _open:
                sys.setswitchinterval(min(_found or seconds, *_open))
            else:
                sys.setswitchinterval(_found if _found is not None else sys.getswitchinterval())
                _found = None
