"""No import cycle between the product's modules (anchorcache, proxy, ext, state, ops).

The graph is read from the source with `ast`, without importing anything (so the SGLang and
torch modules count too). An edge is an import statement that runs when its module loads:
at module level, in a class body, or under a module-level `if`/`try`, and that includes
`if TYPE_CHECKING:` blocks, since a type-only import still says the module depends on the
other (two of the cycles this test was written against hid there). An import inside a
function body is not an edge: it runs when called, and is how a module loads an optional
variant lazily (an SGLang or CUDA piece, a registry's plugin). `from P import name` is an edge
to the module `P.name` when that is a module, else to `P` (its `__init__`); a package's
`__init__` is not implied by importing one of its modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOTS = {"anchorcache": "anchorcache", "anchorcache.proxy": "proxy", "anchorcache.ext": "ext",
         "anchorcache.state": "state", "anchorcache.ops": "ops"}


def _modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for package, folder in ROOTS.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            parts = path.relative_to(REPO / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join((package, *parts))
            # anchorcache/ holds only its own modules; the other roots mount under it
            if package == "anchorcache" and parts and f"anchorcache.{parts[0]}" in ROOTS:
                continue
            out[name] = path
    return out


def _load_time_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Import statements that run when the module loads (not inside a function)."""
    found: list[ast.Import | ast.ImportFrom] = []
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append(child)
            elif not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                stack.append(child)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        here = name if is_package else name.rpartition(".")[0]
        for stmt in _load_time_imports(ast.parse(path.read_text(), str(path))):
            if isinstance(stmt, ast.Import):
                targets = [alias.name for alias in stmt.names]
            else:
                base = stmt.module or ""
                if stmt.level:
                    anchor = here.rsplit(".", stmt.level - 1)[0] if stmt.level > 1 else here
                    base = f"{anchor}.{base}" if base else anchor
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                           for a in stmt.names]
            for target in targets:
                while target and target not in modules:  # `import a.b.c` loads a.b.c
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a path back to its start) per strongly connected component (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[set[str]] = []

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
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    out = []
    for component in components:
        start = min(component)
        path, seen = [start], {start}
        while True:  # walk inside the component until a module repeats
            nxt = min(w for w in graph[path[-1]] if w in component)
            if nxt in seen:
                out.append(path[path.index(nxt):] + [nxt])
                break
            path.append(nxt)
            seen.add(nxt)
    return out


def test_the_graph_is_read():
    graph = _graph()
    assert "anchorcache.proxy.lifecycle" in graph and "anchorcache.ext.sglang.run" in graph
    assert "anchorcache.proxy.toolsets" in graph["anchorcache.proxy.lifecycle"]
    assert "anchorcache.wire" in graph["anchorcache.proxy.planner"]


def test_no_import_cycle():
    cycles = _cycles(_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)
