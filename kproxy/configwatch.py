"""Notice that ``kproxy run``'s ``--config`` file changed, so the process can exit and be restarted with it.

Upstream kube-proxy watches its config file with fsnotify and exits when it is written, renamed or removed: the
DaemonSet then restarts it with the new file (a ConfigMap update reaches the pod as an atomic symlink swap of the
``..data`` folder, which is a rename, never an in-place write). Here a small polling thread does the same without
inotify: every ``interval`` seconds it looks at the file's identity (device, inode), mtime, ctime and size, reads
and hashes its bytes only when those moved, and calls ``on_change`` once with the reason when the bytes differ from
what it saw at start, the file was replaced or it vanished. A steady file costs one ``stat`` per interval and no
extra dependency or privilege; ctime (which nobody can set back) catches a same-size rewrite that restored the
mtime (``cp -p`` over it), and the hash keeps a mere ``touch`` from restarting anything.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_INTERVAL = 2.0  # seconds between looks; upstream reacts within the same order (fsnotify + restart)


@dataclass(frozen=True, slots=True)
class Seen:
    """What one look at the file found; ``missing`` when it could not be read."""

    ident: tuple[int, int] = (0, 0)  # (st_dev, st_ino) of the file the path resolves to
    mtime_ns: int = 0
    ctime_ns: int = 0  # changes on every write and cannot be set back (utime sets mtime only)
    size: int = 0
    digest: str = ""
    missing: bool = False


def look(path: Path, previous: Seen | None = None) -> Seen:
    """The file's identity, mtime, size and hash. The bytes are read only when the stat differs from ``previous``
    (or there is none): an unchanged stat keeps the previous hash, so a steady file costs one stat per look."""
    try:
        st = path.stat()  # follows symlinks: a ConfigMap's ..data swap changes the inode seen here
    except OSError:
        return Seen(missing=True)
    ident = (st.st_dev, st.st_ino)
    if previous is not None and not previous.missing:
        stat_now = (ident, st.st_mtime_ns, st.st_ctime_ns, st.st_size)
        if (previous.ident, previous.mtime_ns, previous.ctime_ns, previous.size) == stat_now:
            return previous
    try:
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return Seen(missing=True)
    return Seen(ident, st.st_mtime_ns, st.st_ctime_ns, st.st_size, digest)


def difference(before: Seen, now: Seen) -> str | None:
    """Why ``now`` is not the file ``before`` was, or None when it is the same file with the same bytes."""
    if before.missing and now.missing:
        return None
    if now.missing:
        return "removed or unreadable"
    if before.missing:
        return "appeared"
    if now.digest != before.digest:
        return "content changed"
    if now.ident != before.ident:
        # replaced by a file with the same bytes: upstream's fsnotify sees the rename/remove and exits too
        return "replaced"
    return None


def watch(
    path: str | os.PathLike[str],
    on_change: Callable[[str], object],
    *,
    interval: float = DEFAULT_INTERVAL,
) -> Callable[[], None]:
    """Start a daemon thread that calls ``on_change(reason)`` once when the file at ``path`` changes (content,
    replacement, removal), then stops looking. Returns ``stop()``, which ends the thread (idempotent, waits for it).
    The first look happens now, in the caller, so a change made after ``watch`` returns is always noticed."""
    if interval <= 0:
        raise ValueError(f"interval must be positive, not {interval}")
    target = Path(path)
    first = look(target)
    stopped = threading.Event()

    def loop() -> None:
        seen = first
        while not stopped.wait(interval):
            now = look(target, seen)
            why = difference(first, now)
            if why is not None:
                log.info("config file %s: %s", target, why)
                try:
                    on_change(why)
                except Exception:  # the callback's own failure must not kill the thread silently
                    log.exception("config watch callback failed")
                return
            seen = now

    thread = threading.Thread(target=loop, name=f"configwatch-{target.name}", daemon=True)
    thread.start()

    def stop() -> None:
        stopped.set()
        if thread is not threading.current_thread():
            thread.join(timeout=max(5.0, 2 * interval))

    return stop
