"""Conformance results and the three ways they are written: a table, JSON and JUnit XML.

Pure data and text: no lab, no root, so tests/unit/test_conformance_report.py covers it entirely.

Statuses are exactly ``pass``, ``fail`` and ``not-applicable``; a not-applicable result always carries its reason
(the backend's ``not_applicable`` entry or what the lab lacks) and is never counted as passed.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import dataclass, field

PASS = "pass"
FAIL = "fail"
NOT_APPLICABLE = "not-applicable"
STATUSES = (PASS, FAIL, NOT_APPLICABLE)


@dataclass(frozen=True, slots=True)
class Result:
    """One scenario on one backend: its status, what happened (always set on fail and not-applicable), how long."""

    scenario: str
    status: str
    detail: str = ""
    seconds: float = 0.0
    #: rows of their own for parts of a scenario that could not be exercised (``cleanup/another-mode``), so a pass
    #: never stands for a part nothing checked; ``run`` puts them in the report right after the scenario's row
    parts: tuple[Result, ...] = ()

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status {self.status!r} is not one of {', '.join(STATUSES)}")

    def as_dict(self) -> dict[str, object]:
        return {"scenario": self.scenario, "status": self.status, "detail": self.detail, "seconds": self.seconds}


@dataclass(slots=True)
class Report:
    """All results of one run on one backend, in scenario order, and the run's wall time."""

    mode: str
    results: list[Result] = field(default_factory=list)
    wall_seconds: float = 0.0
    #: scenarios reported not-applicable because of the lab (too few nodes or pods, no IPv6), not the mode: the
    #: run did not check them, so the command fails (a CI job must not go green having checked nothing)
    lab_gaps: list[str] = field(default_factory=list)

    @property
    def failed(self) -> list[Result]:
        return [r for r in self.results if r.status == FAIL]

    @property
    def ok(self) -> bool:
        return not self.failed

    def counts(self) -> dict[str, int]:
        out = dict.fromkeys(STATUSES, 0)
        for r in self.results:
            out[r.status] += 1
        return out

    def get(self, scenario: str) -> Result | None:
        for r in self.results:
            if r.scenario == scenario:
                return r
        return None


def to_json(report: Report) -> str:
    """``{"mode": ..., "results": [{"scenario", "status", "detail", "seconds"}]}``, seconds rounded to 0.1 ms."""
    doc = {
        "mode": report.mode,
        "results": [dict(r.as_dict(), seconds=round(r.seconds, 4)) for r in report.results],
    }
    return json.dumps(doc, indent=2)


def from_json(text: str) -> Report:
    """The inverse of ``to_json`` (to merge reports of several runs into one table)."""
    doc = json.loads(text)
    results = [
        Result(r["scenario"], r["status"], r.get("detail", ""), float(r.get("seconds", 0.0))) for r in doc["results"]
    ]
    return Report(doc["mode"], results)


def _cell(result: Result | None) -> str:
    if result is None:
        return "-"
    if result.status == PASS:
        return "pass"
    word = "FAIL" if result.status == FAIL else "not-applicable"
    return f"{word}: {result.detail}" if result.detail else word


def format_table(reports: Sequence[Report], width: int = 100) -> str:
    """Scenario x backend. Each cell is ``pass``, ``FAIL: <reason>`` or ``not-applicable: <reason>``; a long reason
    is cut to ``width`` characters in the cell (the JSON and JUnit keep it whole). A footer gives the counts and
    wall time per backend."""
    order: list[str] = []
    for rep in reports:
        for r in rep.results:
            if r.scenario not in order:
                order.append(r.scenario)
    cells: list[list[str]] = []
    for sid in order:
        row = [sid]
        for rep in reports:
            text = " ".join(_cell(rep.get(sid)).split())  # one line per scenario, whatever the detail holds
            if len(text) > width:
                text = text[: width - 3] + "..."
            row.append(text)
        cells.append(row)
    header = ["scenario", *(rep.mode for rep in reports)]
    widths = [
        max(len(header[i]), *(len(row[i]) for row in cells)) if cells else len(header[i]) for i in range(len(header))
    ]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    for row in cells:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    for rep in reports:
        c = rep.counts()
        lines.append(
            f"{rep.mode}: {c[PASS]} passed, {c[FAIL]} failed, {c[NOT_APPLICABLE]} not applicable"
            f" in {rep.wall_seconds:.1f} s"
        )
    return "\n".join(lines)


def to_junit(reports: Sequence[Report]) -> str:
    """JUnit XML: one testsuite per backend, one testcase per scenario (classname ``kproxy.conformance.<mode>``);
    a failure element carrying the detail for FAIL, a skipped element with the reason for not-applicable."""
    root = ET.Element("testsuites", name="kproxy-conformance")
    total = {"tests": 0, "failures": 0, "skipped": 0}
    wall = 0.0
    for rep in reports:
        c = rep.counts()
        suite = ET.SubElement(
            root,
            "testsuite",
            name=f"kproxy-conformance-{rep.mode}",
            tests=str(len(rep.results)),
            failures=str(c[FAIL]),
            errors="0",
            skipped=str(c[NOT_APPLICABLE]),
            time=f"{rep.wall_seconds:.3f}",
        )
        total["tests"] += len(rep.results)
        total["failures"] += c[FAIL]
        total["skipped"] += c[NOT_APPLICABLE]
        wall += rep.wall_seconds
        for r in rep.results:
            case = ET.SubElement(
                suite, "testcase", classname=f"kproxy.conformance.{rep.mode}", name=r.scenario, time=f"{r.seconds:.3f}"
            )
            if r.status == FAIL:
                first = r.detail.splitlines()[0] if r.detail else "failed"
                el = ET.SubElement(case, "failure", message=first[:200], type="ScenarioFailure")
                el.text = r.detail
            elif r.status == NOT_APPLICABLE:
                ET.SubElement(case, "skipped", message=r.detail or "not applicable")
    root.set("tests", str(total["tests"]))
    root.set("failures", str(total["failures"]))
    root.set("skipped", str(total["skipped"]))
    root.set("time", f"{wall:.3f}")
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"
