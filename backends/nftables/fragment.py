"""One service port's fragment of the nftables table, as the ledger keeps it: ``Fragment``, its elements held as one
string, and the digest of its content that adoption compares with the kernel's.

The ledger keeps a fragment per service port per family for as long as the service exists (the render memo and the
comparison with the next sync need it), so its size is the nftables mode's memory per service port. Its elements are
held as one packed text (``pack``: ``map|key|value`` lines, a slot's key without its entry's) and its
hairpin elements as another, not as a tuple of three fresh strings per element (about four times the bytes and nine
times the objects for the collector to walk), and the tuple of shared chains is one object for every fragment that
jumps to the same chains. Equality is one string compare after the digest's, and the transaction of a full sync is
written straight from the packed lines (``Transaction.add_fragment``); ``elements`` makes the tuples only where
something asks (the diff of a changed service, ``describe``, ``verify``, the packet explainer). The digest's input is
the text the tuples gave (``digest_text``: every line whole), so a table written before adopts with zero writes.
"""

from __future__ import annotations

import functools
import hashlib
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from .layout import B32_PAIRS, SERVICE_IPS, SERVICE_NODEPORTS, comment_key
from .localhost import Listen

Element = tuple[str, str, str]  # (map or set, key, value; "" for a set)

ENTRY_MAPS = (SERVICE_IPS, SERVICE_NODEPORTS)
_ENTRY_PREFIXES = tuple(m + "|" for m in ENTRY_MAPS)
_LATER_IPS, _LATER_NODEPORTS = (f"\n{m}|" for m in ENTRY_MAPS)  # an entry after the first line


@dataclass(frozen=True, slots=True, eq=False)
class Fragment:
    """One service port's share of the table in one family (compared with ==; ``digest`` is written into the comment
    of its element in ``service-digests``, keyed by its ClusterIP entry, so adoption compares services by reading
    small sets and maps only; its ``service-ips`` / ``service-nodeports`` entries carry the service's name).

    ``text``: its elements in the shared maps, packed (``pack``) in one string because the ledger keeps a fragment
    per service port (see the module docstring); ``elements`` gives the tuples, made when asked. ``shared``: the
    shared chains it jumps to (one tuple shared by every fragment of the same chains); ``chains``/``sets``: chains
    and dynamic sets of its own (ClientIP affinity only); ``hairpin_text``: the ``ep . ep`` elements of its local
    endpoints, one a line (``hairpin`` gives them; shared by every service, never removed by a partial sync: a
    DNATed packet whose source is its destination always needs masquerading, whichever service it came through).
    """

    key: str
    text: str
    shared: tuple[str, ...] = ()
    chains: tuple[tuple[str, tuple[str, ...]], ...] = ()
    sets: tuple[tuple[str, str], ...] = ()
    hairpin_text: str = ""
    digest: str = ""
    #: its localhost NodePort's listener on 127.0.0.1 (``localhost``: the relay, not the table; not in the digest)
    localhost: Listen | None = None

    @classmethod
    def of(
        cls,
        key: str,
        elements: Sequence[Element],
        shared: tuple[str, ...] = (),
        chains: tuple[tuple[str, tuple[str, ...]], ...] = (),
        sets: tuple[tuple[str, str], ...] = (),
        hairpin: tuple[str, ...] = (),
        digest: str | None = None,
    ) -> Fragment:
        """A fragment from its elements as tuples; its digest computed unless given."""
        if digest is None:
            digest = digest_of(digest_text(elements), (shared, chains, sets, hairpin))
        return cls(key, pack(elements), canonical_shared(shared), chains, sets, "\n".join(hairpin), digest)

    def extended(self, extra: Sequence[Element]) -> Fragment:
        """This fragment with ``extra`` elements after its own, digested with them."""
        elements = [*parse_elements(self.text), *extra]
        rest = (self.shared, self.chains, self.sets, self.hairpin)
        return replace(self, text=pack(elements), digest=digest_of(digest_text(elements), rest))

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, Fragment):
            return NotImplemented
        # the digest first: two different fragments almost always differ there, and it is 10 characters
        return (
            self.digest == other.digest
            and self.text == other.text
            and self.key == other.key
            and self.shared == other.shared
            and self.chains == other.chains
            and self.sets == other.sets
            and self.hairpin_text == other.hairpin_text
            and self.localhost == other.localhost
        )

    def __hash__(self) -> int:
        return hash((self.key, self.digest, self.text))

    @property
    def elements(self) -> tuple[Element, ...]:
        return tuple(parse_elements(self.text))

    @property
    def hairpin(self) -> tuple[str, ...]:
        return tuple(self.hairpin_text.split("\n")) if self.hairpin_text else ()

    @property
    def comment(self) -> str:
        return comment_key(self.key)

    @property
    def digest_comment(self) -> str:
        return f"{comment_key(self.key)} #{self.digest}"

    @property
    def digest_key(self) -> str:
        """The key of its ``service-digests`` element: its ClusterIP entry's (always its first element)."""
        return self.text.split("|", 2)[1]

    @property
    def entries(self) -> tuple[Element, ...]:
        """Its ``service-ips`` and ``service-nodeports`` elements (the user-visible keys)."""
        text = self.text
        if single_entry(text):  # its ClusterIP's only (asked per service)
            first = text.split("\n", 1)[0]
            if not first.startswith(_ENTRY_PREFIXES):
                return ()
            m, k, v = first.split("|")
            return ((m, k, v),)
        lines = [line for line in text.split("\n") if line.startswith(_ENTRY_PREFIXES)]
        return tuple((m, k, v) for m, k, v in map(split_line, lines))


def pack(elements: Iterable[Element]) -> str:
    """Elements as a fragment's ``text``: a ``map|key|value`` line each, where a key that extends the last entry's
    key (``<entry key> . <rest>``: a slot's, a counting element's) is written ``~<rest>``; entries are written whole.
    Deterministic, so two fragments' texts are equal exactly when their elements are (no key starts with ``~``, no
    key or value holds a ``|`` or a newline: checked, in three counts over the text, and refused with ValueError)."""
    lines: list[str] = []
    entry = ""
    packed = 0
    for m, k, v in elements:
        if m in ENTRY_MAPS:
            entry = k + " . "
            lines.append(f"{m}|{k}|{v}")
        elif entry and k.startswith(entry):
            lines.append(f"{m}|~{k[len(entry) :]}|{v}")
            packed += 1
        else:
            lines.append(f"{m}|{k}|{v}")
    text = "\n".join(lines)
    if text.count("|") != 2 * len(lines) or text.count("\n") != max(len(lines) - 1, 0) or text.count("|~") != packed:
        raise ValueError(f"an element holds '|' or a newline, or a key starts with '~': {text[:200]!r}")
    return text


def single_entry(text: str) -> bool:
    """Whether a fragment's ``text`` has one entry only (on its first line, as every fragment's ClusterIP entry)."""
    return _LATER_IPS not in text and _LATER_NODEPORTS not in text


def unpack(text: str) -> str:
    """A fragment's ``text`` with every line whole (``digest_text`` of its elements): in one C call when its only
    entry is its first line, as for every service port but those with NodePorts or external addresses."""
    if single_entry(text):
        if "|~" not in text:
            return text
        # "|~" is only ever a packed key's start: values never start with "~"
        return text.replace("|~", f"|{text.split('|', 2)[1]} . ")
    lines: list[str] = []
    entry = ""
    for line in text.split("\n"):
        m, _, kv = line.partition("|")
        if m in ENTRY_MAPS:
            entry = kv[: kv.index("|")] + " . "
        elif kv[:1] == "~":
            line = f"{m}|{entry}{kv[1:]}"
        lines.append(line)
    return "\n".join(lines)


def parse_elements(text: str) -> list[Element]:
    """A fragment's ``text`` (``pack``) as (map, key, value) tuples, in order."""
    return [(m, k, v) for m, k, v in map(split_line, unpack(text).split("\n"))]


def digest_text(elements: Iterable[Element]) -> str:
    """The digest's input for elements: their ``map|key|value`` lines, whole, joined by newlines."""
    return "\n".join(map("|".join, elements))


def split_line(line: str) -> list[str]:
    return line.split("|")


@functools.lru_cache(maxsize=4096)  # distinct tuples: chain names follow endpoint counts (a few hundred in practice)
def canonical_shared(shared: tuple[str, ...]) -> tuple[str, ...]:
    """One tuple object per distinct tuple of shared chains (a handful in a table of any size): fragments share it."""
    return tuple(sys.intern(s) for s in shared)


def digest_of(text: str, rest: Sequence[object]) -> str:
    """A stable digest (not ``hash()``) of a fragment's content, 50 bits in base32, lowest 5 first; few C calls:
    its elements' text, then the repr of (shared, chains, sets, hairpin) as tuples when any is not empty."""
    if any(rest):
        text += repr(rest)
    n = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")
    p = B32_PAIRS
    return p[n & 1023] + p[(n >> 10) & 1023] + p[(n >> 20) & 1023] + p[(n >> 30) & 1023] + p[(n >> 40) & 1023]
