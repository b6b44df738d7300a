"""Removing everything the nftables mode wrote: kproxy's own tables (``ip kproxy``, ``ip6 kproxy``), nothing else.

Everything the mode writes lives in those two tables (no jumps from other tables, no packet marks, no sysctls), so
deleting them is the whole cleanup; other tables (upstream's ``kube-proxy``, a firewall's) are never touched.
Connections already NATed keep their conntrack entries and finish; the conntrack label bit set on some of them
means nothing without the table.
"""

from __future__ import annotations

from kproxy.nftkernel import Nft

from . import render


def cleanup_tables(netns: str | None = None) -> list[str]:
    """Delete kproxy's table in both families if present; the errors (empty: clean)."""
    errors: list[str] = []
    nft = Nft(netns)
    try:
        for fam in ("ip", "ip6"):
            probe = nft.query(f"list set {fam} {render.TABLE} {render.LOCAL_CIDRS}", json_output=False)
            if not probe.ok and "No such file" in probe.error:
                # no such set: either no table, or a table without it (another layout); delete whatever is there
                gone = nft.query(f"list chains {fam}", json_output=True)
                if gone.ok and f'"table": "{render.TABLE}"' not in gone.output:
                    continue
            res = nft.run(f"delete table {fam} {render.TABLE}\n")
            if not res.ok and "No such file" not in res.error:
                errors.append(f"delete table {fam} {render.TABLE}: {res.error.strip()}")
    finally:
        nft.close()
    return errors
