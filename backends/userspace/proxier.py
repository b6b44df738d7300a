"""The userspace backend's Proxier: proxy sockets per service port, and the redirect elements that reach them.

It syncs through the core's ledger (``kproxy.ledger.LedgerProxier``): ``render`` turns a ServicePort into a
``Fragment`` (redirect elements by role, listeners with their endpoints); ``apply`` binds a proxy socket for every
listener that has none yet, writes the element changes as one libnftables transaction, and then hands new sockets,
new endpoint lists and closed listeners to the data path (``datapath.Engine``) in one step of its loop. The order
matters: a socket is listening before any redirect points at it, and is closed only after the redirect is gone.

Full batches diff what every wanted service needs against what the kernel holds (``adopt`` reads this mode's maps
back), so a restart rebinds the ports its rules name and writes nothing when it can; partial batches diff each
dirty service's old elements against its new ones. A refused transaction changes nothing; the refused command's
line names the service (``Applied.refused``), and the ledger retries without it.

Proxy ports come from ``--proxy-port-range`` (``port_span``; ``proxy_port_capacity`` is its size, what the core's
capacity check asks for). A port is free when no socket of this process holds it and bind() takes it; a service
port that finds none is refused (``ProxyPortsExhausted``) and the rest of the batch goes on. Full batches also write
the range into the input guard's ``proxy-ports`` set when the kernel holds anything else.
"""

from __future__ import annotations

import errno
import functools
import ipaddress
import itertools
import logging
import random
import resource
import socket
import time
import weakref
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar

from kproxy.admission import Limits
from kproxy.backend import LedgerProxier
from kproxy.batch import Applied, Batch
from kproxy.config import ProxyConfig, parse_duration
from kproxy.model import IPFamily, ProxyState, ServicePort, ServicePortName, Verdict
from kproxy.nftkernel import Nft, available
from kproxy.nodeaddr import FamilyContext
from kproxy.proxier import Availability, BackendError, KernelProbe, Option
from kproxy.toolkit import nft as nft_tools
from kproxy.toolkit.cidr import spans
from kproxy.toolkit.netns import in_netns, scratch_netns

from . import inspect, render
from .datapath import Engine, ListenerSpec
from .render import Fragment

log = logging.getLogger(__name__)

CHECK_INTERVAL = 1.0  # seconds between "is my table still there" checks at the start of partial syncs
BACKLOG = 4096
FLOOR_BATCH = 2000  # sockets measure_floor holds at once

ElemKey = tuple[str, str]  # (map, key)
Ident = tuple[IPFamily, ServicePortName, str]  # (family, service port, role): one proxy socket


class Duration(float):
    """Seconds, given as upstream's durations (``250ms``, ``1s``, ``2m``) or a plain number of seconds: parsed by the
    core's one duration parser (finite, within Go's range); must be greater than 0, as upstream's udpIdleTimeout."""

    def __new__(cls, text: str | float = 0.0) -> Duration:
        value = parse_duration(text, "udp-idle-timeout")
        if value <= 0:
            raise ValueError(f"udp-idle-timeout: {text!r} must be greater than 0")
        return super().__new__(cls, value)


#: the proxy port range when none is given: below the NodePort range (30000-32767) and the kernel's ephemeral range
#: (32768-60999), above the node components' own ports (10248-10260: kubelet, kube-proxy's health and metrics)
DEFAULT_PORT_RANGE = "20000-29999"


def parse_port_range(text: str) -> tuple[int, int] | None:
    """Upstream's ``--proxy-port-range``: ``BEGIN-END``, ``BEGIN+SIZE`` or one port (inclusive); empty, ``0`` or
    ``0-0`` for upstream's "random": the kernel's ephemeral range (``ip_local_port_range``). ValueError on anything
    else, naming the flag."""
    t = (text or "").strip()
    if t in ("", "0", "0-0"):
        return None
    try:
        if "+" in t:
            a, _, n = t.partition("+")
            lo, hi = int(a), int(a) + int(n) - 1
        else:
            a, sep, b = t.partition("-")
            lo, hi = int(a), int(b) if sep else int(a)
    except ValueError:
        lo = hi = 0
    if not (0 < lo <= hi <= 65535):
        raise ValueError(f"--proxy-port-range {text!r}: expected BEGIN-END, BEGIN+SIZE or PORT within 1-65535")
    return lo, hi


class PortRange(str):
    """A ``--proxy-port-range`` value, checked when given (``parse_port_range``)."""

    def __new__(cls, text: str = "") -> PortRange:
        parse_port_range(text)
        return super().__new__(cls, text.strip())


class ProxyPortsExhausted(BackendError):
    """Every port of the proxy port range is held (by this proxy's sockets or by other sockets) for one address
    family and protocol: the service port that needed one more is refused, and says why."""

    def __init__(self, family: IPFamily, proto: str, span: tuple[int, int], held: int, busy: int) -> None:
        self.family, self.proto, self.span, self.held, self.busy = family, proto, span, held, busy
        lo, hi = span
        super().__init__(
            f"no proxy port free in --proxy-port-range {lo}-{hi} ({hi - lo + 1} ports) for {family.value} "
            f"{proto.upper()}: {held} held by this proxy's sockets, {busy} by other sockets; widen the range"
        )


@dataclass(slots=True)
class Adopted:
    """What this mode's table holds in one family (read once per full batch)."""

    table: bool = False
    layout_ok: bool = False
    elements: dict[ElemKey, tuple[str, str]] = field(default_factory=dict)  # (map, key) -> (value, comment)
    by_comment: dict[str, set[tuple[str, str, str]]] = field(default_factory=dict)
    nodeport_cidrs: tuple[tuple[int, int], ...] = ()
    proxy_ports: tuple[str, ...] = ()  # the proxy-ports set's elements (the guard's range)
    #: (proto, port) of the wildcard sockets listening now that are this process's own (None: not read)
    live: set[tuple[str, int]] | None = None

    def ports(self, frag: Fragment) -> dict[str, int]:
        """The proxy port the kernel's elements name for each of ``frag``'s roles (where they agree)."""
        out: dict[str, int] = {}
        for e in frag.entries:
            if not e.role:
                continue
            got = self.elements.get((render.PORT_MAPS[e.map], e.key))
            if got is not None and got[0].isdigit() and got[1] == frag.comment:
                out.setdefault(e.role, int(got[0]))
        return out


#: proxy sockets by (namespace, address family, protocol, port) -> the instance holding them, so that a second
#: instance in one process (``kproxy bench sync``'s restart figure: a fresh backend adopting what the kernel holds
#: while the first still runs) takes the sockets its rules name over, as a restarted process rebinds them
_HOLDERS: dict[tuple[str | None, int, str, int], weakref.ref[UserspaceProxier]] = {}


class _Tx:
    """One transaction's lines and, per line, the service that owns it (to map a refused line back)."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.owners: list[ServicePortName | None] = []

    def add(self, line: str, owner: ServicePortName | None = None) -> None:
        self.lines.append(line)
        self.owners.append(owner)

    def owner_of(self, line: int) -> ServicePortName | None:
        return nft_tools.owner_at(self.owners, line)

    def text(self) -> str:
        return "".join(ln + "\n" for ln in self.lines)


def _kernel(netns: str | None) -> nft_tools.OwnContext:
    """libnftables for this mode: in the caller's thread with the process's one shared context when no namespace is
    named (opened before any proxy socket, on a low descriptor: see ``kproxy.nftkernel``), else a worker thread in
    the namespace, which also makes the proxy sockets there."""
    return nft_tools.OwnContext(netns, worker=False, name=f"kpu-kernel-{netns}" if netns else "kpu-kernel")


_SEEN_NODE = "the endpoint sees the node (the proxy's own connection), never the client's address"


UsBatch = Batch[Fragment, FamilyContext, Adopted, None]


class UserspaceProxier(LedgerProxier[Fragment, FamilyContext, Adopted, inspect.View, None]):
    """Proxy sockets in kproxy itself, reached through redirects in a table of this mode's own (see the package
    docstring)."""

    mode: ClassVar[str] = "userspace"
    CHECK_INTERVAL_S: ClassVar[float | None] = CHECK_INTERVAL
    #: redirects are NAT through conntrack: stale UDP entries are reconciled, answered by the node's proxy ports
    uses_conntrack_nat: ClassVar[bool] = True
    #: established connections are the proxy's own sockets: they end with the process (restart, mode switch)
    survives_restart: ClassVar[bool] = False
    options: ClassVar[tuple[Option, ...]] = (
        Option(
            "proxy_port_range",
            PortRange,
            PortRange(DEFAULT_PORT_RANGE),
            "ports reserved for proxy sockets (upstream's --proxy-port-range, config portRange): BEGIN-END, "
            "BEGIN+SIZE or PORT; empty or 0: the kernel's ephemeral range. Only redirected service traffic reaches "
            f"these ports (default {DEFAULT_PORT_RANGE})",
        ),
        Option(
            "udp_timeout",
            Duration,
            Duration(0.25),
            "idle time after which a UDP client's session ends (upstream's --udp-timeout, default 250ms)",
        ),
    )

    def __init__(self, config: ProxyConfig, *, netns: str | None = None) -> None:
        super().__init__(config, netns=netns)
        opts = type(self).option_values(config.backend_options)
        #: the configured range, None for the kernel's ephemeral range (read in the namespace: ``port_span``)
        self.port_range = parse_port_range(str(opts.get("proxy_port_range", DEFAULT_PORT_RANGE)))
        self.udp_timeout = float(Duration(opts.get("udp_timeout", 0.25)))
        self._kernel = _kernel(netns)
        self.engine = Engine(netns, udp_timeout=self.udp_timeout)
        self.engine.on_dead = lambda ident: self.request_full(ident[0])  # a full sync binds a new socket
        self._started = False
        self._ports: dict[Ident, int] = {}  # every proxy socket the data path holds, and its port
        self._used: set[tuple[int, str, int]] = set()  # (socket family, proto, port) taken by our sockets
        self._warned: set[ServicePortName] = set()  # unsupported services already logged
        self._cursor: dict[tuple[int, str], int] = {}  # where the next port search starts, per family and protocol
        self._auto_range: tuple[int, int] | None = None
        self._written: dict[IPFamily, dict[ServicePortName, frozenset[tuple[str, str, str]]]] = {
            f: {} for f in self.families
        }
        self._known: dict[IPFamily, bool] = {f: False for f in self.families}
        self._local: dict[IPFamily, tuple[str, ...]] = {f: () for f in self.families}
        self._rules_checked: dict[IPFamily, float] = {}  # the fixed rules' check, per family
        self._counts: dict[IPFamily, dict[str, int]] = {}  # the last apply's figures per family, for describe()
        self._last_full: dict[IPFamily, tuple[str, int, int]] = {}  # text, TCP and UDP sockets of a fresh full sync

    # ------------------------------------------------------------------------------------------ hooks

    @classmethod
    def available(cls) -> Availability:
        why = available()
        return Availability(why is None, why or "")

    @classmethod
    def not_applicable(cls, options: Mapping[str, Any]) -> Mapping[str, str]:
        return MappingProxyType(
            {
                "source-ip": f"a userspace proxy cannot preserve the client's IP: {_SEEN_NODE}",
            }
        )

    @classmethod
    def not_applicable_parts(cls, options: Mapping[str, Any]) -> Mapping[str, Mapping[str, str]]:
        """Only what the proxy's mechanism rules out: the client's address (the endpoint sees the proxy's own
        connection) and connections through a process that is not running (they are its sockets). Local endpoint
        selection, the drop on nodes without one, IPv6 and dual-stack services, new connections after a restart and
        a mode switch's clean hand-over are judged as for every mode."""
        own = "an established connection is one of the proxy process's own sockets, so it ends with that process"
        down = (
            "new connections are redirected to proxy ports that no process listens on from the moment the process "
            "stops until one is serving again (the restarted process has bound its ports, or the next mode has synced)"
        )
        client_ip = f"the client's IP cannot be preserved: {_SEEN_NODE}"
        return MappingProxyType(
            {
                "etp-local": MappingProxyType({"client-ip": client_ip}),
                "address-collision": MappingProxyType({"while-down": down}),
                "dual-stack": MappingProxyType(
                    {
                        "client-ip": client_ip,
                        "kernel-counters": "its table's map elements carry no counters, so a rewrite of the guard's "
                        "elements with the same content cannot be seen (elements that come or go still are)",
                    }
                ),
                "restart": MappingProxyType({"held-connection": own, "while-down": down}),
                "mode-switch": MappingProxyType(
                    {
                        "held-connections": own,
                        "while-down": down,
                    }
                ),
            }
        )

    @classmethod
    def remnants(cls, probe: KernelProbe) -> list[str]:
        """This mode's tables. Its proxy sockets are the process's own: they close when it exits."""
        return nft_tools.remnants(probe, render.TABLE)

    @classmethod
    def kernel_view(cls, probe: KernelProbe, family: IPFamily) -> dict[str, list[str]] | None:
        out: dict[str, list[str]] = {}
        for el in nft_tools.elements(nft_tools.listed(probe, family, render.TABLE) or ()):
            if el.comment:
                out.setdefault(el.comment, []).append(nft_tools.element_line(el))
        return out

    @classmethod
    def cleanup_leftovers(cls, config: ProxyConfig, *, netns: str | None = None) -> None:
        """Delete this mode's tables (``ip``/``ip6 kproxy-userspace``) and nothing else; errors are logged, never
        raised (a leftover must not stop another mode from starting)."""
        nft_tools.delete_tables(netns, render.TABLE, worker=False)

    # ------------------------------------------------------------------------------------------ lifecycle

    @property
    def kernel(self) -> Nft:
        return self._kernel.get()

    def start(self) -> None:
        """Raise the open-file limit (one descriptor per proxy socket, six per relayed connection: the soft limit
        goes up to the hard one) and start the data-path thread. Idempotent; ``apply`` calls it too (``kproxy bench
        sync`` syncs without ``start``)."""
        if self._started:
            return
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY or soft < hard:
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            except (ValueError, OSError) as exc:
                log.warning("userspace: could not raise the open-file limit from %d to %d: %s", soft, hard, exc)
        self.kernel.ready()  # libnftables' socket on a low descriptor, before the proxy sockets (kproxy.nftkernel)
        self.engine.start()
        self._started = True

    def _forget_sockets(self) -> None:
        for key in [k for k, ref in _HOLDERS.items() if ref() is self]:
            del _HOLDERS[key]

    def close(self) -> None:
        self.engine.stop()
        self._started = False
        self._forget_sockets()
        self._ports.clear()
        self._used.clear()
        self._kernel.close()

    def cleanup(self) -> None:
        if self._started:
            self.engine.update([], list(self.engine_idents()))
        self._forget_sockets()
        self._ports.clear()
        self._used.clear()
        self._written = {f: {} for f in self.families}
        self._known = {f: False for f in self.families}
        super().cleanup()

    def engine_idents(self) -> Iterable[Ident]:
        return list(self._ports)

    # ------------------------------------------------------------------------------------------ ledger methods

    def context(self, node: FamilyContext, state: ProxyState) -> FamilyContext:
        self._local[node.family] = node.local_addresses
        return node.without_addresses()

    def render(self, sp: ServicePort, ctx: FamilyContext) -> Fragment:
        return render.render_service(sp)

    def adopt(self, family: IPFamily, ctx: FamilyContext) -> Adopted | None:
        f = render.nft_family(family)
        objs, err = self.kernel.read(f"list table {f} {render.TABLE}")
        if objs is None:
            if "No such file" in err:
                return Adopted(live=self._live_sockets(family))
            log.warning("%s: reading the userspace table failed (%s): it will be replaced", family.value, err)
            return None
        got = Adopted(table=True, live=self._live_sockets(family))
        got.layout_ok = any((o.get("chain") or {}).get("name") == render.LAYOUT for o in objs)
        if got.layout_ok:
            # a fixed rule deleted, a flushed table (rules gone, maps left), a rule someone added: replaced whole
            damaged = inspect.fixed_problems(objs, family)
            if damaged:
                log.warning(
                    "%s: this mode's table is damaged (%s): it is replaced", family.value, "; ".join(damaged.values())
                )
                got.layout_ok = False
        if not got.layout_ok:
            return got
        cidrs: list[str] = []
        for name, key, value, comment, _ in nft_tools.elements(objs):
            if name == render.NODEPORT_CIDRS:
                cidrs.append(key)
                continue
            if name == render.PROXY_PORTS:
                got.proxy_ports += (key,)
                continue
            if name not in render.SERVICE_MAPS:
                continue
            got.elements[(name, key)] = (value, comment)
            got.by_comment.setdefault(comment, set()).add((name, key, value))
        got.nodeport_cidrs = spans(cidrs)
        return got

    def _live_sockets(self, family: IPFamily) -> set[tuple[str, int]] | None:
        """(proto, port) of the data path's proxy sockets that the kernel's socket table shows listening (TCP) or
        bound (UDP) now; None before the data path runs. The data path's own inodes stand for "this process's"
        here (``verify`` reads the descriptors: 0.1 s at 10,000 sockets, against 0.01 s for these fstats)."""
        if not self._started:
            return None
        mine = {inode for inode, (ident, _, _, dead) in self.engine.table().items() if ident[0] == family and not dead}
        socks = self.kernel.call(lambda: inspect.listening(family))
        return {pp for pp, inodes in socks.items() if any(i in mine for i in inodes)}

    def adopted_unchanged(self, adopted: Adopted, name: ServicePortName, fragment: Fragment) -> bool:
        if not adopted.layout_ok:
            return False
        ports = adopted.ports(fragment)
        if set(ports) != set(fragment.roles()):
            return False
        return adopted.by_comment.get(fragment.comment, set()) == set(fragment.kernel_elements(ports))

    def needs_full(self, family: IPFamily) -> bool:
        now = time.monotonic()
        # a small set, not the layout chain: nft 1.0.6 fetches the whole table (20,000 elements at 10,000 services,
        # 0.3-0.5 s) to list a chain, and only the set itself to list a set. The guard's set: a deleted table, or a
        # flushed set (the proxy ports open to direct connections) both bring the full sync that rewrites it
        objs, _ = self.kernel.read(f"list set {render.nft_family(family)} {render.TABLE} {render.PROXY_PORTS}")
        held = None if objs is None else [el.key for el in nft_tools.elements(objs)]
        if held != [render.proxy_ports_element(self.port_span())]:
            if objs is not None:
                log.warning(
                    "%s: the proxy port guard's set %s was changed: it is rewritten", family.value, render.PROXY_PORTS
                )
            self._known[family] = False
            return True
        # the fixed rules, at most once per sync period (as the iptables mode's canary): a flushed table keeps its
        # sets, and the periodic full sync that would see it comes once an hour. Listed terse (no elements): 0.15 s
        # at 10,000 services against 1 s for the whole table
        if now - self._rules_checked.get(family, float("-inf")) < max(self.config.sync_period, CHECK_INTERVAL):
            return False
        self._rules_checked[family] = now
        objs, _ = self.kernel.read(f"list table {render.nft_family(family)} {render.TABLE}", terse=True)
        damaged = inspect.fixed_problems(objs, family) if objs is not None else {"table": "unreadable"}
        if damaged:
            log.warning("%s: this mode's fixed rules are damaged: %s", family.value, "; ".join(damaged.values()))
            self._known[family] = False
            return True
        return False

    # ------------------------------------------------------------------------------------------ verify

    def verify_view(self, family: IPFamily, ctx: FamilyContext) -> inspect.View:
        """The table (elements, chains, the fixed rules), the namespace's listening sockets from the kernel, which
        of them this process holds, and what the data path serves on each (see ``inspect``)."""
        view = inspect.View(
            family, want_cidrs=render.nodeport_cidrs(ctx), want_ports=render.proxy_ports_element(self.port_span())
        )
        objs, err = self.kernel.read(f"list table {render.nft_family(family)} {render.TABLE}")
        if objs is None:
            if "No such file" not in err:
                view.error = err or "nft list table failed"
                return view
        else:
            inspect.parse_table(view, objs)
        view.sockets, view.mine = self.kernel.call(lambda: (inspect.listening(family), inspect.own_socket_inodes()))
        if self._started:
            view.served = {
                inode: inspect.Served(ident, endpoints, affinity, dead)
                for inode, (ident, endpoints, affinity, dead) in self.engine.table().items()
                if ident[0] == family
            }
        return view

    def verify_error(self, view: inspect.View) -> str | None:
        return view.error

    def verify_service(self, view: inspect.View, name: ServicePortName, fragment: Fragment) -> str | None:
        """Its elements with their verdicts and marks, the fixed rules its traffic passes, and for each proxy port
        its elements name: a socket of this process listening there that the data path serves for this service
        and role, balancing over the wanted endpoints."""
        return inspect.service_problems(view, name, fragment)

    def verify_extra(self, view: inspect.View, wanted: Mapping[ServicePortName, Fragment]) -> list[str]:
        return inspect.extra(view, wanted)

    def detail(self, name: ServicePortName, family: IPFamily, fragment: Fragment) -> dict[str, Any]:
        return {
            "table": f"{render.nft_family(family)} {render.TABLE}",
            **({"unsupported": fragment.unsupported} if fragment.unsupported else {}),
            "elements": [f"{e.map}: {e.key} : {e.verdict}" for e in fragment.entries],
            "firewall": list(fragment.firewall),
            "proxySockets": [
                {
                    "role": lst.role,
                    "port": self._ports.get((family, name, lst.role)),
                    "endpoints": [f"[{ip}]:{p}" if ":" in ip else f"{ip}:{p}" for ip, p in lst.endpoints],
                    "sessionAffinitySeconds": lst.affinity,
                }
                for lst in fragment.listeners
            ],
        }

    def detail_global(self) -> dict[str, Any]:
        counts = {fam.value: dict(c) for fam, c in list(self._counts.items())}
        return {"table": render.TABLE, "layout": render.LAYOUT, "counts": counts, **self.engine.stats()}

    def conntrack_answerers(self, sp: ServicePort) -> Iterable[tuple[str, int]]:
        """A UDP flow to a service is answered by the node: by the proxy socket of the service, from the address
        the redirect chose (the receiving interface's first address, or loopback for the node's own traffic)."""
        fam = sp.family
        ports = [p for (f, spn, _), p in list(self._ports.items()) if f == fam and spn == sp.name]
        if not ports or (sp.internal_verdict is not Verdict.FORWARD and sp.external_verdict is not Verdict.FORWARD):
            return []
        addrs = set(self._local.get(fam, ())) | {"127.0.0.1" if fam == IPFamily.V4 else "::1"}
        return [(a, p) for a in addrs for p in ports]

    def trace(
        self, src: str, proto: str, dst: str, dport: int, *, src_local: bool = False, dst_local: bool = False
    ) -> dict[str, Any] | None:
        """Where a new connection's first packet goes through what was last applied: the redirect element it meets
        (or the reject / drop / firewall verdict), the proxy socket's port and the endpoints it balances over."""
        try:
            fam = IPFamily.of(dst)
        except ValueError:
            return {"error": f"not an address: {dst!r}"}
        ctx, fragments = self.applied(fam)
        if ctx is None:
            return {"error": f"no {fam.value} rules applied yet"}
        p = proto.lower()
        key = f"{ipaddress.ip_address(dst)} . {p} . {dport}"
        path: list[str] = []
        hit: tuple[ServicePortName, render.Entry] | None = None
        for spn, frag in fragments.items():
            for e in frag.entries:
                if (e.map == render.SERVICE_IPS and e.key == key) or (
                    dst_local and e.map == render.SERVICE_NODEPORTS and e.key == f"{p} . {dport}"
                ):
                    hit = (spn, e)
                    break
            if hit is not None:
                break
        outcome: dict[str, Any] = {"verdict": "no service rule"}
        if hit is None:
            path.append(
                f"services: no element {key} in @{render.SERVICE_IPS}" + (" or @service-nodeports" if dst_local else "")
            )
        else:
            spn, e = hit
            path.append(f"services: @{e.map}[{e.key}] = {e.verdict} ({render.service_key(spn)})")
            if e.verdict == render.V_FIREWALL:
                frag = fragments[spn]
                nets = [k.rsplit(" . ", 1)[1] for k in frag.firewall]
                allowed = any(ipaddress.ip_address(src) in ipaddress.ip_network(n) for n in nets)
                path.append(f"firewall: source {src} {'in' if allowed else 'not in'} {', '.join(nets) or '-'}")
                if not allowed:
                    e = render.Entry(e.map, e.key, render.V_DROP)
            if e.role:
                port = self._ports.get((fam, spn, e.role))
                frag = fragments[spn]
                lst = next(x for x in frag.listeners if x.role == e.role)
                local = "loopback" if src_local else "the receiving interface's address"
                path.append(f"redirect to {local}:{port} (proxy socket {e.role} of {render.service_key(spn)})")
                outcome = {
                    "verdict": f"REDIRECT :{port}",
                    "proxyPort": port,
                    "endpoints": [f"[{ip}]:{pt}" if ":" in ip else f"{ip}:{pt}" for ip, pt in lst.endpoints],
                    "balancing": "round robin" + (f", ClientIP affinity {lst.affinity} s" if lst.affinity else ""),
                }
            else:
                outcome = {"verdict": "REJECT (ICMP port unreachable)" if e.verdict == render.V_REJECT else "DROP"}
        outcome["rules"] = path
        return {
            "packet": {
                "src": src,
                "proto": p,
                "dst": dst,
                "dport": dport,
                "srcLocal": src_local,
                "dstLocal": dst_local,
            },
            "hook": "output" if src_local else "prerouting",
            "outcomes": [outcome],
        }

    # ------------------------------------------------------------------------------------------ sockets

    def _take_over(self, fam: IPFamily, proto: str, port: int) -> tuple[socket.socket, int] | None:
        """The proxy socket on ``port`` from another instance of this process that holds it (see ``_HOLDERS``)."""
        af = int(socket.AF_INET if fam == IPFamily.V4 else socket.AF_INET6)
        ref = _HOLDERS.get((self.netns, af, proto, port))
        holder = ref() if ref is not None else None
        if holder is None or holder is self:
            return None
        sock = holder._hand_over(fam, proto, port)
        if sock is None:
            return None
        self._used.add((af, proto, port))
        return sock, port

    def _hand_over(self, fam: IPFamily, proto: str, port: int) -> socket.socket | None:
        """Give up the proxy socket on ``port`` (its listener leaves the loop, the socket stays open) for another
        instance of this process that adopts the rules naming it."""
        ident = next(
            (i for i, p in self._ports.items() if p == port and i[0] == fam and i[1].protocol.lowercase == proto), None
        )
        if ident is None or not self._started:
            return None
        sock: socket.socket | None = self.engine.run(lambda: self.engine.detach(ident))
        if sock is None:
            return None
        del self._ports[ident]
        af = int(socket.AF_INET if fam == IPFamily.V4 else socket.AF_INET6)
        self._used.discard((af, proto, port))
        _HOLDERS.pop((self.netns, af, proto, port), None)
        return sock

    def port_span(self) -> tuple[int, int]:
        """The proxy port range in effect, inclusive: ``--proxy-port-range``, else the backend namespace's
        ``ip_local_port_range`` (read there once)."""
        if self.port_range is not None:
            return self.port_range
        if self._auto_range is None:
            self.kernel.call(self._local_range)
        return self._local_range()

    def proxy_port_capacity(self) -> int:
        """How many proxy sockets fit, per address family and protocol: the range's size. A service port takes one
        (two when a Local traffic policy gives its ClusterIP and external traffic different endpoints)."""
        lo, hi = self.port_span()
        return hi - lo + 1

    def limits(self, family: IPFamily) -> Limits:
        """A service port takes at least one proxy port of its protocol's pool in ``--proxy-port-range``: more
        service ports than the range holds never fit (the core refuses them before anything is bound). Within it,
        a pool that runs out (one protocol's ports, or a Local policy's second socket) refuses the service port that
        needed one more (``ProxyPortsExhausted``)."""
        return Limits(service_ports=self.proxy_port_capacity())

    def in_span(self, port: int) -> bool:
        lo, hi = self.port_span()
        return lo <= port <= hi

    def _candidates(self, af: int, proto: str) -> Iterator[int]:
        """Ports to try, from a cursor that walks the range (``port_span``) skipping those this process holds.
        kproxy picks them itself because the kernel's bind(0) searches its tables for a free port and took 0.44 ms a
        socket with 10,000 bound (4.4 s for 10,000), against a few microseconds for an explicit port."""
        lo, hi = self.port_span()
        n = hi - lo + 1
        start = self._cursor.get((af, proto))
        if start is None:
            start = random.randrange(n)
        for i in range(n):
            off = (start + i) % n
            port = lo + off
            if (af, proto, port) not in self._used:
                self._cursor[(af, proto)] = off + 1
                yield port

    def _local_range(self) -> tuple[int, int]:
        if self._auto_range is None:
            try:
                with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:  # the calling thread's namespace
                    a, b = fh.read().split()[:2]
                self._auto_range = (int(a), int(b))
            except (OSError, ValueError):
                self._auto_range = (32768, 60999)
        return self._auto_range

    def _bind(self, fam: IPFamily, proto: str, preferred: int | None) -> tuple[socket.socket, int]:
        """A proxy socket bound (and listening, for TCP) on the wildcard address: ``preferred`` when free and in the
        range (a restart keeps the ports its rules name), else the next free port of the range (``_candidates``).
        ProxyPortsExhausted when every port of the range is taken; OSError on any other failure."""
        af = socket.AF_INET if fam == IPFamily.V4 else socket.AF_INET6
        kind = socket.SOCK_STREAM if proto == "tcp" else socket.SOCK_DGRAM
        wildcard = "0.0.0.0" if fam == IPFamily.V4 else "::"
        first = [preferred] if preferred and self.in_span(preferred) else []
        busy = 0
        for port in itertools.chain(first, self._candidates(int(af), proto)):
            sock = socket.socket(af, kind | socket.SOCK_CLOEXEC)
            try:
                if af == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                if kind == socket.SOCK_STREAM:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # rebind over TIME_WAIT on restart
                sock.bind((wildcard, port))
                if kind == socket.SOCK_STREAM:
                    sock.listen(BACKLOG)
                self._used.add((af, proto, port))
                return sock, port
            except OSError as exc:
                sock.close()
                if exc.errno not in (errno.EADDRINUSE, errno.EACCES):
                    raise OSError(exc.errno, f"proxy socket {proto}/{port}: {exc.strerror}") from None
                busy += port not in first
        lo, hi = self.port_span()
        held = sum(1 for a, p, n in self._used if a == af and p == proto and lo <= n <= hi)
        raise ProxyPortsExhausted(fam, proto, (lo, hi), held, busy)

    # ------------------------------------------------------------------------------------------ apply

    def apply(self, batch: UsBatch) -> Applied:
        # (the cyclic collector is held off by the ledger's shared pause around the whole sync: kproxy.gcpause)
        self.start()
        span = render.proxy_ports_element(self.port_span())  # resolved here: bind_all runs on the kernel's thread
        fam = batch.family
        t0 = time.perf_counter()
        adopted = batch.adopted
        tx = _Tx()
        f = render.nft_family(fam)
        refused: dict[ServicePortName, str] = {}

        targets: dict[ServicePortName, Fragment | None]
        if batch.full:
            targets = dict(batch.wanted)
        else:
            if not self._known[fam]:
                return Applied(ok=False, error="kernel state unknown: a full sync must come first", need_full=True)
            targets = {d.name: d.new_fragment for d in batch.deltas}

        # who may claim an address . protocol . port is decided in the core (kproxy.admission): no two fragments
        # of one batch name the same element
        for spn in targets:  # the ledger's order (sorting 10,000 names cost 0.1 s)
            frag = targets[spn]
            if frag is not None and frag.unsupported and spn not in self._warned:
                self._warned.add(spn)
                log.warning("%s: %s", render.service_key(spn), frag.unsupported)

        # proxy sockets that stopped listening under us (closed by hand, ss -K; the port perhaps taken by someone
        # else since): dropped here, so bind_all binds new ones and the redirects name those
        dead = [i for i in list(self.engine.dead) if i[0] == fam and i in self._ports]
        if batch.full and adopted is not None and adopted.live is not None:
            dead += [
                i
                for i, port in self._ports.items()
                if i[0] == fam and i not in dead and (i[1].protocol.lowercase, port) not in adopted.live
            ]
        if dead:
            log.warning(
                "%s: proxy sockets no longer listening, bound anew: %s",
                fam.value,
                ", ".join(f"{render.service_key(i[1])} {i[2]} port {self._ports[i]}" for i in dead),
            )
            self._forget(dead)

        # proxy sockets: bound before any redirect names them
        new_socks: dict[Ident, tuple[socket.socket, int]] = {}
        ports_of: dict[ServicePortName, dict[str, int]] = {}

        def bind_all() -> None:
            for spn, frag in targets.items():
                if frag is None:
                    continue
                preferred = adopted.ports(frag) if adopted is not None and adopted.layout_ok else {}
                ports: dict[str, int] = {}
                for lst in frag.listeners:
                    ident = (fam, spn, lst.role)
                    port = self._ports.get(ident)
                    if port is None:
                        want_port = preferred.get(lst.role)
                        if want_port and not self.in_span(want_port):
                            want_port = None  # a port of an earlier range: moved into this one
                        taken = self._take_over(fam, frag.proto, want_port) if want_port else None
                        try:
                            sock, port = taken or self._bind(fam, frag.proto, want_port)
                        except ProxyPortsExhausted as exc:
                            refused[spn] = str(exc)
                            break
                        except OSError as exc:
                            refused[spn] = f"proxy socket: {exc}"
                            break
                        new_socks[ident] = (sock, port)
                    ports[lst.role] = port
                ports_of[spn] = ports

        self.kernel.call(bind_all)

        def drop_new() -> None:
            for (ident_fam, _, _), (sock, port) in new_socks.items():
                self._used.discard((sock.family, "tcp" if sock.type == socket.SOCK_STREAM else "udp", port))
                del ident_fam
                sock.close()

        if refused:
            drop_new()
            return Applied(ok=False, refused=MappingProxyType(refused), error=next(iter(refused.values())))

        want: dict[ServicePortName, frozenset[tuple[str, str, str]]] = {
            spn: frag.kernel_elements(ports_of[spn]) for spn, frag in targets.items() if frag is not None
        }
        comments = {spn: frag.comment for spn, frag in targets.items() if frag is not None}
        fresh = False
        if batch.full:
            kernel: dict[ElemKey, tuple[str, str]] = {}
            if adopted is None or not adopted.layout_ok:
                fresh = True
                if adopted is None or adopted.table:  # unreadable or another layout: replaced in one transaction
                    tx.add(f"add table {f} {render.TABLE}")
                    tx.add(f"delete table {f} {render.TABLE}")
                for line in render.fixed_commands(fam):
                    tx.add(line)
            else:
                kernel = adopted.elements
            cidrs = render.nodeport_cidrs(batch.context)
            if fresh or adopted is None or adopted.nodeport_cidrs != spans(cidrs):
                if not fresh:
                    tx.add(f"flush set {f} {render.TABLE} {render.NODEPORT_CIDRS}")
                if cidrs:
                    tx.add(f"add element {f} {render.TABLE} {render.NODEPORT_CIDRS} {{ {', '.join(cidrs)} }}")
            if fresh or adopted is None or adopted.proxy_ports != (span,):
                if not fresh:
                    tx.add(f"flush set {f} {render.TABLE} {render.PROXY_PORTS}")
                tx.add(f"add element {f} {render.TABLE} {render.PROXY_PORTS} {{ {span} }}")
            if not kernel:  # nothing there (a fresh table): every element is an add, no diff to compute
                for spn, elems in want.items():
                    c = comments[spn]
                    for m, k, v in elems:
                        tx.add(render.element_line(fam, "add", m, k, v, c), spn)
            else:
                desired: dict[ElemKey, tuple[str, ServicePortName]] = {}
                for spn, elems in want.items():
                    for m, k, v in elems:
                        desired[(m, k)] = (v, spn)
                deletes = [
                    (mk, None)
                    for mk, (v, c) in kernel.items()
                    if mk not in desired or desired[mk][0] != v or comments.get(desired[mk][1]) != c
                ]
                adds = [
                    (mk, spn)
                    for mk, (v, spn) in desired.items()
                    if mk not in kernel or kernel[mk][0] != v or kernel[mk][1] != comments[spn]
                ]
                for (m, k), owner in deletes:
                    tx.add(render.element_line(fam, "delete", m, k, "", ""), owner)
                for (m, k), spn in adds:
                    tx.add(render.element_line(fam, "add", m, k, desired[(m, k)][0], comments[spn]), spn)
        else:
            dels: list[tuple[str, str, ServicePortName]] = []
            adds2: list[tuple[str, str, str, ServicePortName]] = []
            for spn in targets:
                old = self._written[fam].get(spn, frozenset())
                new = want.get(spn, frozenset())
                old_keys = {(m, k): v for m, k, v in old}
                new_keys = {(m, k): v for m, k, v in new}
                for mk, v in old_keys.items():
                    if new_keys.get(mk) != v:
                        dels.append((mk[0], mk[1], spn))
                for mk, v in new_keys.items():
                    if old_keys.get(mk) != v:
                        adds2.append((mk[0], mk[1], v, spn))
            for m, k, spn in dels:
                tx.add(render.element_line(fam, "delete", m, k, "", ""), spn)
            for m, k, v, spn in adds2:
                tx.add(render.element_line(fam, "add", m, k, v, comments[spn]), spn)
        render_s = time.perf_counter() - t0

        text = tx.text()
        apply_s = 0.0
        figures = {
            "commands": len(tx.lines),
            "elements_added": sum(1 for ln in tx.lines if ln.startswith("add element")),
            "elements_deleted": sum(1 for ln in tx.lines if ln.startswith("delete element")),
        }
        if text:
            res = self.kernel.run(text)
            apply_s = res.seconds
            if not res.ok:
                self.kernel.call(drop_new)
                self._known[fam] = False
                summary, named = nft_tools.refused(res, tx.owner_of)
                return Applied(
                    ok=False, refused=named, error=summary, kernel_refusals=1, figures=MappingProxyType(figures)
                )

        # the kernel holds it: hand the data path its new sockets and endpoints, close what nothing names now
        specs: list[ListenerSpec] = []
        wanted_idents: set[Ident] = set()
        for spn, frag in targets.items():
            if frag is None:
                continue
            for lst in frag.listeners:
                ident = (fam, spn, lst.role)
                wanted_idents.add(ident)
                sock = new_socks.get(ident, (None, 0))[0]
                specs.append(ListenerSpec(ident, frag.proto, sock, lst.endpoints, float(lst.affinity)))
        if batch.full:
            remove = [i for i in self._ports if i[0] == fam and i not in wanted_idents]
        else:
            remove = [i for i in self._ports if i[0] == fam and i[1] in targets and i not in wanted_idents]
        self.engine.update(specs, [])
        self._forget(remove)
        af = int(socket.AF_INET if fam == IPFamily.V4 else socket.AF_INET6)
        for ident, (_, port) in new_socks.items():
            self._ports[ident] = port
            _HOLDERS[(self.netns, af, ident[1].protocol.lowercase, port)] = weakref.ref(self)

        if batch.full:
            self._written[fam] = dict(want)
            if fresh:
                tcp_n = sum(1 for i in self._ports if i[0] == fam and i[1].protocol.lowercase == "tcp")
                udp_n = sum(1 for i in self._ports if i[0] == fam and i[1].protocol.lowercase == "udp")
                self._last_full[fam] = (text, tcp_n, udp_n)
        else:
            for spn in targets:
                if spn in want:
                    self._written[fam][spn] = want[spn]
                else:
                    self._written[fam].pop(spn, None)
        self._known[fam] = True
        figures["proxy_sockets"] = sum(1 for i in self._ports if i[0] == fam)
        self._counts[fam] = figures
        return Applied(
            ok=True,
            figures=MappingProxyType(figures),
            timings=MappingProxyType({"render_apply": render_s, "apply": apply_s}),
        )

    def _forget(self, idents: Iterable[Ident]) -> None:
        """Close these listeners (the loop lets go of them) and free their ports."""
        idents = list(idents)
        if not idents:
            return
        self.engine.update([], idents)
        for ident in idents:
            port = self._ports.pop(ident)
            af = int(socket.AF_INET if ident[0] == IPFamily.V4 else socket.AF_INET6)
            proto = ident[1].protocol.lowercase
            self._used.discard((af, proto, port))
            key = (self.netns, af, proto, port)
            if key in _HOLDERS and _HOLDERS[key]() is self:
                del _HOLDERS[key]

    # ------------------------------------------------------------------------------------------ bench

    def measure_floor(self) -> float | None:
        """What the kernel alone takes for the last full sync that built the table from nothing: ``nft -f`` of its
        exact transaction plus binding (and for TCP listening on) as many sockets, in a fresh namespace of its own
        (``kpu-floor-…``), deleted afterwards."""
        work = [v for v in self._last_full.values() if v[0]]
        if not work:
            return None
        total = 0.0
        with scratch_netns("kpu-floor-") as ns:
            for (text, tcp_n, udp_n), fam in zip(work, self._last_full, strict=True):
                seconds = nft_tools.file_seconds(ns, text)
                if seconds is None:
                    return None
                try:
                    bound = in_netns(
                        ns, functools.partial(_bind_seconds, fam, tcp_n, udp_n), timeout=600, name="kpu-floor"
                    )
                except (OSError, TimeoutError) as exc:
                    log.warning("floor: binding sockets in %s failed: %s", ns, exc)
                    return None
                if bound is None:
                    return None
                total += seconds + bound
        return total


def _bind_seconds(fam: IPFamily, tcp_n: int, udp_n: int) -> float | None:
    """Seconds binding (and for TCP listening on) ``tcp_n`` + ``udp_n`` wildcard sockets takes in the calling
    thread's namespace (``measure_floor``), None when binding failed (logged)."""
    af = socket.AF_INET if fam == IPFamily.V4 else socket.AF_INET6
    wildcard = "0.0.0.0" if fam == IPFamily.V4 else "::"
    # explicit ports, as _bind picks them; in batches closed in between, since this process
    # still holds its own proxy sockets and the descriptor limit is shared
    lo = 20000
    spent = 0.0
    try:
        for kind, n in ((socket.SOCK_STREAM, tcp_n), (socket.SOCK_DGRAM, udp_n)):
            for first in range(0, n, FLOOR_BATCH):
                socks = []
                t1 = time.perf_counter()
                try:
                    for i in range(first, min(n, first + FLOOR_BATCH)):
                        so = socket.socket(af, kind)
                        socks.append(so)
                        so.bind((wildcard, lo + i % 40000))
                        if kind == socket.SOCK_STREAM:
                            so.listen(BACKLOG)
                    spent += time.perf_counter() - t1
                finally:
                    for so in socks:
                        so.close()
    except OSError as exc:
        log.warning("floor: binding %d sockets failed: %s", tcp_n + udp_n, exc)
        return None
    return spent
