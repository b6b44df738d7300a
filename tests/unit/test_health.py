"""Node health (/healthz, /livez) in every state, as upstream's proxy_health.go answers it."""

from __future__ import annotations

import json

from kproxy.model import IPFamily
from kproxy.server.health import ZERO_TIME, ProxyHealth, go_time

V4, V6 = IPFamily.V4, IPFamily.V6
T0 = 1_700_000_000.0  # 2023-11-14T22:13:20Z


class Clock:
    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def make(timeout: float = 10.0) -> tuple[ProxyHealth, Clock]:
    clock = Clock()
    return ProxyHealth([V4, V6], timeout, clock=clock), clock


def test_go_time_format() -> None:
    assert go_time(T0) == "2023-11-14T22:13:20Z"
    assert go_time(T0 + 0.5) == "2023-11-14T22:13:20.5Z"
    assert go_time(T0 + 0.123456) == "2023-11-14T22:13:20.123456Z"
    assert go_time(None) == ZERO_TIME == "0001-01-01T00:00:00Z"


def test_healthz_is_503_until_every_family_synced_once_livez_is_not() -> None:
    """The issue's DaemonSet rule: a node that never synced must not look ready (upstream is healthy at startup)."""
    h, clock = make()
    code, body = h.healthz()
    assert code == 503
    assert body == {
        "lastUpdated": ZERO_TIME,
        "currentTime": go_time(clock.now),
        "nodeEligible": True,
        "healthy": False,
    }
    # /livez and the service health checks keep upstream's startup grace (a liveness probe must not restart us).
    assert h.livez() == (200, {"lastUpdated": go_time(clock.now), "currentTime": go_time(clock.now), "healthy": True})
    assert h.healthy()
    h.updated(V4)
    clock.now += 1
    code, body = h.healthz()
    assert code == 503 and body["healthy"] is False  # IPv6 has not synced yet
    assert body["lastUpdated"] == go_time(T0) and body["status"] == {
        "IPv4": {"lastUpdated": go_time(T0), "healthy": True}
    }
    h.updated(V6)
    assert h.healthz()[0] == 200


def test_synced_is_healthy_with_upstreams_body() -> None:
    h, clock = make()
    h.updated(V4)
    h.updated(V6)
    code, body = h.healthz()
    assert code == 200
    assert body == {
        "lastUpdated": go_time(clock.now),
        "currentTime": go_time(clock.now),
        "nodeEligible": True,
        "healthy": True,
        "status": {
            "IPv4": {"lastUpdated": go_time(clock.now), "healthy": True},
            "IPv6": {"lastUpdated": go_time(clock.now), "healthy": True},
        },
    }
    assert list(body) == ["lastUpdated", "currentTime", "nodeEligible", "healthy", "status"]
    # The compact JSON upstream's json.Marshal produces.
    assert json.dumps({k: v for k, v in body.items() if k != "status"}, separators=(",", ":")) == (
        '{"lastUpdated":"2023-11-14T22:13:20Z","currentTime":"2023-11-14T22:13:20Z","nodeEligible":true,"healthy":true}'
    )


def test_queued_but_not_late_is_healthy_and_lastupdated_reads_now() -> None:
    h, clock = make()
    h.updated(V4)
    h.updated(V6)
    clock.now += 25
    h.queued_update(V4)
    clock.now += 9.9
    code, body = h.healthz()
    assert code == 200
    assert body["lastUpdated"] == body["currentTime"] == go_time(clock.now)
    assert body["status"] == {
        "IPv4": {"lastUpdated": go_time(T0), "healthy": True},
        "IPv6": {"lastUpdated": go_time(T0), "healthy": True},
    }


def test_one_family_late_is_unhealthy_until_it_updates() -> None:
    h, clock = make()
    h.updated(V4)
    h.updated(V6)
    clock.now += 25
    h.queued_update(V6)
    clock.now += 5
    h.queued_update(V6)  # does not move the oldest queued time
    clock.now += 5  # now exactly health_timeout after the first queue: late
    code, body = h.healthz()
    assert code == 503
    assert body["healthy"] is False
    assert body["lastUpdated"] == go_time(T0)  # the newest real update, not now
    assert body["currentTime"] == go_time(T0 + 35)
    assert body["status"]["IPv6"] == {"lastUpdated": go_time(T0), "healthy": False}
    assert body["status"]["IPv4"]["healthy"] is True
    assert h.livez()[0] == 503
    assert not h.healthy()

    h.updated(V4)  # the other family updating changes nothing
    assert h.healthz()[0] == 503
    assert h.healthz()[1]["lastUpdated"] == go_time(clock.now)  # newest update of any family

    h.updated(V6)
    assert h.healthz()[0] == 200 and h.livez()[0] == 200 and h.healthy()


def test_both_families_late() -> None:
    h, clock = make()
    h.updated(V4)
    h.updated(V6)
    h.queued_update(V4)
    h.queued_update(V6)
    clock.now += 10
    code, body = h.livez()
    assert code == 503
    assert {f: s["healthy"] for f, s in body["status"].items()} == {"IPv4": False, "IPv6": False}
    h.updated(V4)
    assert h.livez()[0] == 503
    h.updated(V6)
    assert h.livez()[0] == 200


def test_family_whose_first_sync_never_succeeds_becomes_unhealthy() -> None:
    h, clock = make()
    h.queued_update(V4)
    clock.now += 9
    assert h.livez()[0] == 200 and h.healthy()
    clock.now += 1
    assert not h.healthy()
    code, body = h.livez()
    assert code == 503
    assert body["lastUpdated"] == ZERO_TIME
    assert body["status"] == {"IPv4": {"lastUpdated": ZERO_TIME, "healthy": False}}


def test_node_ineligible_fails_healthz_but_not_livez() -> None:
    h, clock = make()
    h.updated(V4)
    h.updated(V6)
    clock.now += 3
    h.set_node_eligible(False)
    code, body = h.healthz()
    assert code == 503
    assert body["nodeEligible"] is False
    assert body["healthy"] is True  # the proxy itself is fine
    assert body["lastUpdated"] == go_time(T0)  # not "now": the response is not a 200
    code, body = h.livez()
    assert code == 200 and "nodeEligible" not in body
    assert body["lastUpdated"] == go_time(clock.now)
    h.set_node_eligible(True)
    assert h.healthz()[0] == 200


def test_late_and_ineligible() -> None:
    h, clock = make()
    h.queued_update(V6)
    clock.now += 100
    h.set_node_eligible(False)
    assert h.healthz()[0] == 503 and h.livez()[0] == 503


def test_ages_use_the_monotonic_clock() -> None:
    wall, mono = Clock(T0), Clock(0.0)
    h = ProxyHealth([V4], 10.0, clock=wall, monotonic=mono)
    h.updated(V4)
    h.queued_update(V4)
    wall.now += 3600  # a wall-clock step does not make the update late
    assert h.healthz()[0] == 200
    mono.now += 10
    assert h.healthz()[0] == 503
