"""The soak's faults: the kinds (``FAULT_KINDS``, see kproxy.soak.run), the schedule that runs them in whole cycles,
the fault switch for a failed kernel apply, and the API stand-in's restart from a dump of what it held.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from kproxy.lab import netns
from kproxy.lab.cluster import Lab
from kproxy.lab.plan import API_PORT_IN_LAB
from kproxy.lab.state import stdlib_module_argv
from kproxy.soak.api import Api, SoakError

FAULT_KINDS = ("none", "watch_drop", "http_5xx", "gone_410", "kproxy_kill", "flush", "api_restart", "apply_fail")
#: The fault switch for "a failed kernel apply" (kproxy.ledger.FAULT_SWITCH): with this variable set in kproxy's
#: environment, the ledger looks for ``$KPROXY_TEST_FAULTS_DIR/<node name>/fail-apply`` before each ``apply``;
#: a positive integer N there answers the next N applies as failed (as a refused restore) and counts down. The soak
#: sets it for the kproxy processes it starts and writes the file; a file nobody consumed means "not supported".
FAULT_SWITCH = "KPROXY_TEST_FAULTS_DIR"
MAX_CYCLES = 100


class NotInjected(Exception):
    """This build cannot take the fault (the message says why)."""


def fault_schedule(
    faults: Sequence[str], time_up: Callable[[], bool], cycles: int = 0, stop: Callable[[], bool] = lambda: False
) -> Iterator[str]:
    """The fault kinds in turn, in whole cycles only: ``cycles`` of them when positive, else as many as begin before
    ``time_up()`` (at least one, so every kind runs). ``stop()`` ends it after a cycle (nothing left to inject)."""
    for n in range(1, MAX_CYCLES * 100 + 1):
        yield from faults
        if stop() or (cycles > 0 and n >= cycles) or (cycles <= 0 and time_up()):
            return


def pending(switch: Path) -> int:
    try:
        return int(switch.read_text().strip() or 0)
    except (OSError, ValueError):
        return 0


def restart_api(lab: Lab, api: Api) -> None:
    """Stop the stand-in and start it again from a dump of what it held, on the same addresses."""
    dump = lab.state_dir / "soak-api-dump"
    dump.mkdir(exist_ok=True)
    for old in dump.glob("*.json"):
        old.unlink()
    objs = []
    for kind, api_version in (("Node", "v1"), ("Service", "v1"), ("EndpointSlice", "discovery.k8s.io/v1")):
        # a list's items carry neither (as the real API's); --load needs both to know the resource
        objs += [{**obj, "apiVersion": api_version, "kind": kind} for obj in api.list(kind)]
    for i, obj in enumerate(objs):
        meta = obj.get("metadata", {})
        for key in ("resourceVersion", "uid", "creationTimestamp", "managedFields"):
            meta.pop(key, None)
        (dump / f"{i:05d}.json").write_text(json.dumps(obj))
    pid = lab._pids().get("apiserver")
    if pid is None:
        raise SoakError("the API stand-in is not running")
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 15
    while netns.alive(pid) and time.monotonic() < deadline:
        lab._reap("apiserver")
        time.sleep(0.05)
    if netns.alive(pid):
        os.kill(pid, signal.SIGKILL)
    port_file = lab.state_dir / "api.port"
    port_file.unlink(missing_ok=True)
    argv = [*stdlib_module_argv("kproxy.lab.apiserver")[:1], "-m", "kproxy.lab.apiserver"]
    argv += ["--listen", f"127.0.0.1:{lab.api_port}", "--port-file", str(port_file), "--load", str(dump)]
    argv += ["--listen", f"{lab.fabric_ns}/198.18.0.1:{API_PORT_IN_LAB}"]
    if lab.ipv6:
        argv += ["--listen", f"{lab.fabric_ns}/[fd00:198:18::1]:{API_PORT_IN_LAB}"]
    with open(lab.state_dir / "apiserver.log", "ab") as f:
        f.write(f"--- {time.strftime('%H:%M:%S')} soak: restart from {len(objs)} objects\n".encode())
    proc = lab._spawn("apiserver", argv, lab.state_dir / "apiserver.log", None, append=True)
    deadline = time.monotonic() + 30
    while not port_file.exists():  # written once the dump is loaded
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SoakError("the restarted API stand-in did not come up; see apiserver.log")
        time.sleep(0.05)
    held = sum(len(api.list(kind)) for kind in ("Node", "Service", "EndpointSlice"))
    if held != len(objs):
        raise SoakError(f"the restarted API stand-in holds {held} objects of the {len(objs)} dumped")
