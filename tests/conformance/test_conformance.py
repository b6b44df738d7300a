"""BEHAVIOUR.md's conformance scenarios as pytest tests: one per (mode, scenario), on a real lab.

``make test`` runs these (marker ``lab``). A scenario the backend declares impossible is skipped with the reason;
one the lab cannot support fails (nothing was checked, as ``kproxy conformance`` says too); a FAIL fails with the
scenario's own account of what was sent, what came back and what was expected; a part of a passing scenario that
the mode declares not applicable (``not_applicable_parts``) is printed with its reason and listed in the run's
summary (tests/conformance/conftest.py), and one it does not declare fails the scenario. A mode that is not
available is skipped, or fails where ``KPROXY_REQUIRE_MODES`` requires it (tests/modes.py).
``KPROXY_CONFORMANCE_MODES`` naming a mode that is not installed, or no backend installed at all, fails
(``test_the_requested_modes_exist``) rather than leaving an empty, green run. ``kproxy conformance --mode MODE``
runs the same scenarios outside pytest.
"""

from __future__ import annotations

import os

import pytest
from modes import require_mode, required_modes

from kproxy.conformance.report import FAIL, NOT_APPLICABLE
from kproxy.conformance.runner import ConformanceError, requested_modes
from kproxy.conformance.scenarios import BY_ID, SCENARIOS
from kproxy.proxier import MODE_NAMES, installed_backends

pytestmark = pytest.mark.lab


def _modes() -> tuple[list[str], str]:
    """The installed modes and the required ones (``KPROXY_REQUIRE_MODES``; one whose backend does not even import
    is not installed, and must still get tests that fail), restricted by ``KPROXY_CONFORMANCE_MODES``."""
    known = set(installed_backends()) | required_modes()
    try:
        modes = requested_modes(os.environ.get("KPROXY_CONFORMANCE_MODES", ""), [m for m in MODE_NAMES if m in known])
        return modes, ""
    except ConformanceError as exc:
        return [], str(exc)


MODES, MODES_ERROR = _modes()
CASES = [(mode, s.id) for mode in MODES for s in SCENARIOS]


def test_the_requested_modes_exist() -> None:
    assert not MODES_ERROR, (
        f"KPROXY_CONFORMANCE_MODES={os.environ.get('KPROXY_CONFORMANCE_MODES', '')!r}: {MODES_ERROR}"
    )
    assert CASES, "no conformance case to run"


@pytest.mark.parametrize(("mode", "scenario_id"), CASES, ids=[f"{m}-{s}" for m, s in CASES])
def test_scenario(conformance_labs, mode: str, scenario_id: str) -> None:  # type: ignore[no-untyped-def]
    require_mode(mode)  # skipped with the reason, or a failure where the mode is required (tests/modes.py)
    session = conformance_labs.get(mode)
    result = session.run_scenario(BY_ID[scenario_id])
    if result.status == NOT_APPLICABLE:
        if session.is_lab_gap(result):  # the lab, not the mode: nothing was checked, as `kproxy conformance` says
            pytest.fail(f"{mode} {scenario_id}: not checked, this lab cannot run it: {result.detail}", pytrace=False)
        pytest.skip(f"not applicable to {mode}: {result.detail}")
    if result.status == FAIL:
        pytest.fail(f"{mode} {scenario_id}: {result.detail}", pytrace=False)
    print(f"{mode} {scenario_id}: pass in {result.seconds:.1f} s; {result.detail}")
    for part in result.parts:
        print(f"{mode} {part.scenario}: {part.status}: {part.detail}")
        conformance_labs.parts.append(f"{mode} {part.scenario}: {part.detail}")
