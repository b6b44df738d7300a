"""The bounded-frequency runner: decides *when* the daemon syncs the backend.

A port of upstream's newer runner (``pkg/proxy/runner/bounded_frequency_runner.go``, the one without burst runs).
Its guarantees, each unit-tested with a fake clock:

1. At least ``min_interval`` passes from the *completion* of one run to the *start* of the next. Requests made
   during that cool-down (or while ``fn`` runs) are coalesced into one run at its end.
2. ``fn`` runs at least once per ``max_interval``, requested or not (the periodic full resync).
3. When ``fn`` returns False or raises (the exception is logged), it runs again within
   ``min(retry_interval, max_interval)`` of completing - but never before ``min_interval`` has passed. A
   successful run cancels a pending retry.
4. ``max_interval < min_interval`` is a ValueError (upstream panics).
5. Nothing runs before ``max_interval`` after ``loop()`` starts unless ``run()`` is called; the daemon calls
   ``run()`` when the cache is first ready.
6. ``check()`` asks for the optional ``check_fn`` (a cheap look at the kernel, writing nothing) to run in the same
   thread, as soon as no run is due; it does not wait for ``min_interval`` and does not count as a run. Requests
   coalesce. It may call ``run()`` (the kernel state it looked at is gone): that run keeps the cool-down.

One deliberate difference: upstream drops a ``Run()`` made before the loop goroutine is ready. Here a request made
before ``start()`` is kept and served as soon as the loop starts, so the daemon cannot lose its first sync to a
start-up race.

Time is injected through ``Clock`` (``monotonic()`` and ``wait(cond, timeout)``), so tests drive the loop thread
with ``FakeClock`` deterministically and without real sleeping.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

log = logging.getLogger(__name__)

# An Event set by someone other than ``stop()`` cannot notify our condition; with the real clock the loop looks at
# it at least this often (seconds).
_STOP_POLL = 0.5


class Clock(Protocol):
    """Monotonic time, and a way to block on a condition until notified or until a timeout in that time."""

    def monotonic(self) -> float: ...

    def wait(self, cond: threading.Condition, timeout: float | None) -> None:
        """Called with ``cond`` held; returns when notified, when ``timeout`` (in this clock's seconds) has passed,
        or spuriously. Callers re-check their state after it returns."""
        ...


class RealClock:
    """The system's monotonic clock."""

    def monotonic(self) -> float:
        return time.monotonic()

    def wait(self, cond: threading.Condition, timeout: float | None) -> None:
        cond.wait(_STOP_POLL if timeout is None else max(0.0, min(timeout, _STOP_POLL)))


class FakeClock:
    """A clock that moves only when a test says so, like upstream's ``testingclock.FakeClock``.

    ``advance(dt)`` moves time forward in steps, stopping at every deadline a waiter is blocked on, and after each
    step waits (in real time, bounded) until the woken threads have blocked again, so a test that calls
    ``advance`` observes everything that was due. ``settle(action)`` does the same around an action such as
    ``runner.run()``. A function under test may call ``elapse(dt)`` to make its own run take fake time.
    """

    def __init__(self, start: float = 1000.0, real_timeout: float = 10.0) -> None:
        self.now = start
        self._real_timeout = real_timeout
        self._lock = threading.Condition()
        self._waiters: dict[int, tuple[threading.Condition, float | None]] = {}
        self._entries = 0  # how many times any thread has blocked in wait()
        self._next_id = 0

    def monotonic(self) -> float:
        with self._lock:
            return self.now

    def wait(self, cond: threading.Condition, timeout: float | None) -> None:
        with self._lock:
            deadline = None if timeout is None else self.now + timeout
            if deadline is not None and deadline <= self.now:
                return
            self._next_id += 1
            key = self._next_id
            self._waiters[key] = (cond, deadline)
            self._entries += 1
            self._lock.notify_all()
        try:
            # Released atomically by Condition.wait, so a notify by advance()/settle() cannot be lost.
            cond.wait(self._real_timeout)
        finally:
            with self._lock:
                del self._waiters[key]

    def elapse(self, seconds: float) -> None:
        """Move time forward without waking anyone (for code under test that 'takes' time)."""
        with self._lock:
            self.now += seconds

    @property
    def waiters(self) -> int:
        with self._lock:
            return len(self._waiters)

    def wait_blocked(self, after: int = 0) -> None:
        """Block (real time, bounded) until some thread has entered wait() more than ``after`` times in total and is
        still blocked there."""
        deadline = time.monotonic() + self._real_timeout
        with self._lock:
            while not (self._entries > after and self._waiters):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("no thread blocked on the fake clock")
                self._lock.wait(left)

    def settle(self, action: Callable[[], object]) -> None:
        """Do ``action`` (which wakes a blocked thread, e.g. ``runner.run()``) and wait until it blocks again."""
        with self._lock:
            before = self._entries
        action()
        self.wait_blocked(before)

    def advance(self, seconds: float) -> None:
        """Move time forward by ``seconds``, waking each waiter at its own deadline and letting it settle."""
        with self._lock:
            target = self.now + seconds
        while True:
            with self._lock:
                due = [d for _, d in self._waiters.values() if d is not None and d <= target]
                if not due:
                    self.now = target
                    return
                self.now = max(self.now, min(due))
                woken = [c for c, d in self._waiters.values() if d is not None and d <= self.now]
                before = self._entries
            for cond in woken:
                with cond:
                    cond.notify_all()
            self.wait_blocked(before)


class BoundedFrequencyRunner:
    """Runs ``fn`` in one thread, as soon as allowed after ``run()``, periodically, and again after failures."""

    def __init__(
        self,
        name: str,
        fn: Callable[[], bool],
        min_interval: float,
        retry_interval: float,
        max_interval: float,
        *,
        clock: Clock | None = None,
        check_fn: Callable[[], None] | None = None,
    ) -> None:
        if max_interval < min_interval:
            raise ValueError(f"{name}: max_interval ({max_interval}) must be >= min_interval ({min_interval})")
        if min_interval < 0 or retry_interval < 0:
            raise ValueError(f"{name}: intervals must not be negative")
        self.name = name
        self.fn = fn
        self.min_interval = min_interval
        self.retry_interval = retry_interval
        self.max_interval = max_interval
        self.clock: Clock = clock or RealClock()
        self.check_fn = check_fn
        self._cond = threading.Condition()
        self._requested = False
        self._check_requested = False
        self._retry_at: float | None = None
        self._retry_delay: float | None = None  # a retry_after() made before the loop started
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._running = False
        self.runs = 0  # completed runs, successful or not
        self.failures = 0  # completed runs that failed
        self.last_ok: bool | None = None
        self.checks = 0  # completed check_fn calls

    def run(self) -> None:
        """Ask for a run as soon as allowed. Never blocks on ``fn``; requests coalesce."""
        with self._cond:
            self._requested = True
            self._cond.notify_all()

    def check(self) -> None:
        """Ask for one ``check_fn`` call in the runner thread as soon as no run is due. Never blocks; coalesces."""
        if self.check_fn is None:
            raise RuntimeError(f"runner {self.name} has no check function")
        with self._cond:
            self._check_requested = True
            self._cond.notify_all()

    def retry_after(self, delay: float) -> None:
        """Ask for a run ``delay`` seconds from now (still honouring ``min_interval``), unless one happens sooner.

        Like a failed run's retry, a successful run before then cancels it.
        """
        with self._cond:
            if not self._running:
                self._retry_delay = delay if self._retry_delay is None else min(self._retry_delay, delay)
            else:
                at = self.clock.monotonic() + delay
                self._retry_at = at if self._retry_at is None else min(self._retry_at, at)
            self._cond.notify_all()

    def loop(self, stop: threading.Event) -> None:
        """The runner thread's body; returns when ``stop`` is set."""
        log.debug("runner %s: loop running", self.name)
        with self._cond:
            self._stop = stop
            self._running = True
            now = self.clock.monotonic()
            earliest = now  # no cool-down before the first run
            max_at = now + self.max_interval
            if self._retry_delay is not None:
                self._retry_at = now + self._retry_delay
                self._retry_delay = None
            while not stop.is_set():
                now = self.clock.monotonic()
                due = self._requested or now >= max_at or (self._retry_at is not None and now >= self._retry_at)
                if due and now >= earliest:
                    # This run consumes the request and any pending retry; a success thus cancels the retry.
                    self._requested = False
                    self._retry_at = None
                    self._cond.release()
                    try:
                        ok = self._call()
                    finally:
                        self._cond.acquire()
                    done = self.clock.monotonic()
                    # Requests and retry_after() calls made during the run stay set and are served after the
                    # cool-down; a failure adds its own retry.
                    if not ok:
                        at = done + self.retry_interval
                        self._retry_at = at if self._retry_at is None else min(self._retry_at, at)
                    earliest = done + self.min_interval
                    max_at = done + self.max_interval
                    continue
                if self._check_requested:
                    self._check_requested = False
                    self._cond.release()
                    try:
                        self._call_check()
                    finally:
                        self._cond.acquire()
                    continue
                if due:
                    wake = earliest
                else:
                    wake = max_at if self._retry_at is None else min(max_at, self._retry_at)
                    wake = max(wake, earliest)
                self.clock.wait(self._cond, wake - now)
            self._running = False
        log.debug("runner %s: loop stopped", self.name)

    def _call(self) -> bool:
        try:
            result = self.fn()
        except Exception:
            log.exception("runner %s: run failed; retrying within %gs", self.name, self.retry_interval)
            result = False
        ok = result is not False
        if not ok:
            log.debug("runner %s: run reported failure; retrying within %gs", self.name, self.retry_interval)
        self.runs += 1
        self.failures += 0 if ok else 1
        self.last_ok = ok
        return ok

    def _call_check(self) -> None:
        assert self.check_fn is not None
        try:
            self.check_fn()
        except Exception:
            log.exception("runner %s: check failed", self.name)
        self.checks += 1

    def start(self) -> threading.Thread:
        """Run ``loop`` in a daemon thread named after the runner."""
        if self._thread is not None:
            raise RuntimeError(f"runner {self.name} already started")
        stop = threading.Event()
        thread = threading.Thread(target=self.loop, args=(stop,), name=f"runner-{self.name}", daemon=True)
        with self._cond:
            self._stop = stop
            self._thread = thread
        thread.start()
        return thread

    def stop(self, timeout: float = 5) -> None:
        """Stop the loop and wait (up to ``timeout`` seconds) for a run in progress to finish."""
        with self._cond:
            self._stop.set()
            thread = self._thread
            self._cond.notify_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            if thread.is_alive():
                log.warning("runner %s: still running after %gs", self.name, timeout)

    @property
    def stopped(self) -> bool:
        """Whether the loop thread has ended (or never started): what runs in it may be torn down."""
        thread = self._thread
        return thread is None or not thread.is_alive()
