"""The conformance suite: docs/BEHAVIOUR.md's scenarios, run on real packets in the lab against every backend.

Modules: ``scenarios`` (the one ordered list of scenarios), ``context`` (what a scenario works with), ``runner``
(runs them on a lab, one mode at a time), ``report`` (table / JSON / JUnit), ``cli`` (``kproxy conformance``).
Used by ``kproxy conformance``, ``make conformance`` and tests/conformance.
"""
