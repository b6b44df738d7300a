"""The scenario registry: ``@scenario(id, title, ...)`` beside each scenario function records it as a ``Scenario``.

A scenario is declared where it is written, so its id, title, budget and parts never sit far from its code. The
registry only collects; the order the suite runs in (docs/BEHAVIOUR.md's table, which reports, ``--scenario`` and
the tests rely on) is ``kproxy.conformance.scenarios``'s: its theme modules in their order, each module's scenarios in
the order they are written. An id registered twice is an error at import.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kproxy.conformance.context import Context

Run = Callable[[Context], None]


@dataclass(frozen=True)
class Scenario:
    """One row of docs/BEHAVIOUR.md's table. ``needs``: lab features (``"ipv6"``) without which it is not applicable;
    ``parts``: the parts (an assertion, a half) a mode may declare not applicable (``not_applicable_parts``)."""

    id: str
    title: str
    run: Run
    needs: frozenset[str] = field(default_factory=frozenset)
    timeout_s: float = 60.0
    parts: frozenset[str] = field(default_factory=frozenset)


_REGISTERED: list[Scenario] = []


def scenario(
    id: str,  # noqa: A002 - the scenario's id, as the table and the reports call it
    title: str,
    /,
    *,
    needs: Iterable[str] = (),
    timeout_s: float = 60.0,
    parts: Iterable[str] = (),
) -> Callable[[Run], Run]:
    """Register the decorated function as the scenario ``id``; the function itself is returned unchanged."""

    def register(run: Run) -> Run:
        if any(s.id == id for s in _REGISTERED):
            raise ValueError(f"scenario id {id!r} is registered twice")
        _REGISTERED.append(Scenario(id, title, run, frozenset(needs), timeout_s, frozenset(parts)))
        return run

    return register


def registered(module: str | None = None) -> tuple[Scenario, ...]:
    """The scenarios registered so far, in registration order; with ``module``, those written in that module."""
    return tuple(s for s in _REGISTERED if module is None or s.run.__module__ == module)
