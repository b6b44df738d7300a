"""Fuzzed input, kernel side: every backend's rendering of every accepted generated object is taken by the kernel,
in its check mode too, and carries no object text that is not escaped.

The objects are tests/unit/test_fuzz_cache.py's generators (valid ones and ones with hostile text or wrong types in
every field); the cache takes what it takes, and each installed backend that writes kernel *text* syncs the
resulting state into a throwaway namespace of its own (``kpz-``) through its real code path. What it handed the
kernel is captured at the backend's exec layer (the one module that runs its tool) and then

- sent again to the kernel's check mode in a second, empty namespace (``iptables-restore --test``,
  ``nft -c -f -``), which must accept it;
- read line by line: no control character, balanced quoting (iptables lines split with shlex; nft's strings have
  no escapes at all, so no quote may sit inside one), and every accepted service named in its comment exactly as
  ``ns/name[:port]`` (so no text of an object changed the meaning of a line).

Backends without kernel text (the BPF map writer) are reported as skipped with the reason; a new
text backend gets a ``CheckMode`` entry below. A contract hook would make this backend-neutral (proposed in the
soak's report: ``Proxier.check_payloads``).
"""

from __future__ import annotations

import importlib.util
import logging
import shlex
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from modes import require_mode

from kproxy.cache import ServiceCache
from kproxy.config import ProxyConfig
from kproxy.model import IPFamily
from kproxy.proxier import MODE_NAMES, Proxier, backend_class
from kproxy.toolkit.keys import service_key

from .scratch import scratch_netns

pytestmark = pytest.mark.root

NODE = "node-1"
CFG = ProxyConfig(
    hostname_override=NODE,
    cluster_cidrs=("198.18.64.0/18", "fd00:198:18:40::/58"),
    ip_families=(IPFamily.V4, IPFamily.V6),
)
SETTINGS = settings(
    max_examples=50,  # about 30 accepted services per mode (derandomized: the same examples on every run)
    deadline=None,
    derandomize=True,
    database=None,  # derandomized: nothing to remember between runs, and no .hypothesis folder in the tree
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)


def _generators() -> ModuleType:
    """tests/unit/test_fuzz_cache.py, loaded by path (the two test folders are not one package)."""
    path = Path(__file__).resolve().parents[1] / "unit" / "test_fuzz_cache.py"
    spec = importlib.util.spec_from_file_location("kproxy_fuzz_objects", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


GEN = _generators()
objects = st.lists(
    st.one_of(st.tuples(st.just("Service"), GEN.services()), st.tuples(st.just("EndpointSlice"), GEN.slices())),
    min_size=1,
    max_size=10,
)


# ------------------------------------------------------------------------------------------- per-backend check mode


@dataclass(frozen=True)
class CheckMode:
    """How one text backend's payloads are captured and checked. ``capture(monkeypatch, sink)`` wraps the backend's
    exec layer so every payload it sends is appended to ``sink`` as (family or None, text); ``check(ns, family,
    text)`` runs the kernel's check mode in ``ns`` and returns (ok, message); ``lines_ok(line)`` is the quoting
    check of one payload line."""

    capture: Callable[[pytest.MonkeyPatch, list[tuple[IPFamily | None, str]]], None]
    check: Callable[[str, IPFamily | None, str], tuple[bool, str]]
    quoting: Callable[[str], str | None]


def _iptables_capture(mp: pytest.MonkeyPatch, sink: list[tuple[IPFamily | None, str]]) -> None:
    from kproxy.backends.iptables import kernel

    original = kernel.Kernel.restore

    def restore(self: Any, family: IPFamily, text: str, *, noflush: bool = True) -> Any:
        sink.append((family, text))
        return original(self, family, text, noflush=noflush)

    mp.setattr(kernel.Kernel, "restore", restore)


def _iptables_check(ns: str, family: IPFamily | None, text: str) -> tuple[bool, str]:
    tool = "ip6tables-nft-restore" if family == IPFamily.V6 else "iptables-nft-restore"
    res = subprocess.run(
        ["ip", "netns", "exec", ns, tool, "--test", "--noflush"],
        input=text,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return res.returncode == 0, res.stderr


def _iptables_quoting(line: str) -> str | None:
    try:
        words = shlex.split(line, comments=False, posix=True)
    except ValueError as exc:
        return f"unbalanced quoting: {exc}"
    for i, w in enumerate(words[:-1]):
        if w == "--comment" and ("\n" in words[i + 1] or '"' in words[i + 1]):
            return "a comment carries a newline or a quote"
    return None


def _nft_capture(mp: pytest.MonkeyPatch, sink: list[tuple[IPFamily | None, str]]) -> None:
    from kproxy import nftkernel as kernel

    run, submit = kernel.Nft.run, kernel.Nft.submit

    def spy_run(self: Any, text: str, *, json_output: bool = False) -> Any:
        sink.append((None, text))
        return run(self, text, json_output=json_output)

    def spy_submit(self: Any, text: str, *, json_output: bool = False) -> Any:
        sink.append((None, text))
        return submit(self, text, json_output=json_output)

    mp.setattr(kernel.Nft, "run", spy_run)
    mp.setattr(kernel.Nft, "submit", spy_submit)


def _userspace_capture(mp: pytest.MonkeyPatch, sink: list[tuple[IPFamily | None, str]]) -> None:
    _nft_capture(mp, sink)  # both modes write through kproxy.nftkernel.Nft


def _nft_check(ns: str, family: IPFamily | None, text: str) -> tuple[bool, str]:
    res = subprocess.run(
        ["ip", "netns", "exec", ns, "nft", "-c", "-f", "-"], input=text, capture_output=True, text=True, timeout=60
    )
    return res.returncode == 0, res.stderr


def _nft_quoting(line: str) -> str | None:
    # nft strings ("...") have no escape sequences: a quote inside one would end it, so quotes must pair up
    if line.count('"') % 2:
        return "an odd number of quotes"
    return None


CHECK_MODES: dict[str, CheckMode] = {
    "iptables": CheckMode(_iptables_capture, _iptables_check, _iptables_quoting),
    "nftables": CheckMode(_nft_capture, _nft_check, _nft_quoting),
    "userspace": CheckMode(_userspace_capture, _nft_check, _nft_quoting),  # its redirect table is nft text too
}
NO_TEXT = {
    # map entries are numbers; its companion nft table (kproxy.nftkernel, like the others) holds addresses, ports and
    # chain names made of digests, never text from an object, and plain ClusterIPs never reach it
    "bpf": "writes BPF map entries (numbers) and a companion table without object text",
}


@pytest.fixture(scope="module")
def namespaces() -> Iterator[tuple[str, str]]:
    """(where the backend syncs, an empty one for the check mode); both removed at the end, also on failure."""
    with scratch_netns("kpz-s-", lo_up=True) as sync_ns, scratch_netns("kpz-c-", lo_up=True) as check_ns:
        yield sync_ns, check_ns


def _state(objs: list[tuple[str, dict[str, Any]]]) -> tuple[Any, Any, dict[str, str]]:
    cache = ServiceCache(NODE, ip_families=CFG.ip_families)
    for kind, obj in objs:
        (cache.upsert_service if kind == "Service" else cache.upsert_slice)(obj)
    cache.mark_synced("services")
    cache.mark_synced("endpointslices")
    state, changes = cache.snapshot()
    return state, changes, cache.errors()


def test_every_mode_is_checked_or_says_why_not() -> None:
    assert set(MODE_NAMES) <= set(CHECK_MODES) | set(NO_TEXT), "add a CheckMode for the new mode's kernel text"


@pytest.mark.parametrize("mode", sorted(CHECK_MODES))
def test_kernel_takes_every_accepted_object(
    mode: str, namespaces: tuple[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    for noisy in ("kproxy.cache", "kproxy.ledger"):  # rejections and by-design refusals warn, on purpose
        caplog.set_level(logging.CRITICAL, logger=noisy)
    require_mode(mode)  # a mode that is not installed or not available: skipped, or failed where it is required
    cls: type[Proxier] = backend_class(mode)
    sync_ns, check_ns = namespaces
    adapter = CHECK_MODES[mode]
    seen = {"services": 0, "payloads": 0}

    @SETTINGS
    @given(objects)
    def run(objs: list[tuple[str, dict[str, Any]]]) -> None:
        state, changes, _ = _state(objs)
        config = CFG.with_(mode=mode)
        cls.cleanup_leftovers(config, netns=sync_ns)  # every example starts from an empty kernel
        sink: list[tuple[IPFamily | None, str]] = []
        with pytest.MonkeyPatch.context() as mp:
            adapter.capture(mp, sink)
            backend = cls(config, netns=sync_ns)
            backend.start()
            try:
                result = backend.sync(state, changes)
            finally:
                backend.close()
        assert result.ok, f"{mode}: the kernel refused the sync: {result.error}"
        # a mode may refuse what it cannot do by design (the userspace mode: SCTP) and must say so; the core refuses
        # a second ClusterIP claim on one address . protocol . port (no valid cluster has that; the generators make
        # it) and takes other claims of a held key out of the claimant: nothing else is refused
        unsupported = {spn for spn, why in result.failed.items() if "not supported" in why}
        unsupported |= {spn for spn, why in result.refused.items() if why.startswith("address-conflict: ClusterIP")}
        others = {str(spn): why for spn, why in result.failed.items() if spn not in unsupported}
        assert not others, f"{mode}: services refused: {others}"
        wanted = {
            service_key(spn).rsplit("/", 1)[0]
            for fam in CFG.ip_families
            for spn in state.family(fam)
            if spn not in unsupported
        }
        seen["services"] += len(wanted)
        texts = [(fam, text) for fam, text in sink if text.strip()]
        if wanted:
            assert texts, f"{mode}: services to program but no payload captured"
        for fam, text in texts:
            seen["payloads"] += 1
            ok, why = adapter.check(check_ns, fam, text)
            assert ok, f"{mode}: check mode refused a payload the kernel took: {why}\n{text[:3000]}"
            for line in text.splitlines():
                assert not any(c in line for c in "\x00\r\x0b\x0c"), f"{mode}: control character in {line!r}"
                problem = adapter.quoting(line)
                assert problem is None, f"{mode}: {problem}: {line!r}"
        joined = "\n".join(text for _, text in texts)
        for name in wanted:
            assert name in joined, f"{mode}: service {name} is not named in the payload"

    run()
    assert seen["services"] > 20 and seen["payloads"] > 5, f"the generators gave too little to check: {seen}"
