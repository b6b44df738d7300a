"""The conformance suite: docs/BEHAVIOUR.md's scenarios, run on real packets in the lab against every backend.

Modules, top to bottom (an import-linter contract keeps the layers): ``cli`` (``kproxy conformance``), ``runner``
(runs the scenarios on a lab, one mode at a time), ``scenarios`` (their one order), the ``sc_*`` theme modules (each
scenario a function with its ``@scenario`` declaration), ``steps`` (what several scenarios do), ``checks`` (the pure
verdicts and parsers), ``registry`` (``Scenario`` and ``@scenario``), ``context`` (what a scenario works with),
``api`` (its Kubernetes objects), ``values`` (failures, addresses, probe results) and ``report`` (table, JSON, JUnit).
"""
