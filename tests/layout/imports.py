"""The library's modules and the imports between them, read from the source (no import runs).

Every ``import`` and ``from ... import`` counts, lazy ones inside functions included: a circle that
only closes when a function runs is still a circle a reader has to hold in their head. Imports under
``if TYPE_CHECKING:`` count as well (an annotation's arrow is an arrow).
"""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
# The installed package (pyproject.toml's packages.find) and its rooms, bottom of the data flow first.
PACKAGE = "freescale"
LIBRARY = ("runtime", "tracking", "prepare", "costs", "balancing", "shards", "comm", "training", "launch", "jobs")
MAX_FUNCTION_LINES = 60


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def library_files() -> dict[str, Path]:
    return {module_name(p): p for p in sorted((REPO_ROOT / PACKAGE).rglob("*.py"))}


def _resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imported_modules(path: Path, module: str, known: set[str]) -> set[str]:
    """The library modules ``path`` imports (a name imported from a package that is itself a module
    counts as that module)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(node, module, path.name == "__init__.py")
            names = [f"{target}.{alias.name}" for alias in node.names] + [target]
        else:
            continue
        for name in names:
            # `import a.b.c` names a.b.c; `from a.b import c` names a.b.c when c is a module, else a.b
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module:
                out.add(name)
    return out


def import_graph() -> dict[str, set[str]]:
    files = library_files()
    known = set(files)
    return {module: imported_modules(path, module, known) for module, path in files.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def reachable(graph: dict[str, set[str]], start: list[str]) -> set[str]:
    """Every module that importing ``start`` can load, lazy imports included."""
    seen: set[str] = set()
    todo = list(start)
    while todo:
        v = todo.pop()
        if v not in seen:
            seen.add(v)
            todo.extend(graph.get(v, ()))
            # importing a.b.c runs a/__init__ and a/b/__init__ first
            parts = v.split(".")
            todo.extend(".".join(parts[:i]) for i in range(1, len(parts)) if ".".join(parts[:i]) in graph)
    return seen


def room(module: str) -> str:
    """``freescale.training.ops.jagged`` -> ``training``; the package's own modules (``freescale.model``)
    are rooms of their own."""
    return (module.split(".") + [""])[1] or module


def is_docstring(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    parent = parents.get(node)
    owner = parents.get(parent) if isinstance(parent, ast.Expr) else None
    return owner is not None and isinstance(owner, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) \
        and bool(owner.body) and owner.body[0] is parent


JOBS_MODULE = re.compile(r"(?<![\w])(?:freescale\.)?jobs\.[a-z_]")


def jobs_module_strings(package: str = "training") -> list[str]:
    """String constants (docstrings aside) in ``package``'s modules that name a jobs module: a rank starts
    nothing by name; the launch room does."""
    found = []
    for module, path in library_files().items():
        if room(module) != package:
            continue
        tree = ast.parse(path.read_text(), str(path))
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and JOBS_MODULE.search(node.value) \
                    and not is_docstring(node, parents):
                found.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno} {node.value[:60]!r}")
    return found


@dataclass(frozen=True)
class LongFunction:
    where: str
    lines: int


def _is_kernel(node: ast.AST) -> bool:
    """A Triton kernel (``@triton.jit`` or ``@triton.autotune(...)``): one GPU program, GPU kernels aside."""
    for decorator in getattr(node, "decorator_list", []):
        text = ast.unparse(decorator)
        if text.startswith(("triton.jit", "triton.autotune", "triton.heuristics")):
            return True
    return False


def long_functions(limit: int = MAX_FUNCTION_LINES) -> list[LongFunction]:
    """Library functions longer than ``limit`` lines, from ``def`` to their last line."""
    out = []
    for path in library_files().values():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _is_kernel(node):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    out.append(LongFunction(f"{path.relative_to(REPO_ROOT)}:{node.lineno} {node.name}", lines))
    return sorted(out, key=lambda f: -f.lines)
