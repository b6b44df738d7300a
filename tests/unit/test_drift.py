"""The drift watcher's reading of nf_tables notifications (``kproxy.drift``), on datagrams a real kernel sent.

``CAPTURED`` holds what a socket subscribed to ``NFNLGRP_NFTABLES`` received in a scratch namespace (kernel 6.18,
nft 1.0.6, iptables 1.8.9) while someone else ran, one per entry: ``nft add table ip kproxy``, ``iptables-nft -t nat
-N OTHER``, ``iptables-nft -t nat -N KUBE-X``, ``nft flush ruleset``; each through ``sh -c`` (the committing task is a
grandchild of the capturing process). The integration test ``tests/integration/test_drift_repair.py`` judges live
notifications end to end; these pin the parsing and the own-versus-foreign decision without root."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

from hypothesis import given, settings
from hypothesis import strategies as st

from kproxy.drift import (
    CHAIN_MSGS,
    NFT_MSG_NEWGEN,
    NFTA_GEN_PROC_PID,
    NFTA_TABLE,
    RULE_MSGS,
    Assembler,
    Drift,
    DriftWatcher,
    Message,
    Transaction,
    own_pid,
    parse,
    touched,
)
from kproxy.model import IPFamily
from kproxy.toolkit import netlink

CAPTURED = {
    "add_table": (
        "3c000000000a00000100000060160000020000020b0001006b70726f7879000008000300000000000c00040000000000"
        "0000000108000200000000002c0000000f0a000001000000601600000000000208000100000000020800020000001660"
        "080003006e667400"
    ),
    "other_chain": (
        "38000000000a0004020000006316000002000003080001006e61740008000300000000010c0004000000000000000002"
        "08000200000000003c000000030a0002030000006316000002000003080001006e6174000a0003004f54484552000000"
        "0c00020000000000000000010800060000000000380000000f0a00000200000063160000000000030800010000000003"
        "08000200000016631100030069707461626c65732d6e667400000000"
    ),
    "kube_chain": (
        "3c000000030a0002020000006f16000002000004080001006e6174000b0003004b5542452d5800000c00020000000000"
        "000000020800060000000000380000000f0a0000020000006f160000000000040800010000000004080002000000166f"
        "1100030069707461626c65732d6e667400000000"
    ),
    "flush": (
        "34000000020a00000100000084160000020000050b0001006b70726f7879000008000300000000000c00040000000000"
        "0000000134000000050a0000010000008416000002000005080001006e6174000a0003004f544845520000000c000200"
        "000000000000000134000000050a0000010000008416000002000005080001006e6174000b0003004b5542452d580000"
        "0c000200000000000000000230000000020a0000010000008416000002000005080001006e6174000800030000000000"
        "0c00040000000000000000022c0000000f0a000001000000841600000000000508000100000000050800020000001684"
        "080003006e667400"
    ),
}
V4 = (IPFamily.V4,)
NFTABLES = Drift(frozenset({"kproxy"}))
IPTABLES = Drift(frozenset({"nat", "filter", "mangle"}), chains=("KUBE-",))


def transactions(name: str) -> list[Transaction]:
    return list(Assembler().feed(parse(bytes.fromhex(CAPTURED[name]))))


def test_a_transaction_is_its_messages_then_newgen_with_the_committer() -> None:
    (tx,) = transactions("add_table")
    assert tx.name == "nft" and tx.pid > 0
    assert [(m.kind, m.family, m.table) for m in tx.messages] == [(0, 2, "kproxy")]  # NEWTABLE, ip


def test_only_declared_state_counts() -> None:
    assert touched(NFTABLES, V4, transactions("add_table")[0]) == {IPFamily.V4: "changed in table kproxy"}
    assert touched(IPTABLES, V4, transactions("add_table")[0]) == {}  # not a table iptables writes
    assert touched(IPTABLES, V4, transactions("other_chain")[0]) == {}  # someone else's chain in a shared table
    kube = touched(IPTABLES, V4, transactions("kube_chain")[0])
    assert kube == {IPFamily.V4: "changed in table nat chain KUBE-X"}
    assert touched(NFTABLES, (IPFamily.V6,), transactions("add_table")[0]) == {}  # an ip table is not IPv6's


def test_a_flush_is_seen_by_every_mode_whose_tables_it_removed() -> None:
    (tx,) = transactions("flush")
    assert {m.table for m in tx.messages} == {"kproxy", "nat"}
    assert "deleted in table kproxy" in touched(NFTABLES, V4, tx)[IPFamily.V4]
    assert "deleted in table nat" in touched(IPTABLES, V4, tx)[IPFamily.V4]  # a deletion in a shared table counts


def test_own_threads_and_live_children_are_kproxy_s() -> None:
    assert own_pid(threading.get_native_id(), pid_ns_is_init=True) is True
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        assert own_pid(child.pid, pid_ns_is_init=True) is True
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(10)
    assert own_pid(child.pid, pid_ns_is_init=True) is None  # gone: cannot be told
    assert own_pid(os.getppid(), pid_ns_is_init=True) is False  # alive and someone else's
    assert own_pid(threading.get_native_id(), pid_ns_is_init=False) is None  # the kernel's pids are not ours


def watcher(events: list[tuple[str, frozenset[IPFamily], str]], owner: bool | None) -> DriftWatcher:
    w = DriftWatcher(
        NFTABLES,
        V4,
        repair=lambda f, why: events.append(("repair", f, why)),
        check=lambda f, why: events.append(("check", f, why)),
    )
    w._init_ns = owner is not None  # noqa: SLF001 - the captured pids are not this machine's tasks any more
    return w


def test_outside_the_window_a_change_of_someone_else_is_repaired() -> None:
    events: list[tuple[str, frozenset[IPFamily], str]] = []
    w = watcher(events, None)
    w.consume(bytes.fromhex(CAPTURED["flush"]))
    assert [(k, f) for k, f, _ in events] == [("repair", frozenset(V4))]
    assert "by nft" in events[0][2]


def test_inside_the_window_an_unknown_committer_is_checked_once_the_window_closes() -> None:
    events: list[tuple[str, frozenset[IPFamily], str]] = []
    w = watcher(events, None)
    with w.own_writes():
        w.consume(bytes.fromhex(CAPTURED["flush"]))
        w.consume(bytes.fromhex(CAPTURED["add_table"]))
        assert events == []
    w.settle()
    assert [(k, f) for k, f, _ in events] == [("check", frozenset(V4))]
    w.stop()


KINDS = (0, 3, 6, 9, 12, 2, 5, 8, 14, 28)  # NEW table/chain/rule/set/setelem, DEL table/chain/rule/setelem, DESTROYRULE
_messages = st.lists(
    st.tuples(
        st.sampled_from(KINDS),
        st.sampled_from((1, 2, 10)),  # inet, ip, ip6
        st.sampled_from(("kproxy", "nat", "other")),
        st.sampled_from(("KUBE-SVC-A", "KUBE-X", "OTHER")),
    ),
    max_size=30,
)


def _message(kind: int, family: int, table: str, chain: str) -> Message:
    body = netlink.nla(NFTA_TABLE, table.encode() + b"\0")
    if kind in RULE_MSGS:
        body += netlink.nla(2, chain.encode() + b"\0")
    elif kind in CHAIN_MSGS:
        body += netlink.nla(3, chain.encode() + b"\0")
    return Message(kind, family, 0, body)


@settings(max_examples=200, deadline=None)
@given(_messages)
def test_keeping_one_message_of_each_sort_judges_a_transaction_as_all_of_them(specs: list) -> None:  # type: ignore[type-arg]
    """The assembler keeps the first message of each sort (deletion, family, table, chain): every mode's judgement of
    the transaction is the one the whole list of messages gives."""
    messages = [_message(*spec) for spec in specs]
    newgen = Message(NFT_MSG_NEWGEN, 0, 0, netlink.nla(NFTA_GEN_PROC_PID, (42).to_bytes(4, "big")))
    (kept,) = Assembler().feed([*messages, newgen])
    whole = Transaction(tuple(messages), 42, "")
    assert len(kept.messages) <= len(messages) and kept.pid == 42
    for spec in (NFTABLES, IPTABLES, Drift(frozenset({"kproxy", "nat"}), chains=("KUBE-SVC-",))):
        for fams in (V4, (IPFamily.V6,), (IPFamily.V4, IPFamily.V6)):
            assert touched(spec, fams, kept) == touched(spec, fams, whole)
