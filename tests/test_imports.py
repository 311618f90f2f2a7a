"""The package's modules import each other without cycles: a module that needs another imports it at the top, and
the few imports inside functions are there for a cost (jax, the model code, the server) a caller may not need, never
to break a loop. Counted over every sgjax module, top-level and function-level imports alike."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in [*(ROOT / "sgjax").rglob("*.py"), *(ROOT / "kernels").rglob("*.py")]:
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[0] == "kernels":  # installed as sgjax.kernels
            parts = ["sgjax", "kernels", *parts[1:]]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(node):
    """The import statements under node, but not those under `if TYPE_CHECKING:` (type-only, never executed)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
            continue
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        else:
            yield from _imports(child)


def _edges(name: str, path: pathlib.Path, modules) -> set[str]:
    """The sgjax modules `name` imports (a `from package import module` names the module, not the package)."""
    out = set()
    for node in _imports(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            subs = {f"{node.module}.{a.name}" for a in node.names} & set(modules)
            out |= subs or ({node.module} & set(modules))
    return out - {name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles_among_the_packages_modules():
    modules = _modules()
    graph = {name: _edges(name, path, modules) for name, path in modules.items()}
    assert len(graph) > 100  # every module was read
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
