"""``kproxy.nftkernel`` opens nothing at import: the low-descriptor reserve and the process's shared libnftables
context are opened on first use and given back by ``HANDLES.close()``. Each check runs in a fresh interpreter, whose
descriptor table nothing else in the test process has touched."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kproxy.nftkernel import import_nftables

_IMPORT = """
import json, os
before = sorted(os.listdir("/proc/self/fd"))
import kproxy.nftkernel
after = sorted(os.listdir("/proc/self/fd"))
print(json.dumps({"before": before, "after": after}))
"""

# A read (`list flowtables`) opens the shared context whatever the kernel answers (without privileges it refuses the
# dump, yet the context's netlink socket is open); nothing in the kernel changes.
_USE_AND_CLOSE = """
import json, os
from kproxy import nftkernel

def fds():
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            out[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except FileNotFoundError:  # the listing's own descriptor, closed by now
            pass
    return out

before = fds()
nft = nftkernel.Nft(worker=False)
made = fds()
nft.query("list flowtables")
used = fds()
nft.close()
nftkernel.HANDLES.close()
closed = fds()
print(json.dumps({"before": before, "made": made, "used": used, "closed": closed}))
"""


def _run(code: str) -> dict[str, object]:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    parsed: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return parsed


def test_importing_the_module_opens_no_descriptor() -> None:
    got = _run(_IMPORT)
    assert got["after"] == got["before"]


def test_handles_open_on_first_use_and_close_gives_them_back() -> None:
    try:
        import_nftables()
    except ImportError as exc:
        pytest.skip(f"python3-nftables is not importable: {exc}")
    got = _run(_USE_AND_CLOSE)
    before, made, used, closed = (got[k] for k in ("before", "made", "used", "closed"))
    assert isinstance(before, dict) and isinstance(used, dict)
    assert made == before, "constructing an Nft opened a descriptor"
    opened = {int(fd): target for fd, target in used.items() if fd not in before}
    sockets = [fd for fd, target in opened.items() if target.startswith("socket:")]
    assert sockets, f"no netlink socket opened by the first query: {opened}"
    assert max(sockets) < 1000, "the context's socket is not on a low descriptor"
    assert len(opened) > 1, "no reserve of low descriptors was taken"
    assert closed == before, "HANDLES.close() left descriptors open"
