"""The userspace mode's proxy port range without root: ``--proxy-port-range`` parsing (upstream's spellings, the
dedicated default, bad input refused with the flag named), the capacity the core asks for, the allocator's walk over
the range skipping ports this proxy holds, the typed refusal once every port is held (no socket is made for it), and
the input guard's rules (what the fixed table holds and how its rules' signatures read)."""

from __future__ import annotations

from types import MappingProxyType

import pytest

from kproxy.backends.userspace import adopt, render
from kproxy.backends.userspace.ports import DEFAULT_PORT_RANGE, PortRange, ProxyPortsExhausted, parse_port_range
from kproxy.backends.userspace.proxier import UserspaceProxier
from kproxy.config import ProxyConfig
from kproxy.model import IPFamily
from kproxy.proxier import BackendError

NODEPORTS = range(30000, 32768)  # Kubernetes' default NodePort range
EPHEMERAL = range(32768, 61000)  # the kernel's default ip_local_port_range


def proxier(port_range: str) -> UserspaceProxier:
    cfg = ProxyConfig(ip_families=(IPFamily.V4,), backend_options=MappingProxyType({"proxy_port_range": port_range}))
    return UserspaceProxier(cfg)  # nothing is opened until start or a sync


def test_port_range_spellings() -> None:
    assert parse_port_range("41000-41009") == (41000, 41009)
    assert parse_port_range(" 41000+10 ") == (41000, 41009)
    assert parse_port_range("41000") == (41000, 41000)
    for random_ports in ("", "0", "0-0"):  # upstream's "randomly chosen": the kernel's ephemeral range
        assert parse_port_range(random_ports) is None
    for bad in ("9-1", "abc", "1-70000", "0+3", "41000+0", "-5", "1-2-3", "41000+x"):
        with pytest.raises(ValueError, match="--proxy-port-range"):
            parse_port_range(bad)
    opt = next(o for o in UserspaceProxier.options if o.name == "proxy_port_range")
    assert opt.flag == "--proxy-port-range"
    assert opt.convert("20000+5") == "20000+5"
    with pytest.raises(ValueError, match="--proxy-port-range"):
        opt.convert("20000-1")  # refused when given, before anything starts
    with pytest.raises(ValueError):
        PortRange("nope")


def test_default_range_is_dedicated_and_sized() -> None:
    lo, hi = parse_port_range(DEFAULT_PORT_RANGE) or (0, 0)
    ports = set(range(lo, hi + 1))
    assert not ports & set(NODEPORTS) and not ports & set(EPHEMERAL)
    assert not ports & set(range(10248, 10261))  # kubelet's and kube-proxy's own ports
    p = UserspaceProxier(ProxyConfig(ip_families=(IPFamily.V4,)))
    assert p.pool.range == (lo, hi) and p.pool.span() == (lo, hi)
    assert p.pool.capacity() == hi - lo + 1 == 10000
    assert p.limits(IPFamily.V4).service_ports == 10000
    assert proxier("41000+3").pool.capacity() == 3


def test_allocator_walks_the_range_and_skips_held_ports() -> None:
    p = proxier("41000+4")
    af = 2  # AF_INET
    p.pool.used.add((af, "tcp", 41001))
    first = list(p.pool.candidates(af, "tcp"))
    assert sorted(first) == [41000, 41002, 41003]  # each free port once, the held one never
    assert sorted(p.pool.candidates(af, "udp")) == [41000, 41001, 41002, 41003]  # UDP ports are counted apart
    p.pool.used.add((af, "tcp", first[0]))
    nxt = next(p.pool.candidates(af, "tcp"))
    assert nxt == first[1]  # the cursor goes on from the last port handed out
    assert p.pool.contains(41003) and not p.pool.contains(41004) and not p.pool.contains(40999)


def test_exhausted_range_refuses_with_a_typed_error_and_makes_no_socket() -> None:
    p = proxier("41000+3")
    for port in (41000, 41001, 41002):
        p.pool.used.add((2, "tcp", port))
    assert list(p.pool.candidates(2, "tcp")) == []
    with pytest.raises(ProxyPortsExhausted) as err:
        p.pool.bind(IPFamily.V4, "tcp", 45000)  # a port its rules named from an earlier range is not taken either
    exc = err.value
    assert isinstance(exc, BackendError)
    assert (exc.family, exc.proto, exc.span, exc.held, exc.busy) == (IPFamily.V4, "tcp", (41000, 41002), 3, 0)
    assert str(exc) == (
        "no proxy port free in --proxy-port-range 41000-41002 (3 ports) for IPv4 TCP: 3 held by this proxy's "
        "sockets, 0 by other sockets; widen the range"
    )
    assert p.pool.used == {(2, "tcp", 41000), (2, "tcp", 41001), (2, "tcp", 41002)}


def test_the_input_guard_in_the_fixed_table() -> None:
    for fam, f in ((IPFamily.V4, "ip"), (IPFamily.V6, "ip6")):
        cmds = render.fixed_commands(fam)
        t = render.TABLE
        assert f"add set {f} {t} {render.PROXY_PORTS} {{ type inet_service; flags interval; }}" in cmds
        hook = f"add chain {f} {t} input {{ type filter hook input priority filter; policy accept; }}"
        assert hook in cmds
        assert f"add rule {f} {t} input meta l4proto {{ tcp, udp }} th dport @proxy-ports jump proxy-guard" in cmds
        guard = [c.split(f" {render.GUARD} ", 1)[1] for c in cmds if c.startswith(f"add rule {f} {t} {render.GUARD} ")]
        assert guard == ["ct direction reply accept", "ct status dnat accept", "reject with tcp reset", "reject"]
        fixed = adopt.expected_fixed(fam)
        assert fixed.hooks["input"] == ("filter", "input", "accept")
        assert render.PROXY_PORTS in fixed.maps
    # "dnat" after "ct status" is a value, not a dnat statement: the signature matches libnftables' JSON listing
    assert adopt.text_signature("ct status dnat accept") == {"ct.status", "accept"}
    assert adopt.json_signature(
        [{"match": {"op": "in", "left": {"ct": {"key": "status"}}, "right": "dnat"}}, {"accept": None}]
    ) == {"ct.status", "accept"}
    assert render.proxy_ports_element((20000, 29999)) == "20000-29999"
    assert render.proxy_ports_element((41000, 41000)) == "41000"
    assert render.LAYOUT.endswith("-3")  # a table of an older layout (unguarded, no martian guard) is replaced whole


def test_the_open_file_limit_caps_what_fits() -> None:
    """Each proxy socket is a descriptor: under a hard open-file limit of FD_RESERVE + 100 the mode holds 100 service
    ports, so the core refuses the rest service by service (before, the sockets took every descriptor and the table's
    own write failed with EMFILE). In a child process: a lowered hard limit cannot be raised again."""
    import resource
    import subprocess
    import sys

    from kproxy.backends.userspace.ports import FD_RESERVE

    code = (
        "from kproxy.config import ProxyConfig\n"
        "from kproxy.model import IPFamily\n"
        "from kproxy.backends.userspace.proxier import UserspaceProxier\n"
        "print(UserspaceProxier(ProxyConfig(ip_families=(IPFamily.V4,))).limits(IPFamily.V4).service_ports)\n"
    )
    limit = FD_RESERVE + 100

    def lower() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

    out = subprocess.run(
        [sys.executable, "-c", code], preexec_fn=lower, capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "100"
