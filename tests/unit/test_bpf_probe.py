"""The bpf mode's availability probe tries bcc's import in a child: asking never loads libbcc (LLVM and clang, about
60 MB resident) into the asking process, and a bcc that does not import is still the reason given."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from backends.bpf import probe

ROOT = Path(__file__).resolve().parents[2]


def test_asking_whether_the_mode_can_run_leaves_bcc_out_of_the_process() -> None:
    """A fresh interpreter asks (``BpfProxier.available``, as ``kproxy run`` and every other mode's start-up ask):
    the answer is known, and neither the bcc package nor libbcc is in that process afterwards."""
    code = (
        "import sys\n"
        "from kproxy.proxier import backend_class\n"
        "avail = backend_class('bpf').available()\n"
        "maps = open('/proc/self/maps').read()\n"
        "print(bool(avail), 'bcc' in sys.modules, 'libbcc' in maps, avail.reason)\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert res.returncode == 0, res.stderr
    ok, imported, mapped, *_ = res.stdout.split()
    assert (imported, mapped) == ("False", "False"), res.stdout
    # the machine this runs on has bcc (HOST.md; CI requires the mode): the probe says so
    assert ok == "True", res.stdout


def test_a_bcc_that_does_not_import_is_the_reason(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "nobcc"
    fake.mkdir()
    (fake / "bcc.py").write_text('raise OSError("libbcc.so.0: hidden by the test")\n')
    monkeypatch.setenv("PYTHONPATH", str(fake))
    monkeypatch.setattr(probe, "_importable", False)
    avail = probe.availability()
    assert not avail
    assert avail.reason == "bcc (python3-bpfcc) is not importable: OSError: libbcc.so.0: hidden by the test"
    monkeypatch.delenv("PYTHONPATH")
    assert probe.bcc_import_error() is None  # the real one imports; from now on the answer is kept
    monkeypatch.setenv("PYTHONPATH", str(fake))
    assert probe.bcc_import_error() is None
