"""The core names no mode: only the mode table (``kproxy/proxier.py``) does.

A mode name in the core (a comparison such as ``mode == "bpf"``, a dict keyed by mode, a default) means behaviour
that belongs in a backend hook has leaked into the core, and a fifth mode would need the core changed. The scan reads
every module under ``kproxy/`` (backends and BPF sources excluded: they are the modes) and flags a mode name used as
an operand of a comparison (``==``, ``!=``, ``in``), as a dict key, as a default value (an argument default or a
``default=`` keyword) or as a plain assignment or return value. The name of a tool (``["iptables", "--version"]``)
and docstrings and comments are not mode names.
"""

from __future__ import annotations

import ast
from pathlib import Path

from kproxy.proxier import MODE_NAMES

ROOT = Path(__file__).resolve().parents[2] / "kproxy"
TABLE = ROOT / "proxier.py"
# Not mode names: the KubeProxyConfiguration file format has a section called "iptables" (masqueradeAll,
# masqueradeBit, syncPeriod), which kproxy reads and writes as upstream does whatever the mode.
# And the machine facts of ``kproxy compare`` name the iptables tool's version, whatever modes ran; libnftables'
# JSON output is a document whose top key is "nftables" (nftkernel.py reads it for every mode that uses nft).
ALLOWED = {("config.py", "iptables"), ("results.py", "iptables"), ("nftkernel.py", "nftables")}


def _docstrings(tree: ast.AST) -> set[int]:
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def _is_mode(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Constant) and node.value in MODE_NAMES


def mode_names_in(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), str(path))
    suspects: list[ast.AST] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            suspects += [node.left, *node.comparators]
            for comp in node.comparators:  # x in ("iptables", "bpf")
                if isinstance(comp, (ast.Tuple, ast.List, ast.Set)):
                    suspects += comp.elts
        elif isinstance(node, ast.Dict):
            suspects += [k for k in node.keys if k is not None]
        elif isinstance(node, ast.keyword) and node.arg == "default":
            suspects.append(node.value)
        elif isinstance(node, ast.arguments):
            suspects += [*node.defaults, *(d for d in node.kw_defaults if d is not None)]
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.Return)):
            suspects.append(node.value)  # type: ignore[arg-type]
    found = {(n.lineno, n.value) for n in suspects if _is_mode(n)}  # type: ignore[attr-defined]
    return sorted((line, value) for line, value in found if (path.name, value) not in ALLOWED)


def core_modules() -> list[Path]:
    return [
        p
        for p in sorted(ROOT.rglob("*.py"))
        if p != TABLE and not p.is_relative_to(ROOT / "backends") and not p.is_relative_to(ROOT / "bpf")
    ]


def test_the_scan_finds_a_mode_name(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        '"""a docstring that says iptables is fine"""\n'
        'MODE = "nftables"\n'
        'if MODE == "bpf":\n'
        '    COLORS = {"userspace": 1}\n'
        'def f(mode="iptables"): return ["iptables", "--version"]\n'
    )
    assert mode_names_in(sample) == [(2, "nftables"), (3, "bpf"), (4, "userspace"), (5, "iptables")]


def test_no_mode_name_in_the_core_outside_the_mode_table() -> None:
    assert core_modules(), ROOT
    leaks = {str(p.relative_to(ROOT)): found for p in core_modules() if (found := mode_names_in(p))}
    assert not leaks, f"mode names in the core (use a backend hook or the mode table): {leaks}"
