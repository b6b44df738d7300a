"""The iptables backend passes ``-w`` only where the installed iptables takes it, as upstream's pkg/util/iptables.

Versions: ``iptables -w`` since 1.4.20, ``-w SECONDS`` since 1.4.22, ``iptables-restore -w SECONDS`` since 1.6.2.
The version is read from the binary itself once; the argv checks run stand-in binaries (small scripts that print a
version and the arguments they got) on PATH, so no root and no kernel are needed: what is tested is the command line.
"""

from __future__ import annotations

import os
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from kproxy.backends.iptables import kernel
from kproxy.backends.iptables.kernel import WAIT, Kernel, parse_version, tool_version, wait_flags
from kproxy.model import IPFamily


@pytest.mark.parametrize(
    ("text", "version"),
    [
        ("iptables v1.8.9 (nf_tables)\n", (1, 8, 9)),
        ("ip6tables-restore v1.8.9 (legacy)", (1, 8, 9)),
        ("iptables v1.4.21", (1, 4, 21)),
        ("iptables v1.6", (1, 6, 0)),
        ("iptables-restore: unknown option", None),
        ("", None),
    ],
)
def test_parse_version(text: str, version: tuple[int, int, int] | None) -> None:
    assert parse_version(text) == version


@pytest.mark.parametrize(
    ("version", "plain", "restore"),
    [
        ((1, 8, 9), WAIT, WAIT),
        ((1, 6, 2), WAIT, WAIT),
        ((1, 6, 1), WAIT, ()),  # -w SECONDS for iptables, but this restore has no -w at all
        ((1, 4, 22), WAIT, ()),
        ((1, 4, 21), ("-w",), ()),  # bare -w: seconds came in 1.4.22
        ((1, 4, 20), ("-w",), ()),
        ((1, 4, 19), (), ()),
        (None, (), ()),  # unknown: no flag (a missing wait is retried by the next sync; a bad flag never works)
    ],
)
def test_wait_flags(version: tuple[int, int, int] | None, plain: tuple[str, ...], restore: tuple[str, ...]) -> None:
    assert wait_flags(version, restore=False) == plain
    assert wait_flags(version, restore=True) == restore


@pytest.fixture
def bindir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A folder first on PATH for stand-in binaries (``_install``); the version cache starts empty."""
    folder = tmp_path / "bin"
    folder.mkdir()
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ.get('PATH', '')}")
    kernel.tool_version.cache_clear()
    yield folder
    kernel.tool_version.cache_clear()  # the stand-ins' versions stay in this test


def _install(bindir: Path, versions: dict[str, str]) -> None:
    """Each ``name`` becomes a script that prints ``name VERSION`` for ``--version`` and otherwise appends its
    arguments to ``<name>.args`` (and reads stdin, as iptables-restore does)."""
    for name, ver in versions.items():
        script = bindir / name
        script.write_text(
            "#!/bin/sh\n"
            f'if [ "$1" = "--version" ]; then echo "{name} {ver} (nf_tables)"; exit 0; fi\n'
            f'echo "$@" >> "{bindir}/{name}.args"\n'
            "cat >/dev/null\n"
        )
        script.chmod(script.stat().st_mode | stat.S_IXUSR)


def _args(bindir: Path, name: str) -> list[str]:
    return (bindir / f"{name}.args").read_text().split()


def test_old_iptables_gets_bare_w_and_restore_none(bindir: Path) -> None:
    _install(bindir, {"iptables-nft": "v1.4.21", "iptables-nft-restore": "v1.4.21"})
    k = Kernel("nft")
    assert k.restore(IPFamily.V4, "*nat\nCOMMIT\n").ok
    assert k.list_chain(IPFamily.V4, "nat", "KUBE-SERVICES").ok
    assert _args(bindir, "iptables-nft-restore") == ["--noflush", "--counters"]
    assert _args(bindir, "iptables-nft") == ["-w", "-t", "nat", "-S", "KUBE-SERVICES"]


def test_current_iptables_gets_w_5(bindir: Path) -> None:
    _install(bindir, {"ip6tables-nft": "v1.8.9", "ip6tables-nft-restore": "v1.8.9"})
    k = Kernel("nft")
    assert k.restore(IPFamily.V6, "*nat\nCOMMIT\n", noflush=False).ok
    assert k.chain_exists(IPFamily.V6, "filter", "KUBE-FORWARD")
    assert _args(bindir, "ip6tables-nft-restore") == ["-w", "5", "--counters"]
    assert _args(bindir, "ip6tables-nft") == ["-w", "5", "-t", "filter", "-S", "KUBE-FORWARD"]


def test_version_is_asked_once_per_binary(bindir: Path) -> None:
    _install(bindir, {"iptables-legacy": "v1.6.1"})
    assert tool_version("iptables-legacy") == (1, 6, 1)
    (bindir / "iptables-legacy").unlink()  # gone: a second ask would fail, the cached answer stands
    assert tool_version("iptables-legacy") == (1, 6, 1)
    assert tool_version("iptables-nowhere-restore") is None


def test_the_installed_iptables_is_read() -> None:
    """The real binary of this host, read without root: Debian 12 ships 1.8.9, so both take ``-w 5``."""
    try:
        out = subprocess.run(["iptables-nft", "--version"], capture_output=True, text=True, timeout=10, check=False)
    except FileNotFoundError:
        pytest.skip("iptables-nft is not installed")
    expected = parse_version(out.stdout)
    assert expected is not None
    assert tool_version("iptables-nft") == expected
    assert Kernel("nft").wait(IPFamily.V4) == wait_flags(expected, restore=False)
