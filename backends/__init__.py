"""Backends: one package per ``--mode``. Each only translates node-local ``ServicePort`` values into kernel state.

Everything else is the core's: the Kubernetes semantics (``kproxy.cache``, ``kproxy.topology``), this node's context
(``kproxy.nodeaddr``), what is programmed and the refusal rounds (``kproxy.ledger``), when to sync (``kproxy.runner``),
health, metrics and conntrack (``kproxy.daemon``). A backend never reads a Kubernetes object, never imports another
backend (import-linter checks it) and is found by the core only through its ``kproxy.backends`` entry point.

Adding a mode ``foo`` is this list:

1. ``kproxy/proxier.py``: add ``Mode("foo", "one line")`` to ``MODES`` (the only place the core names a mode).
2. ``pyproject.toml``: ``foo = "kproxy.backends.foo.proxier:FooProxier"`` under the ``kproxy.backends``
   entry-point group and ``"kproxy.backends.foo"`` in ``packages`` (this folder is installed as ``kproxy.backends``
   through ``package-dir``); add ``backends.foo`` to the "Backends never import each other" contract in
   ``.importlinter``.
3. ``backends/foo/__init__.py``: a docstring with the layout, the reasons for it (their figures go to
   docs/PERFORMANCE.md), every deviation from upstream, and the conformance scenarios that are not applicable (with
   why).
4. ``backends/foo/render.py`` (pure, table-tested without root): one ``ServicePort`` plus the family's context to a
   *fragment* (a frozen value compared with ``==``: rule text, map elements, map entries, a socket spec).
5. ``backends/foo/proxier.py``: ``class FooProxier(kproxy.backend.LedgerProxier[F, C, A, V, S])`` naming its own types
   (``kproxy.batch``: the fragment, the rendering context, what ``adopt`` and ``verify_view`` read, its scratch across
   refusal rounds; ``None`` for what it has not), with
   - ``mode = "foo"``, ``available()`` (the reason names what is missing), ``options`` (typed ``Option`` values);
   - the driven protocol (``kproxy.batch.Backend``): ``context(node, state)``, ``render(sp, ctx)`` (delegates to
     render.py), ``apply(batch)`` (make the kernel hold the batch in as few kernel transactions as it allows, report
     services the kernel refused or a failure, never raise for one bad service); optionally ``adopt`` with
     ``adopted_unchanged`` (so a restart with nothing changed writes nothing), ``needs_full`` (the cheap "is my state
     still there", scheduled by the ledger every ``CHECK_INTERVAL_S``), ``limits`` (what fits), ``verify_view`` with
     ``verify_error``/``verify_service``/``verify_extra``, ``detail``/``detail_global``; it asks for a full sync with
     ``request_full(family)`` and never overrides ``sync``;
   - the three hook protocols of ``kproxy.proxier``, with defaults in the base: ``KernelHooks`` (classmethods:
     ``cleanup_leftovers(config, netns=)``, ``remnants(probe)``, ``kernel_view(probe, family)``), ``LabHooks``
     (classmethods: ``not_applicable(options)``, ``not_applicable_parts(options)``, ``lab_options(node, options)``,
     ``lab_prepare``) and ``BenchHooks`` (``measure_floor(scratch)``, into an empty namespace the bench made,
     ``measure_partial_floor()``);
   - optionally ``register_metrics``/``observe_sync``, ``start()``/``close()``, ``trace(...)``,
     ``conntrack_answerers(sp)``.
   ``tests/unit/test_fifth_mode.py`` is such a mode in forty lines: it passes the ledger's and the verify contract's
   tests without any other code.
6. Tests: ``tests/unit/test_foo_render.py`` (every behaviour, no root), ``tests/integration/test_foo_backend.py`` (real
   kernel state in a namespace of the test's own), and ``kproxy conformance --mode foo`` (every scenario, in CI through
   ``tests/conformance``: installed modes are picked up by themselves).
7. ``deploy/overlays/foo/``: the DaemonSet with ``--mode foo`` and exactly the privileges the mode needs.
"""
