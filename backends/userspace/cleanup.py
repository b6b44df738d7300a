"""What the userspace mode leaves in a namespace and how it goes: its tables (``ip``/``ip6 kproxy-userspace``),
nothing else. Its proxy sockets are the process's own: they close when it exits.

``remnants`` and ``kernel_view`` read through a ``KernelProbe`` (a namespace's ``nft``), so the conformance suite and
``kproxy cleanup`` see what is there whichever mode runs; the kernel view groups the elements by the service key
each carries as its comment.
"""

from __future__ import annotations

from kproxy.config import ProxyConfig
from kproxy.model import IPFamily
from kproxy.proxier import KernelProbe
from kproxy.toolkit import nft as nft_tools

from . import render


def remnants(probe: KernelProbe) -> list[str]:
    """This mode's tables where the namespace holds them."""
    return nft_tools.remnants(probe, render.TABLE)


def kernel_view(probe: KernelProbe, family: IPFamily) -> dict[str, list[str]]:
    """The table's elements by the service key in their comments (empty: no table)."""
    out: dict[str, list[str]] = {}
    for el in nft_tools.elements(nft_tools.listed(probe, family, render.TABLE) or ()):
        if el.comment:
            out.setdefault(el.comment, []).append(nft_tools.element_line(el))
    return out


def cleanup_leftovers(config: ProxyConfig, *, netns: str | None = None) -> None:
    """Delete this mode's tables in both families, nothing else; errors are logged, never raised (a leftover must
    not stop another mode from starting)."""
    nft_tools.delete_tables(netns, render.TABLE, worker=False)
