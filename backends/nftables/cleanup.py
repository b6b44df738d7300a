"""Removing everything the nftables mode wrote: kproxy's own tables (``ip kproxy``, ``ip6 kproxy``), nothing else.

Everything the mode writes lives in those two tables (no jumps from other tables, no packet marks, no sysctls), so
deleting them is the whole cleanup; other tables (upstream's ``kube-proxy``, a firewall's) are never touched.
Connections already NATed keep their conntrack entries and finish; the conntrack label bit set on some of them
means nothing without the table.
"""

from __future__ import annotations

from kproxy.toolkit.nft import delete_tables

from . import layout


def cleanup_tables(netns: str | None = None) -> list[str]:
    """Delete kproxy's table in both families if present; the errors, logged (empty: clean)."""
    return delete_tables(netns, layout.TABLE)
