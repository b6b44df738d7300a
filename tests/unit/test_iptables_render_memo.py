"""The iptables renderer's memo of service-port hashes is bounded: services churning over a long life do not grow
it forever, and the chain names stay upstream's when it starts over."""

from __future__ import annotations

import base64
import hashlib

import pytest

from kproxy.backends.iptables import render

from .iptables_objects import spn


def upstream_hash(key: str) -> str:
    return base64.b32encode(hashlib.sha256(key.encode()).digest()).decode()[:16]


def test_the_service_hash_memo_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(render, "_SVC_HASH_MAX", 100, raising=False)
    monkeypatch.setattr(render, "_SVC_HASH", {})  # this test's own memo
    sizes = []
    for i in range(1_000):  # 1,000 services come and go
        name = spn(f"churn{i}")
        assert render.service_chain(name) == "KUBE-SVC-" + upstream_hash(f"ns1/churn{i}:httptcp")
        sizes.append(len(render._SVC_HASH))
    assert max(sizes) <= 100, max(sizes)
    # after the memo started over, an old name is computed again, the same
    assert render.port_proto_hash(spn("churn0")) == upstream_hash("ns1/churn0:httptcp")
