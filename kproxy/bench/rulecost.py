"""What the nftables mode's own rules cost the traffic that crosses them, beyond conntrack and NAT: the data-path
lab (kproxy.bench.datapath) with ``--mode nftables`` programmed, kproxy then stopped (its table stays), and the table's
base chains rewritten by hand between rounds into variants of the same layout, each measured against the limit and
the NAT floor (``limit_nat``) in the same rounds.

Variants (only the three base chains change; the maps, sets and shared chains stay as kproxy wrote them):

* ``kproxy``: the base chains as kproxy wrote them (read back from the kernel at the start);
* ``inline``: ``nat-prerouting``/``nat-output`` hold the ``services`` chain's two rules themselves (no jump);
* ``bare``: only what this traffic needs: the service map lookup in prerouting/output and the masquerade-by-label
  rule in postrouting (no NodePort lookup, no hairpin rule): the least a map-based NAT layout can do.

If ``kproxy`` and ``bare`` measure the same (and the same as ``limit_nat``), no rule change can make the mode faster
here: what is left is the kernel's floor for a NAT proxy.

Run by hand (root): ``python -m kproxy.bench.rulecost --services 1000 --rounds 8``; its figures are in
docs/compare/rulecost/.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any

from kproxy.bench.datapath import (
    CONNTRACK_LIMITS,
    DatapathConfig,
    DatapathError,
    DatapathLab,
    round_order,
    stop_on_sigterm,
)
from kproxy.bench.dpstats import paired_ratios, ratio_spread

TABLE = "ip kproxy"
BASE_CHAINS = ("nat-prerouting", "nat-output", "nat-postrouting")
VMAP = "ip daddr . meta l4proto . th dport vmap @service-ips"
NODEPORTS = "ip daddr @nodeport-cidrs fib daddr type local meta l4proto . th dport vmap @service-nodeports"
MASQ = "ct label 127 masquerade fully-random"
VARIANTS: dict[str, dict[str, tuple[str, ...]]] = {
    "inline": {"nat-prerouting": (VMAP, NODEPORTS), "nat-output": (VMAP, NODEPORTS)},
    "bare": {"nat-prerouting": (VMAP,), "nat-output": (VMAP,), "nat-postrouting": (MASQ,)},
}
MEASURED = ("limit", "limit_nat", "podip", "clusterip")


def chain_rules(listing: str) -> tuple[str, ...]:
    """The rules of one chain from ``nft list chain`` (the hook line and braces left out; handles dropped)."""
    rules = []
    for line in listing.splitlines():
        text = line.strip()
        if not text or text.startswith(("table ", "chain ", "type ", "}", "comment ")):
            continue
        rules.append(text.split(" # handle")[0])
    return tuple(rules)


def variant_commands(chains: dict[str, tuple[str, ...]]) -> str:
    """One nft transaction that rewrites the given base chains."""
    out = []
    for chain, rules in chains.items():
        out.append(f"flush chain {TABLE} {chain}")
        out += [f"add rule {TABLE} {chain} {r}" for r in rules]
    return "\n".join(out) + "\n"


def run(services: int, rounds: int, prefix: str) -> dict[str, Any]:
    config = DatapathConfig(rounds=rounds, prefix=prefix, conntrack_limits=True)

    def progress(msg: str, advance: int = 0) -> None:
        if msg:
            print(f"rulecost: {msg}", file=sys.stderr, flush=True)

    doc: dict[str, Any] = {"services": services, "rounds": rounds, "config": config.describe(), "variants": {}}
    with DatapathLab(config, progress) as dl:
        dl.ensure_services(services)
        progress(f"nftables @ {services}: starting kproxy")
        doc["ready_s"] = dl.start_mode("nftables")
        lab = dl.lab
        assert lab is not None
        for node in dl.loaded_nodes:  # its table stays: the variants are written by hand from here on
            lab.stop_kproxy(node)
        original = {}
        for chain in BASE_CHAINS:
            res = lab.exec(dl.loaded_nodes[0].ns, ["nft", "list", "chain", *TABLE.split(), chain], timeout=30)
            original[chain] = chain_rules(res.stdout.decode())
        variants = {"kproxy": original, **VARIANTS}
        doc["base_chains"] = {name: {c: list(r) for c, r in ch.items()} for name, ch in variants.items()}
        per_variant: dict[str, list[dict[str, dict[str, float]]]] = {v: [] for v in variants}
        names = list(variants)
        for r in range(rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            for v in order:
                text = variant_commands(original) + (variant_commands(variants[v]) if v != "kproxy" else "")
                for node in dl.loaded_nodes:
                    dl._nft(node.ns, text)
                    lab.exec(node.ns, ["conntrack", "-F"], timeout=30)
                targets = round_order(MEASURED, r * len(names) + names.index(v))
                progress(f"round {r + 1}/{rounds}, variant {v}: {', '.join(targets)} interleaved")
                this, _ = dl.measure_round(targets)
                per_variant[v].append(this)
        for v, rs in per_variant.items():
            both = ("podip", "clusterip")
            doc["variants"][v] = {
                "ratios": paired_ratios(rs, ("limit", *both, *CONNTRACK_LIMITS[1:])),
                "spread": ratio_spread(rs, ("limit", *both)),
                "vs_nat_floor": paired_ratios(rs, ("limit_nat", *both), base="limit_nat"),
                "conn_rate_median": {t: statistics.median(x[t]["conn_rate"] for x in rs) for t in MEASURED},
                "rounds": rs,
            }
    return doc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kproxy.bench.rulecost", description=__doc__.splitlines()[0])
    p.add_argument("--services", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--lab-prefix", default="kpdv-")
    args = p.parse_args(argv)
    stop_on_sigterm()
    try:
        doc = run(args.services, args.rounds, args.lab_prefix)
    except DatapathError as exc:
        print(f"rulecost: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(doc, indent=2))
    for v, d in doc["variants"].items():
        r, f = d["ratios"], d["vs_nat_floor"]
        print(
            f"{v:8s} conn/s vs limit: pod IP {r['podip'].get('conn_rate', 0):.2f}, ClusterIP"
            f" {r['clusterip'].get('conn_rate', 0):.2f}; vs NAT floor: pod IP {f['podip'].get('conn_rate', 0):.2f},"
            f" ClusterIP {f['clusterip'].get('conn_rate', 0):.2f}; NAT floor / limit"
            f" {r['limit_nat'].get('conn_rate', 0):.2f}",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
