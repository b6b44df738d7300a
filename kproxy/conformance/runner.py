"""Runs conformance scenarios on a lab with kproxy in one mode and collects a ``Report``.

For every scenario, in ``SCENARIOS`` order: a scenario the backend declares impossible (``not_applicable``) or
that needs what the lab lacks is reported not-applicable with the reason, never run and never passed. Otherwise
the session makes sure kproxy runs on every node in the mode (restarting one that died), runs the scenario in its
own API namespace, and always empties that namespace afterwards, so a failing scenario leaves the lab usable for
the next. Anything a scenario raises is a FAIL with the reason; a kproxy that exited during a scenario it did not
stop itself is a FAIL too, with the tail of its log.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kproxy.conformance.context import Context
from kproxy.conformance.registry import Scenario
from kproxy.conformance.report import FAIL, NOT_APPLICABLE, PASS, Report, Result
from kproxy.conformance.scenarios import BY_ID, SCENARIOS
from kproxy.conformance.values import HEALTHZ_PORT, Addresses, NotApplicable, NotApplicableHere, ScenarioFailure

if TYPE_CHECKING:
    from kproxy.proxier import LabHooks

log = logging.getLogger("kproxy.conformance")

# Scenarios that stop kproxy themselves (and start it again): a kproxy not running afterwards is theirs to report.
STOPS_KPROXY = frozenset({"restart", "cleanup", "mode-switch"})
READY_TIMEOUT_S = 40.0


class ConformanceError(RuntimeError):
    """The suite cannot run at all (unknown scenario, mode not available here, no lab); the message says why."""


def select(scenario_ids: Sequence[str] | None) -> list[Scenario]:
    """The scenarios to run, in table order; ConformanceError names unknown ids."""
    if not scenario_ids:
        return list(SCENARIOS)
    unknown = [s for s in scenario_ids if s not in BY_ID]
    if unknown:
        raise ConformanceError(f"unknown scenario(s) {', '.join(unknown)}; known: {', '.join(BY_ID)}")
    wanted = set(scenario_ids)
    return [s for s in SCENARIOS if s.id in wanted]


def requested_modes(spec: str, installed: Sequence[str]) -> list[str]:
    """The modes a comma-separated request names (``KPROXY_CONFORMANCE_MODES``; empty: every installed one), in
    the order given. ConformanceError for a name that is no installed mode, or when nothing is left to test: a typo
    or a missing backend must fail the run, not shrink it to nothing and go green."""
    wanted = [w.strip() for w in spec.split(",") if w.strip()]
    if not wanted:
        modes = list(installed)
    else:
        unknown = [w for w in wanted if w not in installed]
        if unknown:
            raise ConformanceError(
                f"requested mode(s) {', '.join(unknown)} not installed here; "
                f"installed: {', '.join(installed) or 'none'}"
            )
        modes = list(dict.fromkeys(wanted))
    if not modes:
        raise ConformanceError("no backend is installed, so there is nothing to test")
    return modes


def declared_not_applicable(cls: LabHooks, options: Mapping[str, Any]) -> dict[str, str]:
    """The mode's own ``not_applicable(options)`` (scenario id -> reason). A key that is no scenario id is a
    ConformanceError: a typo there would otherwise leave the scenario it meant running (and failing) unnoticed, or
    name one that no longer exists."""
    found = dict(cls.not_applicable(options))
    unknown = sorted(set(found) - set(BY_ID))
    if unknown:
        raise ConformanceError(
            f"mode {getattr(cls, 'mode', '?')} declares not-applicable scenarios that do not exist: "
            f"{', '.join(unknown)}; known: {', '.join(BY_ID)}"
        )
    return found


def declared_not_applicable_parts(cls: LabHooks, options: Mapping[str, Any]) -> dict[str, dict[str, str]]:
    """The mode's own ``not_applicable_parts(options)`` (scenario id -> part -> reason). A scenario id that does not
    exist, or a part that is not one of the scenario's own (``Scenario.parts``), is a ConformanceError: a typo would
    otherwise leave the part it meant running, or declare away nothing."""
    found = {sid: dict(parts) for sid, parts in cls.not_applicable_parts(options).items()}
    wrong = [sid for sid in found if sid not in BY_ID]
    wrong += [
        f"{sid}/{part}"
        for sid, parts in found.items()
        if sid in BY_ID
        for part in parts
        if part not in BY_ID[sid].parts
    ]
    if wrong:
        known = ", ".join(f"{s.id}/{p}" for s in SCENARIOS for p in sorted(s.parts))
        raise ConformanceError(
            f"mode {getattr(cls, 'mode', '?')} declares not-applicable parts that do not exist: {', '.join(wrong)}; "
            f"known: {known}"
        )
    return found


def judge_parts(mode: str, scenario: str, ctx: Context) -> str:
    """Why a scenario that passed fails on its parts, or "": a part found not applicable that the mode does not
    declare, or a declared part the scenario never reached (the declaration names something it does not have)."""
    problems = [
        f"part {part} found not applicable but not declared by mode {mode} (not_applicable_parts): {why}"
        for part, why in ctx.undeclared
    ]
    reached = {p for p, _ in ctx.parts}
    problems += [
        f"mode {mode} declares part {part} not applicable, but the scenario never reached it"
        for part in sorted(set(ctx.declared_parts) - reached)
    ]
    return "; ".join(problems)


def lab_features(lab: Any) -> set[str]:
    out = set()
    if getattr(lab, "ipv6", False):
        out.add("ipv6")
    return out


class Session:
    """One lab with kproxy in one mode, running scenarios one at a time."""

    def __init__(self, mode: str, lab: Any, *, owns_lab: bool = False, **context_kwargs: Any) -> None:
        """``context_kwargs`` go to every scenario's ``Context`` (the judge's tests pass a fake clock and API)."""
        from kproxy.proxier import backend_class

        self.mode = mode
        self.lab = lab
        self.owns_lab = owns_lab
        self.context_kwargs = context_kwargs
        self.addresses = Addresses()
        #: the backend options the lab gives every node's kproxy, as this mode reads them (``option_values``: its
        #: declared options over their defaults); what its ``not_applicable`` is asked about
        cls = backend_class(mode)
        given = dict(getattr(lab, "backend_options", None) or {})
        values = getattr(cls, "option_values", None)
        self.options: dict[str, Any] = dict(values(given)) if values is not None else given
        self.not_applicable = declared_not_applicable(cls, self.options)
        self.not_applicable_parts = declared_not_applicable_parts(cls, self.options)
        self.lab_gaps: list[str] = []  # scenarios this lab could not run
        self.kproxy_args: list[str] = list(getattr(lab, "state", {}).get("kproxy_args", []) or [])

    # -- lifecycle ---------------------------------------------------------------------------------------------
    @classmethod
    def open(
        cls,
        mode: str,
        *,
        reuse_lab: bool = False,
        replace_lab: bool = False,
        prefix: str | None = None,
        backend_options: Mapping[str, Any] | None = None,
    ) -> Session:
        """Check the mode, then bring up a fresh 2-node lab (or attach to the running one with ``reuse_lab``).
        A live lab under the prefix (``Lab.live``: its processes run) is someone's: bringing one up would take it
        down, so that is refused (ConformanceError) unless ``replace_lab``; a killed run's leftover is replaced."""
        from kproxy.lab.cluster import Lab, LabError, check_prefix
        from kproxy.proxier import availability

        avail = availability(mode)
        if not avail:
            raise ConformanceError(f"mode {mode} cannot run here: {avail.reason}")
        if prefix is not None:
            try:
                check_prefix(prefix)
            except LabError as exc:
                raise ConformanceError(str(exc)) from None
        lab = None
        owns = False
        if reuse_lab:
            try:
                lab = Lab.attach(prefix=prefix)
            except LabError as exc:
                log.info("no lab to reuse (%s); bringing one up", exc)
        elif not replace_lab:
            if Lab.live(prefix=prefix) is not None:  # a leftover of a killed run is nobody's: replaced silently
                raise ConformanceError(
                    f"a lab is already running under prefix {prefix or Lab.PREFIX!r} and this run did not create it; "
                    "bringing up a fresh one would take it down: pass --reuse-lab to run on it, --replace-lab to "
                    "replace it, or --lab-prefix PREFIX for a lab of your own"
                )
        if lab is None:
            try:
                lab = Lab.up(
                    nodes=2, pods_per_node=3, mode=mode, ipv6=True, prefix=prefix, backend_options=backend_options
                )
            except Exception as exc:  # the lab cleans up after a failed start itself
                raise ConformanceError(f"the lab did not come up: {type(exc).__name__}: {exc}") from exc
            owns = not reuse_lab
        try:
            session = cls(mode, lab, owns_lab=owns)
        except BaseException:
            if owns:
                Lab.down(prefix=getattr(lab, "prefix", None))
            raise
        try:
            session.prepare()
        except BaseException:
            session.close()  # a lab we brought up goes again; a reused one stays
            raise
        return session

    def prepare(self) -> None:
        """kproxy in this mode on every node, each answering /healthz 200."""
        self._wrong_mode_stopped()
        for node in self.lab.nodes:
            if not self.lab.kproxy_running(node):
                self.lab.start_kproxy(node, self.mode, self.kproxy_args)
        self.wait_ready()

    def _wrong_mode_stopped(self) -> list[str]:
        """Stop a kproxy that runs in another mode than the session's (the lab records each node's); say where."""
        running = (getattr(self.lab, "state", {}) or {}).get("kproxy", {})
        stopped = []
        for node in self.lab.nodes:
            mode_there = (running.get(node.name) or {}).get("mode")
            if self.lab.kproxy_running(node) and mode_there not in (None, self.mode):
                self.lab.stop_kproxy(node)
                stopped.append(f"kproxy on {node.name} ran in mode {mode_there}, not {self.mode}")
        return stopped

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        for node in self.lab.nodes:
            url = f"http://{node.ip4}:{HEALTHZ_PORT}/healthz"
            last = ""
            while True:
                if not self.lab.kproxy_running(node):
                    raise ConformanceError(f"kproxy on {node.name} exited while starting: {self.log_tail(node)}")
                try:
                    r = self.lab.probe_http(self.lab.external_ns, url, timeout=1.0)
                    if r.status == 200:
                        break
                    last = f"{r.status} {r.error} {(r.body or '')[:200]}"
                except Exception as exc:  # the probe itself failing is "not yet" until the deadline
                    last = str(exc)
                if time.monotonic() > deadline:
                    raise ConformanceError(
                        f"kproxy on {node.name} not healthy after {timeout:.0f} s: GET {url}: {last}"
                    )
                time.sleep(0.3)

    def close(self, keep_lab: bool = False) -> None:
        if self.owns_lab and not keep_lab:
            from kproxy.lab.cluster import Lab

            Lab.down(prefix=getattr(self.lab, "prefix", None))

    def log_tail(self, node: Any, lines: int = 6, since: int = 0) -> str:
        text = self.lab.kproxy_log(node)[since:]
        tail = [ln for ln in text.splitlines() if ln.strip()][-lines:]
        return " | ".join(tail) if tail else "(empty log)"

    # -- scenarios ---------------------------------------------------------------------------------------------
    def run_scenario(self, scenario: Scenario) -> Result:
        reason = self.not_applicable.get(scenario.id)
        if reason:
            return Result(scenario.id, NOT_APPLICABLE, f"{self.mode}: {reason}")
        missing = scenario.needs - lab_features(self.lab)
        if missing:
            self.lab_gaps.append(scenario.id)
            return Result(scenario.id, NOT_APPLICABLE, f"the lab lacks {', '.join(sorted(missing))}")
        t0 = time.monotonic()
        revived = self._revive()
        log_marks = {n.name: len(self.lab.kproxy_log(n)) for n in self.lab.nodes}
        ctx: Context | None = None
        status, detail = PASS, ""
        try:
            ctx = Context(
                self.lab,
                self.mode,
                scenario.id,
                self.addresses,
                scenario.timeout_s,
                self.kproxy_args,
                options=self.options,
                declared_parts=self.not_applicable_parts.get(scenario.id),
                **self.context_kwargs,
            )
            ctx.empty_namespace()  # leftovers of a killed earlier run
            scenario.run(ctx)
            detail = "; ".join(ctx.notes)
        except NotApplicable as exc:  # raised by scenarios for what the lab (or the host) lacks
            status, detail = NOT_APPLICABLE, str(exc)
            if not isinstance(exc, NotApplicableHere):
                self.lab_gaps.append(scenario.id)
        except ScenarioFailure as exc:
            status, detail = FAIL, str(exc)
        except Exception as exc:
            frame = traceback.extract_tb(exc.__traceback__)[-1]
            status = FAIL
            detail = f"{type(exc).__name__}: {exc} (at {frame.filename.rsplit('/', 1)[-1]}:{frame.lineno})"
        finally:
            if ctx is not None:
                try:
                    ctx.empty_namespace()
                except Exception as exc:
                    detail += f" [emptying namespace {ctx.namespace} failed: {exc}]"
        if scenario.id not in STOPS_KPROXY or status == FAIL:
            died = [n for n in self.lab.nodes if not self.lab.kproxy_running(n)]
            if died and status != NOT_APPLICABLE:
                status = FAIL
                detail = (detail + "; " if detail else "") + "; ".join(
                    f"kproxy on {n.name} exited during the scenario, log: {self.log_tail(n, since=log_marks[n.name])}"
                    for n in died
                )
        if status == FAIL:
            errors = self._errors_since(log_marks)
            if errors:
                detail += " [kproxy log: " + errors + "]"
        if revived:
            detail = (detail + "; " if detail else "") + revived
        if status == PASS and ctx is not None:
            wrong = judge_parts(self.mode, scenario.id, ctx)
            if wrong:
                status, detail = FAIL, wrong + (f" [{detail}]" if detail else "")
        parts: tuple[Result, ...] = ()
        if status == PASS and ctx is not None:
            parts = tuple(Result(f"{scenario.id}/{part}", NOT_APPLICABLE, why) for part, why in ctx.parts)
        return Result(scenario.id, status, detail, time.monotonic() - t0, parts)

    def is_lab_gap(self, result: Result) -> bool:
        """Whether a not-applicable ``result`` stands for what this lab lacks (not the mode, not the host)."""
        return result.status == NOT_APPLICABLE and result.scenario in self.lab_gaps

    def _revive(self) -> str:
        """Restart kproxy, in the session's mode, where it is not running (a previous scenario killed it or it
        crashed) or runs in another mode (a scenario that switched modes failed half-way); say so."""
        notes = self._wrong_mode_stopped()
        dead = [n for n in self.lab.nodes if not self.lab.kproxy_running(n)]
        for node in dead:
            self.lab.start_kproxy(node, self.mode, self.kproxy_args)
            notes.append(f"kproxy on {node.name} was not running before this scenario and was restarted")
        if dead:
            try:
                self.wait_ready()
            except ConformanceError as exc:
                notes.append(str(exc))
        return "; ".join(notes)

    def _errors_since(self, marks: dict[str, int]) -> str:
        found = []
        for node in self.lab.nodes:
            text = self.lab.kproxy_log(node)[marks.get(node.name, 0) :]
            lines = [ln.strip() for ln in text.splitlines() if "ERROR" in ln or "Traceback" in ln or "Error:" in ln]
            for ln in lines[:2]:
                found.append(f"{node.name}: {ln[:240]}")
        return " | ".join(found[:4])


def run(
    mode: str,
    scenario_ids: Sequence[str] | None = None,
    lab: Any | None = None,
    *,
    keep_lab: bool = False,
    reuse_lab: bool = False,
    replace_lab: bool = False,
    prefix: str | None = None,
    progress: Callable[[Result], None] | None = None,
    backend_options: Mapping[str, Any] | None = None,
) -> Report:
    """Run the scenarios (all by default) on ``lab`` (default: a fresh 2-node lab, torn down at the end unless
    ``keep_lab``; ``reuse_lab`` attaches to a running one; a ready lab already under the prefix is only replaced
    with ``replace_lab``) with kproxy in ``mode``, given ``backend_options`` (typed, the mode's own).
    ``progress`` sees each result as it comes. ConformanceError when the suite cannot start."""
    chosen = select(scenario_ids)
    t0 = time.monotonic()
    report = Report(mode)
    if lab is not None:
        session = Session(mode, lab)
        session.prepare()
    else:
        session = Session.open(
            mode, reuse_lab=reuse_lab, replace_lab=replace_lab, prefix=prefix, backend_options=backend_options
        )
    try:
        for scenario in chosen:
            log.info("scenario %s on %s", scenario.id, mode)
            result = session.run_scenario(scenario)
            for row in (result, *result.parts):
                report.results.append(row)
                if progress is not None:
                    progress(row)
    finally:
        session.close(keep_lab=keep_lab)
        report.wall_seconds = time.monotonic() - t0
        report.lab_gaps = list(session.lab_gaps)
    return report
