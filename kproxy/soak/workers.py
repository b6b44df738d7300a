"""The soak's two background workers: the churner (the churn's writes at a steady rate, pausable, with a record of
what the API took) and the traffic client (``kproxy.soak.traffic`` in a pod, its events read line by line).
"""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from typing import Any

from kproxy.lab import netns
from kproxy.lab.cluster import Lab
from kproxy.lab.plan import LabNode
from kproxy.lab.state import module_env, stdlib_module_argv
from kproxy.soak.api import Api
from kproxy.soak.churn import Churn, Write


class Churner(threading.Thread):
    """Writes the churn's steps at ``rate`` per second until stopped; ``pause()`` waits for the write in flight."""

    def __init__(self, api: Api, churn: Churn, rate: float) -> None:
        super().__init__(name="soak-churn", daemon=True)
        self.api, self.churn, self.rate = api, churn, max(0.1, rate)
        self.stop_event = threading.Event()
        self.run_event = threading.Event()
        self.idle = threading.Event()
        self.idle.set()
        self.lock = threading.Lock()
        self.applied = 0
        self.api_refused = 0
        self.retries = 0
        self.by_step: dict[str, int] = {}
        self.last_write = 0.0  # monotonic time of the last write the API took
        self.failures: list[str] = []
        self.written: dict[tuple[str, str], Write] = {}  # (kind, name) -> the last write of it the API took
        self.unsure: set[tuple[str, str]] = set()  # objects whose last write the API refused
        self.changed: set[str] = set()  # names of the services written since the last take_changed()

    def record(self, w: Write, took: bool) -> None:
        key = (w.kind, w.name)
        with self.lock:
            self.changed.add(w.service)  # a refused write may still have landed: its service is checked too
            if took:
                self.written[key] = w
                self.unsure.discard(key)
            else:
                self.unsure.add(key)

    def take_changed(self) -> set[str]:
        """The services written since the last call."""
        with self.lock:
            changed, self.changed = self.changed, set()
        return changed

    def resume(self) -> None:
        self.run_event.set()

    def pause(self, timeout: float = 30.0) -> None:
        self.run_event.clear()
        self.idle.wait(timeout)

    def stop(self) -> None:
        self.stop_event.set()
        self.run_event.set()

    MAX_WRITES = 200_000  # a bound in count besides the soak's in time (10 minutes at 5/s is about 4,000)

    def run(self) -> None:
        interval = 1.0 / self.rate
        nxt = time.monotonic()
        while not self.stop_event.is_set() and self.applied + self.api_refused < self.MAX_WRITES:
            self.run_event.wait()
            if self.stop_event.is_set():
                break
            self.idle.clear()
            try:
                if not self.run_event.is_set():
                    continue
                for w in self.churn.step():
                    took, retries = self.api.write(w, time.monotonic() + 20.0)
                    self.record(w, took)
                    with self.lock:
                        self.retries += retries
                        if took:
                            self.applied += 1
                            self.by_step[w.step] = self.by_step.get(w.step, 0) + 1
                            self.last_write = time.monotonic()
                        else:
                            self.api_refused += 1
                            if len(self.failures) < 20:
                                self.failures.append(f"{w.verb} {w.kind} {w.name} ({w.step})")
            finally:
                self.idle.set()
            nxt = max(nxt + interval, time.monotonic() - interval)
            self.stop_event.wait(max(0.0, nxt - time.monotonic()))


class Traffic:
    """``kproxy.soak.traffic`` in a pod's namespace, read line by line into ``events``."""

    def __init__(self, lab: Lab, pod_ns: str, node: LabNode, host: str, port: int, seconds: float) -> None:
        argv = netns.exec_argv(pod_ns, [*stdlib_module_argv("kproxy.soak.traffic")])
        argv += ["--host", host, "--port", str(port), "--seconds", str(int(seconds))]
        self.proc = subprocess.Popen(
            argv,
            env=module_env(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            preexec_fn=netns.cgroup_preexec(lab.cgroup_path(node)),
        )
        self.events: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.reader = threading.Thread(target=self._read, name="soak-traffic", daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            try:
                ev = json.loads(raw)
            except ValueError:
                continue
            with self.lock:
                self.events.append(ev)

    def snapshot(self) -> list[dict[str, Any]]:
        with self.lock:
            return list(self.events)

    def held_alive(self) -> bool:
        holds = [e for e in self.snapshot() if e.get("kind") == "hold"]
        return bool(holds) and all(e.get("ok") for e in holds) and time.time() - float(holds[-1]["t"]) < 3.0

    def finish(self) -> str:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            _, err = self.proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        self.reader.join(timeout=5)
        return (err or b"").decode(errors="replace")[-2000:]
