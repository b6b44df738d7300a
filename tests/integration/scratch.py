"""A throwaway network namespace for integration tests, with the caller's prefix (``kpt-ipt-``, ``kpt-chk-`` ...),
deleted on exit also when the test fails."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def scratch_netns(prefix: str, *, lo_up: bool = False) -> Iterator[str]:
    """A new network namespace ``<prefix><random>``, deleted on exit whatever happened."""
    name = prefix + uuid.uuid4().hex[:8]
    subprocess.run(["ip", "netns", "add", name], check=True, timeout=30)
    try:
        if lo_up:
            subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True, timeout=30)
        yield name
    finally:
        subprocess.run(["ip", "netns", "delete", name], check=False, timeout=30)
