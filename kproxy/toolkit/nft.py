"""A table of one's own in nftables (the nftables mode's ``kproxy``, the userspace mode's redirect table, the bpf
mode's companion table): its elements read from libnftables' JSON, what of it is left in a namespace (remnants,
the kernel view), deleting it, and a refused transaction's lines mapped back to the services that own them."""

from __future__ import annotations

import json
import logging
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, NamedTuple, TypeVar

from kproxy.model import IPFamily
from kproxy.nftkernel import Nft, Result
from kproxy.proxier import BackendError, KernelProbe

T = TypeVar("T")
log = logging.getLogger(__name__)
FAMILIES = ("ip", "ip6")
_VERDICTS = ("drop", "accept", "return", "continue")


def nft_family(family: IPFamily) -> str:
    """The nft family of an IP family's table: ``ip`` or ``ip6``."""
    return "ip" if family == IPFamily.V4 else "ip6"


# ---------------------------------------------------------------------------------------------------- elements


class Element(NamedTuple):
    """One element of a listed set or map, in nft's text spelling (``198.18.0.1 . tcp . 80``, ``goto svc-x``)."""

    set: str  # the set or map it is in
    key: str
    value: str  # a map element's value (a verdict or data), "" in a set
    comment: str  # "" without one
    counter: tuple[int, int] | None  # (packets, bytes) when the element carries a counter


def elements(objs: Iterable[dict[str, Any]]) -> list[Element]:
    """Every element of the sets and maps among ``list set/map/table`` JSON objects (other objects are skipped)."""
    out: list[Element] = []
    for obj in objs:
        body = obj.get("map") or obj.get("set")
        if not body:
            continue
        name = str(body.get("name", ""))
        for item in body.get("elem") or []:
            data: Any = None
            if isinstance(item, list) and len(item) == 2:  # a map element: [key, value]
                key, data = item
            else:
                key = item
            comment = ""
            counter: tuple[int, int] | None = None
            if isinstance(key, dict) and "elem" in key:
                comment = str(key["elem"].get("comment") or "")
                c = key["elem"].get("counter")
                if isinstance(c, dict):
                    counter = (int(c.get("packets", 0)), int(c.get("bytes", 0)))
                key = key["elem"].get("val")
            out.append(Element(name, key_text(key), "" if data is None else value_text(data), comment, counter))
    return out


def key_text(obj: Any) -> str:
    """An element key (or data) of libnftables' JSON in nft's text spelling."""
    if isinstance(obj, dict):
        if "concat" in obj:
            return " . ".join(key_text(x) for x in obj["concat"])
        if "prefix" in obj:
            return f"{obj['prefix']['addr']}/{obj['prefix']['len']}"
        if "range" in obj:
            lo, hi = obj["range"]
            return f"{key_text(lo)}-{key_text(hi)}"
    return str(obj)


def value_text(obj: Any) -> str:
    """A map element's value of libnftables' JSON in nft's text spelling: a verdict, or data as ``key_text``."""
    if isinstance(obj, dict):
        for verdict in ("goto", "jump"):
            if verdict in obj:
                return f"{verdict} {obj[verdict]['target']}"
        for verdict in _VERDICTS:
            if verdict in obj:
                return verdict
    return key_text(obj)


def element_line(el: Element, comment: str | None = None) -> str:
    """One element as a kernel view line: ``set: key [counter ...] comment "..." [: value]`` (``comment``: the
    comment to show instead of the element's own)."""
    ctr = f" counter packets {el.counter[0]} bytes {el.counter[1]}" if el.counter else ""
    shown = el.comment if comment is None else comment
    return f'{el.set}: {el.key}{ctr} comment "{shown}"' + (f" : {el.value}" if el.value else "")


# ---------------------------------------------------------------------------------------------------- the table


class OwnContext:
    """A backend's libnftables context, made on first use (a backend object is also made where no kernel is
    needed: tests, the bench's planning) and closed by ``close`` (made again if used afterwards)."""

    def __init__(self, netns: str | None, *, worker: bool = True, name: str = "nft") -> None:
        self.netns = netns
        self.worker = worker
        self.name = name
        self._nft: Nft | None = None

    def get(self) -> Nft:
        if self._nft is None:
            self._nft = Nft(self.netns, worker=self.worker, name=self.name)
        return self._nft

    def close(self) -> None:
        if self._nft is not None:
            self._nft.close()
            self._nft = None


def remnants(probe: KernelProbe, table: str) -> list[str]:
    """``table ip <table>`` / ``table ip6 <table>`` where the namespace holds them (BackendError when nft fails)."""
    res = probe.run(["nft", "list", "tables"])
    if res.returncode != 0:
        raise BackendError(f"nft list tables failed: {res.stderr.strip()}")
    own = {f"table {f} {table}" for f in FAMILIES}
    return [line.strip() for line in res.stdout.splitlines() if line.strip() in own]


def listed(probe: KernelProbe, family: IPFamily, table: str) -> list[dict[str, Any]] | None:
    """The JSON objects of ``nft -j list table`` (metainfo left out); None when there is no such table,
    BackendError when nft fails otherwise."""
    fam = nft_family(family)
    res = probe.run(["nft", "-j", "list", "table", fam, table], timeout=60)
    if res.returncode != 0:
        if "No such file" in res.stderr:
            return None
        raise BackendError(f"nft list table {fam} {table} failed: {res.stderr.strip()}")
    return [o for o in json.loads(res.stdout or "{}").get("nftables", []) if "metainfo" not in o]


def delete_text(fam: str, table: str) -> str:
    """The transaction that removes ``table`` of nft family ``fam`` whether or not it exists (a table added and
    deleted in one transaction: nothing of it is left either way)."""
    return f"add table {fam} {table}\ndelete table {fam} {table}\n"


def delete_tables(netns: str | None, table: str, *, worker: bool = True) -> list[str]:
    """Delete ``table`` in both families of ``netns`` (the caller's namespace when None), nothing else. Errors are
    logged and returned (empty: clean), never raised: a leftover must not stop another mode from starting.
    ``worker``: as ``Nft``'s (False: the process's shared context in the caller's namespace)."""
    errors: list[str] = []
    nft = Nft(netns, worker=worker, name="kproxy-cleanup")
    try:
        for fam in FAMILIES:
            res = nft.run(delete_text(fam, table))
            if not res.ok:
                errors.append(f"delete table {fam} {table}: {res.error.strip()}")
                log.warning("cleanup: %s", errors[-1])
    finally:
        nft.close()
    return errors


# ---------------------------------------------------------------------------------------------------- refusals


def summary(error: str) -> str:
    """libnftables' error text in one line: the messages and the refused commands, not the ``^^^~~~`` markers."""
    lines = [ln.strip() for ln in error.splitlines() if ln.strip() and not set(ln.strip()) <= {"^", "~"}]
    return "; ".join(lines[:4])[:600] or "nft refused the transaction"


def refused(res: Result, owner_of: Callable[[int], T | None]) -> tuple[str, Mapping[T, str]]:
    """A refused transaction's summary, and the owners of the lines libnftables named, each with that summary
    (``owner_of``: the owner of a 1-based line of the transaction's text, None for a line no one owns)."""
    why = summary(res.error)
    owners = (owner_of(n) for n in res.error_lines())
    return why, MappingProxyType({o: why for o in owners if o is not None})


def owner_at(owners: Sequence[T | None], lineno: int) -> T | None:
    """The owner of 1-based line ``lineno`` in a transaction whose lines' owners are ``owners``."""
    return owners[lineno - 1] if 0 < lineno <= len(owners) else None


def file_seconds(netns: str, text: str) -> float | None:
    """Seconds ``nft -f`` takes to run ``text`` in ``netns`` (the tool, as an operator would run it), or None when
    it refuses (logged)."""
    with tempfile.NamedTemporaryFile("w", suffix=".nft", prefix="kproxy-floor-") as f:
        f.write(text)
        f.flush()
        t0 = time.perf_counter()
        res = subprocess.run(
            ["ip", "netns", "exec", netns, "nft", "-f", f.name],
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        seconds = time.perf_counter() - t0
    if res.returncode != 0:
        log.warning("floor: nft -f refused the transaction: %s", res.stderr.strip()[:500])
        return None
    return seconds
