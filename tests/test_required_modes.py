"""Every mode of kproxy's table is available here, or this says why: skipped on a developer's machine, a failure
where ``KPROXY_REQUIRE_MODES`` requires the mode (CI requires all of them, ``.ci/run``), whatever else the run
selects. Not marked ``root``: a mode that cannot even be imported fails the run however it is started."""

from __future__ import annotations

import pytest
from modes import all_modes, require_mode


@pytest.mark.parametrize("mode", all_modes())
def test_mode_available(mode: str) -> None:
    require_mode(mode)
