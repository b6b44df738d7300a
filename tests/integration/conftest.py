"""Shared fixture of the integration tests: the iptables flavours present on the machine (each test taking
``flavour`` runs once per flavour). Throwaway namespaces come from ``scratch.py``."""

from __future__ import annotations

import shutil

import pytest


@pytest.fixture(params=["nft", "legacy"])
def flavour(request: pytest.FixtureRequest) -> str:
    """An iptables flavour: the test runs once for nf_tables and once for legacy."""
    if shutil.which(f"iptables-{request.param}-restore") is None:
        pytest.skip(f"iptables-{request.param}-restore not installed")
    return str(request.param)
