"""Names and values from the manifest folder cannot forge log lines (control characters are escaped), and a bad
value is rendered for a message without looking at all of it."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from kproxy import validation as v
from kproxy.cache import ServiceCache
from kproxy.objects import clip, label
from kproxy.sources.files import FilesSource

NODE = "node-1"
FORGED = "web\nERROR kproxy.daemon: forged line \x1b[2K\u202e"

SERVICE = """\
apiVersion: v1
kind: Service
metadata: {{name: {name}, namespace: default}}
spec: {{clusterIP: 198.19.0.10, ports: [{{port: 80}}]}}
"""


def lines_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records]


def test_a_name_with_a_newline_is_logged_escaped_on_one_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    name = '"web\\nERROR kproxy.daemon: forged line \\e[2K\\u202e"'  # YAML double-quoted escapes
    (tmp_path / "svc.yaml").write_text(SERVICE.format(name=name))
    (tmp_path / "label.yaml").write_text(
        SERVICE.format(name="ok").replace("namespace: default", 'namespace: default, labels: {"a\\nb": 1}')
    )
    cache = ServiceCache(NODE)
    with caplog.at_level(logging.DEBUG):
        FilesSource(cache, tmp_path, NODE).poll()
    rejected = [m for m in lines_of(caplog) if "rejected" in m]
    assert len(rejected) == 2, lines_of(caplog)
    for message in lines_of(caplog):
        assert message.isprintable(), message  # no newline, no escape sequence, no bidi override
    assert any("web\\nERROR kproxy.daemon: forged line \\x1b[2K\\u202e" in m for m in rejected), rejected
    assert any("metadata.labels[a\\nb]" in m for m in rejected), rejected
    assert all(key.isprintable() and reason.isprintable() for key, reason in cache.errors().items())


def test_unparsable_files_are_one_escaped_line_whatever_their_name(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "bad\nINFO forged.yaml").write_text("a: [1, 2\nb: {")  # YAML errors span several lines
    (tmp_path / "nameless.yaml").write_text('apiVersion: v1\nkind: "Service\\nINFO forged"\nmetadata: {}\n')
    (tmp_path / "odd-kind.yaml").write_text("apiVersion: v1\nkind: {a: b}\nmetadata: {}\n")
    source = FilesSource(ServiceCache(NODE), tmp_path, NODE)
    with caplog.at_level(logging.DEBUG):
        source.poll()
    messages = lines_of(caplog)
    assert source.errors == 1
    assert any("unparsable" in m and "bad\\nINFO forged.yaml" in m for m in messages), messages
    assert any("without metadata.name" in m and "Service\\nINFO forged" in m for m in messages), messages
    assert any("<dict kind>" in m for m in messages), messages
    for message in messages:
        assert message.isprintable(), message


@pytest.mark.parametrize(("text", "want"), [("plain-name", "plain-name"), (FORGED, None), ("x" * 1000, None)])
def test_clip_escapes_and_bounds(text: str, want: str | None) -> None:
    out = clip(text)
    assert out.isprintable() and len(out) <= 120
    if want is not None:
        assert out == want
    assert label("Service", "default", text).isprintable()


class Counted:
    reprs = 0

    def __repr__(self) -> str:
        Counted.reprs += 1
        return "Counted()"


def test_show_looks_at_a_bounded_part_of_a_bad_value() -> None:
    Counted.reprs = 0
    with pytest.raises(ValueError) as err:
        v.mapping([Counted() for _ in range(10_000)], "spec")
    assert Counted.reprs <= 4, Counted.reprs  # not 10,000: the value is cut before it is rendered
    assert len(str(err.value)) < 300

    deep: Any = []
    for _ in range(100_000):  # repr() of the whole would overflow the stack
        deep = [deep]
    with pytest.raises(ValueError) as err:
        v.string(deep, "metadata.name")
    assert "expected a string, got list" in str(err.value) and len(str(err.value)) < 300

    huge = "a\n" * 500_000
    message = v._show(huge)
    assert message.isprintable() and len(message) < 120 and "(1000000 chars)" in message
