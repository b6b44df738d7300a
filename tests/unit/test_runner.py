"""The bounded-frequency runner's timing rules, driven by a fake clock (plus one short real-time check)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from kproxy.runner import BoundedFrequencyRunner, FakeClock

MIN, RETRY, MAX = 1.0, 5.0, 60.0


class Recorder:
    """An ``fn`` that records when it started, can take fake time, and fails on demand."""

    def __init__(self, clock: FakeClock, duration: float = 0.0) -> None:
        self.clock = clock
        self.duration = duration
        self.starts: list[float] = []
        self.results: list[bool | Exception] = []  # consumed in order; empty means succeed
        self.during: Callable[[], None] | None = None

    def __call__(self) -> bool:
        self.starts.append(self.clock.now)
        if self.during is not None:
            self.during()
        self.clock.elapse(self.duration)
        if self.results:
            outcome = self.results.pop(0)
            if isinstance(outcome, Exception):
                raise outcome
            return outcome
        return True


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(start=1000.0)


@pytest.fixture
def make(clock: FakeClock) -> Iterator[Callable[..., tuple[BoundedFrequencyRunner, Recorder]]]:
    runners: list[BoundedFrequencyRunner] = []

    def factory(
        min_interval: float = MIN, retry: float = RETRY, max_interval: float = MAX, duration: float = 0.0
    ) -> tuple[BoundedFrequencyRunner, Recorder]:
        rec = Recorder(clock, duration)
        runner = BoundedFrequencyRunner("test", rec, min_interval, retry, max_interval, clock=clock)
        runners.append(runner)
        return runner, rec

    yield factory
    for r in runners:
        r.stop(timeout=5)


def started(runner: BoundedFrequencyRunner, clock: FakeClock) -> None:
    runner.start()
    clock.wait_blocked()


def rel(rec: Recorder, origin: float = 1000.0) -> list[float]:
    return [round(t - origin, 6) for t in rec.starts]


def test_max_below_min_is_rejected() -> None:
    with pytest.raises(ValueError, match="max_interval"):
        BoundedFrequencyRunner("bad", lambda: True, 10.0, 1.0, 5.0)


def test_nothing_runs_until_requested_or_max_interval(make, clock: FakeClock) -> None:
    runner, rec = make()
    started(runner, clock)
    clock.advance(MAX - 0.001)
    assert rec.starts == []
    clock.advance(0.001)
    assert rel(rec) == [MAX]


def test_first_run_is_prompt_after_run(make, clock: FakeClock) -> None:
    runner, rec = make()
    started(runner, clock)
    clock.settle(runner.run)
    assert rel(rec) == [0.0]


def test_request_before_start_is_kept(make, clock: FakeClock) -> None:
    runner, rec = make()
    runner.run()
    started(runner, clock)
    assert rel(rec) == [0.0]


def test_min_interval_counts_from_completion(make, clock: FakeClock) -> None:
    runner, rec = make(duration=2.0)  # each run takes 2 s of fake time
    started(runner, clock)
    clock.settle(runner.run)  # runs at 0, completes at 2
    clock.settle(runner.run)  # requested at 2: must wait until 2 + MIN
    clock.advance(MIN - 0.01)
    assert rel(rec) == [0.0]
    clock.advance(0.01)
    assert rel(rec) == [0.0, 2.0 + MIN]


def test_requests_during_cooldown_coalesce_into_one_run(make, clock: FakeClock) -> None:
    runner, rec = make()
    started(runner, clock)
    clock.settle(runner.run)
    for _ in range(5):
        clock.settle(runner.run)
        clock.advance(0.1)
    clock.advance(MIN)
    assert rel(rec) == [0.0, MIN]
    clock.advance(MIN * 3)
    assert rel(rec) == [0.0, MIN]  # nothing further was asked for


def test_request_during_a_run_is_served_after_cooldown(make, clock: FakeClock) -> None:
    runner, rec = make(duration=0.5)
    rec.during = runner.run  # a change arrives while fn is running
    started(runner, clock)
    clock.settle(runner.run)
    rec.during = None
    assert rel(rec) == [0.0]
    clock.advance(0.5 + MIN)
    assert rel(rec) == [0.0, 0.5 + MIN]


def test_runs_at_least_once_per_max_interval(make, clock: FakeClock) -> None:
    runner, rec = make()
    started(runner, clock)
    clock.settle(runner.run)
    clock.advance(10.0)
    clock.settle(runner.run)  # at 10: resets the max timer from its completion
    clock.advance(3 * MAX)
    assert rel(rec) == [0.0, 10.0, 10.0 + MAX, 10.0 + 2 * MAX, 10.0 + 3 * MAX]


def test_failure_is_retried_after_retry_interval(make, clock: FakeClock) -> None:
    runner, rec = make(duration=1.0)
    rec.results = [False]
    started(runner, clock)
    clock.settle(runner.run)  # fails, completes at 1
    clock.advance(RETRY - 0.01)
    assert rel(rec) == [0.0]
    clock.advance(0.01)
    assert rel(rec) == [0.0, 1.0 + RETRY]
    assert runner.failures == 1 and runner.last_ok is True


def test_exception_is_logged_and_retried(make, clock: FakeClock, caplog: pytest.LogCaptureFixture) -> None:
    runner, rec = make()
    rec.results = [RuntimeError("kernel said no")]
    started(runner, clock)
    with caplog.at_level(logging.ERROR, logger="kproxy.runner"):
        clock.settle(runner.run)
    assert "kernel said no" in caplog.text
    clock.advance(RETRY)
    assert rel(rec) == [0.0, RETRY]


def test_retry_never_sooner_than_min_interval(make, clock: FakeClock) -> None:
    runner, rec = make(min_interval=3.0, retry=0.5, max_interval=MAX)
    rec.results = [False]
    started(runner, clock)
    clock.settle(runner.run)
    clock.advance(2.99)
    assert rel(rec) == [0.0]
    clock.advance(0.01)
    assert rel(rec) == [0.0, 3.0]


def test_retry_bounded_by_max_interval(make, clock: FakeClock) -> None:
    runner, rec = make(min_interval=1.0, retry=100.0, max_interval=20.0)
    rec.results = [False]
    started(runner, clock)
    clock.settle(runner.run)
    clock.advance(20.0)
    assert rel(rec) == [0.0, 20.0]


def test_successful_run_cancels_pending_retry(make, clock: FakeClock) -> None:
    runner, rec = make()
    rec.results = [False]
    started(runner, clock)
    clock.settle(runner.run)  # fails at 0: retry due at RETRY
    clock.advance(2.0)
    clock.settle(runner.run)  # succeeds at 2
    clock.advance(RETRY + 1.0)
    assert rel(rec) == [0.0, 2.0]  # no run at RETRY
    clock.advance(MAX)
    assert rel(rec) == [0.0, 2.0, 2.0 + MAX]


def test_retry_after_schedules_a_run(make, clock: FakeClock) -> None:
    runner, rec = make()
    started(runner, clock)
    clock.settle(lambda: runner.retry_after(7.0))
    clock.advance(6.99)
    assert rec.starts == []
    clock.advance(0.01)
    assert rel(rec) == [7.0]


def test_retry_after_called_during_a_successful_run_is_kept(make, clock: FakeClock) -> None:
    runner, rec = make()
    rec.during = lambda: runner.retry_after(4.0)
    started(runner, clock)
    clock.settle(runner.run)
    rec.during = None
    clock.advance(4.0)
    assert rel(rec) == [0.0, 4.0]
    clock.advance(MAX - 0.01)
    assert rel(rec) == [0.0, 4.0]


def test_stop_ends_the_loop(make, clock: FakeClock) -> None:
    runner, rec = make()
    thread = runner.start()
    clock.wait_blocked()
    runner.stop(timeout=5)
    assert not thread.is_alive()


def test_loop_ends_when_its_external_stop_event_is_set() -> None:
    """The daemon runs ``loop(stop)`` with an Event of its own and sets it without calling ``stop()``: nobody
    notifies the runner's condition then, so the loop must notice the Event by itself (the real clock looks at it at
    least every _STOP_POLL seconds), even with nothing due for a minute."""
    calls: list[float] = []
    runner = BoundedFrequencyRunner("ext", lambda: bool(calls.append(time.monotonic())) or True, MIN, RETRY, MAX)
    stop = threading.Event()
    thread = threading.Thread(target=runner.loop, args=(stop,), daemon=True)
    thread.start()
    runner.run()
    deadline = time.monotonic() + 5
    while not calls and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(calls) == 1  # the loop is running, and has nothing due for MAX seconds
    t0 = time.monotonic()
    stop.set()  # only the event: no stop(), no notify
    thread.join(timeout=5)
    assert not thread.is_alive(), "the loop did not notice its stop event"
    assert time.monotonic() - t0 < 2.0
    assert len(calls) == 1


def test_real_time_min_interval_and_coalescing() -> None:
    """With the real clock: 20 requests made while a run is in progress give exactly one more run (coalesced), which
    starts >= min_interval after the first ended. Every step waits on an event (a run entered, a gate opened), never
    on a sleep, so a loaded machine only makes the gap longer."""
    spans: list[tuple[float, float]] = []
    entered = [threading.Event(), threading.Event(), threading.Event()]
    gates = [threading.Event(), threading.Event(), threading.Event()]

    def fn() -> bool:
        n = min(len(spans), 2)
        start = time.monotonic()
        entered[n].set()
        gates[n].wait(10)
        spans.append((start, time.monotonic()))
        return True

    runner = BoundedFrequencyRunner("real", fn, 0.05, 0.2, 60.0)
    runner.start()
    try:
        runner.run()
        assert entered[0].wait(10), "the first run never started"  # no cool-down before the first run
        for _ in range(20):
            runner.run()
        gates[0].set()
        assert entered[1].wait(10), "the requests made during the first run were not served"
        gates[1].set()
        runner.stop(timeout=10)  # the second run ends; nothing was asked since it began, so no third run is due
    finally:
        for g in gates:
            g.set()
        runner.stop(timeout=10)
    assert runner.stopped
    assert len(spans) == 2 and not entered[2].is_set(), spans  # 20 requests during one run: one more run
    (_, end0), (start1, _) = spans
    assert start1 - end0 >= 0.05 - 0.002, spans
