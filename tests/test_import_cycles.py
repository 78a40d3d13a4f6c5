"""No import cycles in pagedkern: among all its modules, counting imports inside functions too
(a lazy import hides a cycle from the interpreter, not from the design). grimp is the graph
import-linter builds (tests/test_tooling.py checks the layer contracts on it)."""

from __future__ import annotations

import pytest

grimp = pytest.importorskip("grimp")


def strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """The cycles of a graph: its strongly connected components of two or more nodes (Tarjan,
    iterative: the package graph is deep enough for Python's recursion limit to matter)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_finder_finds_cycles():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert strongly_connected(edges) == [["a", "b", "c"]]
    assert strongly_connected({"a": {"b"}, "b": set()}) == []


def test_pagedkern_has_no_import_cycle():
    graph = grimp.build_graph("pagedkern", cache_dir=None)
    edges = {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    cycles = strongly_connected(edges)
    details = [
        f"{a} -> {b} (line {d['line_number']}: {d['line_contents']})"
        for cycle in cycles
        for a in cycle
        for b in sorted(edges[a] & set(cycle))
        for d in graph.get_import_details(importer=a, imported=b)[:1]
    ]
    assert not cycles, "import cycles:\n" + "\n".join(details)
