"""What a conformance scenario's verdicts are made of: the suite's constants, its failures, unique addresses, probe
results and the small readers of what a probe brought back.

No lab and no API here: ``context`` and the scenarios build on these, and the unit tests use them directly.
"""

from __future__ import annotations

import collections
import ipaddress
import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
MANAGED_BY_LABEL = "endpointslice.kubernetes.io/managed-by"
MANAGED_BY = "conformance.kproxy.example"
TRIGGER_TIME_ANNOTATION = "endpoints.kubernetes.io/last-change-trigger-time"
METRICS_PORT = 10249
HEALTHZ_PORT = 10256
# (connect, read) seconds for every API call: a stuck API stand-in fails the call, not the whole pytest run
API_TIMEOUT = (5, 30)


class ScenarioFailure(AssertionError):
    """A scenario's expectation did not hold. ``str()`` is the whole story: what was sent, got and expected."""

    def __init__(self, what: str, *, sent: str = "", got: str = "", expected: str = "") -> None:
        parts = [what]
        if sent:
            parts.append(f"sent: {sent}")
        if got:
            parts.append(f"got: {got}")
        if expected:
            parts.append(f"expected: {expected}")
        super().__init__("; ".join(parts))
        self.what, self.sent, self.got, self.expected = what, sent, got, expected


class NotApplicable(Exception):
    """The scenario cannot be run meaningfully on this lab or backend; the message is the reason."""


class NotApplicableHere(NotApplicable):
    """The scenario has nothing to judge on this host, whatever the lab (a single installed mode has no other mode to
    switch to): reported not-applicable with the reason, and not a gap of a reused lab."""


class ScenarioTimeout(ScenarioFailure):
    """The scenario ran past its own time budget."""


# --------------------------------------------------------------------------------------------------------------
# Addresses: unique per run, from the lab's address plan.
# --------------------------------------------------------------------------------------------------------------


class Addresses:
    """Hands out ClusterIPs, externalIPs, load-balancer IPs and NodePorts that no other scenario of this run uses.

    The plan is the lab's: ClusterIPs from 198.19.0.0/18 and fd00:198:18:ff::/112, externalIPs from
    198.19.100.0/24, load-balancer IPs from 198.19.200.0/24, NodePorts from 30000-32767. Thread-safe, because
    scale-smoke builds services from several threads.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._v4 = int(ipaddress.IPv4Address("198.19.1.1"))  # leave 198.19.0.x to the lab's own services
        self._v4_end = int(ipaddress.IPv4Address("198.19.63.254"))
        self._v6 = int(ipaddress.IPv6Address("fd00:198:18:ff::100"))
        self._ext = 10
        self._lb = 10
        self._node_port = 30100

    def cluster_ip(self, family: str = "IPv4") -> str:
        with self._lock:
            if family == "IPv6":
                self._v6 += 1
                return str(ipaddress.IPv6Address(self._v6))
            if self._v4 >= self._v4_end:
                raise RuntimeError("ClusterIP range 198.19.0.0/18 exhausted for this run")
            self._v4 += 1
            if self._v4 & 0xFF in (0, 255):  # skip .0/.255, which look odd in reports
                self._v4 += 2 if self._v4 & 0xFF == 255 else 1
            return str(ipaddress.IPv4Address(self._v4))

    def external_ip(self) -> str:
        with self._lock:
            self._ext += 1
            return f"198.19.100.{self._ext}"

    def lb_ip(self) -> str:
        with self._lock:
            self._lb += 1
            return f"198.19.200.{self._lb}"

    def node_port(self) -> int:
        with self._lock:
            self._node_port += 1
            if self._node_port > 32767:
                raise RuntimeError("NodePort range exhausted for this run")
            return self._node_port


# --------------------------------------------------------------------------------------------------------------
# Probe results, summarised for failure messages.
# --------------------------------------------------------------------------------------------------------------


def answer_pod(result: Any) -> str:
    """The pod name an echo reply names (``"<pod> <seen-ip> <seen-port>"``), or ``""``."""
    pod = getattr(result, "pod", None)
    if pod:
        return str(pod)
    reply = getattr(result, "reply", "") or ""
    return reply.split()[0] if reply.split() else ""


def answer_seen_ip(result: Any) -> str:
    """The source address the echo server saw, or ``""``."""
    seen = getattr(result, "seen_ip", None)
    if seen:
        return str(seen)
    parts = (getattr(result, "reply", "") or "").split()
    return parts[1] if len(parts) > 1 else ""


def summarize(results: Sequence[Any]) -> str:
    """``"60 probes: 58 answered (pod-1-1 x20, pod-2-0 x38), 2 failed (timeout x2)"``."""
    ok = [r for r in results if getattr(r, "ok", False)]
    bad = [r for r in results if not getattr(r, "ok", False)]
    pods = collections.Counter(answer_pod(r) or "?" for r in ok)
    errors = collections.Counter(str(getattr(r, "error", "") or "error") for r in bad)
    text = f"{len(results)} probes: {len(ok)} answered"
    if pods:
        text += " (" + ", ".join(f"{p} x{n}" for p, n in sorted(pods.items())) + ")"
    if bad:
        text += f", {len(bad)} failed (" + ", ".join(f"{e} x{n}" for e, n in sorted(errors.items())) + ")"
        secs = [float(getattr(r, "seconds", 0.0) or 0.0) for r in bad]
        text += f" after {min(secs):.2f}-{max(secs):.2f} s"
    return text


def hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass
class Probe:
    """What a probe helper sent and what came back, kept for the failure message."""

    src: str
    kind: str
    host: str
    port: int
    results: list[Any] = field(default_factory=list)

    @property
    def sent(self) -> str:
        return f"{len(self.results)} {self.kind.upper()} probe(s) from {self.src} to {hostport(self.host, self.port)}"

    @property
    def ok(self) -> list[Any]:
        return [r for r in self.results if getattr(r, "ok", False)]

    @property
    def failed(self) -> list[Any]:
        return [r for r in self.results if not getattr(r, "ok", False)]

    @property
    def pods(self) -> set[str]:
        return {answer_pod(r) for r in self.ok}

    @property
    def seen_ips(self) -> set[str]:
        return {answer_seen_ip(r) for r in self.ok}

    @property
    def errors(self) -> set[str]:
        return {str(getattr(r, "error", "") or "error") for r in self.failed}

    def summary(self) -> str:
        return summarize(self.results)


def name_of(obj: Any) -> str:
    return str(getattr(obj, "name", obj))


def ns_of(where: Any) -> str:
    """A lab pod, node or namespace name -> the network namespace to run in."""
    if isinstance(where, str):
        return where
    ns = getattr(where, "ns", None)
    if not ns:
        raise TypeError(f"cannot run a probe from {where!r}: it has no network namespace")
    return str(ns)


def text_of(data: Any) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else str(data or "")


def is_refusal(err: str) -> bool:
    """The lab probe's words for a rejection: ``refused`` (ECONNREFUSED / a reset) or ``unreachable`` (an ICMP
    host/net unreachable or administratively prohibited). Anything else (a timeout, ``closed``) is not one."""
    return err in ("refused", "unreachable")


def http_got(r: Any) -> str:
    """An HTTP probe's outcome for a failure message: the status, or the error when nothing came back."""
    err = getattr(r, "error", "") or ""
    return f"{getattr(r, 'status', None)}" + (f" ({err})" if err else "") + f" {body_of(r)[:200]}"


def body_of(r: Any) -> str:
    """An HTTP probe's body as text."""
    body = getattr(r, "body", "")
    if isinstance(body, bytes):
        return body.decode(errors="replace")
    return str(body or "")


def header(r: Any, name: str) -> str | None:
    """A response header, case-insensitively, from whatever mapping the lab returns."""
    headers = getattr(r, "headers", None) or {}
    try:
        items = headers.items()
    except AttributeError:
        items = list(headers)
    for k, v in items:
        if str(k).lower() == name.lower():
            return str(v)
    return None


def api_error(exc: Any) -> str:
    body = getattr(exc, "body", "") or ""
    try:
        msg = json.loads(body).get("message", body)
    except (ValueError, AttributeError):
        msg = body
    return f"HTTP {getattr(exc, 'status', '?')} {getattr(exc, 'reason', '')}: {str(msg)[:300]}"
