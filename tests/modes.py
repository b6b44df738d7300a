"""Which modes a test run must cover: an unavailable mode skips on a developer's machine and fails where it is required.

``KPROXY_REQUIRE_MODES`` names the required modes: ``all`` (every mode of kproxy's table), a comma list
(``iptables,bpf``), or empty / unset (none: an unavailable mode is skipped with its reason, as on a laptop without
bcc). CI sets ``all`` (``.ci/run``), so a broken bcc or a backend that no longer imports fails the run with the mode's
own ``available()`` reason instead of leaving every bpf test skipped and the run green.

Tests importing it: ``require_mode(mode)`` where a test needs a mode; ``all_modes()`` to parametrize over every mode
of the table (never only the installed or available ones: a mode that vanished must still get its failing test).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Mapping

import pytest

from kproxy.proxier import MODE_NAMES, Availability, availability

ENV = "KPROXY_REQUIRE_MODES"


def required_modes(env: Mapping[str, str] | None = None) -> frozenset[str]:
    """The modes ``KPROXY_REQUIRE_MODES`` requires; ValueError names a word that is no mode (a typo must not
    quietly require nothing)."""
    spec = (os.environ if env is None else env).get(ENV, "")
    words = {w.strip() for w in spec.split(",") if w.strip()}
    if "all" in words:
        return frozenset(MODE_NAMES)
    unknown = sorted(words - set(MODE_NAMES))
    if unknown:
        raise ValueError(f"{ENV}={spec!r}: {', '.join(unknown)} is no mode; modes: all, {', '.join(MODE_NAMES)}")
    return frozenset(words)


def all_modes() -> list[str]:
    """Every mode of kproxy's table, in its order: what tests parametrize over (each then calls ``require_mode``)."""
    return list(MODE_NAMES)


def missing(mode: str, reason: str, env: Mapping[str, str] | None = None) -> None:
    """``mode`` cannot run here for ``reason``: fail when the run requires it, else skip saying why."""
    if mode in required_modes(env):
        pytest.fail(f"mode {mode} is required ({ENV}) but not available here: {reason}", pytrace=False)
    pytest.skip(f"mode {mode} is not available here: {reason}")


def require_mode(
    mode: str, env: Mapping[str, str] | None = None, probe: Callable[[str], Availability] = availability
) -> None:
    """Return when ``mode`` is available here; otherwise fail (required) or skip, with the mode's reason."""
    avail = probe(mode)
    if not avail:
        missing(mode, avail.reason or "no reason given", env)


def run_mode_cli(mode: str, args: list[str], timeout: float = 280) -> tuple[int, str]:
    """``python -P -m kproxy.bench <args>`` for ``mode``, killed at ``timeout``: (its pid, its stdout). The mode's
    ``missing`` when its backend is not available here; a failing exit code fails the test with its stderr."""
    argv = [sys.executable, "-P", "-m", "kproxy.bench", *args]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    if proc.returncode == 1 and "is not available here" in stderr:
        missing(mode, stderr.strip())
    assert proc.returncode == 0, stderr
    return proc.pid, stdout
