"""The core names no mode: only the mode table (``kproxy/proxier.py``) does.

A mode name in the core (a comparison such as ``mode == "bpf"``, a dict keyed by mode, a default) means behaviour
that belongs in a backend hook has leaked into the core, and a fifth mode would need the core changed. The scan reads
every string constant of every module under ``kproxy/`` (backends and BPF sources excluded: they are the modes);
docstrings and comments may name modes freely.
"""

from __future__ import annotations

import ast
from pathlib import Path

from kproxy.proxier import MODE_NAMES

ROOT = Path(__file__).resolve().parents[2] / "kproxy"
TABLE = ROOT / "proxier.py"
# Not mode names: the KubeProxyConfiguration file format has a section called "iptables" (masqueradeAll,
# masqueradeBit, syncPeriod), which kproxy reads and writes as upstream does whatever the mode.
ALLOWED = {("config.py", "iptables")}


def _docstrings(tree: ast.AST) -> set[int]:
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def mode_names_in(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), str(path))
    docs = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            if node.value in MODE_NAMES and (path.name, node.value) not in ALLOWED:
                found.append((node.lineno, node.value))
    return found


def core_modules() -> list[Path]:
    return [
        p
        for p in sorted(ROOT.rglob("*.py"))
        if p != TABLE and not p.is_relative_to(ROOT / "backends") and not p.is_relative_to(ROOT / "bpf")
    ]


def test_the_scan_finds_a_mode_name(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text('"""a docstring that says iptables is fine"""\nMODE = "nftables"\nif MODE == "bpf":\n    pass\n')
    assert mode_names_in(sample) == [(2, "nftables"), (3, "bpf")]


def test_no_mode_name_in_the_core_outside_the_mode_table() -> None:
    assert core_modules(), ROOT
    leaks = {str(p.relative_to(ROOT)): found for p in core_modules() if (found := mode_names_in(p))}
    assert not leaks, f"mode names in the core (use a backend hook or the mode table): {leaks}"
