"""Talking to the kernel for the nftables mode: applying a batch's transactions (element changes as netlink batches,
``nlwrite``; anything else through libnftables in-process, ``kproxy.nftkernel``), reading the whole table back for
``verify``, and the bench's floors.

Each chunk of a batch is applied in libnftables' worker thread (it releases the GIL) while the next one is built; the
first refused transaction stops the batch, and libnftables' line numbers name the services that own the refused
commands (``kproxy.toolkit.nft.refused``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field

from kproxy.model import IPFamily, ServicePortName
from kproxy.nftkernel import Nft, Result
from kproxy.toolkit import nft as nft_tools

from . import adopt as adopt_mod
from . import layout, nlwrite, render
from .plan import Chunk
from .render import Fragment

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Outcome:
    """What applying a batch's chunks did: the committed texts (while they add up to at most ``keep`` characters:
    a full sync at 100,000 x 10 commits ~70 MB of text, which must not all be held until its last chunk is
    applied), their size, the figures, the timings, and the refused chunk with libnftables' answer (None: all
    committed)."""

    texts: list[str] = field(default_factory=list)
    size: int = 0  # characters committed, kept or not (a netlink batch's text is not made once none is kept)
    dropped: bool = False  # the committed texts did not fit in ``keep``: none is kept
    figures: dict[str, int] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=lambda: {"render_apply": 0.0, "apply": 0.0})
    error: tuple[Chunk, Result] | None = None

    def committed(self, text: str, keep: int) -> None:
        """Count a committed ``text``; keep it while every committed text fits in ``keep`` characters."""
        self.size += len(text)
        if self.size > keep:
            self.texts.clear()
            self.dropped = True
        else:
            self.texts.append(text)

    @property
    def kept(self) -> str | None:
        """Every committed text joined, or None when they did not fit."""
        return None if self.dropped else "".join(self.texts)


def apply_chunks(
    nft: Nft,
    chunks: Iterator[Chunk],
    committed: Callable[[Chunk], None],
    keep: int,
    writer: nlwrite.Writer | None = None,
) -> Outcome:
    """Apply ``chunks`` in order, each while the next is built; ``committed(chunk)`` after each one the kernel took.
    Stops at the first refusal. Keeps the committed texts up to ``keep`` characters (``Outcome.committed``). With a
    ``writer``, a chunk of element changes only is sent as a netlink batch (``nlwrite``); one the kernel refuses is
    applied again through libnftables, whose answer names the refused line."""
    out = Outcome()
    added = deleted = commands = transactions = direct = fallbacks = 0
    pending: tuple[Chunk, str, Future[Result] | Future[Result | None]] | None = None
    while True:
        b0 = time.perf_counter()
        nxt = next(chunks, None)
        messages = nlwrite.encode(nxt.tx) if writer is not None and nxt is not None else None
        # a netlink batch's text is made only if libnftables must take it, or while it may be kept (``committed``)
        text = "" if nxt is None or messages else nxt.tx.text()
        out.timings["render_apply"] += time.perf_counter() - b0
        if pending is not None:
            chunk, ptext, fut = pending
            pending = None
            res = fut.result()
            if res is None:  # the kernel refused the batch, which changed nothing: libnftables names the line
                fallbacks += 1
                ptext = ptext or chunk.tx.text()
                res = nft.run(ptext)
            transactions += 1
            out.timings["apply"] += res.seconds
            if not res.ok:
                out.error = (chunk, res)
                break
            committed(chunk)
            out.committed(ptext or ("" if out.dropped else chunk.tx.text()), keep)
            del chunk, ptext
        if nxt is None:
            break
        added += nxt.tx.elements_added
        deleted += nxt.tx.elements_deleted
        commands += nxt.tx.line_count()
        if messages and writer is not None:
            direct += 1
            pending = (nxt, "", writer.submit(nxt.tx.family, messages))
            messages = None  # the batch holds its bytes
        elif text:
            pending = (nxt, text, nft.submit(text))
        else:
            committed(nxt)
    out.figures = {
        "elements_added": added,
        "elements_deleted": deleted,
        "commands": commands,
        "transactions": transactions,
        "netlink_batches": direct,
        "netlink_refused": fallbacks,
    }
    return out


def creates_objects(family: IPFamily, text: str) -> bool:
    """Whether a committed text created or removed chains or sets (such a change is not replayed by the floor)."""
    fam = render.nft_family(family)
    return any(f" {w} {fam} " in text for w in ("chain", "set"))


Change = tuple[ServicePortName, Fragment | None, Fragment | None]


def _send_now(nft: Nft, writer: nlwrite.Writer | None, tx: render.Transaction) -> Result | None:
    """``tx`` sent as ``apply_chunks`` sends it (a netlink batch when ``nlwrite`` encodes it, else libnftables) and
    waited for, encoded before the timed send; None when the kernel refused the batch."""
    messages = nlwrite.encode(tx) if writer is not None else None
    if writer is not None and messages:
        return writer.submit(tx.family, messages).result()
    return nft.run(tx.text())


def partial_floor(
    nft: Nft, changes: dict[IPFamily, list[Change]], writer: nlwrite.Writer | None = None
) -> float | None:
    """The kernel's own time to take the last partial sync's element changes again, sent as the sync sent them (a
    netlink batch through ``writer`` when it holds element changes only, else libnftables in-process): each change
    is first undone (untimed), then the same transaction is sent and timed. None when undoing or replaying failed
    (logged)."""
    total = 0.0
    for fam, done in changes.items():
        undo, redo = render.Transaction(fam), render.Transaction(fam)
        for spn, old, new in done:
            render.change_service(undo, spn, new, old)
            render.change_service(redo, spn, old, new)
        for what, tx in (("undoing", undo), ("replaying", redo)):
            res = _send_now(nft, writer, tx)
            if res is None or not res.ok:
                error = nft_tools.summary(res.error) if res is not None else "the kernel refused the netlink batch"
                log.warning("partial floor: %s the last change failed: %s", what, error)
                return None
            seconds = res.seconds  # the replay's, once the loop is done
        total += seconds
    return total


def netlink_floor(netns: str, chunks: Iterable[Chunk]) -> float | None:
    """Seconds the kernel takes for ``chunks`` sent as a full sync sends them (``apply_chunks``: element changes as
    netlink batches, anything else through libnftables) into the empty namespace ``netns``: each chunk is built and
    encoded untimed, then its send timed (for the few libnftables chunks, their call: the fixed part's parse is in
    it). The floor of kproxy's own transactions, kproxy's Python left out. None when one is refused (logged)."""
    nft = Nft(netns)
    writer = nlwrite.Writer(nft)
    total = 0.0
    try:
        for chunk in chunks:
            res = _send_now(nft, writer, chunk.tx)
            if res is None or not res.ok:
                log.warning("floor: the kernel refused a transaction: %s", res.error if res else "a netlink batch")
                return None
            total += res.seconds
    finally:
        writer.close()
        nft.close()
    return total


@dataclass(slots=True)
class TableView:
    """What ``verify`` read: every map and set of the table (name -> key -> value), the chain names, the comments of
    every chain's rules (``layout.rule_tag``) and how the fixed chains differ from the layout."""

    family: IPFamily = IPFamily.V4
    maps: dict[str, dict[str, str]] = field(default_factory=dict)
    chains: set[str] = field(default_factory=set)
    rules: dict[str, adopt_mod.Tags] = field(default_factory=dict)
    fixed: list[str] = field(default_factory=list)
    error: str | None = None


def read_table(nft: Nft, family: IPFamily, counters: bool = False) -> TableView:
    """The whole table read back (every map and set with its elements, chain names, rule tags): unlike adoption,
    which trusts the digests in the entry comments, ``verify`` compares every element, slots included."""
    objs, err = nft.read(f"list table {render.nft_family(family)} {layout.TABLE}")
    view = TableView(family)
    if objs is None:
        if "No such file" in err or "does not exist" in err:
            return view  # no table: everything wanted is missing
        view.error = err or "nft list table failed"
        return view
    for obj in objs:
        body = obj.get("map") or obj.get("set")
        if body is not None and body.get("table") == layout.TABLE:
            view.maps[body["name"]] = {el.key: el.value for el in nft_tools.elements([obj])}
        chain = obj.get("chain")
        if chain is not None and chain.get("table") == layout.TABLE:
            view.chains.add(chain["name"])
    rules, err = adopt_mod.read_rules(nft, family)
    if rules is None:
        view.error = err
        return view
    view.rules = rules
    view.fixed = adopt_mod.fixed_problems(family, rules, counters)
    return view
