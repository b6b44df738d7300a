"""The iptables renderer's memo of service-port hashes is bounded: services churning over a long life do not grow
it forever, and the chain names stay upstream's when it starts over."""

from __future__ import annotations

import base64
import hashlib

from kproxy.backends.iptables import render

from .iptables_objects import spn


def upstream_hash(key: str) -> str:
    return base64.b32encode(hashlib.sha256(key.encode()).digest()).decode()[:16]


def test_the_service_hash_memo_is_bounded() -> None:
    bound = render._proto_hash.cache_info().maxsize
    assert bound is not None and bound <= 131_072
    render._proto_hash.cache_clear()
    for i in range(bound + 1_000):  # more services come and go than the memo holds
        name = spn(f"churn{i}")
        assert render.service_chain(name) == "KUBE-SVC-" + upstream_hash(f"ns1/churn{i}:httptcp")
    assert render._proto_hash.cache_info().currsize == bound
    # after the memo started over, an old name is computed again, the same
    assert render.port_proto_hash(spn("churn0")) == upstream_hash("ns1/churn0:httptcp")
