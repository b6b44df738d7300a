"""The bpf companion table's ``nodeport-cidrs`` set (backends/bpf/render.py ``nodeport_cidrs``, and its read-back in
backends/bpf/companion.py): every address but loopback by default, the ``--nodeport-addresses`` CIDRs and primary
addresses otherwise, collapsed as an interval set needs them; nft's JSON elements read back in the same spelling."""

from __future__ import annotations

from kproxy.backends.bpf import companion, render
from kproxy.model import IPFamily


def test_every_address_but_loopback_by_default() -> None:
    v4 = render.nodeport_cidrs(IPFamily.V4, True)
    assert "127.0.0.0/8" not in v4 and "128.0.0.0/1" in v4 and "0.0.0.0/2" in v4
    assert len(v4) == 8
    v6 = render.nodeport_cidrs(IPFamily.V6, True)
    assert "::1" not in v6 and "8000::/1" in v6


def test_the_given_cidrs_and_primary_addresses_collapsed() -> None:
    got = render.nodeport_cidrs(
        IPFamily.V4, False, ("198.18.0.0/16", "198.18.5.0/24", "fd00:198:18::/64"), ("198.19.0.1", "198.18.0.7")
    )
    assert got == ("198.18.0.0/16", "198.19.0.1")
    assert render.nodeport_cidrs(IPFamily.V6, False, ("fd00:198:18::/64",), ()) == ("fd00:198:18::/64",)


def test_nft_json_elements_read_back_in_the_same_spelling() -> None:
    want = render.nodeport_cidrs(IPFamily.V4, True)
    elems = [{"prefix": {"addr": c.split("/")[0], "len": int(c.split("/")[1])}} for c in want]
    assert companion._cidrs(elems) == want
    assert companion._cidrs(["198.19.0.1", {"range": ["198.18.0.0", "198.18.255.255"]}]) == (
        "198.18.0.0/16",
        "198.19.0.1",
    )


def test_the_fixed_part_matches_nodeports_on_the_set() -> None:
    cmds = companion.fixed_commands(IPFamily.V4)
    assert any("add set ip kproxy-bpf nodeport-cidrs { type ipv4_addr ; flags interval ; }" in c for c in cmds)
    assert any("ip daddr @nodeport-cidrs fib daddr type local" in c for c in cmds)
    assert companion.nodeport_cidr_commands(IPFamily.V6, ("fd00:198:18::/64",)) == [
        "flush set ip6 kproxy-bpf nodeport-cidrs",
        "add element ip6 kproxy-bpf nodeport-cidrs { fd00:198:18::/64 }",
    ]
