"""A short soak on every mode: one whole cycle of every fault kind, nothing lost, no drift (a mode that is
unavailable here is skipped with its reason, or fails where it is required: tests/modes.py).

``kproxy soak`` (kproxy.soak) on a lab of its own (prefix ``kps-``, taken down afterwards, also on failure): changes
at 5/s with dropped watches, 410 Gone, 5xx, an API stand-in restart, a SIGKILL of a node's kproxy, someone else's
cleanup of the mode's state and a failed apply (each must run and be injected), with a held connection and new
connections through a ClusterIP, and at every checkpoint real packets to the changed services and the kernel view,
both judged by the soak's reference model. ``make soak`` runs the ten-minute version.
"""

from __future__ import annotations

import logging
import os

import pytest
from modes import all_modes, require_mode

pytestmark = [pytest.mark.lab, pytest.mark.slow]

MODES = all_modes()  # every mode: one that is unavailable here is skipped with its reason, or fails where required


@pytest.mark.timeout(600)  # one whole cycle takes about two minutes; a slow turn is the soak's own to report
@pytest.mark.parametrize("mode", MODES)
def test_short_soak(mode: str, caplog: pytest.LogCaptureFixture) -> None:
    if os.geteuid() != 0:
        pytest.skip("the soak's lab needs root")
    require_mode(mode)
    from kproxy.soak.report import table
    from kproxy.soak.run import FAULT_KINDS, Soak, SoakOptions

    caplog.set_level(logging.ERROR, logger="kproxy.cache")  # the churn's bad objects are rejected on purpose
    # one whole cycle of every fault kind (about a minute and a half of churn), however long each turn takes
    report = Soak(SoakOptions(mode=mode, cycles=1, prefix="kps-", converge_timeout=30.0)).run()
    summary = table(report)
    assert report["lost_changes"] == 0, summary
    assert report["drift_final"] == 0, summary
    assert report["drift_checkpoints"] == 0, summary
    assert report["checkpoints"][-1]["converged_s"] is not None, summary
    assert report["changes"]["applied"] > 100, summary  # the churn really ran (5/s for a minute)
    # every fault kind ran once and was injected (a kind the build cannot take fails the run, never shrinks it)
    assert report["cycles"] == 1 and report["turns"] == {k: 1 for k in FAULT_KINDS}, summary
    assert {k: row["injected"] for k, row in report["faults"].items()} == {k: 1 for k in FAULT_KINDS}, summary
    assert not report["faults_not_injected"], summary
    assert not any(row["unconverged"] for row in report["faults"].values()), summary
    # real packets at every checkpoint, judged by the reference model, and the kernel view against it
    assert report["packets"]["failed"] == 0 and report["packets"]["sent"] > 0, summary
    assert report["kernel_view"]["missing"] == report["kernel_view"]["extra"] == 0, summary
    assert report["new_connections"]["failed_outside"] == 0, summary
    if report["held_connection"]["required"]:
        assert report["held_connection"]["alive"], summary
    assert report["ok"], summary
