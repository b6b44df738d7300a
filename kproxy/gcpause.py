"""The shared pause of the cyclic garbage collector during bulk work (a cache rebuild or relist, a full sync).

Bulk work allocates hundreds of thousands of acyclic objects while the process holds a large heap; the collector
would walk that heap again and again for nothing. ``collector_paused`` is the one pause every part shares (the
cache's sources and snapshot, the ledger's full syncs), so overlapping users never end each other's pause.

The daemon's process also *settles* its heap after syncs (``settle``: collect, then freeze for good): a long-running
kproxy holds one large, acyclic, slowly changing heap, and the collector's full walks of it stalled every change
of a churn; once settled, every collection walks only what changed since the last settling.

``trim_heap`` gives the C heap's free pages back to the OS after a bulk step freed a large share of it (a relist's
raw objects): glibc keeps freed memory in its arenas, and a process that peaked once would hold that peak for good.
``limit_arenas`` caps how many arenas glibc makes for the process's threads (``kproxy run`` calls it first thing).

Imports nothing of kproxy: any layer may use it.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import threading
from collections.abc import Callable, Iterator


class _CollectorPause:
    """Hold off the cyclic garbage collector's walks over the old heap during a bulk rebuild or relist.

    Those allocate ~10 acyclic objects per endpoint while the process holds a large heap (at 10k services, the API
    client's list of objects too); the collector would walk that heap again and again for nothing, a third to a
    half of the time. Sources (one thread per kind) and the runner pause at the same time, so the pause is shared:
    a lock-protected count of holders, the first one in starts it and the last one out ends it. (It was a
    ``gc.disable()``/``gc.enable()`` pair per caller, and one thread's ``enable`` ended another's pause.)

    How it pauses: ``gc.freeze()`` on every entry moves everything alive into the permanent generation, so the
    collector's walks see only what was allocated since, and ``gc.unfreeze()`` by the last holder gives it all
    back. The collector stays enabled throughout: cycles made meanwhile by other threads (HTTP servers, the
    API client) are still collected, and nobody's ``gc.isenabled()`` ever changes. If someone else froze objects
    before us (a pre-fork freeze), we neither freeze nor unfreeze: their choice is left alone.

    Both shared pauses kept the old per-caller pause's gain; freeze is chosen for the enabled collector (the
    figures: docs/PERFORMANCE.md).

    Freeze alone still let the collector walk what the pause itself allocates (a full bpf sync at 10,000 x 10
    allocates ~300,000 tracked objects); raising only the older generations' thresholds left the young collections
    (each young object's referents are visited: cache misses all over the old heap), and a higher young threshold
    made fewer, slower walks. So during a
    pause the young threshold is ``PAUSED_YOUNG`` (no collection below that many allocations), and the last holder
    moves what the pause allocated straight into the oldest generation (one more ``gc.freeze()`` before the
    ``gc.unfreeze()``), where the next full collection, whenever it comes, looks at it once. The collector stays
    enabled; its thresholds are restored at the end.
    """

    #: the young generation's threshold during a pause (Python's default: 700)
    PAUSED_YOUNG = 1_000_000

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders = 0
        #: whether this pause may freeze (nobody else had frozen objects): asked by the first holder that is not
        #: light, None until then (``gc.get_freeze_count()`` walks every frozen object: 16 ms with a frozen heap of
        #: 10,000 services, so light holders never ask)
        self._may_freeze: bool | None = None
        self._froze = False  # a holder froze objects: the last one out unfreezes them
        self._thresholds: tuple[int, int, int] | None = None  # the thresholds before the pause, restored at its end
        self._settled = False  # ``settle`` froze the heap, for good: pauses only defer collections from then on

    @contextlib.contextmanager
    def __call__(self, active: bool = True, *, light: bool = False) -> Iterator[None]:
        """Pause while the block runs. ``light``: only defer collections (the young threshold), freeze nothing: for a
        small sync, so a collection of the whole heap never lands inside it, while what it allocated stays young and
        is collected as usual afterwards (objects of frequent small syncs must not bypass the young collections)."""
        if not active:
            yield
            return
        with self._lock:
            if self._holders == 0:
                before = gc.get_threshold()
                if 0 < before[0] < self.PAUSED_YOUNG:  # threshold 0: someone disabled collections
                    self._thresholds = before
                    gc.set_threshold(self.PAUSED_YOUNG, before[1], before[2])
            self._holders += 1
            if not light and not self._settled:
                if self._may_freeze is None:
                    self._may_freeze = gc.get_freeze_count() == 0
                if self._may_freeze:
                    gc.freeze()
                    self._froze = True
        try:
            yield
        finally:
            with self._lock:
                self._holders -= 1
                if self._holders == 0:
                    if self._froze:
                        gc.freeze()  # what the pause allocated joins the rest: into the oldest generation, unwalked
                        gc.unfreeze()
                    self._froze = False
                    self._may_freeze = None
                    if self._thresholds is not None:
                        if gc.get_threshold()[0] == self.PAUSED_YOUNG:  # nobody changed them since
                            gc.set_threshold(*self._thresholds)
                        self._thresholds = None

    def keep(self) -> None:
        """Move what the pause has allocated so far into the frozen heap now, as its end will: a bulk step that
        keeps most of what it allocates (a relist: the sink's records of each page) would otherwise have every
        young and middle collection of the pause walk all the earlier steps' objects again. Only while held, and
        only by a pause that froze (someone else's freeze is left alone); ``gc.freeze()`` is a list splice."""
        with self._lock:
            if self._holders > 0 and self._froze:
                gc.freeze()

    def settle(self) -> bool:
        """A long-running process's steady heap, out of the collector's walks for good: collect (cycles that became
        garbage are freed), then freeze what is left. Between two calls, every collection, the full ones
        included, walks only what was allocated since the last one; without it, a full collection walks the whole
        heap (seconds at 100,000 service ports), and a churn's long-lived objects trigger one every few seconds:
        every change meanwhile waits for it (the figures: docs/PERFORMANCE.md).

        The cost: a frozen object that later becomes part of a garbage *cycle* is never freed (acyclic ones still
        are, by their reference counts); the cache's and the ledgers' objects are acyclic (a unit test checks a
        churn leaves no cyclic garbage in the frozen heap). The first call walks the whole heap once. From then on
        pauses freeze nothing (nothing is frozen without a collection first) and only defer collections. Does
        nothing while a pause is held or when someone else froze objects; True when it settled the heap."""
        with self._lock:
            if self._holders or (not self._settled and gc.get_freeze_count()):
                return False
            gc.collect()
            gc.freeze()
            self._settled = True
            return True

    def unsettle(self) -> None:
        """Give the settled heap back to the collector (tests, and a process done with its steady state)."""
        with self._lock:
            if self._settled:
                gc.unfreeze()
                self._settled = False


#: the process's one pause (see ``_CollectorPause``)
collector_paused = _CollectorPause()


def _glibc(name: str, *argtypes: type) -> Callable[..., int] | None:
    """glibc's ``name`` taking ``argtypes`` and returning an int; None without it (musl and others have neither
    ``malloc_trim`` nor ``mallopt``)."""
    try:
        fn = getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes = list(argtypes)
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


_MALLOC_TRIM = _glibc("malloc_trim", ctypes.c_size_t)


def trim_heap() -> bool:
    """Return the C heap's free memory to the OS (glibc's ``malloc_trim(0)``: every arena, not only the top of the
    main one); True if some was released. A no-op (False) without glibc. It walks the free chunks, so it is meant
    for once after a bulk step, not for every change; ctypes drops the GIL meanwhile."""
    if _MALLOC_TRIM is None:
        return False
    return bool(_MALLOC_TRIM(0))


_M_ARENA_MAX = -8  # mallopt's parameter (glibc's malloc.h)
DAEMON_ARENAS = 2


def limit_arenas(n: int = DAEMON_ARENAS) -> bool:
    """Let glibc make at most ``n`` malloc arenas for the rest of the process's life (``mallopt(M_ARENA_MAX, n)``,
    what ``MALLOC_ARENA_MAX`` does from the environment); True if glibc took it, False without glibc.

    glibc gives each new thread that allocates an arena of its own, up to eight per core, and memory freed in one
    arena serves only the threads on it. kproxy's threads take turns with large allocations (three reflectors'
    pages, the runner's sync, the drift watcher's and the servers' buffers), so each arena kept its own high-water
    mark: with two arenas, an nftables kproxy fed by the API server at 100,000 service ports peaked 7-11 MB lower
    (524-528 MB against 535, two runs each; docs/PERFORMANCE.md). Python's small objects are not in these arenas
    (pymalloc maps its own), so nothing is slower for it. Call it before threads start: arenas already made stay."""
    mallopt = _glibc("mallopt", ctypes.c_int, ctypes.c_int)
    return mallopt is not None and bool(mallopt(_M_ARENA_MAX, n))
