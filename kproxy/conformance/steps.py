"""The steps several conformance scenarios share: pick the lab's nodes, wait for a service to be programmed, put
a barrier behind a change, keep a client connecting, stop and start kproxy, and read the node's kernel and metrics.

Conventions (the lab's default shape: 2 nodes x 3 pods): ``node-1``'s first pod is the usual client; service port
80 maps to the echo servers' 8080; "the service is programmed" is always waited for (kproxy syncs at most once a
second), and a negative expectation (must time out, must not be reachable) is only checked after a *barrier*: a
fresh service created afterwards answers on the nodes concerned, which proves those nodes have synced past the
objects under test. What the kernel holds is read through the mode's own hooks (``remnants``, ``kernel_view``),
handed a probe into the node; nothing here names a mode.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from prometheus_client.samples import Sample

from kproxy.conformance.checks import samples
from kproxy.conformance.context import Context
from kproxy.conformance.values import (
    HEALTHZ_PORT,
    METRICS_PORT,
    NotApplicable,
    Probe,
    ScenarioFailure,
    body_of,
    hostport,
    name_of,
)

SYNC_WAIT = 15.0  # how long a change may take to show up before a scenario gives up waiting
#: how long a (re)started kproxy may take to answer /healthz 200, which it does once every family has synced once: its
#: start (the bpf mode compiles its programs at start, which is slow on a busy machine), lists and first sync
START_WAIT = 45.0


T = TypeVar("T")


def two_nodes(ctx: Context) -> tuple[Any, Any]:
    nodes = ctx.nodes
    if len(nodes) < 2:
        raise NotApplicable(f"needs a lab of at least 2 nodes, this one has {len(nodes)}")
    if any(len(ctx.pods_on(n)) < 3 for n in nodes[:2]):
        raise NotApplicable("needs at least 3 pods per node")
    return nodes[0], nodes[1]


def cip(svc: dict[str, Any], family: str = "IPv4") -> str:
    for ip in svc["spec"].get("clusterIPs") or [svc["spec"]["clusterIP"]]:
        if (":" in ip) == (family == "IPv6"):
            return str(ip)
    raise KeyError(f"service {svc['metadata']['name']} has no {family} ClusterIP")


def wait_reach(
    ctx: Context, src: Any, host: str, port: int, kind: str = "tcp", only: Sequence[Any] | None = None, what: str = ""
) -> Probe:
    return ctx.eventually(
        lambda: ctx.reach(src, host, port, kind, count=1, timeout=0.5, only=only),
        timeout=SYNC_WAIT,
        interval=0.2,
        what=what or f"waiting for {hostport(host, port)}/{kind} to be programmed",
    )


_barrier_seq = [0]


def barrier(ctx: Context, *nodes: Any) -> list[str]:
    """Create a fresh service and wait until a pod on each of ``nodes`` reaches it: from then on those nodes'
    kproxies have synced every object written before (they sync whole states, in API order). Returns the names
    of the barrier services, in ``nodes`` order."""
    _barrier_seq[0] += 1
    name = f"barrier-{_barrier_seq[0]}"
    made = []
    for node in nodes:
        pods = ctx.pods_on(node)
        svc = ctx.service(f"{name}-{node.name}")
        ctx.apply(svc, ctx.slice_for(svc, [pods[2]]))
        wait_reach(ctx, pods[0], cip(svc), 80, only=[pods[2]], what=f"barrier: {node.name} syncing")
        made.append(svc["metadata"]["name"])
    return made


def http_url(host: str, port: int, path: str = "/") -> str:
    return f"http://{hostport(host, port)}{path}"


@dataclass
class FailedResult:
    """A probe that raised instead of returning, recorded as a failed result for the judge."""

    error: str
    ok: bool = False
    reply: str = ""
    seconds: float = 0.0


class Prober:
    """New TCP connections to each of ``targets`` (what -> (source, host, port)), one round every ``interval`` s, in a
    thread of its own while a scenario changes things; each result is kept with the phases (``phase[0]``, set by the
    scenario) it started and ended in: a probe still in flight when the phase changed (a kill landed while it ran)
    belongs to both. A probe that raises is recorded as failed, for the scenario to judge."""

    def __init__(
        self, ctx: Context, targets: Mapping[str, tuple[Any, str, int]], first_phase: str, interval: float
    ) -> None:
        self.ctx, self.targets, self.interval = ctx, dict(targets), interval
        self.phase = [first_phase]
        self.records: list[tuple[str, str, str, Probe]] = []  # (phase at the start, at the end, target, probe)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @classmethod
    def to(cls, ctx: Context, client: Any, ip: str, first_phase: str, interval: float) -> Prober:
        """A prober of ``ip:80`` from ``client`` alone."""
        return cls(ctx, {"": (client, ip, 80)}, first_phase, interval)

    @property
    def probes(self) -> list[tuple[str, Probe]]:
        """(phase, probe) of every connection, whatever its target; ``A -> B`` for one that spanned a change."""
        return [(start if start == end else f"{start} -> {end}", pr) for start, end, _, pr in self.records]

    def _run(self) -> None:
        while not self._stop.is_set() and self.ctx.remaining() > 5:
            for what, (src, host, port) in self.targets.items():
                start = self.phase[0]
                try:
                    probe = self.ctx.probe(src, host, port, count=1, timeout=1.0)
                except Exception as exc:  # recorded, judged by the scenario
                    probe = Probe(name_of(src), "tcp", host, port, [FailedResult(str(exc))])
                self.records.append((start, self.phase[0], what, probe))
            time.sleep(self.interval)

    def __enter__(self) -> Prober:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def stdout_of(res: Any) -> str:
    out = getattr(res, "stdout", res)
    return out.decode(errors="replace") if isinstance(out, bytes) else str(out or "")


def rc_of(res: Any) -> int:
    return int(getattr(res, "returncode", 0) or 0)


def kproxy_bin() -> str:
    exe = Path(sys.executable).with_name("kproxy")
    return str(exe) if exe.exists() else "kproxy"


def synced_since_start(ctx: Context, node: Any) -> int:
    """The restarted kproxy's sync count from its /rules (a new process starts at 0): >= 1 once it has synced."""
    doc = ctx.rules(node)
    syncs = int((doc.get("sync") or {}).get("syncs") or 0)
    ctx.expect(
        syncs >= 1,
        f"the restarted kproxy on {node.name} has not synced yet",
        sent=f"GET http://127.0.0.1:{METRICS_PORT}/rules in {node.ns}",
        got=f"sync: {json.dumps(doc.get('sync'))[:200]}, ready: {doc.get('ready')}",
        expected="sync.syncs >= 1",
    )
    return syncs


def start_kproxy(ctx: Context, node: Any, mode: str) -> None:
    if ctx.kproxy_argv:
        ctx.lab.start_kproxy(node, mode, list(ctx.kproxy_argv))
    else:
        ctx.lab.start_kproxy(node, mode)


def healthz_ok(ctx: Context, node: Any) -> None:
    url = http_url(node.ip4, HEALTHZ_PORT, "/healthz")
    r = ctx.http(ctx.external_ns, url)
    ctx.expect(
        getattr(r, "status", None) == 200,
        f"/healthz on {node.name} not 200",
        sent=f"GET {url} from the external client",
        got=f"{getattr(r, 'status', None)} {getattr(r, 'error', '')} {body_of(r)[:200]}",
        expected="200",
    )


def remnants(ctx: Context, mode: str, node: Any) -> list[str]:
    """What ``mode`` left in ``node``'s kernel, by the mode's own ``remnants`` hook reading the kernel through a
    probe into the node. A hook that could not look fails the scenario: "nothing left" must mean "looked"."""
    from kproxy.proxier import backend_class

    hook = getattr(backend_class(mode), "remnants", None)
    if hook is None:
        raise ScenarioFailure(f"mode {mode} has no remnants hook, so what it left in the kernel cannot be checked")
    try:
        return list(hook(ctx.kernel_probe(node, mode)))
    except ScenarioFailure:
        raise
    except Exception as exc:  # BackendError: a tool failed; NotImplementedError: the hook is missing
        raise ScenarioFailure(
            f"could not read what mode {mode} left in {node.name}'s kernel",
            sent=f"{mode}.remnants() through a probe into {node.ns}",
            got=f"{type(exc).__name__}: {exc}",
            expected="a list of leftovers (empty when clean)",
        ) from None


def started_and_synced(ctx: Context, node: Any, mode: str | None, what: str) -> None:
    """Start kproxy in ``mode`` on ``node`` (None: it was started already) and wait for its first sync. Reaching a
    ClusterIP from the node's pods proves nothing here: with no rules on this node a pod's SYN leaves by the
    default route and the lab's router hands it to node-1, whose rules answer it."""
    if mode is not None:
        start_kproxy(ctx, node, mode)
    ctx.eventually(lambda: healthz_ok(ctx, node), timeout=START_WAIT, what=f"kproxy {what}: healthy")
    ctx.eventually(lambda: synced_since_start(ctx, node), timeout=SYNC_WAIT, what=f"kproxy {what}: first sync")


def kernel_view(ctx: Context, node: Any, family: str) -> dict[str, list[str]] | None:
    """The mode's ``kernel_view`` hook on ``node``: service port -> the kernel's lines for it, read from the kernel
    now (never kproxy's own account). None when the mode has no such view; a hook that fails fails the scenario."""
    from kproxy.model import IPFamily
    from kproxy.proxier import backend_class

    hook = getattr(backend_class(ctx.mode), "kernel_view", None)
    if hook is None:
        return None
    try:
        view = hook(ctx.kernel_probe(node), IPFamily(family))
    except Exception as exc:  # BackendError: a tool failed
        raise ScenarioFailure(
            f"could not read the {family} kernel view of mode {ctx.mode} on {node.name}",
            sent=f"{ctx.mode}.kernel_view({family}) through a probe into {node.ns}",
            got=f"{type(exc).__name__}: {exc}",
            expected="service port -> kernel lines",
        ) from None
    return None if view is None else {str(k): [str(x) for x in v] for k, v in view.items()}


def parsed_metrics(ctx: Context, node: Any) -> list[Sample]:
    return parsed_exposition(ctx, node, samples)


def parsed_exposition(ctx: Context, node: Any, parse: Callable[[str], T]) -> T:
    """The node's ``/metrics`` text through ``parse``; text that is no valid exposition fails the scenario."""
    text = ctx.metrics_text(node)
    try:
        return parse(text)
    except ValueError as exc:
        ctx.fail(
            f"/metrics on {node.name} is not a valid Prometheus exposition: {exc}",
            sent=f"GET http://127.0.0.1:{METRICS_PORT}/metrics in {node.ns}",
            got=text[:300],
            expected="text format 0.0.4",
        )
        raise  # unreachable; fail raises
