"""Packaging: ``backends/`` and ``bpf/`` live at the top of the repository and are installed as ``kproxy.backends``
and ``kproxy.bpf`` (``package-dir`` in pyproject.toml, no symlink). The package list there is explicit: it must name
every package folder of the tree, or an installed kproxy (the image) would lack a module the tests never miss."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_package_list_names_every_package_folder() -> None:
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapped = conf["package-dir"]
    assert mapped == {"kproxy.backends": "backends", "kproxy.bpf": "bpf"}
    found = {"kproxy.bpf"}  # C sources only: package data, no __init__.py
    for top, name in ((ROOT / "kproxy", "kproxy"), (ROOT / "backends", "kproxy.backends")):
        for init in top.rglob("__init__.py"):
            rel = init.parent.relative_to(top).parts
            found.add(".".join((name, *rel)))
    assert set(conf["packages"]) == found


def test_the_c_sources_ship_as_package_data() -> None:
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    shipped = conf["package-data"]["kproxy.bpf"]
    assert {p.name for p in (ROOT / "bpf").iterdir() if p.suffix in (".c", ".h")} and shipped == ["*.c", "*.h"]
