"""No import cycle anywhere in the kproxy package, between any two modules.

The import-linter contracts (``.importlinter``) keep the layers of the core, the lab, the bench and the soak in
order; this test is the catch-all beside them: it builds the import graph of the whole package with grimp (the
graph library import-linter itself uses) and fails on every strongly connected group of modules, naming one cycle
through it with the line of each import. Every import counts, those inside functions too: a lazy import hides a
cycle from the interpreter, not from the reader.
"""

from __future__ import annotations

from collections import deque

import grimp


def _graph() -> grimp.ImportGraph:
    # backends/ is its own root in the tree (installed, it is kproxy.backends: pyproject.toml's package-dir)
    return grimp.build_graph("kproxy", "backends", cache_dir=None)  # no cache folder written into the tree


def _cyclic_groups(modules: set[str], imports: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one module (or a module importing itself)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    for root in sorted(modules):
        if root in index:
            continue
        # iterative, so a deep import chain cannot hit the recursion limit
        work: list[tuple[str, int]] = [(root, 0)]
        while work:
            v, i = work.pop()
            if i == 0:
                index[v] = low[v] = len(index)
                stack.append(v)
                on_stack.add(v)
            succ = sorted(imports[v])
            if i < len(succ):
                work.append((v, i + 1))
                w = succ[i]
                if w not in index:
                    work.append((w, 0))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            if low[v] == index[v]:
                group = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    group.append(w)
                    if w == v:
                        break
                if len(group) > 1 or v in imports[v]:
                    groups.append(sorted(group))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[v])
    return groups


def _one_cycle(group: list[str], imports: dict[str, set[str]]) -> list[str]:
    """The shortest cycle through the group's first module, inside the group: [a, b, ..., a]."""
    start, members = group[0], set(group)
    came_from: dict[str, str] = {}
    queue = deque([start])
    while queue:
        v = queue.popleft()
        for w in sorted(imports[v] & members):
            if w == start:
                path = [v]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                return [start, *reversed(path[:-1]), start] if len(path) > 1 else [start, start]
            if w not in came_from:
                came_from[w] = v
                queue.append(w)
    raise AssertionError(f"no cycle through {start} in {group}")


def _describe(graph: grimp.ImportGraph, cycle: list[str]) -> str:
    steps = [cycle[0]]
    for a, b in zip(cycle, cycle[1:], strict=False):
        lines = sorted({d["line_number"] for d in graph.get_import_details(importer=a, imported=b)})
        steps.append(f"{b} (line {', '.join(map(str, lines))} of {a})")
    return " -> ".join(steps)


def test_the_cycle_finder_finds_cycles_and_only_cycles() -> None:
    """The finder itself, on a made-up graph: a -> b -> c -> a is one group, d -> e is none, f imports itself."""
    imports = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": {"e"}, "e": set(), "f": {"f"}}
    groups = _cyclic_groups(set(imports), imports)
    assert groups == [["a", "b", "c"], ["f"]]
    assert _one_cycle(["a", "b", "c"], imports) == ["a", "b", "c", "a"]
    assert _one_cycle(["f"], imports) == ["f", "f"]


def test_no_import_cycle_in_the_package() -> None:
    graph = _graph()
    modules = set(graph.modules)
    assert "kproxy.ledger" in modules and "kproxy.lab.cluster" in modules  # the graph is the whole package
    imports = {m: set(graph.find_modules_directly_imported_by(m)) for m in modules}
    cycles = [_describe(graph, _one_cycle(g, imports)) for g in _cyclic_groups(modules, imports)]
    assert not cycles, "import cycles:\n" + "\n".join(cycles)
