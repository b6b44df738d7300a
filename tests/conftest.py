"""Shared pytest set-up: tests marked ``root`` or ``lab`` need root and kernel features and skip, with the reason,
where those are missing. CI runs as root with everything installed, so there they all run; a mode that is not
available skips too, except where ``KPROXY_REQUIRE_MODES`` requires it (CI: all), where it fails (tests/modes.py)."""

from __future__ import annotations

import os

import pytest


def pytest_configure(config: pytest.Config) -> None:
    """A ``KPROXY_REQUIRE_MODES`` word that is no mode stops the run at once (tests/modes.py): a typo there would
    otherwise require nothing and let an unavailable mode skip."""
    from modes import required_modes

    try:
        required_modes()
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.geteuid() == 0:
        return
    skip = pytest.mark.skip(reason="needs root: it creates network namespaces and kernel rules")
    for item in items:
        if "root" in item.keywords or "lab" in item.keywords:
            item.add_marker(skip)


def pytest_unconfigure(config: pytest.Config) -> None:
    """A child process a test started and never waited for, still running once everything is torn down, is named
    here (with its command line) and ended, rather than left to an anonymous ResourceWarning at exit ("subprocess N
    is still running", seen now and then after the summary line of a full run)."""
    import gc
    import subprocess
    import sys

    from kproxy.lab import netns

    for proc in [o for o in gc.get_objects() if isinstance(o, subprocess.Popen)]:
        if proc.returncode is not None or proc.poll() is not None:
            continue
        sys.__stderr__.write(f"tests: a child process was still running at the end: pid {proc.pid}: {proc.args!r}\n")
        netns.terminate([proc.pid])  # SIGTERM, SIGKILL after a grace, reaped
        proc.poll()  # the Popen learns it is gone (no ResourceWarning when it is collected)
