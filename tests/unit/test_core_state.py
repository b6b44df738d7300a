"""The core modules and the backends keep no process-wide state filled at run time: no module-level container that
starts empty (a hand-rolled memo, a "seen" set, a lazily filled singleton). A memo is ``functools.lru_cache``
(bounded when its keys come from input); a kernel handle belongs to an object with a ``close``. Constant tables are
fine."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "kproxy"
# The modules with owners of their own (the ledger, the runner, the daemon, the fake and the Kubernetes source) and
# the tools (lab, bench, conformance, soak) are checked by their own tests, if at all.
_ELSEWHERE = {"ledger.py", "proxier.py", "fake.py", "daemon.py", "runner.py", "sources/kube.py"}
_CORE = sorted(
    str(p.relative_to(ROOT))
    for pattern in ("*.py", "server/*.py", "sources/*.py", "toolkit/*.py")
    for p in ROOT.glob(pattern)
    if str(p.relative_to(ROOT)) not in _ELSEWHERE
)
BACKENDS = ROOT.parent / "backends"
# the backends' proxier modules hold their classes' state on instances; every backend module is checked
_BACKEND_MODULES = sorted(str(p.relative_to(BACKENDS)) for p in BACKENDS.glob("**/*.py"))
_EMPTY_CALLS = {"dict", "set", "list", "OrderedDict", "defaultdict", "WeakValueDictionary", "WeakKeyDictionary"}


def _starts_empty(value: ast.expr | None) -> bool:
    if isinstance(value, ast.Dict):
        return not value.keys
    if isinstance(value, ast.List | ast.Set):
        return not value.elts
    if isinstance(value, ast.Call) and not value.args and not value.keywords:
        func = value.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        return name in _EMPTY_CALLS
    return False


def _module_state(path: Path) -> list[str]:
    found = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign):
            targets, value = [node.target], node.value
        else:
            continue
        if _starts_empty(value):
            found += [f"{path.name}:{node.lineno} {ast.unparse(t)}" for t in targets]
    return found


def test_the_core_list_is_not_empty() -> None:
    assert "nftkernel.py" in _CORE and "endpointslices.py" in _CORE and "toolkit/nft.py" in _CORE


@pytest.mark.parametrize("module", _CORE)
def test_no_module_level_state_filled_at_run_time(module: str) -> None:
    assert _module_state(ROOT / module) == []


def test_the_backend_list_is_not_empty() -> None:
    assert {"nftables/layout.py", "iptables/render.py", "bpf/plan.py", "userspace/ports.py"} <= set(_BACKEND_MODULES)


#: process-wide by design: which proxier instance of this process holds a proxy port, so that a second instance in
#: the same process (the sync bench's restart figure) takes the listening sockets over as a restarted process rebinds
_BY_DESIGN = {"userspace/proxier.py": ["_HOLDERS"]}


@pytest.mark.parametrize("module", _BACKEND_MODULES)
def test_no_backend_module_state_filled_at_run_time(module: str) -> None:
    assert [s.split()[-1] for s in _module_state(BACKENDS / module)] == _BY_DESIGN.get(module, [])
