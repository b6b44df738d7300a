"""The lab for the conformance tests: one lab per mode, brought up when that mode's first scenario runs.

Each (mode, scenario) is its own test (see test_conformance.py), run in mode order, so at most one lab exists
at a time: when the mode changes, the previous mode's lab is taken down before the next comes up, and the last
one goes as soon as the conformance tests end (also when tests fail), not with the whole session: the rest of the
suite must not run beside a lab's kproxy processes, nor leave its namespaces and pins behind if it is killed. A lab
that cannot come up fails every test of that mode with the same reason instead of being retried 24 times.

``KPROXY_CONFORMANCE_MODES=iptables,nftables`` restricts the modes (default: every installed mode);
``KPROXY_CONFORMANCE_LAB_PREFIX=kpq-`` builds the lab under another namespace prefix (default ``kpk-``, the tests'
own, never the ``kpl-`` of a lab someone brought up by hand). A lab already running under the tests' own default
prefix is a leftover of an earlier test run and is replaced; under a prefix given in the environment it is left
alone and every test of the mode fails saying so.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from kproxy.conformance.runner import Session

DEFAULT_PREFIX = "kpk-"


class Labs:
    """The current mode's conformance session (lab + kproxy), switched when the mode changes."""

    def __init__(self) -> None:
        self.mode: str | None = None
        self.session: Session | None = None
        self.error: str | None = None
        #: "<mode> <scenario>/<part>: <reason>" of every passing scenario's not-applicable part, for the summary
        self.parts: list[str] = []

    def get(self, mode: str) -> Session:
        if mode != self.mode:
            self.close()
            self.mode = mode
            try:
                prefix = os.environ.get("KPROXY_CONFORMANCE_LAB_PREFIX") or DEFAULT_PREFIX
                self.session = Session.open(mode, prefix=prefix, replace_lab=prefix == DEFAULT_PREFIX)
            except Exception as exc:  # the reason is what every test of the mode reports
                self.error = f"lab with kproxy --mode {mode} did not come up: {type(exc).__name__}: {exc}"
        if self.error is not None:
            pytest.fail(self.error, pytrace=False)
        assert self.session is not None
        return self.session

    def close(self) -> None:
        if self.session is not None:
            self.session.close()
        self.session, self.error, self.mode = None, None, None


PARTS_KEY = pytest.StashKey[list[str]]()


@pytest.fixture(scope="module")
def conformance_labs(request: pytest.FixtureRequest) -> Iterator[Labs]:
    if os.geteuid() != 0:
        pytest.skip("the conformance lab needs root (network namespaces, netfilter)")
    labs = Labs()
    request.config.stash[PARTS_KEY] = labs.parts
    try:
        yield labs
    finally:
        labs.close()


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """The parts of passing scenarios that were not checked, each with its mode's declared reason: a pass never
    hides one (pytest shows a passing test's output only on request)."""
    parts = config.stash.get(PARTS_KEY, [])
    if parts:
        terminalreporter.section("conformance: parts not applicable (declared by each mode)")
        for line in parts:
            terminalreporter.write_line(line)
