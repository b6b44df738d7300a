"""The base class of a ledger-driven backend: a ``Proxier`` whose ``sync``, ``describe`` and ``verify`` are the
ledger's (``kproxy.ledger``, ``kproxy.readback``), with a default for every optional method of the typed protocol
(``kproxy.batch.Backend``). A backend derives from ``LedgerProxier[F, C, A, V, S]`` naming its own types, implements
``context``, ``render`` and ``apply`` (and what else of the protocol it has), and never overrides ``sync``: it asks
for a full sync with ``request_full``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Generic

from kproxy.admission import UNLIMITED, Limits
from kproxy.batch import A, Applied, Batch, C, F, S, V
from kproxy.config import ProxyConfig
from kproxy.ledger import Ledger
from kproxy.model import Changes, IPFamily, ProxyState, ServicePort, ServicePortName, SyncResult
from kproxy.nodeaddr import FamilyContext, NodeContext
from kproxy.proxier import Description, Proxier, VerifyReport
from kproxy.readback import describe, verify


class LedgerProxier(Proxier, Generic[F, C, A, V, S]):
    """A backend driven by a ``Ledger`` (see the module docstring); the ledger is ``self.ledger``."""

    #: seconds between the ledger's calls of ``needs_full`` per family (the cheap "is my state still there" check,
    #: before a partial sync once due); None: the sync period, as upstream polls its canary chain
    CHECK_INTERVAL_S: ClassVar[float | None] = 1.0

    def __init__(self, config: ProxyConfig, *, netns: str | None = None) -> None:
        super().__init__(config, netns=netns)
        self.ledger: Ledger[F, C, A, V, S] = Ledger(self, config)
        self.families: tuple[IPFamily, ...] = self.ledger.families

    # -- what a backend implements -----------------------------------------------------------------------------

    def context(self, node: FamilyContext, state: ProxyState) -> C:
        raise NotImplementedError(f"{type(self).__name__} must implement 'context(node, state)'")

    def render(self, sp: ServicePort, ctx: C) -> F:
        raise NotImplementedError(f"{type(self).__name__} must implement 'render(sp, ctx)'")

    def apply(self, batch: Batch[F, C, A, S]) -> Applied:
        raise NotImplementedError(f"{type(self).__name__} must implement 'apply(batch)'")

    # -- optional, with their defaults ---------------------------------------------------------------------------

    def adopt(self, family: IPFamily, ctx: C) -> A | None:
        """Default: nothing is known of the kernel (a full batch rewrites every service)."""
        return None

    def adopted_unchanged(self, adopted: A, name: ServicePortName, fragment: F) -> bool:
        return False

    def limits(self, family: IPFamily) -> Limits:
        """Default: no limit."""
        return UNLIMITED

    def needs_full(self, family: IPFamily) -> bool:
        """Default: the state is always there."""
        return False

    def readback_due(self, family: IPFamily) -> bool:
        """Default: the mode reads the kernel back at every full batch anyway."""
        return False

    def kernel_read(self, family: IPFamily, at: float | None) -> None:
        """Default: nothing to remember (a mode without ``readback_due`` never gets a read-behind)."""

    def verify_view(self, family: IPFamily, ctx: C) -> V | None:
        """Default: the mode cannot read its kernel state back."""
        return None

    def verify_error(self, view: V) -> str | None:
        return None

    def verify_service(self, view: V, name: ServicePortName, fragment: F) -> str | None:
        raise NotImplementedError(f"{type(self).__name__} has a 'verify_view' and must implement 'verify_service'")

    def verify_extra(self, view: V, wanted: Mapping[ServicePortName, F]) -> list[str]:
        return []

    def detail(self, name: ServicePortName, family: IPFamily, fragment: F) -> dict[str, Any]:
        return {}

    def detail_global(self) -> dict[str, Any]:
        return {}

    # -- the contract, from the ledger ---------------------------------------------------------------------------

    def sync(self, state: ProxyState, changes: Changes, node: NodeContext | None = None) -> SyncResult:
        return self.ledger.sync(state, changes, node)

    def describe(self, key: ServicePortName | None = None) -> Description:
        return describe(self.ledger, key)

    def verify(self, state: ProxyState, node: NodeContext | None = None) -> VerifyReport:
        return verify(self.ledger, state, node)

    def request_full(self, family: IPFamily) -> None:
        """Ask for a full batch of ``family`` at its next sync (the backend lost track of the kernel, or its data path
        saw its state go). Any thread."""
        self.ledger.request_full(family)

    def check_now(self, family: IPFamily) -> bool:
        return self.ledger.check_now(family)

    def applied(self, family: IPFamily) -> tuple[C | None, dict[ServicePortName, F]]:
        """(context, fragments) of what the ledger records as in the kernel: a consistent copy, any thread (what
        ``trace`` explains)."""
        return self.ledger.applied(family)

    def applied_fragments(self, family: IPFamily) -> dict[ServicePortName, F]:
        return self.ledger.applied(family)[1]

    def forget(self) -> None:
        """Drop every record (after ``cleanup``): the next sync is a full one that rewrites everything."""
        self.ledger.forget()

    def cleanup(self) -> None:
        super().cleanup()
        self.forget()
