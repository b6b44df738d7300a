"""What a conformance scenario works with: the lab, the API, probes, expectations and deadlines, in one ``Context``.

A scenario builds its objects (``kproxy.conformance.api``), sends real packets with the lab's probes, and states its
expectations with ``expect``/``fail``. A failure raises ``ScenarioFailure`` whose text says what was sent, what came
back and what was expected, so a person can act on it without re-running. Every object a scenario makes lives in its
own namespace (``conf-<id>``), which the runner empties afterwards (also on failure), so a failing scenario leaves
the lab usable for the next one. Waiting is always bounded: ``eventually`` polls with short sleeps up to a deadline,
and every wait is also capped by the scenario's own timeout.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, TypeVar

from kproxy.conformance.api import ApiObjects
from kproxy.conformance.values import (
    METRICS_PORT,
    Addresses,
    Probe,
    ScenarioFailure,
    ScenarioTimeout,
    body_of,
    hostport,
    http_got,
    is_refusal,
    name_of,
    ns_of,
    text_of,
)

# Addresses and ScenarioFailure are imported from here by the demo, which predates kproxy.conformance.values
__all__ = ["Addresses", "Context", "KernelProbe", "ScenarioFailure"]

T = TypeVar("T")


class Context(ApiObjects):
    """Everything one scenario run needs. Made by the runner; see the module docstring."""

    def __init__(
        self,
        lab: Any,
        mode: str,
        scenario_id: str,
        addresses: Addresses,
        timeout_s: float,
        kproxy_argv: Sequence[str] = (),
        *,
        options: Mapping[str, Any] | None = None,
        declared_parts: Mapping[str, str] | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        api: tuple[Any, Any] | None = None,
    ) -> None:
        """``options``: the backend options kproxy runs with on the nodes (what ``kernel_probe`` hands the mode's
        hooks). ``declared_parts``: the parts of this scenario the mode declares not applicable (part -> reason, its
        ``not_applicable_parts``). ``clock``/``sleep``/``api`` are seams for the judge's own tests
        (tests/unit/test_conformance_judge.py), which drive a scenario on a scripted lab with a fake clock and
        in-memory CoreV1Api/DiscoveryV1Api stand-ins; the runner leaves them at the real clock and the lab's API."""
        self.lab = lab
        self.mode = mode
        self.scenario_id = scenario_id
        self.addresses = addresses
        self.namespace = f"conf-{scenario_id}"
        self.now = clock
        self._sleep = sleep
        self.deadline = self.now() + timeout_s
        self.timeout_s = timeout_s
        self.kproxy_argv = tuple(kproxy_argv)
        self.options: Mapping[str, Any] = MappingProxyType(dict(options or {}))
        if api is None:
            from kubernetes import client as k8s  # imported here so report/cli users need no client

            self.api_client = lab.api_client()
            # Any: the scenarios hand plain dicts to the client, which accepts them (pydantic validates them there)
            api = (k8s.CoreV1Api(self.api_client), k8s.DiscoveryV1Api(self.api_client))
        else:
            self.api_client = None
        self.core: Any = api[0]
        self.discovery: Any = api[1]
        self.notes: list[str] = []
        self.declared_parts: Mapping[str, str] = MappingProxyType(dict(declared_parts or {}))
        self.parts: list[tuple[str, str]] = []  # (part, reason): halves of the scenario that could not be exercised
        #: parts found not applicable at run time that the mode does not declare: the runner fails the scenario
        self.undeclared: list[tuple[str, str]] = []
        self._service_ports: dict[str, list[dict[str, Any]]] = {}
        self._slice_seq = 0

    # -- lab shortcuts -----------------------------------------------------------------------------------------
    @property
    def nodes(self) -> list[Any]:
        return list(self.lab.nodes)

    @property
    def pods(self) -> list[Any]:
        return list(self.lab.pods)

    def pods_on(self, node: Any) -> list[Any]:
        name = name_of(node)
        return [p for p in self.lab.pods if p.node == name]

    def node_of(self, pod: Any) -> Any:
        for n in self.lab.nodes:
            if n.name == pod.node:
                return n
        raise KeyError(pod.node)

    @property
    def external_ns(self) -> str:
        return str(self.lab.external_ns)

    @property
    def external_ip4(self) -> str:
        return str(getattr(self.lab, "external_ip4", None) or "198.18.0.2")

    @property
    def external_ip6(self) -> str:
        return str(getattr(self.lab, "external_ip6", None) or "fd00:198:18::2")

    @property
    def has_ipv6(self) -> bool:
        ipv6 = getattr(self.lab, "ipv6", None)
        if ipv6 is not None:
            return bool(ipv6)
        return all(getattr(p, "ip6", None) for p in self.lab.pods)

    def note(self, text: str) -> None:
        """A fact worth reporting even when the scenario passes (a figure, a caveat)."""
        self.notes.append(text)

    def skips(self, part: str) -> bool:
        """Whether the mode declares ``part`` of this scenario not applicable (``not_applicable_parts``), decided up
        front and never by what the lab shows: then it is reported as its own not-applicable row
        ``<scenario>/<part>`` with the mode's reason, and the scenario leaves that part out."""
        reason = self.declared_parts.get(part)
        if reason is None:
            return False
        if part not in {p for p, _ in self.parts}:
            self.parts.append((part, f"declared by mode {self.mode}: {reason}"))
        return True

    def part_not_applicable(self, part: str, reason: str) -> None:
        """A part of the scenario found not applicable at run time (``reason``: what was seen). A part the mode
        declares is its not-applicable row; one it does not declare is a failure of the scenario (the runner's):
        what a mode cannot do is said up front, never inferred from an observation that may be wrong."""
        if self.skips(part):
            return
        self.undeclared.append((part, reason))

    def part_not_applicable_here(self, part: str, reason: str) -> None:
        """A part nothing on this host can exercise, whatever the mode (say, "starting another mode" with one mode
        installed): its own not-applicable row ``<scenario>/<part>``, never folded into a pass. A run that requires
        every mode (CI) never meets one."""
        self.parts.append((part, f"not on this host: {reason}"))

    # -- deadlines ---------------------------------------------------------------------------------------------
    def remaining(self) -> float:
        return self.deadline - self.now()

    def check_deadline(self, doing: str = "") -> None:
        if self.remaining() <= 0:
            raise ScenarioTimeout(
                f"scenario exceeded its {self.timeout_s:.0f} s budget" + (f" while {doing}" if doing else "")
            )

    def sleep(self, seconds: float) -> None:
        self.check_deadline("sleeping")
        self._sleep(max(0.0, min(seconds, self.remaining())))

    def eventually(self, check: Callable[[], T], timeout: float = 10.0, interval: float = 0.2, what: str = "") -> T:
        """Call ``check`` until it returns without raising ``ScenarioFailure``; return its value. After
        ``timeout`` seconds (capped by the scenario's budget) the last failure is raised, saying how long we
        waited. Other exceptions propagate at once: they are bugs, not "not yet"."""
        start = self.now()
        end = min(start + timeout, self.deadline)
        attempts = 0
        while True:
            attempts += 1
            try:
                return check()
            except ScenarioFailure as exc:
                if self.now() >= end:
                    waited = self.now() - start
                    raise ScenarioFailure(
                        f"{what + ': ' if what else ''}{exc.what} (still so after {waited:.1f} s, {attempts} tries)",
                        sent=exc.sent,
                        got=exc.got,
                        expected=exc.expected,
                    ) from None
            self._sleep(max(0.0, min(interval, end - self.now())))

    # -- expectations ------------------------------------------------------------------------------------------
    def fail(self, what: str, *, sent: str = "", got: str = "", expected: str = "") -> None:
        raise ScenarioFailure(what, sent=sent, got=got, expected=expected)

    def expect(self, cond: object, what: str, *, sent: str = "", got: str = "", expected: str = "") -> None:
        if not cond:
            raise ScenarioFailure(what, sent=sent, got=got, expected=expected)

    # -- probes ------------------------------------------------------------------------------------------------
    def probe(
        self,
        src: Any,
        host: str,
        port: int,
        kind: str = "tcp",
        *,
        count: int = 1,
        timeout: float = 1.0,
        src_port: int | None = None,
        interval: float | None = None,
        payload: str | None = None,
    ) -> Probe:
        """Send ``count`` probes (new connections / datagrams) from ``src`` (a pod, node or namespace name).
        ``payload="info"`` makes the echo server add ``port=<its port> proto=<tcp|udp>`` to its answer."""
        self.check_deadline(f"probing {hostport(host, port)}")
        kwargs: dict[str, Any] = {"count": count, "timeout": timeout}
        if src_port is not None:
            kwargs["src_port"] = src_port
        if interval is not None:
            kwargs["interval"] = interval
        if payload is not None:
            kwargs["payload"] = payload
        results = list(self.lab.probe(ns_of(src), kind, host, port, **kwargs))
        label = name_of(src) if not isinstance(src, str) else src
        return Probe(label, kind, host, port, results)

    def reach(
        self,
        src: Any,
        host: str,
        port: int,
        kind: str = "tcp",
        *,
        count: int = 1,
        timeout: float = 1.0,
        only: Iterable[Any] | None = None,
        all_of: Iterable[Any] | None = None,
    ) -> Probe:
        """Probe and demand that every probe is answered; ``only``: by these pods alone; ``all_of``: each of
        these pods answers at least once. Raises ScenarioFailure saying what came back otherwise."""
        pr = self.probe(src, host, port, kind, count=count, timeout=timeout)
        only_names = {name_of(p) for p in only} if only is not None else None
        all_names = {name_of(p) for p in all_of} if all_of is not None else None
        expected = f"all {count} answered"
        if only_names is not None:
            expected += " by " + ", ".join(sorted(only_names)) + " only"
        if all_names is not None:
            expected += ", each of " + ", ".join(sorted(all_names)) + " at least once"
        if pr.failed:
            self.fail(
                f"{len(pr.failed)} of {count} probes were not answered",
                sent=pr.sent,
                got=pr.summary(),
                expected=expected,
            )
        if only_names is not None and not pr.pods <= only_names:
            self.fail(
                "answered by a pod that is not an endpoint it should reach: " + ", ".join(sorted(pr.pods - only_names)),
                sent=pr.sent,
                got=pr.summary(),
                expected=expected,
            )
        if all_names is not None and not all_names <= pr.pods:
            self.fail(
                "some endpoints never answered: " + ", ".join(sorted(all_names - pr.pods)),
                sent=pr.sent,
                got=pr.summary(),
                expected=expected,
            )
        return pr

    def blocked(
        self,
        src: Any,
        host: str,
        port: int,
        kind: str = "tcp",
        *,
        how: str = "any",
        count: int = 1,
        timeout: float = 1.0,
        within: float | None = None,
    ) -> Probe:
        """Probe and demand that nothing answers. ``how``: ``"refused"`` (RST / ICMP unreachable: the error is
        refused or unreachable), ``"port-unreachable"`` (for UDP: ICMP port unreachable, which the probe's connected
        socket sees as ECONNREFUSED, "refused"; a host-unreachable or a timeout is not it), ``"timeout"`` (silently
        dropped) or ``"any"``. ``within``: every probe must have failed faster than this many seconds."""
        expected = {
            "refused": "every probe refused (TCP RST / ICMP unreachable)",
            "port-unreachable": "every probe answered by ICMP port unreachable (ECONNREFUSED)",
            "timeout": "every probe dropped (a timeout, not a refusal)",
            "any": "no probe answered",
        }[how]
        pr = self.probe(src, host, port, kind, count=count, timeout=timeout)
        if within is not None:
            expected += f" in under {within:.1f} s"
        if pr.ok:
            self.fail("a probe that must fail was answered", sent=pr.sent, got=pr.summary(), expected=expected)
        for r in pr.failed:
            err = str(getattr(r, "error", "") or "")
            if how == "refused" and not is_refusal(err):
                self.fail(
                    f"the probe failed with {err!r}, not a refusal", sent=pr.sent, got=pr.summary(), expected=expected
                )
            if how == "port-unreachable" and err != "refused":
                self.fail(
                    f"the probe failed with {err!r}, not ICMP port unreachable",
                    sent=pr.sent,
                    got=pr.summary(),
                    expected=expected,
                )
            if how == "timeout" and err != "timeout":
                self.fail(
                    f"the probe failed with {err!r}, not a timeout", sent=pr.sent, got=pr.summary(), expected=expected
                )
            secs = float(getattr(r, "seconds", 0.0) or 0.0)
            if within is not None and secs >= within:
                self.fail(f"the refusal took {secs:.2f} s", sent=pr.sent, got=pr.summary(), expected=expected)
        return pr

    def http(self, src: Any, url: str) -> Any:
        """GET ``url`` from ``src``'s namespace; returns the lab's result (``status``, ``headers``, ``body``)."""
        self.check_deadline(f"fetching {url}")
        return self.lab.probe_http(ns_of(src), url)

    def metrics_text(self, node: Any) -> str:
        """``/metrics`` of the kproxy on ``node``, read from inside the node (it listens on 127.0.0.1)."""
        url = f"http://127.0.0.1:{METRICS_PORT}/metrics"
        r = self.http(node, url)
        if getattr(r, "status", None) != 200:
            self.fail(
                f"/metrics on {name_of(node)} did not answer 200",
                sent=f"GET {url} in {ns_of(node)}",
                got=http_got(r),
                expected="200 and the Prometheus exposition",
            )
        return body_of(r)

    def rules(self, node: Any, service: str | None = None) -> dict[str, Any]:
        """``/rules`` of the kproxy on ``node`` (how each service is programmed), as JSON."""
        url = f"http://127.0.0.1:{METRICS_PORT}/rules"
        if service:
            url += "?service=" + service
        r = self.http(node, url)
        sent = f"GET {url} in {ns_of(node)}"
        if getattr(r, "status", None) != 200:
            self.fail(
                f"/rules on {name_of(node)} did not answer 200", sent=sent, got=http_got(r), expected="200 and JSON"
            )
        try:
            return dict(json.loads(body_of(r)))
        except ValueError:
            self.fail(
                f"/rules on {name_of(node)} is not JSON", sent=sent, got=body_of(r)[:200], expected="a JSON object"
            )
            raise  # unreachable; fail raises

    def exec(self, where: Any, argv: Sequence[str], timeout: float = 30.0) -> Any:
        self.check_deadline(f"running {' '.join(argv[:3])}")
        return self.lab.exec(ns_of(where), list(argv), timeout=min(timeout, max(1.0, self.remaining())))

    def kernel_probe(self, node: Any, mode: str | None = None) -> KernelProbe:
        """A ``kproxy.proxier.KernelProbe`` into ``node``'s namespace, for ``mode``'s (default: the scenario's)
        ``remnants``/``kernel_view`` hooks: what the kernel holds, read from the kernel, never from kproxy's own
        account (/rules). Its options are those the node's kproxy runs with in that mode (the lab's
        ``node_options``), else the session's."""
        node_options = getattr(self.lab, "node_options", None)
        options = node_options(node, mode or self.mode) if node_options is not None else self.options
        return KernelProbe(self, node, options)


class KernelProbe:
    """Runs read-only commands in one lab node's network namespace (through the lab's exec, bounded by the
    scenario's deadline) with the node's backend options: the conformance side of ``kproxy.proxier.KernelProbe``."""

    def __init__(self, ctx: Context, node: Any, options: Mapping[str, Any] | None = None) -> None:
        self.ctx = ctx
        self.node = node
        self.options: Mapping[str, Any] = MappingProxyType(dict(ctx.options if options is None else options))

    def run(self, argv: Sequence[str], *, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        res = self.ctx.exec(self.node, argv, timeout=timeout)
        return subprocess.CompletedProcess(
            list(argv),
            int(getattr(res, "returncode", 0) or 0),
            text_of(getattr(res, "stdout", "")),
            text_of(getattr(res, "stderr", "")),
        )
