"""``gcpause.trim_heap``: the C heap's free pages go back to the OS after a bulk step freed them (glibc's
``malloc_trim(0)``), and the call is a no-op without glibc."""

from __future__ import annotations

import pytest

from kproxy import gcpause


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


@pytest.mark.skipif(gcpause._MALLOC_TRIM is None, reason="no glibc malloc_trim here")
def test_free_heap_memory_between_live_blocks_goes_back_to_the_os() -> None:
    # 80 MB of 4 KB blocks (below glibc's mmap threshold: on the heap), one in 16 kept so that what is freed lies
    # between live blocks: free() alone trims only the top of the heap, this stays resident until a trim
    blocks = [bytearray(4000) for _ in range(20_000)]
    kept = blocks[::16]
    del blocks
    before = rss_kib()
    assert gcpause.trim_heap() is True
    assert rss_kib() < before - 30 * 1024  # most of the ~75 MB freed
    assert len(kept) == 1250


def test_without_glibc_it_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gcpause, "_MALLOC_TRIM", None)
    assert gcpause.trim_heap() is False
