"""kproxy.configwatch: a changed, replaced or removed --config file is noticed once; an untouched one never."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from kproxy.configwatch import Seen, difference, look, watch

INTERVAL = 0.05


def _watch(path: Path) -> tuple[list[str], threading.Event, object]:
    reasons: list[str] = []
    fired = threading.Event()

    def on_change(why: str) -> None:
        reasons.append(why)
        fired.set()

    stop = watch(path, on_change, interval=INTERVAL)
    return reasons, fired, stop


def test_untouched_file_never_fires(tmp_path: Path) -> None:
    cfg = tmp_path / "config.yaml"
    cfg.write_text("mode: iptables\n")
    reasons, fired, stop = _watch(cfg)
    assert not fired.wait(10 * INTERVAL)
    stop()  # type: ignore[operator]
    assert reasons == []


def test_content_change_fires_once(tmp_path: Path) -> None:
    cfg = tmp_path / "config.yaml"
    cfg.write_text("mode: iptables\n")
    reasons, fired, stop = _watch(cfg)
    cfg.write_text("mode: nftables\n")
    assert fired.wait(5.0)
    cfg.write_text("mode: iptables\n")  # a second change after the first: nobody is told twice
    time.sleep(5 * INTERVAL)
    stop()  # type: ignore[operator]
    assert reasons == ["content changed"]


def test_same_size_same_mtime_rewrite_is_seen(tmp_path: Path) -> None:
    cfg = tmp_path / "config.yaml"
    cfg.write_text("mode: iptables\n")
    st = cfg.stat()
    reasons, fired, stop = _watch(cfg)
    with open(cfg, "r+") as f:  # same inode, same size
        f.write("mode: iptablez\n")
    os.utime(cfg, ns=(st.st_atime_ns, st.st_mtime_ns))  # and the old mtime, as `cp -p` over it leaves it
    assert fired.wait(5.0)
    stop()  # type: ignore[operator]
    assert reasons == ["content changed"]


def test_touch_alone_does_not_fire(tmp_path: Path) -> None:
    cfg = tmp_path / "config.yaml"
    cfg.write_text("mode: iptables\n")
    reasons, fired, stop = _watch(cfg)
    os.utime(cfg)  # new mtime and ctime, same bytes: the hash says nothing changed
    assert not fired.wait(10 * INTERVAL)
    stop()  # type: ignore[operator]
    assert reasons == []
    assert difference(Seen(missing=True), look(cfg)) == "appeared"
    assert difference(Seen(missing=True), Seen(missing=True)) is None


def test_configmap_style_symlink_swap_fires(tmp_path: Path) -> None:
    # A ConfigMap volume: config.yaml -> ..data/config.yaml, ..data -> ..2026_1 ; an update swaps ..data.
    (tmp_path / "..v1").mkdir()
    (tmp_path / "..v1" / "config.yaml").write_text("mode: iptables\n")
    (tmp_path / "..v2").mkdir()
    (tmp_path / "..v2" / "config.yaml").write_text("mode: nftables\n")
    (tmp_path / "..data").symlink_to("..v1")
    cfg = tmp_path / "config.yaml"
    cfg.symlink_to("..data/config.yaml")
    reasons, fired, stop = _watch(cfg)
    tmp_link = tmp_path / "..data_tmp"
    tmp_link.symlink_to("..v2")
    tmp_link.replace(tmp_path / "..data")  # atomic rename, as the kubelet does
    assert fired.wait(5.0)
    stop()  # type: ignore[operator]
    assert reasons == ["content changed"]


def test_replaced_by_identical_bytes_fires(tmp_path: Path) -> None:
    cfg = tmp_path / "config.yaml"
    cfg.write_text("mode: iptables\n")
    reasons, fired, stop = _watch(cfg)
    new = tmp_path / "config.yaml.new"
    new.write_text("mode: iptables\n")
    new.replace(cfg)
    assert fired.wait(5.0)
    stop()  # type: ignore[operator]
    assert reasons == ["replaced"]


def test_removed_file_fires(tmp_path: Path) -> None:
    cfg = tmp_path / "config.yaml"
    cfg.write_text("mode: iptables\n")
    reasons, fired, stop = _watch(cfg)
    cfg.unlink()
    assert fired.wait(5.0)
    stop()  # type: ignore[operator]
    assert reasons == ["removed or unreadable"]


def test_stop_ends_the_thread_and_is_idempotent(tmp_path: Path) -> None:
    cfg = tmp_path / "config.yaml"
    cfg.write_text("x\n")
    before = {t.name for t in threading.enumerate()}
    stop = watch(cfg, lambda why: None, interval=INTERVAL)
    assert any(t.name == "configwatch-config.yaml" for t in threading.enumerate())
    stop()
    stop()
    assert {t.name for t in threading.enumerate()} <= before


def test_a_failing_callback_does_not_raise_in_the_thread(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cfg = tmp_path / "config.yaml"
    cfg.write_text("x\n")
    fired = threading.Event()

    def boom(why: str) -> None:
        fired.set()
        raise RuntimeError("callback broke")

    stop = watch(cfg, boom, interval=INTERVAL)
    cfg.write_text("y\n")
    assert fired.wait(5.0)
    stop()
    assert "config watch callback failed" in caplog.text


def test_bad_interval() -> None:
    with pytest.raises(ValueError):
        watch("/nonexistent", lambda why: None, interval=0)
