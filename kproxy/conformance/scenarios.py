"""The conformance scenarios: the one ordered list ``SCENARIOS`` of what every backend must do, on real packets.

docs/BEHAVIOUR.md's scenario table is the spec, id for id and in the same order (tests/unit/test_docs.py keeps them
equal); ``kproxy.conformance.runner`` runs them in this order on one lab per backend. Each scenario is a function of
a ``Context`` in a theme module, registered by the ``@scenario`` decorator beside it; this module fixes the order:
the themes in ``THEMES`` order, each theme's scenarios in the order they are written. Adding a scenario is one
decorated function in its theme; adding a backend needs nothing here (its impossible scenarios are its own
``not_applicable(options)``, and what the kernel holds is read through its own hooks). Nothing here names a mode.
"""

from __future__ import annotations

from types import ModuleType

from kproxy.conformance import (
    sc_changes,
    sc_counters,
    sc_dual_stack,
    sc_paths,
    sc_policy,
    sc_restarts,
    sc_scale,
    sc_servers,
    sc_udp,
)
from kproxy.conformance.registry import Scenario, registered

__all__ = ["BY_ID", "SCENARIOS", "SCENARIO_IDS", "THEMES", "Scenario"]

#: the theme modules, in docs/BEHAVIOUR.md's order
THEMES: tuple[ModuleType, ...] = (
    sc_paths,  # ClusterIP, NodePort, externalIP, load balancer, rejection, affinity, source IP, hairpin
    sc_policy,  # traffic policies and terminating endpoints
    sc_changes,  # objects that change: lifecycle, address collision, churn, port update, ignored services
    sc_udp,  # UDP and conntrack
    sc_restarts,  # kproxy restarted, cleaned up, replaced by another mode
    sc_servers,  # the health and metrics servers
    sc_counters,  # the traffic counters (--service-counters), against the packets
    sc_dual_stack,  # IPv6 and dual-stack services
    sc_scale,  # 1,000 services and the syncs' bounds
)

SCENARIOS: tuple[Scenario, ...] = tuple(s for theme in THEMES for s in registered(theme.__name__))
SCENARIO_IDS: tuple[str, ...] = tuple(s.id for s in SCENARIOS)
BY_ID: dict[str, Scenario] = {s.id: s for s in SCENARIOS}
assert len(SCENARIOS) == len(registered()), "a scenario is registered outside THEMES"
