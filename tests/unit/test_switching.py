"""The switch interval is lowered inside blocks and restored after the last one, also when blocks overlap in threads."""

from __future__ import annotations

import sys
import threading

import pytest

from kproxy.toolkit.switching import switch_interval


@pytest.fixture(autouse=True)
def _default_interval() -> object:
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    yield
    sys.setswitchinterval(before)


def test_a_block_lowers_the_interval_and_restores_it() -> None:
    with switch_interval(0.0005):
        assert sys.getswitchinterval() == pytest.approx(0.0005)
    assert sys.getswitchinterval() == pytest.approx(0.005)


def test_a_block_never_raises_the_interval() -> None:
    sys.setswitchinterval(0.001)
    with switch_interval(0.004):
        assert sys.getswitchinterval() == pytest.approx(0.001)
    assert sys.getswitchinterval() == pytest.approx(0.001)


def test_an_error_in_the_block_still_restores() -> None:
    with pytest.raises(RuntimeError), switch_interval(0.0005):
        raise RuntimeError("boom")
    assert sys.getswitchinterval() == pytest.approx(0.005)


def test_blocks_that_overlap_in_threads_restore_the_interval_found_first() -> None:
    """A enters, B enters, A leaves, B leaves: saving and restoring per block would leave B's 'before' (A's lowered
    value) in force for good; counted, the first interval comes back and the lowest one holds while any is open."""
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, float] = {}

    def block_b() -> None:
        a_in.wait(5)
        with switch_interval(0.001):
            b_in.set()
            a_out.wait(5)
            seen["b after a left"] = sys.getswitchinterval()

    thread = threading.Thread(target=block_b)
    thread.start()
    with switch_interval(0.0005):
        a_in.set()
        b_in.wait(5)
        seen["both open"] = sys.getswitchinterval()
    a_out.set()
    thread.join(5)
    assert seen["both open"] == pytest.approx(0.0005)
    assert seen["b after a left"] == pytest.approx(0.001)
    assert sys.getswitchinterval() == pytest.approx(0.005)


def test_a_nonpositive_interval_is_refused() -> None:
    with pytest.raises(ValueError, match="positive"):
        with switch_interval(0):
            pass
