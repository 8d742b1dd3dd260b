"""No import cycle between the modules of `acp_once`, counting imports made only for type checking.

import-linter (run by the test command) checks the layers on the imports that run; a cycle kept
alive only by a `TYPE_CHECKING` import still ties two modules together for a reader and for the
type checker, so it is checked here, on the full graph (protocols break such cycles).
"""

from __future__ import annotations

import grimp


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of two or more modules that import each other, directly or not (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group: list[str] = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


def module_graph() -> dict[str, set[str]]:
    """Who imports whom among the non-package modules (a package's `__init__` re-exports its
    own modules, which is not a cycle a reader follows)."""
    full = grimp.build_graph("acp_once", exclude_type_checking_imports=False)
    packages = {m for m in full.modules if any(o.startswith(m + ".") for o in full.modules)}
    modules = full.modules - packages
    return {m: full.find_modules_directly_imported_by(m) & modules for m in modules}


def test_the_finder_sees_a_cycle() -> None:
    assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert strongly_connected({"a": {"b"}, "b": set()}) == []


def test_no_module_cycle_even_through_type_checking_imports() -> None:
    graph = module_graph()
    assert "acp_once.client.connection" in graph
    assert "acp_once.client.interface" in graph["acp_once.client.connection"] or (
        "acp_once.client.connection" in graph["acp_once.client.interface"]
    )
    assert strongly_connected(graph) == []
