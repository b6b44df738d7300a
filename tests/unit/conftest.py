"""Fixtures the reflector tests share: the API stand-in on loopback, an official client for it, a recording sink."""

from __future__ import annotations

from collections.abc import Iterator

import kubernetes
import pytest

from kproxy.lab.apiserver import ApiServer, serve
from kproxy.sources.kube import make_api_client
from kproxy.sources.recording import RecordingSink


@pytest.fixture
def reflector_api() -> Iterator[ApiServer]:
    server = serve([(None, "127.0.0.1", 0)], bookmark_interval=0.2, history=1000)
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def reflector_client(reflector_api: ApiServer) -> Iterator[kubernetes.client.ApiClient]:
    c = make_api_client(master=reflector_api.url)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def sink() -> RecordingSink:
    return RecordingSink()
