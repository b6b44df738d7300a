"""The documentation stays true to the code: docs/BEHAVIOUR.md's scenario table is the conformance suite's, docstrings
cite only what the repository holds, and nothing tracked names a path of one particular machine."""

from __future__ import annotations

import ast
import functools
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from kproxy.conformance.scenarios import SCENARIO_IDS

ROOT = Path(__file__).resolve().parents[2]
BEHAVIOUR = ROOT / "docs" / "BEHAVIOUR.md"
CODE_ROOTS = ("kproxy", "backends")
#: an absolute path under the development machines' work folder (spelled in two parts so this file does not match)
MACHINE_PATH = re.compile(r"(?<![\w.~-])/" + r"work/")
MD_CITATION = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)*[\w.-]+\.md)\b")
MODULE_CITATION = re.compile(r"``((?:kproxy|backends)(?:\.\w+)+)``")


def behaviour_ids(text: str) -> list[str]:
    """The first column of the scenario table (the table whose header starts with ``| id |``)."""
    ids: list[str] = []
    in_table = False
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| id |"):
            in_table = True
            continue
        if in_table:
            if not line.startswith("|"):
                break
            if set(cells[0]) <= {"-", ":"}:
                continue
            ids.append(cells[0])
    return ids


def python_files() -> Iterator[Path]:
    """Every module under kproxy/ and backends/, each once (symlinked folders are not followed)."""
    for top in CODE_ROOTS:
        for folder, dirs, files in os.walk(ROOT / top, followlinks=False):
            dirs[:] = [d for d in dirs if d != "__pycache__" and not (Path(folder) / d).is_symlink()]
            for name in sorted(files):
                if name.endswith(".py"):
                    yield Path(folder) / name


def tracked_files() -> list[Path]:
    try:
        res = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"git ls-files could not run: {exc}")
    if res.returncode != 0:
        pytest.skip(f"not a git checkout: {res.stderr.decode(errors='replace').strip()}")
    return [ROOT / p for p in res.stdout.decode().split("\0") if p]


@functools.cache
def parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def docstrings(path: Path) -> Iterator[tuple[str, str]]:
    """(where, text) of the module's docstring and of every class and function docstring in it."""
    for node in ast.walk(parsed(path)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            text = ast.get_docstring(node, clean=False)
            if text:
                where = "module" if isinstance(node, ast.Module) else f"{node.name} (line {node.lineno})"
                yield where, text


def md_exists(citation: str, module: Path, tracked_names: set[str]) -> bool:
    """A cited ``.md`` file: a path from the repository's root (``docs/X.md``, ``deploy/README.md``), or a bare name
    at the root, in docs/, beside the module, or a file of that name the repository tracks (``report.md``)."""
    if "/" in citation:
        return (ROOT / citation).is_file()
    return (
        (ROOT / citation).is_file()
        or (ROOT / "docs" / citation).is_file()
        or (module.parent / citation).is_file()
        or citation in tracked_names
    )


def module_exists(dotted: str) -> bool:
    """``kproxy.a.b`` / ``backends.a.b`` names a module, a package, or a name defined in one."""
    parts = dotted.split(".")
    if parts[0] == "kproxy" and len(parts) > 1 and parts[1] in ("backends", "bpf"):
        parts = parts[1:]  # kproxy.backends.x is backends/x in the source tree
    for cut in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:cut])
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                rest = parts[cut:]
                return not rest or (
                    len(rest) == 1 and re.search(rf"\b{re.escape(rest[0])}\b", candidate.read_text()) is not None
                )
        if base.is_dir() and cut == len(parts):
            return True  # a folder of data (kproxy.bpf's C sources)
    return False


def test_behaviour_table_is_the_suites_scenario_table_in_order() -> None:
    ids = behaviour_ids(BEHAVIOUR.read_text())
    assert ids, "no scenario table (a header starting '| id |') in docs/BEHAVIOUR.md"
    assert ids == list(SCENARIO_IDS)


def test_behaviour_ids_reads_only_the_scenario_table() -> None:
    text = "intro\n\n| a | b |\n|---|---|\n| x | y |\n\n| id | s |\n|---|---|\n| one | 1 |\n| two | 2 |\n\nafter\n"
    assert behaviour_ids(text) == ["one", "two"]


def test_no_module_keeps_a_who_uses_it_trailer() -> None:
    offenders = [
        f"{p.relative_to(ROOT)}:{n}"
        for p in python_files()
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if "Who uses it:" in line
    ]
    assert offenders == [], "a 'Who uses it:' line goes stale; git grep answers the question"


def test_no_tracked_file_names_a_machine_path() -> None:
    offenders = []
    for path in tracked_files():
        if not path.is_file() or path.is_symlink():
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue  # images and other binary files
        offenders += [
            f"{path.relative_to(ROOT)}:{n}" for n, line in enumerate(text.splitlines(), 1) if MACHINE_PATH.search(line)
        ]
    assert offenders == []


def test_machine_path_pattern() -> None:
    machine = "/" + "work/"
    assert MACHINE_PATH.search(f"see {machine}main/README.md")
    assert MACHINE_PATH.search(f"({machine}shared)")
    assert not MACHINE_PATH.search("kproxy/work/x and ~/work/y")


def test_docstrings_cite_only_markdown_files_the_repository_holds() -> None:
    tracked_names = {p.name for p in tracked_files() if p.suffix == ".md"}
    missing = [
        f"{p.relative_to(ROOT)} {where}: {cite}"
        for p in python_files()
        for where, text in docstrings(p)
        for cite in MD_CITATION.findall(text)
        if not md_exists(cite, p, tracked_names)
    ]
    assert missing == []


def test_markdown_citation_pattern() -> None:
    found = MD_CITATION.findall("see docs/PERFORMANCE.md, BEHAVIOUR.md's table and shared/reference/x-y.md section 2")
    assert found == ["docs/PERFORMANCE.md", "BEHAVIOUR.md", "shared/reference/x-y.md"]


def test_module_docstrings_cite_modules_that_exist() -> None:
    missing = []
    for p in python_files():
        text = ast.get_docstring(parsed(p)) or ""
        missing += [f"{p.relative_to(ROOT)}: {m}" for m in MODULE_CITATION.findall(text) if not module_exists(m)]
    assert missing == []


def test_module_exists_resolves_packages_modules_and_names() -> None:
    assert module_exists("kproxy.ledger")
    assert module_exists("kproxy.ledger.LedgerProxier")
    assert module_exists("kproxy.backends.iptables.render")
    assert module_exists("backends.nftables")
    assert not module_exists("kproxy.no_such_module")
    assert not module_exists("backends.iptables.no_such_module")
