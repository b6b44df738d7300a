"""What the nftables mode left in a kernel, and removing it: kproxy's own tables (``ip kproxy``, ``ip6 kproxy``).

Everything the mode writes lives in those two tables (no jumps from other tables, no packet marks, no sysctls), so
deleting them is the whole cleanup; other tables (upstream's ``kube-proxy``, a firewall's) are never touched.
Connections already NATed keep their conntrack entries and finish; the conntrack label bit set on some of them
means nothing without the table. The per-service view names each element by the comment on its service's entries
(slots carry none: their key is their entry's plus a slot number).
"""

from __future__ import annotations

from kproxy.config import ProxyConfig
from kproxy.model import IPFamily
from kproxy.proxier import KernelProbe
from kproxy.toolkit import nft as nft_tools

from . import layout
from .adopt import split_comment


def remnants(probe: KernelProbe) -> list[str]:
    """kproxy's tables still present in the probed namespace."""
    return nft_tools.remnants(probe, layout.TABLE)


def kernel_view(probe: KernelProbe, family: IPFamily) -> dict[str, list[str]]:
    """Service (comment key) -> its elements as the kernel holds them, one line each."""
    found = nft_tools.elements(nft_tools.listed(probe, family, layout.TABLE) or ())
    owner = {
        el.key: split_comment(el.comment)[0] for el in found if el.set in (layout.SERVICE_IPS, layout.SERVICE_NODEPORTS)
    }
    slot_maps = tuple(layout.SLOT_BASES)
    out: dict[str, list[str]] = {}
    for el in found:
        ckey, _ = split_comment(el.comment)
        if ckey:
            out.setdefault(ckey, []).append(nft_tools.element_line(el))
        elif el.set.startswith(slot_maps) and (ckey := owner.get(el.key.rpartition(" . ")[0], "")):
            out.setdefault(ckey, []).append(nft_tools.element_line(el, ckey))
    return out


def cleanup_leftovers(config: ProxyConfig, *, netns: str | None = None) -> None:
    """Delete kproxy's tables (``ip kproxy``, ``ip6 kproxy``) and nothing else; errors are logged, never raised (a
    leftover must not stop another mode from starting)."""
    nft_tools.delete_tables(netns, layout.TABLE)
