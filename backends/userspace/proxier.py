"""The userspace backend's Proxier: the ledger's protocol for proxy sockets and the redirect elements that reach them.

It syncs through the core's ledger (``kproxy.backend.LedgerProxier``): ``render`` turns a ServicePort into a
``Fragment`` (redirect elements by role, listeners with their endpoints); ``apply`` binds a proxy socket for every
listener that has none yet (``ports.PortPool``), writes the element changes as one libnftables transaction
(``render.Tx``), and then hands new sockets, new endpoint lists and closed listeners to the data path
(``datapath.Engine``) in one step of its loop. The order matters: a socket is listening before any redirect points
at it, and is closed only after the redirect is gone.

Full batches diff what every wanted service needs against what the kernel holds (``adopt.read``), so a restart
rebinds the ports its rules name and writes nothing when it can; partial batches diff each dirty service's old
elements against its new ones. A refused transaction changes nothing; the refused command's line names the service
(``Applied.refused``), and the ledger retries without it. Reading back, cleanup and the packet explainer are
``adopt``, ``cleanup`` and ``trace``; what talks to the kernel besides the transaction is ``kernel``.
"""

from __future__ import annotations

import functools
import logging
import socket
import time
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar

from kproxy.admission import Limits
from kproxy.backend import LedgerProxier
from kproxy.batch import Applied, Batch
from kproxy.config import ProxyConfig
from kproxy.counters import CounterDump, Measure
from kproxy.drift import Drift
from kproxy.model import IPFamily, ProxyState, ServicePort, ServicePortName, Verdict
from kproxy.nftkernel import Nft, available
from kproxy.nodeaddr import FamilyContext
from kproxy.proxier import Availability, KernelHooks, Option
from kproxy.relay.datapath import Engine, ListenerSpec
from kproxy.relay.dump import dump as dump_counters
from kproxy.relay.udp import Duration
from kproxy.toolkit import nft as nft_tools
from kproxy.toolkit.cidr import spans
from kproxy.toolkit.trace import traced

from . import cleanup, render
from . import trace as tracing
from .adopt import Adopted, Served, View, extra, fixed_problems, parse_table, service_problems
from .adopt import read as read_adopted
from .kernel import context as kernel_context
from .kernel import floor_seconds, guard_ports, listening, missing, own_socket_inodes, raise_open_file_limit, read_table
from .ports import (
    DEFAULT_PORT_RANGE,
    Ident,
    PortPool,
    PortRange,
    ProxyPortsExhausted,
    Sockets,
    descriptor_budget,
    parse_port_range,
    socket_family,
)
from .render import Elements, Fragment, Tx

log = logging.getLogger(__name__)

CHECK_INTERVAL = 1.0  # seconds between "is my table still there" checks at the start of partial syncs

UsBatch = Batch[Fragment, FamilyContext, Adopted, None]
Targets = Mapping[ServicePortName, Fragment | None]  # a batch's services: their fragment, None to remove


#: proxy sockets by (namespace, address family, protocol, port) -> the instance holding them, so that a second
#: instance in one process (``kproxy bench sync``'s restart figure: a fresh backend adopting what the kernel holds
#: while the first still runs) takes the sockets its rules name over, as a restarted process rebinds them
_HOLDERS: dict[tuple[str | None, int, str, int], weakref.ref[UserspaceProxier]] = {}

_SEEN_NODE = "the endpoint sees the node (the proxy's own connection), never the client's address"


@dataclass(slots=True)
class _Bound:
    """The proxy sockets of one batch: those bound for it, every target's ports by role, and the services refused
    for want of a socket."""

    new: dict[Ident, tuple[socket.socket, int]] = field(default_factory=dict)
    ports: dict[ServicePortName, dict[str, int]] = field(default_factory=dict)
    refused: dict[ServicePortName, str] = field(default_factory=dict)


class UserspaceProxier(LedgerProxier[Fragment, FamilyContext, Adopted, View, None]):
    """Proxy sockets in kproxy itself, reached through redirects in a table of this mode's own (see the package
    docstring)."""

    mode: ClassVar[str] = "userspace"
    kernel_hooks: ClassVar[KernelHooks | None] = cleanup  # remnants, kernel_view, cleanup_leftovers
    CHECK_INTERVAL_S: ClassVar[float | None] = CHECK_INTERVAL
    DRIFT: ClassVar[Drift | None] = Drift(frozenset({render.TABLE}))  # the redirect table announces its changes
    #: redirects are NAT through conntrack: stale UDP entries are reconciled, answered by the node's proxy ports
    uses_conntrack_nat: ClassVar[bool] = True
    #: established connections are the proxy's own sockets: they end with the process (restart, mode switch)
    survives_restart: ClassVar[bool] = False
    counters_offered: ClassVar[frozenset[Measure]] = frozenset({Measure.CONNECTIONS, Measure.BYTES})
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
        self.udp_timeout = float(Duration(opts.get("udp_timeout", 0.25)))
        self._kernel = kernel_context(netns)
        #: the proxy port range (the kernel's ephemeral range, read in the namespace, when none is configured)
        self.pool = PortPool(
            parse_port_range(str(opts.get("proxy_port_range", DEFAULT_PORT_RANGE))), lambda fn: self.kernel.call(fn)
        )
        self.engine = Engine(netns, udp_timeout=self.udp_timeout, counting=config.service_counters)
        self.engine.on_dead = lambda ident: self.request_full(ident[0])  # a full sync binds a new socket
        self._started = False
        self.bound = Sockets()  # every proxy socket the data path holds, and its port
        self._warned: set[ServicePortName] = set()  # unsupported services already logged
        self._written: dict[IPFamily, dict[ServicePortName, Elements]] = {f: {} for f in self.families}
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
        return MappingProxyType({"source-ip": f"a userspace proxy cannot preserve the client's IP: {_SEEN_NODE}"})

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
        counters = (
            "its table's map elements carry no counters, so a rewrite of the guard's elements with the same content "
            "cannot be seen (elements that come or go still are)"
        )
        return MappingProxyType(
            {
                "etp-local": MappingProxyType({"client-ip": client_ip}),
                "address-collision": MappingProxyType({"while-down": down}),
                "dual-stack": MappingProxyType({"client-ip": client_ip, "kernel-counters": counters}),
                "restart": MappingProxyType({"held-connection": own, "while-down": down}),
                "mode-switch": MappingProxyType({"held-connections": own, "while-down": down}),
            }
        )

    # ------------------------------------------------------------------------------------------ lifecycle

    @property
    def kernel(self) -> Nft:
        return self._kernel.get()

    def start(self) -> None:
        """Raise the open-file limit and start the data-path thread. Idempotent; ``apply`` calls it too (``kproxy
        bench sync`` syncs without ``start``)."""
        if self._started:
            return
        raise_open_file_limit()
        self.kernel.ready()  # libnftables' socket on a low descriptor, before the proxy sockets (kproxy.nftkernel)
        self.engine.start()
        self._started = True

    def _forget_sockets(self) -> None:
        for key in [k for k, ref in _HOLDERS.items() if ref() is self]:
            del _HOLDERS[key]
        self.bound.clear()
        self.pool.used.clear()

    def close(self) -> None:
        self.engine.stop()
        self._started = False
        self._forget_sockets()
        self._kernel.close()

    def cleanup(self) -> None:
        if self._started:
            self.engine.update([], list(self.bound))
        self._forget_sockets()
        self._written = {f: {} for f in self.families}
        self._known = {f: False for f in self.families}
        super().cleanup()

    # ------------------------------------------------------------------------------------------ ledger methods

    def context(self, node: FamilyContext, state: ProxyState) -> FamilyContext:
        self._local[node.family] = node.local_addresses
        return node.without_addresses()

    def render(self, sp: ServicePort, ctx: FamilyContext) -> Fragment:
        return render.render_service(sp)

    def adopt(self, family: IPFamily, ctx: FamilyContext) -> Adopted | None:
        objs, err = read_table(self.kernel, family)
        if objs is None and not missing(err):
            log.warning("%s: reading the userspace table failed (%s): it will be replaced", family.value, err)
            return None
        return read_adopted(objs, family, self._live_sockets(family))

    def _live_sockets(self, family: IPFamily) -> set[tuple[str, int]] | None:
        """(proto, port) of the data path's proxy sockets that the kernel's socket table shows listening (TCP) or
        bound (UDP) now; None before the data path runs. The data path's own inodes stand for "this process's"
        here (``verify`` reads the descriptors, which costs more at thousands of sockets)."""
        if not self._started:
            return None
        mine = {inode for inode, (ident, _, _, dead) in self.engine.table().items() if ident[0] == family and not dead}
        socks = self.kernel.call(lambda: listening(family))
        return {pp for pp, inodes in socks.items() if any(i in mine for i in inodes)}

    def adopted_unchanged(self, adopted: Adopted, name: ServicePortName, fragment: Fragment) -> bool:
        return adopted.unchanged(fragment)

    def needs_full(self, family: IPFamily) -> bool:
        # the guard's small set: a deleted table, or a flushed set (the proxy ports open to direct connections) both
        # bring the full sync that rewrites it
        held = guard_ports(self.kernel, family)
        if held != [render.proxy_ports_element(self.pool.span())]:
            if held is not None:
                log.warning(
                    "%s: the proxy port guard's set %s was changed: it is rewritten", family.value, "proxy-ports"
                )
            self._known[family] = False
            return True
        # the fixed rules, at most once per sync period (as the iptables mode's canary): a flushed table keeps its
        # sets, and the periodic full sync that would see it comes once an hour. Listed terse (without elements)
        now = time.monotonic()
        if now - self._rules_checked.get(family, float("-inf")) < max(self.config.sync_period, CHECK_INTERVAL):
            return False
        self._rules_checked[family] = now
        objs, _ = read_table(self.kernel, family, terse=True)
        damaged = fixed_problems(objs, family) if objs is not None else {("table", -1): "unreadable"}
        if damaged:
            log.warning("%s: this mode's fixed rules are damaged: %s", family.value, "; ".join(damaged.values()))
            self._known[family] = False
            return True
        return False

    # ------------------------------------------------------------------------------------------ verify

    def verify_view(self, family: IPFamily, ctx: FamilyContext) -> View:
        """The table (elements, chains, the fixed rules), the namespace's listening sockets from the kernel, which
        of them this process holds, and what the data path serves on each (see ``adopt``)."""
        view = View(
            family, want_cidrs=render.nodeport_cidrs(ctx), want_ports=render.proxy_ports_element(self.pool.span())
        )
        objs, err = read_table(self.kernel, family)
        if objs is None:
            if not missing(err):
                view.error = err or "nft list table failed"
                return view
        else:
            parse_table(view, objs)
        view.sockets, view.mine = self.kernel.call(lambda: (listening(family), own_socket_inodes()))
        if self._started:
            view.served = {
                inode: Served(ident, endpoints, affinity, dead)
                for inode, (ident, endpoints, affinity, dead) in self.engine.table().items()
                if ident[0] == family
            }
        return view

    def verify_error(self, view: View) -> str | None:
        return view.error

    def verify_service(self, view: View, name: ServicePortName, fragment: Fragment) -> str | None:
        """Its elements with their verdicts and marks, the fixed rules its traffic passes, and for each proxy port
        its elements name: a socket of this process listening there that the data path serves for this service
        and role, balancing over the wanted endpoints."""
        return service_problems(view, name, fragment)

    def verify_extra(self, view: View, wanted: Mapping[ServicePortName, Fragment]) -> list[str]:
        return extra(view, wanted)

    # ------------------------------------------------------------------------------------------ describe, trace

    def detail(self, name: ServicePortName, family: IPFamily, fragment: Fragment) -> dict[str, Any]:
        return {
            "table": f"{render.nft_family(family)} {render.TABLE}",
            **({"unsupported": fragment.unsupported} if fragment.unsupported else {}),
            "elements": [f"{e.map}: {e.key} : {e.verdict}" for e in fragment.entries],
            "firewall": list(fragment.firewall),
            "proxySockets": [
                {
                    "role": lst.role,
                    "port": self.bound.get((family, name, lst.role)),
                    "endpoints": [f"[{ip}]:{p}" if ":" in ip else f"{ip}:{p}" for ip, p in lst.endpoints],
                    "sessionAffinitySeconds": lst.affinity,
                }
                for lst in fragment.listeners
            ],
        }

    def detail_global(self) -> dict[str, Any]:
        counts = {fam.value: dict(c) for fam, c in list(self._counts.items())}
        return {"table": render.TABLE, "layout": render.LAYOUT, "counts": counts, **self.engine.stats()}

    def counters(self, family: IPFamily) -> CounterDump | None:
        """The relay's own tallies (``kproxy.relay.dump``, one step of its loop); None with counting off."""
        return dump_counters(self.engine, family) if self.engine.counting else None

    def conntrack_answerers(self, sp: ServicePort) -> Iterable[tuple[str, int]]:
        """A UDP flow to a service is answered by the node: by the proxy socket of the service, from the address
        the redirect chose (the receiving interface's first address, or loopback for the node's own traffic)."""
        fam = sp.family
        bound = self.bound  # keyed (family, service port, role): three lookups, never a walk of every socket
        ports = [p for p in (bound.get((fam, sp.name, role)) for role in render.ROLES) if p is not None]
        if not ports or (sp.internal_verdict is not Verdict.FORWARD and sp.external_verdict is not Verdict.FORWARD):
            return []
        addrs = set(self._local.get(fam, ())) | {"127.0.0.1" if fam == IPFamily.V4 else "::1"}
        return [(a, p) for a in addrs for p in ports]

    def trace(
        self, src: str, proto: str, dst: str, dport: int, *, src_local: bool = False, dst_local: bool = False
    ) -> dict[str, Any]:
        """Where a new connection's first packet would go through what was last applied (see ``trace.py``)."""
        walk = functools.partial(tracing.walk, dict(self.bound))
        return traced(self.applied, walk, src, proto, dst, dport, src_local=src_local, dst_local=dst_local)

    # ------------------------------------------------------------------------------------------ ports

    def limits(self, family: IPFamily) -> Limits:
        """A service port takes at least one proxy port of its protocol's pool in ``--proxy-port-range``: more
        service ports than the range holds never fit (the core refuses them before anything is bound). Within it,
        a pool that runs out (one protocol's ports, or a Local policy's second socket) refuses the service port that
        needed one more (``ProxyPortsExhausted``). Each socket is a descriptor too: no more than the open-file limit
        leaves room for (``descriptor_budget``), so a large table is refused service by service in the core rather
        than failing its writes when the process runs out of descriptors."""
        budget = descriptor_budget()
        ports = self.pool.capacity()
        return Limits(service_ports=ports if budget is None else min(ports, budget))

    def _take_over(self, fam: IPFamily, proto: str, port: int) -> tuple[socket.socket, int] | None:
        """The proxy socket on ``port`` from another instance of this process that holds it (see ``_HOLDERS``)."""
        af = socket_family(fam)
        ref = _HOLDERS.get((self.netns, af, proto, port))
        holder = ref() if ref is not None else None
        if holder is None or holder is self:
            return None
        sock = holder._hand_over(fam, proto, port)
        if sock is None:
            return None
        self.pool.take(af, proto, port)
        return sock, port

    def _hand_over(self, fam: IPFamily, proto: str, port: int) -> socket.socket | None:
        """Give up the proxy socket on ``port`` (its listener leaves the loop, the socket stays open) for another
        instance of this process that adopts the rules naming it."""
        ident = next(
            (i for i, p in self.bound.items() if p == port and i[0] == fam and i[1].protocol.lowercase == proto), None
        )
        if ident is None or not self._started:
            return None
        sock: socket.socket | None = self.engine.run(lambda: self.engine.detach(ident))
        if sock is None:
            return None
        self.bound.take(ident)
        af = socket_family(fam)
        self.pool.release(af, proto, port)
        _HOLDERS.pop((self.netns, af, proto, port), None)
        return sock

    def _new_socket(self, fam: IPFamily, proto: str, want_port: int | None) -> tuple[socket.socket, int]:
        """A proxy socket for one listener: on ``want_port`` (the port its rules name) when it is in the range,
        taken over from another instance or bound anew, else on the next free port."""
        if want_port and not self.pool.contains(want_port):
            want_port = None  # a port of an earlier range: moved into this one
        taken = self._take_over(fam, proto, want_port) if want_port else None
        return taken or self.pool.bind(fam, proto, want_port)

    def _bind_all(self, fam: IPFamily, targets: Targets, adopted: Adopted | None) -> _Bound:
        """Every target's listeners with a socket: those the data path holds keep theirs, the others get one (the
        kernel's thread: in the backend's namespace). A service port that gets none is refused."""
        bound = _Bound()
        for spn, frag in targets.items():
            if frag is None:
                continue
            preferred = adopted.ports(frag) if adopted is not None and adopted.layout_ok else {}
            ports: dict[str, int] = {}
            for lst in frag.listeners:
                ident = (fam, spn, lst.role)
                port = self.bound.get(ident)
                if port is None:
                    try:
                        sock, port = self._new_socket(fam, frag.proto, preferred.get(lst.role))
                    except ProxyPortsExhausted as exc:
                        bound.refused[spn] = str(exc)
                        break
                    except OSError as exc:
                        bound.refused[spn] = f"proxy socket: {exc}"
                        break
                    bound.new[ident] = (sock, port)
                ports[lst.role] = port
            bound.ports[spn] = ports
        return bound

    def _drop_new(self, bound: _Bound) -> None:
        """Close the sockets bound for a batch that did not reach the kernel."""
        for sock, port in bound.new.values():
            self.pool.release(sock.family, "tcp" if sock.type == socket.SOCK_STREAM else "udp", port)
            sock.close()

    # ------------------------------------------------------------------------------------------ apply

    def apply(self, batch: UsBatch) -> Applied:
        # (the cyclic collector is held off by the ledger's shared pause around the whole sync: kproxy.gcpause)
        self.start()
        self.pool.span()  # resolved here: binding runs on the kernel's thread
        fam, t0 = batch.family, time.perf_counter()
        if not batch.full and not self._known[fam]:
            return Applied(ok=False, error="kernel state unknown: a full sync must come first", need_full=True)
        targets = dict(batch.wanted) if batch.full else {d.name: d.new_fragment for d in batch.deltas}
        self._warn_unsupported(targets)
        self._drop_dead(fam, batch.adopted if batch.full else None)
        bound = self.kernel.call(functools.partial(self._bind_all, fam, targets, batch.adopted))
        if bound.refused:
            self._drop_new(bound)
            return Applied(ok=False, refused=MappingProxyType(bound.refused), error=next(iter(bound.refused.values())))
        want = {spn: frag.kernel_elements(bound.ports[spn]) for spn, frag in targets.items() if frag is not None}
        tx, fresh = self._transaction(batch, targets, want)
        render_s = time.perf_counter() - t0
        figures = tx.figures()
        apply_s = 0.0
        if tx.lines:
            res = self.kernel.run(tx.text())
            apply_s = res.seconds
            if not res.ok:
                self._drop_new(bound)
                self._known[fam] = False
                summary, named = nft_tools.refused(res, tx.owner_of)
                return Applied(
                    ok=False, refused=named, error=summary, kernel_refusals=1, figures=MappingProxyType(figures)
                )
        self._hand_to_data_path(fam, batch.full, targets, bound)
        self._record(fam, batch.full, targets, want, tx.text() if fresh else "")
        figures["proxy_sockets"] = self.bound.count(fam)
        self._counts[fam] = figures
        return Applied(
            ok=True,
            figures=MappingProxyType(figures),
            timings=MappingProxyType({"render_apply": render_s, "apply": apply_s}),
        )

    def _warn_unsupported(self, targets: Targets) -> None:
        for spn, frag in targets.items():  # the ledger's order
            if frag is not None and frag.unsupported and spn not in self._warned:
                self._warned.add(spn)
                log.warning("%s: %s", render.service_key(spn), frag.unsupported)

    def _drop_dead(self, fam: IPFamily, adopted: Adopted | None) -> None:
        """Proxy sockets that stopped listening under us (closed by hand, ``ss -K``; the port perhaps taken by someone
        else since): the loop saw it, or (a full batch) the kernel's socket table no longer shows them. Dropped, so
        binding gives them new sockets and the redirects name those."""
        dead = [i for i in list(self.engine.dead) if i[0] == fam and i in self.bound]
        if adopted is not None and adopted.live is not None:
            live = adopted.live
            dead += [
                i
                for i, port in self.bound.items()
                if i[0] == fam and i not in dead and (i[1].protocol.lowercase, port) not in live
            ]
        if dead:
            log.warning(
                "%s: proxy sockets no longer listening, bound anew: %s",
                fam.value,
                ", ".join(f"{render.service_key(i[1])} {i[2]} port {self.bound[i]}" for i in dead),
            )
            self._forget(dead)

    def _transaction(
        self, batch: UsBatch, targets: Targets, want: Mapping[ServicePortName, Elements]
    ) -> tuple[Tx, bool]:
        """The batch's transaction, and whether it builds the table from nothing."""
        fam = batch.family
        tx = Tx()
        comments = {spn: frag.comment for spn, frag in targets.items() if frag is not None}
        if not batch.full:
            render.delta_element_lines(tx, fam, targets, self._written[fam], want, comments)
            return tx, False
        adopted = batch.adopted
        span = render.proxy_ports_element(self.pool.span())
        cidrs = render.nodeport_cidrs(batch.context)
        if adopted is None or not adopted.layout_ok:
            replace = adopted is None or adopted.table
            render.table_lines(tx, fam, fresh=True, replace=replace, cidrs=cidrs, span=span)
            render.full_element_lines(tx, fam, {}, want, comments)
            return tx, True
        render.table_lines(
            tx,
            fam,
            fresh=False,
            replace=False,
            cidrs=None if adopted.nodeport_cidrs == spans(cidrs) else cidrs,
            span=None if adopted.proxy_ports == (span,) else span,
        )
        render.full_element_lines(tx, fam, adopted.elements, want, comments)
        return tx, False

    def _hand_to_data_path(self, fam: IPFamily, full: bool, targets: Targets, bound: _Bound) -> None:
        """The kernel holds the batch: the data path takes its new sockets and endpoints in one step, then what no
        target names now is closed."""
        specs: list[ListenerSpec] = []
        wanted: set[Ident] = set()
        for spn, frag in targets.items():
            if frag is None:
                continue
            for lst in frag.listeners:
                ident = (fam, spn, lst.role)
                wanted.add(ident)
                sock = bound.new.get(ident, (None, 0))[0]
                specs.append(ListenerSpec(ident, frag.proto, sock, lst.endpoints, float(lst.affinity)))
        if full:
            held: Iterable[Ident] = [i for i in self.bound if i[0] == fam]
        else:  # only the batch's services' sockets: O(changes)
            held = self.bound.of(fam, targets)
        remove = [i for i in held if i not in wanted]
        self.engine.update(specs, [])
        self._forget(remove)
        af = socket_family(fam)
        for ident, (_, port) in bound.new.items():
            self.bound.put(ident, port)
            _HOLDERS[(self.netns, af, ident[1].protocol.lowercase, port)] = weakref.ref(self)

    def _record(
        self,
        fam: IPFamily,
        full: bool,
        targets: Targets,
        want: Mapping[ServicePortName, Elements],
        fresh_text: str,
    ) -> None:
        """What the kernel holds now, for the next partial batch's diff (and the bench's floor: ``fresh_text``, the
        transaction that built the table from nothing)."""
        if full:
            self._written[fam] = dict(want)
            if fresh_text:
                protos = [i[1].protocol.lowercase for i in self.bound if i[0] == fam]
                self._last_full[fam] = (fresh_text, protos.count("tcp"), protos.count("udp"))
        else:
            for spn in targets:
                if spn in want:
                    self._written[fam][spn] = want[spn]
                else:
                    self._written[fam].pop(spn, None)
        self._known[fam] = True

    def _forget(self, idents: Iterable[Ident]) -> None:
        """Close these listeners (the loop lets go of them) and free their ports."""
        idents = list(idents)
        if not idents:
            return
        self.engine.update([], idents)
        for ident in idents:
            port = self.bound.take(ident)
            af = socket_family(ident[0])
            proto = ident[1].protocol.lowercase
            self.pool.release(af, proto, port)
            key = (self.netns, af, proto, port)
            if key in _HOLDERS and _HOLDERS[key]() is self:
                del _HOLDERS[key]

    # ------------------------------------------------------------------------------------------ bench

    def measure_floor(self, scratch: str) -> float | None:
        """What the kernel alone takes for the last full sync that built the table from nothing, in the bench's
        empty namespace ``scratch`` (``kernel.floor_seconds``)."""
        return floor_seconds(dict(self._last_full), scratch)
