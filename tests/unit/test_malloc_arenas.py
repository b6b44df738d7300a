"""``gcpause.limit_arenas``: glibc makes at most that many malloc arenas for the process's threads, where it would
give each new thread that allocates an arena of its own (``kproxy run`` calls it before its threads start). The
limit is process-wide and cannot be undone, so each case runs in a child of its own, whose threads allocate beyond
pymalloc's reach, and counts the arenas in glibc's own report (``malloc_info``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kproxy import gcpause

CHILD = """
import ctypes, sys, threading
from kproxy.gcpause import limit_arenas
if sys.argv[1] != "none":
    assert limit_arenas(int(sys.argv[1]))
keep = []
def work():
    for _ in range(200):
        keep.append(bytearray(64_000))  # beyond pymalloc's 512 bytes: glibc's malloc, in this thread's arena
threads = [threading.Thread(target=work) for _ in range(6)]
for t in threads:
    t.start()
for t in threads:
    t.join()
libc = ctypes.CDLL(None)
libc.fopen.restype = ctypes.c_void_p
libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
libc.fclose.argtypes = [ctypes.c_void_p]
fp = libc.fopen(sys.argv[2].encode(), b"w")
assert libc.malloc_info(0, fp) == 0
libc.fclose(fp)
"""


def _arenas(tmp_path: Path, limit: str) -> int:
    report = tmp_path / f"malloc-{limit}.xml"
    res = subprocess.run(
        [sys.executable, "-c", CHILD, limit, str(report)], capture_output=True, text=True, timeout=60, check=False
    )
    assert res.returncode == 0, res.stderr
    return report.read_text().count("<heap nr=")


@pytest.mark.skipif(gcpause._MALLOC_TRIM is None, reason="no glibc here")
def test_the_threads_share_the_arenas_it_allows(tmp_path: Path) -> None:
    assert _arenas(tmp_path, "none") > 2  # the main arena and one per thread that allocated (up to 8 per core)
    assert _arenas(tmp_path, "2") <= 2
    assert _arenas(tmp_path, "1") == 1
