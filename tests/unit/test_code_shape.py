"""The code's shape, checked: no function over 80 lines and no module over 600 lines in the core and the backends
(the lab, conformance, bench and soak tools are held to the same limits by review, not by this test), no symlink in
the tree, and no module-level ``Any`` in the backend contract (``kproxy/batch.py``, ``kproxy/backend.py``)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_FUNCTION_LINES = 80
MAX_MODULE_LINES = 600
CHECKED = [ROOT / "kproxy", ROOT / "backends"]
TOOLS = ("lab", "conformance", "bench", "soak")


def _sources() -> list[Path]:
    out = []
    for top in CHECKED:
        for path in sorted(top.rglob("*.py")):
            rel = path.relative_to(ROOT).parts
            if "__pycache__" in rel or (rel[0] == "kproxy" and len(rel) > 2 and rel[1] in TOOLS):
                continue
            out.append(path)
    return out


def test_no_function_over_80_lines_and_no_module_over_600() -> None:
    long_functions, long_modules = [], []
    for path in _sources():
        text = path.read_text()
        lines = text.count("\n")
        if lines > MAX_MODULE_LINES:
            long_modules.append(f"{path.relative_to(ROOT)}: {lines} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long_functions.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {n} lines")
    assert not long_modules, long_modules
    assert not long_functions, long_functions


def test_no_symlink_in_the_tree() -> None:
    links = [p for top in CHECKED for p in top.rglob("*") if p.is_symlink()]
    assert not links, links


def test_the_backend_contract_has_no_any() -> None:
    for name in ("batch.py", "backend.py", "ledger.py"):
        tree = ast.parse((ROOT / "kproxy" / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("detail"):
                for arg in [*node.args.args, *node.args.kwonlyargs]:
                    assert "Any" not in ast.unparse(arg.annotation or ast.Constant(None)), f"{name}: {node.name}"
                ret = ast.unparse(node.returns) if node.returns is not None else ""
                assert "Any" not in ret, f"{name}: {node.name} returns {ret}"
