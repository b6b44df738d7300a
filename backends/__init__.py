"""Backends: one package per ``--mode``. Each only translates node-local ``ServicePort`` values into kernel state.

Everything else is the core's: the Kubernetes semantics (``kproxy.cache``, ``kproxy.topology``), this node's context
(``kproxy.nodeaddr``), what is programmed and the refusal rounds (``kproxy.ledger``), when to sync (``kproxy.runner``),
health, metrics and conntrack (``kproxy.daemon``). A backend never reads a Kubernetes object, never imports another
backend (import-linter checks it) and is found by the core only through its ``kproxy.backends`` entry point.

Adding a mode ``foo`` is this list:

1. ``kproxy/proxier.py``: add ``Mode("foo", "one line")`` to ``MODES`` (the only place the core names a mode).
2. ``pyproject.toml``: ``foo = "kproxy.backends.foo.proxier:FooProxier"`` under the ``kproxy.backends``
   entry-point group; add ``kproxy.backends.foo`` to the "Backends never import each other" contract in
   ``.importlinter``.
3. ``backends/foo/__init__.py``: a docstring with the layout, the reasons for it (their figures go to
   docs/PERFORMANCE.md), every deviation from upstream, and the conformance scenarios that are not applicable (with
   why).
4. ``backends/foo/render.py`` (pure, table-tested without root): one ``ServicePort`` plus the family's context to a
   *fragment* (a frozen value compared with ``==``: rule text, map elements, map entries, a socket spec).
5. ``backends/foo/proxier.py``: ``class FooProxier(kproxy.ledger.LedgerProxier[Fragment, Context])`` with
   - ``mode = "foo"``, ``available()`` (the reason names what is missing), ``options`` (typed ``Option`` values);
   - ``context(node, state)``: the family's rendering context from the ``FamilyContext`` (hashable; a change forces
     a full batch);
   - ``render(sp, ctx)``: delegates to render.py;
   - ``apply(batch)``: make the kernel hold the batch (full: exactly ``batch.wanted``; partial: ``batch.deltas``) in as
     few kernel transactions as the kernel allows, and report services the kernel refused (``Applied.refused``) or
     a failure (``Applied(ok=False, error=...)``); never raise for one bad service;
   - ``adopt(family, ctx)`` and ``adopted_unchanged(...)``: read what the kernel holds once per full batch, so a
     restart with nothing changed writes nothing; ``needs_full(family)``: a cheap "is my state still there";
   - ``detail(name, family, fragment)`` / ``detail_global()``: the backend's own part of ``describe()`` (pure);
   - classmethods ``cleanup_leftovers(config, netns=)``, ``remnants(probe)``, ``kernel_view(probe, family)``,
     ``not_applicable(options)``, ``lab_options(node, options)`` (a cgroup or pin folder of the lab node's own);
   - ``register_metrics(registry, families)`` / ``observe_sync(...)`` for upstream's mode-specific metrics;
   - ``start()`` / ``close()`` if it runs threads or loaders; ``trace(...)`` (the packet explainer);
     ``conntrack_answerers(sp)`` if something other than the endpoints answers UDP flows;
     ``measure_floor()`` / ``measure_partial_floor()`` for ``kproxy bench sync``.
6. Tests: ``tests/unit/test_foo_render.py`` (every behaviour, no root), ``tests/integration/test_foo_backend.py`` (real
   kernel state in a namespace of the test's own), and ``kproxy conformance --mode foo`` (every scenario, in CI through
   ``tests/conformance``: installed modes are picked up by themselves).
7. ``deploy/overlays/foo/``: the DaemonSet with ``--mode foo`` and exactly the privileges the mode needs.
"""
