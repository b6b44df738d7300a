"""Conformance scenario scale-smoke: 1,000 services x 3 endpoints written at once, a random sample of 50 reachable,
and node-1's syncs within bounds relative to the mode's own kernel floor (``kproxy bench sync``).

The spec is docs/BEHAVIOUR.md's scenario table; ``kproxy.conformance.scenarios`` fixes the order.
"""

from __future__ import annotations

import json
import random
import subprocess
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kproxy.conformance.checks import SCALE_CONVERGE_S, SCALE_ENDPOINTS, SCALE_SAMPLE, SCALE_SERVICES, judge_syncs
from kproxy.conformance.context import Context
from kproxy.conformance.registry import scenario
from kproxy.conformance.steps import barrier, cip, kproxy_bin, parsed_metrics, two_nodes
from kproxy.conformance.values import METRICS_PORT


def measure_floor(ctx: Context) -> tuple[float | None, float | None]:
    """``floor_s`` and ``full_sync_s`` of ``kproxy bench sync --mode MODE`` at SCALE_SERVICES x SCALE_ENDPOINTS (a
    few seconds; the bench makes and removes its own namespace). None for a figure the mode does not have; a bench
    that fails fails the scenario (its bound would otherwise be guessed)."""
    command = getattr(ctx.lab, "kproxy_command", None)
    argv = [*(command() if command else [kproxy_bin()]), "bench", "sync", "--mode", ctx.mode]
    argv += ["--services", str(SCALE_SERVICES), "--endpoints", str(SCALE_ENDPOINTS), "--repeat", "1"]
    argv += ["--format", "json"]
    ctx.check_deadline("measuring the floor")
    doc: Any = None
    try:
        res = subprocess.run(argv, capture_output=True, text=True, timeout=min(120.0, ctx.remaining()), check=False)
        err = f"exit {res.returncode}: {res.stderr.strip()[-300:]}"
        doc = json.loads(res.stdout) if res.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, ValueError) as exc:
        err = f"{type(exc).__name__}: {exc}"
    if not isinstance(doc, dict):
        ctx.fail(
            f"could not measure the {ctx.mode} floor the sync bounds are relative to",
            sent=" ".join(argv),
            got=err,
            expected="exit 0 and the bench's JSON",
        )
        raise AssertionError("unreachable")
    floor, full = doc.get("floor_s"), doc.get("full_sync_s")
    return (
        float(floor) if isinstance(floor, (int, float)) and floor > 0 else None,
        float(full) if isinstance(full, (int, float)) and full > 0 else None,
    )


@scenario("scale-smoke", "1,000 services x 3 endpoints; a random sample of 50 reachable", timeout_s=280)
def scale_smoke(ctx: Context) -> None:
    n1, _ = two_nodes(ctx)
    client = ctx.pods_on(n1)[0]
    others = [p for p in ctx.pods if p.name != client.name]
    seed = random.randrange(1 << 30)
    rnd = random.Random(seed)
    metrics_url = f"http://127.0.0.1:{METRICS_PORT}/metrics in {n1.ns}"
    floor, full_s = measure_floor(ctx)
    before = parsed_metrics(ctx, n1)
    plan = []
    for i in range(SCALE_SERVICES):
        svc = ctx.service(f"s{i:04d}")
        plan.append((svc, rnd.sample(others, SCALE_ENDPOINTS)))
    objs = [o for svc, eps in plan for o in (svc, ctx.slice_for(svc, eps))]
    try:
        t0 = ctx.now()
        with ThreadPoolExecutor(max_workers=8) as pool:
            list(pool.map(lambda o: ctx.apply(o), objs))
        t_written = ctx.now()
        sample = rnd.sample(plan, SCALE_SAMPLE)
        reached: dict[str, float] = {}

        def reach_one(item: tuple[dict[str, Any], list[Any]]) -> None:
            svc, eps = item
            ctx.eventually(
                lambda: ctx.reach(client, cip(svc), 80, count=1, timeout=0.5, only=eps),
                timeout=SCALE_CONVERGE_S,
                interval=0.5,
                what=f"sample service {svc['metadata']['name']} ({cip(svc)}:80, written "
                f"{ctx.now() - t_written:.1f} s before giving up)",
            )
            reached[svc["metadata"]["name"]] = ctx.now() - t_written

        with ThreadPoolExecutor(max_workers=4) as pool:
            list(pool.map(reach_one, sample))
        slowest = max(reached, key=reached.__getitem__)
        ctx.expect(
            reached[slowest] <= SCALE_CONVERGE_S,
            f"the sample became reachable only {reached[slowest]:.1f} s after the last write (slowest: {slowest})",
            sent=f"{SCALE_SAMPLE} TCP probes from {client.name}, one per sampled service (seed {seed})",
            got=f"slowest {slowest} reachable after {reached[slowest]:.1f} s",
            expected=f"all reachable within {SCALE_CONVERGE_S:.0f} s",
        )
        # The sample answering does not mean node-1 has synced every write (the sync carrying the last ones may
        # still run): a service written after all of them answering does, and its sync is then observed too.
        barrier(ctx, n1)
        after = parsed_metrics(ctx, n1)
    finally:
        # Deleted here, in parallel: the runner empties a namespace one object at a time, which for 2,000 objects
        # could push the test past pytest's timeout.
        with ThreadPoolExecutor(max_workers=8) as pool:
            list(pool.map(lambda item: ctx.delete("Service", item[0]["metadata"]["name"]), plan))
            list(pool.map(lambda item: ctx.delete("EndpointSlice", item[0]["metadata"]["name"] + "-v4"), plan))
    figures = judge_syncs(
        ctx,
        before,
        after,
        floor,
        node=n1.name,
        full_s=full_s,
        sent=f"{SCALE_SERVICES} Services + EndpointSlices ({SCALE_ENDPOINTS} endpoints each), then a barrier "
        f"service; GET {metrics_url} before and after",
    )
    ctx.note(
        f"{SCALE_SERVICES} services x {SCALE_ENDPOINTS} endpoints written in {t_written - t0:.1f} s; sample of "
        f"{SCALE_SAMPLE} (seed {seed}) all reachable {reached[slowest]:.1f} s after the last write (slowest "
        f"{slowest}); {figures}"
    )
