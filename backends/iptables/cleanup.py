"""Removing everything the iptables mode (and upstream kube-proxy's iptables mode) wrote, and nothing else.

``cleanup_payload`` is pure: from ``iptables-save`` text it selects kproxy's chains (upstream's names: the fixed
top-level chains and the hashed per-service / per-endpoint chains) and the rules in the built-in chains that jump
into them, and returns an ``iptables-restore --noflush`` payload that flushes and deletes exactly those. An owned
chain another program still jumps to is kept (see ``_plan``). Chains of
kubelet (``KUBE-FIREWALL``, ``KUBE-KUBELET-CANARY``, ``KUBE-IPTABLES-HINT``) and of other software that happens to
use a ``KUBE-`` prefix (kube-router's ``KUBE-ROUTER-*``, ``KUBE-POD-FW-*`` ...) are left alone.

``cleanup_leftovers`` runs it for both flavours, both families and every table, with no proxier running: the CLI
calls it for ``kproxy cleanup`` and when another mode starts.
"""

from __future__ import annotations

import logging
import shutil

from kproxy.model import IPFamily

from .kernel import FLAVOURS, Kernel, binary

log = logging.getLogger(__name__)

#: Fixed chain names this mode (and upstream kube-proxy's iptables mode) creates.
OWNED_CHAINS = frozenset(
    {
        "KUBE-SERVICES",
        "KUBE-EXTERNAL-SERVICES",
        "KUBE-NODEPORTS",
        "KUBE-POSTROUTING",
        "KUBE-MARK-MASQ",
        "KUBE-FORWARD",
        "KUBE-PROXY-FIREWALL",
        "KUBE-PROXY-CANARY",
    }
)
#: Prefixes of the hashed chains (KUBE-XLB- is the pre-1.24 name of KUBE-SVL-).
OWNED_PREFIXES = ("KUBE-SVC-", "KUBE-SVL-", "KUBE-EXT-", "KUBE-FW-", "KUBE-SEP-", "KUBE-XLB-")
CLEANUP_TABLES = ("mangle", "filter", "nat")


CLEANUP_CHUNK_LINES = 10_000  # lines per nf_tables cleanup payload (see cleanup_payloads)


def is_owned(chain: str) -> bool:
    return chain in OWNED_CHAINS or chain.startswith(OWNED_PREFIXES)


def _target(words: list[str]) -> str | None:
    for i, w in enumerate(words[:-1]):
        if w in ("-j", "-g", "--jump", "--goto"):
            return words[i + 1]
    return None


def _plan(save_text: str) -> list[tuple[str, list[str], list[str]]]:
    """Per table: (table, owned chains to remove, ``-D`` lines for the built-in chains' jumps into them).

    Only jumps from the built-in chains are deleted (upstream's ``CleanupLeftovers`` deletes its own jump rules and
    nothing else). An owned chain that another program's chain jumps to (the CNI portmap plugin's ``CNI-HOSTPORT``
    with ``externalSetMarkChain: KUBE-MARK-MASQ``) is kept, with everything it reaches, and so is the jump into it:
    removing it would break that program (upstream's restore fails on it and keeps the whole table). The
    masquerade mark set by ``KUBE-MARK-MASQ`` means something only through ``KUBE-POSTROUTING``, so the two are
    kept together."""
    plan: list[tuple[str, list[str], list[str]]] = []
    table: str | None = None
    owned: list[str] = []
    builtin: set[str] = set()
    rules: list[tuple[str, str | None, str]] = []  # (chain, target, line)

    def finish(table: str) -> None:
        jumps: dict[str, set[str]] = {}
        kept: set[str] = set()
        for chain, target, line in rules:
            if target is None or not is_owned(target):
                continue
            jumps.setdefault(chain, set()).add(target)
            if chain not in builtin and not is_owned(chain):
                log.warning("iptables cleanup: keeping %s/%s, which %s jumps to: %s", table, target, chain, line)
                kept.add(target)
        if "KUBE-MARK-MASQ" in kept:
            kept.add("KUBE-POSTROUTING")
        todo = list(kept)
        while todo:  # everything a kept chain reaches stays too
            for target in jumps.get(todo.pop(), ()):
                if target not in kept:
                    kept.add(target)
                    todo.append(target)
        deletes = [
            "-D " + line[3:]
            for chain, target, line in rules
            if chain in builtin and target in owned and target not in kept
        ]
        remove = [c for c in owned if c not in kept]
        if remove or deletes:
            plan.append((table, remove, deletes))

    for raw in save_text.splitlines():
        line = raw.strip()
        if line.startswith("*"):
            table, owned, builtin, rules = line[1:], [], set(), []
        elif line.startswith(":") and table is not None:
            name, _, rest = line[1:].partition(" ")
            if is_owned(name):
                owned.append(name)
            if not rest.startswith("-"):  # a policy (ACCEPT, DROP): a built-in chain
                builtin.add(name)
        elif line.startswith("-A ") and table is not None:
            words = line.split()
            if len(words) >= 2:
                rules.append((words[1], _target(words), line))
        elif line == "COMMIT":
            if table is not None:
                finish(table)
            table = None
    return plan


def cleanup_payloads(save_text: str, chunk_lines: int | None = None) -> list[str]:
    """The ``iptables-restore --noflush`` payloads, in order, that remove kproxy's chains and the jumps into them.

    Without ``chunk_lines``: one payload (the legacy flavour replaces whole tables anyway). With it (nf_tables,
    whose restore time grows quadratically with a payload's size: one payload for 10,000 services took 146 s),
    two ordered stages of small payloads: first the jumps from other chains are deleted and every owned chain is
    flushed, so nothing references an owned chain any more; then the chains are deleted. Each payload is valid on
    its own, so a run cut short leaves a consistent (if partly cleaned) table that the next cleanup finishes."""
    plan = _plan(save_text)
    if chunk_lines is None:
        out: list[str] = []
        for table, owned, deletes in plan:
            out.append("*" + table)
            out.extend(f":{c} - [0:0]" for c in owned)
            out.extend(deletes)
            out.extend(f"-X {c}" for c in owned)
            out.append("COMMIT")
        return ["\n".join(out) + "\n"] if out else []
    payloads: list[str] = []
    for stage in ("unhook", "delete"):
        for table, owned, deletes in plan:
            lines = deletes + [f":{c} - [0:0]" for c in owned] if stage == "unhook" else [f"-X {c}" for c in owned]
            for i in range(0, len(lines), chunk_lines):
                payloads.append("\n".join(["*" + table, *lines[i : i + chunk_lines], "COMMIT"]) + "\n")
    return payloads


def cleanup_payload(save_text: str) -> str:
    """The single ``iptables-restore --noflush`` text that removes kproxy's chains and jumps ("" if none)."""
    return "".join(cleanup_payloads(save_text))


def cleanup_kernel(kernel: Kernel, families: tuple[IPFamily, ...] = (IPFamily.V4, IPFamily.V6)) -> list[str]:
    """Remove this mode's rules through one kernel handle (one flavour); returns the errors (empty = clean)."""
    errors: list[str] = []
    for fam in families:
        if shutil.which(binary("save", fam, kernel.flavour)) is None:
            continue
        saved = kernel.save(fam)
        if not saved.ok:
            errors.append(f"{binary('save', fam, kernel.flavour)}: {saved.stderr.strip()}")
            continue
        chunk = CLEANUP_CHUNK_LINES if kernel.flavour == "nft" else None
        for payload in cleanup_payloads(saved.stdout, chunk):
            res = kernel.restore(fam, payload)
            if not res.ok:
                errors.append(f"{binary('restore', fam, kernel.flavour)}: {res.stderr.strip()}")
                break
    return errors


def cleanup_leftovers(netns: str | None = None) -> None:
    """Remove every chain and jump of this mode in both flavours, both families, all tables (no proxier needed).

    Logs and swallows errors, as upstream's ``CleanupLeftovers`` does: a leftover must never stop a start-up."""
    for flavour in FLAVOURS:
        for err in cleanup_kernel(Kernel(flavour, netns)):
            log.warning("iptables cleanup (%s): %s", flavour, err)
