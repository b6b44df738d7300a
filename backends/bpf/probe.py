"""Whether the bpf mode can run here (``BpfProxier.available``), asked without loading bcc into kproxy's process.

``import bcc`` loads libbcc, which carries LLVM and clang: about 60 MB resident in the importing process, measured on
this machine (a process at 42 MB goes to 102 MB), and never given back. kproxy's own process needs none of it: the
programs are compiled in a child (``loader.attach_in_child``) and the maps are opened and written with ``bpf(2)``
(``maps``). Yet every process that asked whether the mode is available paid it: ``kproxy run`` in the bpf mode, and
``kproxy run`` in every *other* mode, whose start-up removes the bpf mode's leftovers once it has asked
(``cleanup_other_modes``). So the import is tried in a short-lived child of the same interpreter and environment
(``PYTHONPATH`` included: a test hides bcc that way), and its error, if any, is the reason given.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

from kproxy.proxier import Availability

#: the child's program: nothing on success; the import's error as ``Type: message`` on stderr and exit 1 otherwise
_IMPORT = """
try:
    import bcc
except Exception as exc:  # bcc raises OSError when libbcc is missing
    import sys
    sys.stderr.write(f"{type(exc).__name__}: {exc}")
    raise SystemExit(1)
"""
IMPORT_TIMEOUT = 60.0

_lock = threading.Lock()
_importable = False  # once bcc imported in a child, it does for this process's life (a failure is asked again)


def bcc_import_error() -> str | None:
    """None when ``import bcc`` works for this interpreter, else why not (the child's ``Type: message``)."""
    global _importable
    with _lock:
        if _importable:
            return None
        try:
            res = subprocess.run(
                [sys.executable, "-c", _IMPORT],
                capture_output=True,
                text=True,
                timeout=IMPORT_TIMEOUT,
                check=False,
                cwd="/",  # the child's sys.path[0] is its working folder: nothing there may stand in for bcc
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"{type(exc).__name__}: {exc}"
        if res.returncode != 0:
            return res.stderr.strip()[-400:] or f"the import exited {res.returncode}"
        _importable = True
        return None


def availability() -> Availability:
    """bcc importable, root, kernel headers for bcc and BTF; the first thing missing is the reason."""
    error = bcc_import_error()
    if error is not None:
        return Availability(False, f"bcc (python3-bpfcc) is not importable: {error}")
    if os.geteuid() != 0:
        return Availability(False, "the bpf mode needs root (bpf(2), cgroup attachments)")
    release = os.uname().release
    # bcc's own order: BCC_KERNEL_SOURCE (the image's merged tree, deploy/Dockerfile), the release's build
    # folder, the kernel's built-in archive
    source = os.environ.get("BCC_KERNEL_SOURCE")
    if source:
        if not Path(source, "include", "linux", "kconfig.h").exists():
            return Availability(False, f"BCC_KERNEL_SOURCE={source} holds no kernel headers (include/linux)")
    elif not Path(f"/lib/modules/{release}/build").exists() and not Path("/sys/kernel/kheaders.tar.xz").exists():
        return Availability(False, f"no kernel headers for bcc: /lib/modules/{release}/build is missing")
    if not Path("/sys/kernel/btf/vmlinux").exists():
        return Availability(False, "the kernel has no BTF (/sys/kernel/btf/vmlinux): too old for the bpf mode")
    return Availability(True)
