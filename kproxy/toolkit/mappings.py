"""Copies and comparisons of large mappings keyed by ``ServicePortName`` without hashing the keys again.

A ``ServicePortName``'s hash is a Python call (a frozen dataclass's): at 100,000 service ports every pass that hashes
each name costs a tenth of a second. A dict's ``copy`` and ``update`` reuse the hashes the dict stores; ``dict()`` of
a ``MappingProxyType`` and a set difference of key views compute them again. The ledger's full syncs use these.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import TypeVar

from kproxy.model import Overlaid

K = TypeVar("K")
V = TypeVar("V")


def dict_of(m: Mapping[K, V]) -> dict[K, V]:
    """A dict copy of ``m``, without hashing its keys again when it is a dict or a read-only view of one."""
    if isinstance(m, dict | MappingProxyType):
        return m.copy()
    return dict(m)


def has_other_keys(recorded: Mapping[K, object], wanted: Mapping[K, object]) -> bool:
    """Whether ``recorded`` has a key ``wanted`` lacks, told by the size of their union (True when that cannot be
    told without hashing: ``wanted`` is no dict, view of one or ``Overlaid``)."""
    union: dict[K, object]
    if isinstance(wanted, Overlaid):
        union = dict(wanted.merged())
    elif isinstance(wanted, dict | MappingProxyType):
        union = dict(wanted) if isinstance(wanted, dict) else dict(wanted.copy())
    else:
        return True
    union.update(recorded if isinstance(recorded, dict) else dict_of(recorded))
    return len(union) > len(wanted)
