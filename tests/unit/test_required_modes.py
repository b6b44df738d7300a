"""tests/modes.py and .ci/run: an unavailable mode skips on a developer's machine and fails, with the mode's reason,
where ``KPROXY_REQUIRE_MODES`` requires it; CI requires every mode and still runs exactly ``make test``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from modes import ENV, require_mode, required_modes

from kproxy.proxier import MODE_NAMES, Availability

ROOT = Path(__file__).resolve().parents[2]


def test_required_modes_spellings() -> None:
    assert required_modes({}) == frozenset()
    assert required_modes({ENV: ""}) == frozenset()
    assert required_modes({ENV: "all"}) == frozenset(MODE_NAMES)
    assert required_modes({ENV: " bpf , iptables,"}) == {"bpf", "iptables"}
    with pytest.raises(ValueError, match="bfp is no mode"):
        required_modes({ENV: "iptables,bfp"})


def _gone(mode: str) -> Availability:
    return Availability(False, "bcc is not importable: no module named bcc")


def test_an_unavailable_mode_fails_where_required_and_skips_elsewhere() -> None:
    with pytest.raises(pytest.fail.Exception, match="mode bpf is required .* bcc is not importable"):
        require_mode("bpf", {ENV: "all"}, _gone)
    with pytest.raises(pytest.fail.Exception, match="bcc is not importable"):
        require_mode("bpf", {ENV: "bpf"}, _gone)
    with pytest.raises(pytest.skip.Exception, match="mode bpf is not available here: bcc is not importable"):
        require_mode("bpf", {ENV: "iptables"}, _gone)
    with pytest.raises(pytest.skip.Exception):
        require_mode("bpf", {}, _gone)
    require_mode("bpf", {ENV: "all"}, lambda m: Availability(True))  # available: nothing happens


def _pytest_without_bcc(tmp_path: Path, require: str | None) -> subprocess.CompletedProcess[str]:
    """tests/test_required_modes.py's bpf case in a child pytest whose ``import bcc`` raises ImportError (a fake
    bcc first on PYTHONPATH): the machine's real bcc is hidden, nothing else changes."""
    fake = tmp_path / "nobcc"
    fake.mkdir(exist_ok=True)
    (fake / "bcc.py").write_text('raise ImportError("bcc hidden by the test (libbcc missing)")\n')
    env = {k: v for k, v in os.environ.items() if k not in (ENV, "PYTHONPATH")}
    env["PYTHONPATH"] = str(fake)
    if require is not None:
        env[ENV] = require
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rsf", "-q"]
    argv += ["tests/test_required_modes.py::test_mode_available[bpf]"]
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False)


def test_hidden_bcc_fails_the_run_where_bpf_is_required(tmp_path: Path) -> None:
    required = _pytest_without_bcc(tmp_path, "all")
    assert required.returncode == 1, required.stdout + required.stderr
    assert "1 failed" in required.stdout
    assert "mode bpf is required (KPROXY_REQUIRE_MODES) but not available here" in required.stdout
    assert "ImportError: bcc hidden by the test" in required.stdout  # the mode's own reason
    laptop = _pytest_without_bcc(tmp_path, None)
    assert laptop.returncode == 0, laptop.stdout + laptop.stderr
    assert "1 skipped" in laptop.stdout and "ImportError: bcc hidden by the test" in laptop.stdout


def test_a_misspelt_requirement_stops_the_run(tmp_path: Path) -> None:
    res = _pytest_without_bcc(tmp_path, "iptables,bfp")
    assert res.returncode == 4, res.stdout + res.stderr  # pytest's usage error
    assert "bfp is no mode" in res.stderr


def test_ci_requires_every_mode_and_runs_make_test(tmp_path: Path) -> None:
    """.ci/run with a stand-in ``make`` first on PATH that records its arguments and the variable it was given."""
    record = tmp_path / "make.txt"
    stub = tmp_path / "bin" / "make"
    stub.parent.mkdir()
    stub.write_text(f'#!/bin/sh\necho "$*|${{{ENV}:-unset}}" > {record}\n')
    stub.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != ENV}
    env["PATH"] = f"{stub.parent}:{env.get('PATH', '/usr/bin:/bin')}"
    res = subprocess.run([str(ROOT / ".ci" / "run")], env=env, capture_output=True, text=True, timeout=60, check=False)
    assert res.returncode == 0, res.stderr
    assert record.read_text().strip() == "test|all"
