"""What the iptables mode (and upstream kube-proxy's iptables mode) left in a kernel, and removing it, nothing else.

Reading it back, from outside a running kproxy: ``remnants`` and ``kernel_view`` only run ``iptables-save`` /
``ip6tables-save`` (through the probe) and parse the text; they never trust what kproxy believes it wrote (``/rules``),
which is the point of having them.

- ``remnants(probe)``: every ``KUBE-`` line of both families and both flavours (nf_tables and legacy, those
  installed) that is not kubelet's. Deliberately wider than the cleanup's own selection (fixed names plus hashed
  prefixes), so a chain the cleanup forgets to know about still shows. Excluded: kubelet's chains (upstream's
  ``pkg/kubelet/kubelet_network_linux.go``: ``KUBE-IPTABLES-HINT``, ``KUBE-KUBELET-CANARY``, ``KUBE-FIREWALL``,
  and ``KUBE-MARK-DROP`` of kubelets before 1.28, which also wrote ``KUBE-MARK-MASQ``/``KUBE-POSTROUTING``; those
  two are kube-proxy's too, so they count), and the chains of upstream's *userspace* mode (``KUBE-PORTALS-*``,
  ``KUBE-NODEPORT-CONTAINER``/``-HOST``), which belong to that mode while it runs. A save that fails raises
  ``BackendError``: "nothing left" never stands for "could not look".
- ``kernel_view(probe, family)``: ``iptables-save -c`` grouped by service port, ``"ns/name:port/PROTO"`` -> lines.
  A rule belongs to a service port when its comment names it (``ns/name:port ...``; the protocol from its ``-p``),
  and so does every line of the per-service chains (``KUBE-SVC-``/``SVL-``/``EXT-``/``FW-``/``SEP-``) such a rule
  jumps to, transitively (which also covers large-cluster mode, where endpoint rules carry no comment). Lines are
  ``"<flavour> <table>: [packets:bytes] <rule>"``; rules in the shared chains (``KUBE-SERVICES``,
  ``KUBE-NODEPORTS`` ...) carry no counters, because those chains are rewritten whenever any service's entry in them
  changes and on every full sync, so their counters say nothing about *this* service; the counters of the
  service's own chains are reset exactly when that service is rewritten.

Removing it: ``cleanup_payload`` is pure: from ``iptables-save`` text it selects kproxy's chains (upstream's names:
the fixed top-level chains and the hashed per-service / per-endpoint chains) and the rules in the built-in chains
that jump into them, and returns an ``iptables-restore --noflush`` payload that flushes and deletes exactly those.
An owned chain another program still jumps to is kept (see ``_plan``). Chains of kubelet (``KUBE-FIREWALL``,
``KUBE-KUBELET-CANARY``, ``KUBE-IPTABLES-HINT``) and of other software that happens to use a ``KUBE-`` prefix
(kube-router's ``KUBE-ROUTER-*``, ``KUBE-POD-FW-*`` ...) are left alone. ``cleanup_leftovers`` runs it for both
flavours, both families and every table, with no proxier running: the CLI calls it for ``kproxy cleanup`` and when
another mode starts.
"""

from __future__ import annotations

import logging
import re
import shlex
import shutil

from kproxy.config import ProxyConfig
from kproxy.model import IPFamily
from kproxy.proxier import BackendError, KernelProbe

from .kernel import FLAVOURS, Kernel, binary
from .render import SERVICE_CHAIN_PREFIXES

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
    whose restore time grows quadratically with a payload's size, docs/PERFORMANCE.md),
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


def cleanup_leftovers(config: ProxyConfig, *, netns: str | None = None) -> None:
    """Remove every chain and jump of this mode in both flavours, both families, all tables (no proxier needed).

    Logs and swallows errors, as upstream's ``CleanupLeftovers`` does: a leftover must never stop a start-up."""
    for flavour in FLAVOURS:
        for err in cleanup_kernel(Kernel(flavour, netns)):
            log.warning("iptables cleanup (%s): %s", flavour, err)


# ------------------------------------------------------------------------------------ reading it back


#: kubelet's chains (and a pre-1.28 kubelet's KUBE-MARK-DROP): never this mode's
KUBELET_CHAINS = frozenset({"KUBE-FIREWALL", "KUBE-KUBELET-CANARY", "KUBE-IPTABLES-HINT", "KUBE-MARK-DROP"})
#: upstream's userspace mode's chains: that mode's while it runs, so not a remnant of this one
USERSPACE_CHAINS = ("KUBE-PORTALS-", "KUBE-NODEPORT-CONTAINER", "KUBE-NODEPORT-HOST")

_KUBE = re.compile(r"KUBE-[A-Z0-9][A-Z0-9-]*")
_COUNTERS = re.compile(r"^\[(\d+):(\d+)\]\s+")
# ns/name[:port] as a comment word: DNS-1123 namespace, DNS-1035 service name, IANA_SVC_NAME port name
_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_SERVICE_WORD = re.compile(rf"^{_LABEL}/[a-z]([-a-z0-9]*[a-z0-9])?(:{_LABEL})?$")
_PROTOCOLS = {"tcp": "TCP", "udp": "UDP", "sctp": "SCTP"}


def _is_ours(chain: str) -> bool:
    return chain not in KUBELET_CHAINS and not chain.startswith(USERSPACE_CHAINS)


def _save(probe: KernelProbe, tool: str, *args: str) -> str | None:
    """The tool's output, or None when the tool is not installed on this host (nothing of that flavour can have
    been written through it). Any other failure raises BackendError."""
    if shutil.which(tool) is None:
        return None
    res = probe.run([tool, *args], timeout=60.0)
    if res.returncode != 0:
        err = (res.stderr or "").strip()[:300]
        raise BackendError(f"{' '.join([tool, *args])} failed (exit {res.returncode}): {err}")
    return res.stdout or ""


def remnants(probe: KernelProbe) -> list[str]:
    """Every line of ``iptables-save``/``ip6tables-save`` (each installed flavour) naming a ``KUBE-`` chain that is
    not kubelet's or the userspace mode's, as ``"<tool>: <line>"``; [] when none. BackendError when a save fails."""
    left: list[str] = []
    for flavour in FLAVOURS:
        for family in (IPFamily.V4, IPFamily.V6):
            tool = binary("save", family, flavour)
            text = _save(probe, tool)
            if text is None:
                continue
            for line in text.splitlines():
                line = line.strip()
                if not line or line.startswith("#"):
                    continue
                if any(_is_ours(chain) for chain in _KUBE.findall(line)):
                    left.append(f"{tool}: {line}")
    return left


def _words(rule: str) -> list[str]:
    try:
        return shlex.split(rule)
    except ValueError:  # an unbalanced quote: iptables-save never writes one, but a view must not crash on it
        return rule.split()


def _services_in(words: list[str]) -> set[str]:
    """The ``ns/name[:port]`` words of the rule's comment(s)."""
    out: set[str] = set()
    for i, w in enumerate(words[:-1]):
        if w == "--comment":
            out.update(x for x in words[i + 1].split() if _SERVICE_WORD.match(x))
    return out


def _option(words: list[str], *names: str) -> str | None:
    for i, w in enumerate(words[:-1]):
        if w in names:
            return words[i + 1]
    return None


def group_by_service(save_text: str, prefix: str = "") -> dict[str, list[str]]:
    """``iptables-save -c`` text of one family -> ``{"ns/name:port/PROTO": [lines]}`` (see the module docstring).
    Pure, so it is unit-tested on text; ``prefix`` (``"nft "``) starts every line."""
    out: dict[str, list[str]] = {}
    table = ""
    # per table: (chain, counters, rule text, words) and the per-service chains' declarations
    rules: list[tuple[str, str, str, list[str]]] = []
    declared: dict[str, str] = {}

    def finish() -> None:
        owner: dict[str, set[str]] = {}  # per-service chain -> keys that jump into it
        unresolved: list[tuple[set[str], str, str, str]] = []
        keyed: list[tuple[set[str], str, str, str]] = []  # (keys, chain, counters, rule)
        for chain, counters, rule, words in rules:
            names = _services_in(words)
            if not names:
                continue
            proto = _PROTOCOLS.get((_option(words, "-p", "--protocol") or "").lower())
            if proto is None:
                unresolved.append((names, chain, counters, rule))
                continue
            keys = {f"{n}/{proto}" for n in names}
            keyed.append((keys, chain, counters, rule))
            target = _option(words, "-j", "--jump", "-g", "--goto")
            if target and target.startswith(SERVICE_CHAIN_PREFIXES):
                owner.setdefault(target, set()).update(keys)
        # a rule without -p (KUBE-EXT-'s masquerade) belongs to the keys of its chain, else to every key of its name
        known = {k for keys, *_ in keyed for k in keys}
        for names, chain, counters, rule in unresolved:
            keys = owner.get(chain) or {k for k in known if k.rsplit("/", 1)[0] in names}
            keyed.append((keys or {f"{n}/?" for n in names}, chain, counters, rule))
        # per-service chains reached from owned ones (KUBE-SVC- -> KUBE-SEP-, KUBE-EXT- -> KUBE-SVC-) are owned too
        changed = True
        while changed:
            changed = False
            for chain, _, _, words in rules:
                target = _option(words, "-j", "--jump", "-g", "--goto")
                if chain in owner and target and target.startswith(SERVICE_CHAIN_PREFIXES):
                    before = len(owner.setdefault(target, set()))
                    owner[target] |= owner[chain]
                    changed = changed or len(owner[target]) != before
        lines: dict[str, list[str]] = {}
        for keys, chain, _counters, rule in keyed:
            if chain in owner:
                continue  # listed below with the chain's other rules
            for k in keys:
                lines.setdefault(k, []).append(f"{prefix}{table}: {rule}")
        for chain, keys in owner.items():
            own = [f"{prefix}{table}: {counters}{rule}" for c, counters, rule, _ in rules if c == chain]
            head = [f"{prefix}{table}: {declared[chain]}"] if chain in declared else []
            for k in keys:
                lines.setdefault(k, []).extend(head + own)
        for k, v in lines.items():
            out.setdefault(k, []).extend(v)

    for raw in save_text.splitlines():
        line = raw.strip()
        if line.startswith("*"):
            table, rules, declared = line[1:], [], {}
        elif line.startswith(":") and table:
            name = line[1:].split(" ", 1)[0]
            if name.startswith(SERVICE_CHAIN_PREFIXES):
                declared[name] = line.rsplit(" ", 1)[0] if line.endswith("]") else line  # without [0:0]
        elif line == "COMMIT":
            if table:
                finish()
            table = ""
        elif table and (line.startswith("-A ") or _COUNTERS.match(line)):
            m = _COUNTERS.match(line)
            counters = f"[{m.group(1)}:{m.group(2)}] " if m else ""
            rule = line[m.end() :] if m else line
            words = _words(rule)
            if len(words) >= 2 and words[0] == "-A":
                rules.append((words[1], counters, rule, words))
    return out


def kernel_view(probe: KernelProbe, family: IPFamily) -> dict[str, list[str]]:
    """What the kernel holds for each service port of ``family`` now: ``iptables-save -c`` of every installed
    flavour, grouped by ``group_by_service``. BackendError when a save fails."""
    out: dict[str, list[str]] = {}
    for flavour in FLAVOURS:
        text = _save(probe, binary("save", family, flavour), "-c")
        if text is None:
            continue
        for key, lines in group_by_service(text, prefix=f"{flavour} ").items():
            out.setdefault(key, []).extend(lines)
    return out
