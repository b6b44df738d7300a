"""What the ledger and a backend exchange: the typed protocol a ledger-driven backend implements, and its values.

The ledger (``kproxy.ledger``) drives; a backend is driven. Per IP family the ledger asks the backend for its
rendering ``context`` and one *fragment* per service port (``render``: pure), hands it a ``Batch`` of ``Delta`` values
to ``apply``, and reads the kernel back through ``adopt`` (once per full batch, so a restart writes nothing) and
``verify_view``. Each backend names its own types, so nothing between the two is ``Any``:

- ``F``, the fragment: what one service port renders to (rule text, map elements, BPF entries, a socket spec),
  compared with ``==``;
- ``C``, the family's rendering context (hashable; a change forces a full batch);
- ``A``, what ``adopt`` reads from the kernel; ``V``, what ``verify_view`` reads (often the same type);
- ``S``, the backend's scratch across the refusal rounds of one family's sync (a dataclass of its own: what an
  earlier, partly committed round wrote), created by the backend on first use.

The rest of the contract (the classmethod hooks for the kernel, the lab and the bench; lifecycle; metrics) is
``kproxy.proxier.Proxier``'s and is documented there.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar, Generic, Protocol, TypeVar

from kproxy.admission import Limits
from kproxy.model import IPFamily, ProxyState, ServicePort, ServicePortName
from kproxy.nodeaddr import FamilyContext

F = TypeVar("F")  # a backend's fragment: what one service port renders to (compared with ==)
C = TypeVar("C")  # a backend's per-family rendering context (hashable; compared with ==)
A = TypeVar("A")  # what a backend's ``adopt`` reads from the kernel
V = TypeVar("V")  # what a backend's ``verify_view`` reads from the kernel
S = TypeVar("S")  # a backend's scratch across the refusal rounds of one family's sync


@dataclass(frozen=True, slots=True)
class Delta(Generic[F]):
    """One service port's change in one family. ``old_fragment`` is what the kernel holds (None: nothing, or unknown
    on a full batch without adoption); ``new_fragment`` None means remove it."""

    name: ServicePortName
    old: ServicePort | None
    old_fragment: F | None
    new: ServicePort | None
    new_fragment: F | None

    @property
    def removed(self) -> bool:
        return self.new_fragment is None


@dataclass(slots=True)
class Batch(Generic[F, C, A, S]):
    """What ``apply`` must make true in one family. ``full``: the kernel must hold exactly ``wanted`` (ensure the
    base objects, write ``deltas``, remove anything of the mode's that ``wanted`` lacks); otherwise only ``deltas``.
    ``applied`` is what the ledger records as in the kernel before this batch; ``adopted`` what ``adopt`` read (full
    batches only; None when unknown). ``scratch`` is the backend's own memory across the refusal rounds of this
    family's sync: None in the first round; whatever the backend stores there is handed to the next round's batch."""

    family: IPFamily
    full: bool
    context: C
    deltas: tuple[Delta[F], ...]
    wanted: Mapping[ServicePortName, F]
    applied: Mapping[ServicePortName, F]
    state: ProxyState
    adopted: A | None = None
    scratch: S | None = None

    @property
    def written(self) -> tuple[ServicePortName, ...]:
        """The services this batch (re)writes (not removals)."""
        return tuple(d.name for d in self.deltas if d.new_fragment is not None)


class Overlay(Mapping[ServicePortName, F]):
    """A partial batch's ``wanted``: the applied fragments with the batch's changes laid over them, without a copy
    of the whole table (a partial sync stays O(changes)). Valid while the batch is applied."""

    __slots__ = ("_base", "_new", "_gone")

    def __init__(
        self, base: Mapping[ServicePortName, F], new: Mapping[ServicePortName, F], gone: set[ServicePortName]
    ) -> None:
        self._base, self._new, self._gone = base, new, gone

    def __getitem__(self, key: ServicePortName) -> F:
        if key in self._new:
            return self._new[key]
        if key in self._gone:
            raise KeyError(key)
        return self._base[key]

    def __contains__(self, key: object) -> bool:
        return key in self._new or (key not in self._gone and key in self._base)

    def __iter__(self) -> Iterator[ServicePortName]:
        new, gone = self._new, self._gone
        yield from (k for k in self._base if k not in new and k not in gone)
        yield from new

    def __len__(self) -> int:
        base = self._base
        return (
            len(base)
            - sum(1 for k in self._gone if k in base and k not in self._new)
            + sum(1 for k in self._new if k not in base)
        )


def _no_refusals() -> Mapping[ServicePortName, str]:
    return MappingProxyType({})


def _no_counts() -> Mapping[str, int]:
    return MappingProxyType({})


def _no_timings() -> Mapping[str, float]:
    return MappingProxyType({})


@dataclass(frozen=True, slots=True)
class Applied:
    """What ``apply`` reports. ``refused``: services the kernel refused (the rest of the batch may or may not have
    been applied: the ledger retries with those services kept on their old fragment or left out); ``error`` with
    ``ok`` False and nothing refused: the family failed as a whole (a full sync follows). ``kernel_refusals``: kernel
    transactions refused in this apply (also ones the backend retried itself); ``rules``/``rules_last``/``figures``
    as ``FamilySync``'s (the last apply's stand); ``timings`` (seconds per phase) feed metrics; ``need_full`` asks for
    a full sync soon. ``leftovers``: services the kernel held that nothing wants and no delta names, which this apply
    removed (a full sync after kproxy was down: deleted meanwhile), counted in ``FamilySync.written``."""

    ok: bool = True
    refused: Mapping[ServicePortName, str] = field(default_factory=_no_refusals)
    error: str | None = None
    kernel_refusals: int = 0
    rules: Mapping[str, int] = field(default_factory=_no_counts)
    rules_last: Mapping[str, int] = field(default_factory=_no_counts)
    figures: Mapping[str, int] = field(default_factory=_no_counts)
    timings: Mapping[str, float] = field(default_factory=_no_timings)
    need_full: bool = False
    leftovers: int = 0


class Backend(Protocol[F, C, A, V, S]):
    """What the ledger calls, all in the runner thread but ``detail``/``detail_global`` (any thread, pure, on the
    published snapshot). ``kproxy.ledger.LedgerProxier`` gives every optional method a default."""

    mode: ClassVar[str]
    #: seconds between the ledger's calls of ``needs_full`` per family; None: the sync period (upstream's canary)
    CHECK_INTERVAL_S: ClassVar[float | None]

    def context(self, node: FamilyContext, state: ProxyState) -> C:
        """The family's rendering context; when it differs from the last applied one, the batch is a full one."""
        ...

    def render(self, sp: ServicePort, ctx: C) -> F:
        """One service port's fragment (pure: no kernel, no shared state). The ledger never renders an identical
        ``(sp, ctx)`` twice: it reuses the applied fragment."""
        ...

    def apply(self, batch: Batch[F, C, A, S]) -> Applied:
        """Make the kernel hold what ``batch`` says; report refused services or an error; never raise for one bad
        service."""
        ...

    def adopt(self, family: IPFamily, ctx: C) -> A | None:
        """What the kernel holds now for this mode (once per full batch), or None when unknown."""
        ...

    def adopted_unchanged(self, adopted: A, name: ServicePortName, fragment: F) -> bool:
        """Whether ``adopted`` holds ``fragment`` for ``name`` exactly (then the batch has no delta for it)."""
        ...

    def limits(self, family: IPFamily) -> Limits:
        """What this mode can hold in one family; the core refuses what does not fit before rendering."""
        ...

    def needs_full(self, family: IPFamily) -> bool:
        """The cheap "is my state still there" check, asked when the ledger's schedule says it is due, and by the
        drift watcher between syncs: True only when the state is gone or damaged."""
        ...

    def readback_due(self, family: IPFamily) -> bool:
        """Whether a full batch that reads the kernel back is due although nothing is known to be damaged (a mode
        that trusts its memory of what it wrote between such read-backs); asked with the cheap check before a sync,
        never by the drift watcher (a due read-back is no damage)."""
        ...

    def kernel_read(self, family: IPFamily, at: float | None) -> None:
        """A read-behind (``kproxy.readbehind``) read the kernel back beginning at monotonic time ``at`` and found it
        holding what the ledger records; None: it did not, so the next full batch must adopt from the kernel, not
        from the backend's memory of what it wrote. Any thread."""
        ...

    def verify_view(self, family: IPFamily, ctx: C) -> V | None:
        """What the kernel holds, read now, for ``verify``; None when the mode cannot read it back."""
        ...

    def verify_error(self, view: V) -> str | None:
        """Why ``view`` is not a usable read-back (None: it is)."""
        ...

    def verify_service(self, view: V, name: ServicePortName, fragment: F) -> str | None:
        """None when ``view`` holds ``fragment`` exactly; else ``missing`` or ``different`` with what differs."""
        ...

    def verify_extra(self, view: V, wanted: Mapping[ServicePortName, F]) -> list[str]:
        """What ``view`` holds that no wanted fragment accounts for, one line each."""
        ...

    def detail(self, name: ServicePortName, family: IPFamily, fragment: F) -> dict[str, Any]:
        """The backend's own detail of one applied service, for ``describe()`` (pure)."""
        ...

    def detail_global(self) -> dict[str, Any]:
        """The backend's own global detail for ``describe()``; any thread, no lock."""
        ...
