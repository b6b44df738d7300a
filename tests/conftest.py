"""Shared pytest set-up: tests marked ``root`` or ``lab`` need root and kernel features and skip, with the reason,
where those are missing. CI runs as root with everything installed, so there they all run."""

from __future__ import annotations

import os

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.geteuid() == 0:
        return
    skip = pytest.mark.skip(reason="needs root: it creates network namespaces and kernel rules")
    for item in items:
        if "root" in item.keywords or "lab" in item.keywords:
            item.add_marker(skip)
